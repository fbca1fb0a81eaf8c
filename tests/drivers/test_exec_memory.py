"""What a payload's output costs the runner: each stream's last ``KEPT_BYTES``, not all of it.

A payload prints 256 MiB through ``exec`` of the reference driver, of a jsonl driver (the
output crossing the protocol as base64 events) and of a templates driver; the peak resident
memory of the process that ran it may grow by a few times ``KEPT_BYTES``, not by the output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.exec_memory import drivers, measure_apart
from drivers.base import KEPT_BYTES
from gpuhost import simulated

PRINTED = 256 * 1024 * 1024
HELD_MIB = 6 * KEPT_BYTES / 2**20
"""Both streams' tails, what a read takes at once, the decoded text: far under ``PRINTED``."""


@pytest.mark.parametrize("label", ["reference", "exec:jsonl-jail", "exec:sh (templates)"])
def test_a_payload_printing_256_mib_costs_the_runner_a_bounded_amount(
    label: str, sim_host: simulated.SimulatedHost, tmp_path: Path
) -> None:
    measured = measure_apart(drivers(tmp_path)[label], sim_host.root, PRINTED)
    held = measured["after"] - measured["before"]
    assert held < HELD_MIB, f"{label}: the exec made the runner hold {held:.0f} MiB more"
    assert (measured["kept"], measured["cut"]) == (KEPT_BYTES, PRINTED - KEPT_BYTES)
