"""What a payload's output costs the runner: each stream's last ``KEPT_BYTES``, not all of it.

A payload prints 512 MiB through ``exec`` of the reference driver, of a jsonl driver (the
output crossing the protocol as base64 events) and of a templates driver; the peak resident
memory of the process that ran it may grow by a few times ``KEPT_BYTES``, not by the output.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.exec_memory import drivers, measure_apart
from drivers.base import KEPT_BYTES
from gpuhost import simulated

PRINTED = 512 * 1024 * 1024
HELD_MIB = 8 * KEPT_BYTES / 2**20
"""Both streams' tails, the result's bytes and text, a reader thread's heap: under a quarter
of ``PRINTED`` (the jsonl adapter holds 88 to 92 MiB, the others 55 MiB, for any output)."""


@pytest.mark.parametrize("label", ["reference", "exec:jsonl-jail", "exec:sh (templates)"])
def test_a_payload_printing_512_mib_costs_the_runner_a_bounded_amount(
    label: str, sim_host: simulated.SimulatedHost, tmp_path: Path
) -> None:
    measured = measure_apart(drivers(tmp_path)[label], sim_host.root, PRINTED)
    held = measured["after"] - measured["before"]
    assert held < HELD_MIB, f"{label}: the exec made the runner hold {held:.0f} MiB more"
    assert (measured["kept"], measured["cut"]) == (KEPT_BYTES, PRINTED - KEPT_BYTES)
