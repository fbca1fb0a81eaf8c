"""The local cluster grown to two nodes, the second planted to leak: for the runs node by node.

``scripts/cluster.sh add-node``: a second kubelet on this machine, with a containerd, a
simulated host and a device plugin of its own, which injects every GPU of its host whatever
a pod was given. A module that imports ``two_nodes`` adds the node for its tests and removes
it after them: the other kubernetes tests expect the one node.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
CLUSTER = ROOT / "scripts" / "cluster.sh"
SECOND = "127.0.0.2"
SECOND_GPUS = 2
CHECKED = "GPU-DEFAULT-01,GPU-COUNT-01,GPU-ISOLATION-01"
"""What each node's run judges here: enough for a device plugin that injects every GPU to
fail, in the time of a test (the whole lane is the runner's default)."""


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    """The local cluster with a second node whose device plugin is planted to leak."""
    status = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True)
    assert status.returncode == 0, f"the local cluster does not answer (make cluster): {status}"
    nodes = subprocess.run(["bash", str(CLUSTER), "nodes"], capture_output=True, text=True)
    if SECOND in nodes.stdout.split():  # left by a run that was killed
        subprocess.run(["bash", str(CLUSTER), "remove-node", SECOND], check=True)
    added = subprocess.run(
        ["bash", str(CLUSTER), "add-node", SECOND, str(SECOND_GPUS), "--leaky"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    try:
        yield SECOND
    finally:
        removed = subprocess.run(
            ["bash", str(CLUSTER), "remove-node", SECOND], capture_output=True, text=True
        )
        assert removed.returncode == 0, removed.stderr


def the_planted_node_failed_alone(
    run: subprocess.CompletedProcess[str], out: Path, second: str
) -> dict[str, Any]:
    """The fleet report a run node by node wrote in ``out``: the planted node failed alone."""
    said = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 1, said  # the gate fails: one node fails
    fleet: dict[str, Any] = json.loads((out / "conformance.json").read_text())
    hosts = {host["name"]: host for host in fleet["hosts"]}
    assert set(hosts) == {"localhost", second}, said
    verdict = fleet["verdicts"]["kubernetes"]
    assert verdict["hosts"] == {"localhost": "PASS", second: "FAIL"}, said
    assert verdict["status"] == "FAIL"
    failed = {
        req
        for req, row in fleet["matrix"].items()
        if row["kubernetes"]["hosts"].get(second) == "failed"
    }
    assert "GPU-ISOLATION-01" in failed, failed
    assert not any(
        row["kubernetes"]["hosts"].get("localhost") == "failed" for row in fleet["matrix"].values()
    )
    runs_on = hosts[second]["report"]["runs_on"]
    assert f"nvidia.com/gpu {SECOND_GPUS}" in runs_on, runs_on
    return fleet
