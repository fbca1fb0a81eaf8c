"""The kubernetes lane node by node (``python -m conformance.nodes``).

Its pods pinned to one node by name; its turn on that node's own Lease; its report naming
the node, its GPUs and its device plugins' resources in the host's place. On the local
cluster grown to two nodes (``scripts/cluster.sh add-node``: a second kubelet on this
machine, with a containerd, a simulated host and a device plugin of its own), a node whose
device plugin misbehaves (planted: it injects every GPU of its host) fails its column only.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from drivers.kubernetes import KubernetesDriver, pod_manifest
from drivers.kubernetes.cluster import NODE_ENV
from drivers.kubernetes.turn import CATALOGUE_LEASE, node_lease
from gpuhost.host import GpuHost, HostConfig
from tests.drivers.second_node import (
    CHECKED,
    ROOT,
    SECOND_GPUS,
    the_planted_node_failed_alone,
    two_nodes,
)

__all__ = ["two_nodes"]  # the fixture, for pytest

pytestmark = pytest.mark.xdist_group("kubernetes")


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
    fleet = the_planted_node_failed_alone(run, out, two_nodes)
    hosts = {host["name"]: host for host in fleet["hosts"]}
    # Each column names its node, its GPUs and its device plugins' resources.
    second = hosts[two_nodes]
    assert f"{SECOND_GPUS} x NVIDIA" in second["gpus"], second["gpus"]
    header = second["report"]
    assert header["hostname"] == two_nodes
    assert "gpu-sandbox.test/leaky-gpu" in hosts["localhost"]["report"]["runs_on"]
    assert header["host_id"] != hosts["localhost"]["report"]["host_id"]
    for name in (f"{two_nodes}.json", f"{two_nodes}.log", "localhost.json"):
        assert (out / "nodes" / name).is_file(), name
    assert f"kubernetes on {two_nodes}: FAIL" in run.stdout
    assert "kubernetes on localhost: PASS" in run.stdout
