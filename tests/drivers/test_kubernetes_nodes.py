"""The kubernetes lane node by node (``python -m conformance.nodes``).

Its pods pinned to one node by name; its turn on that node's own Lease; its report naming
the node, its GPUs and its device plugins' resources in the host's place. On the local
cluster grown to two nodes (``scripts/cluster.sh add-node``: a second kubelet on this
machine, with a containerd, a simulated host and a device plugin of its own), a node whose
device plugin misbehaves (planted: it injects every GPU of its host) fails its column only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from drivers.kubernetes import KubernetesDriver, pod_manifest
from drivers.kubernetes.cluster import NODE_ENV
from drivers.kubernetes.turn import CATALOGUE_LEASE, node_lease
from gpuhost.host import GpuHost, HostConfig

pytestmark = pytest.mark.xdist_group("kubernetes")
ROOT = Path(__file__).parents[2]
CLUSTER = ROOT / "scripts" / "cluster.sh"
SECOND = "127.0.0.2"
SECOND_GPUS = 2
CHECKED = "GPU-DEFAULT-01,GPU-COUNT-01,GPU-ISOLATION-01"
"""What each node's run judges here: enough for a device plugin that injects every GPU to
fail, in the time of a test (the whole lane is the runner's default)."""


def test_a_pinned_pod_goes_to_its_node_by_name_through_the_scheduler() -> None:
    pod = pod_manifest(
        name="p", namespace="ns", labels={}, image="img", env={},
        resource="nvidia.com/gpu", gpus=1, node="node-a",
    )  # fmt: skip
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
        ]
    }
    assert "nodeName" not in pod["spec"]  # the scheduler still judges what fits
    assert (
        "affinity"
        not in pod_manifest(
            name="p", namespace="ns", labels={}, image="img", env={}, resource="r", gpus=1
        )["spec"]
    )


def test_a_pinned_driver_takes_its_turn_on_its_nodes_own_lease(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    host = GpuHost.open(HostConfig(sim_root=None, state_dir=tmp_path))
    assert KubernetesDriver(host, "s1").turn_lease == CATALOGUE_LEASE
    monkeypatch.setenv(NODE_ENV, "node-a")
    assert KubernetesDriver(host, "s1").turn_lease == f"{CATALOGUE_LEASE}-node-node-a"
    long_name = "n" * 253
    assert len(node_lease(long_name)) <= 253
    assert node_lease(long_name) != node_lease("n" * 252)


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


def test_the_planted_node_fails_its_column_only(two_nodes: str, tmp_path: Path) -> None:
    out = tmp_path / "fleet"
    run = subprocess.run(
        [
            sys.executable, "-m", "conformance.nodes", f"--out={out}", "--jobs=2",
            "--sim-gpus=1", f"--requirement={CHECKED}", "-p", "no:cacheprovider",
        ],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != NODE_ENV},
    )  # fmt: skip
    said = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 1, said  # the gate fails: one node fails
    fleet = json.loads((out / "conformance.json").read_text())
    hosts = {host["name"]: host for host in fleet["hosts"]}
    assert set(hosts) == {"localhost", two_nodes}, said
    verdict = fleet["verdicts"]["kubernetes"]
    assert verdict["hosts"] == {"localhost": "PASS", two_nodes: "FAIL"}, said
    assert verdict["status"] == "FAIL"
    failed = {
        req
        for req, row in fleet["matrix"].items()
        if row["kubernetes"]["hosts"].get(two_nodes) == "failed"
    }
    assert "GPU-ISOLATION-01" in failed, failed
    assert not any(
        row["kubernetes"]["hosts"].get("localhost") == "failed" for row in fleet["matrix"].values()
    )
    # Each column names its node, its GPUs and its device plugins' resources.
    second = hosts[two_nodes]
    assert f"{SECOND_GPUS} x NVIDIA" in second["gpus"], second["gpus"]
    header = second["report"]
    assert header["hostname"] == two_nodes
    assert f"nvidia.com/gpu {SECOND_GPUS}" in header["runs_on"], header["runs_on"]
    assert "gpu-sandbox.test/leaky-gpu" in hosts["localhost"]["report"]["runs_on"]
    assert header["host_id"] != hosts["localhost"]["report"]["host_id"]
    for name in (f"{two_nodes}.json", f"{two_nodes}.log", "localhost.json"):
        assert (out / "nodes" / name).is_file(), name
    assert f"kubernetes on {two_nodes}: FAIL" in run.stdout, said
    assert "kubernetes on localhost: PASS" in run.stdout, said
