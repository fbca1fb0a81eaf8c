"""The catalogue as a Kubernetes Job per GPU node (``python -m conformance.job``).

The image is built from this machine and the project (scripts/cluster/job_image.py) and
imported into each node of the local cluster; each Job's pod runs the kubernetes lane on its
node through its service account; its reports come back through its log and are merged as
the nodes' runs are. On the cluster grown to two nodes, the planted one fails its column only.
The pod leaves its reports as Sonobuoy's plugin contract has them: a results directory and a
``done`` file naming the archive.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conformance import job
from drivers.kubernetes import KubernetesDriver
from drivers.kubernetes.api import json_body
from drivers.kubernetes.cluster import NODE_ENV
from gpuhost.host import GpuHost, HostConfig
from tests.drivers.second_node import (
    CHECKED,
    CLUSTER,
    ROOT,
    the_planted_node_failed_alone,
    two_nodes,
)

__all__ = ["two_nodes"]  # the fixture, for pytest
pytestmark = pytest.mark.xdist_group("kubernetes")
API_SERVER = "127.0.0.1:6443"
"""The local cluster has no service proxy: the Jobs' pods reach it on the host's network."""
PLUGIN = ROOT / "examples" / "sonobuoy" / "gpu-sandbox-plugin.yaml"
OWN = "<the driver's namespace>"


def _archive(files: dict[str, bytes], links: dict[str, str] | None = None) -> str:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return job.MARKER + base64.b64encode(buffer.getvalue()).decode()


def test_a_pods_log_gives_its_reports_and_nothing_else(tmp_path: Path) -> None:
    log = "\n".join([
        "collected 2 items",
        _archive(
            {"conformance.json": b"{}", "junit.xml": b"<x/>", "../../escape": b"x",
             "/etc/cron.d/x": b"x", "other.sh": b"x"},
            {"output.txt": "/etc/shadow"},
        ),
    ])  # fmt: skip
    report = job.taken(log, tmp_path / "node")
    assert report == tmp_path / "node" / "conformance.json"
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == [
        "conformance.json",
        "junit.xml",
    ]
    assert not (tmp_path / "escape").exists()
    assert job.taken("a pod that printed no archive", tmp_path / "none") is None
    for corrupt in ("not base64 at all!", base64.b64encode(b"not gzip").decode(), "QUJD"):
        assert job.taken(job.MARKER + corrupt, tmp_path / "corrupt") is None
    # A sandbox's output in the log comes before the pod's own archive, which is taken.
    forged = _archive({"conformance.json": b'"forged"'})
    assert job.taken(f"{forged}\n{log}", tmp_path / "last") is not None
    assert (tmp_path / "last" / "conformance.json").read_bytes() == b"{}"


def test_the_sonobuoy_plugin_shipped_is_the_jobs_pod() -> None:
    shipped = yaml.safe_load(PLUGIN.read_text())
    assert shipped == job.sonobuoy_plugin(job.IMAGE), (
        "regenerate: python -m conformance.job sonobuoy-plugin"
    )
    assert shipped["sonobuoy-config"]["driver"] == "DaemonSet"
    mounts = shipped["spec"]["volumeMounts"]
    assert mounts == [{"name": "results", "mountPath": job.RESULTS_DIR}]


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    """The catalogue's image, built from this checkout, in every node of the cluster."""
    archive = ROOT / "build" / "gpu-sandbox-catalogue-test.oci.tar"
    archive.parent.mkdir(exist_ok=True)
    name = "docker.io/library/gpu-sandbox-catalogue:test"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/cluster/job_image.py"), f"--name={name}",
         f"--out={archive}"],
        check=True, timeout=600,
    )  # fmt: skip
    subprocess.run(["bash", str(CLUSTER), "import-image", str(archive)], check=True, timeout=300)
    yield name.rpartition("/")[2]
    archive.unlink()


def test_a_pod_leaves_its_reports_as_sonobuoy_expects(tmp_path: Path) -> None:
    results = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k != NODE_ENV}
    run = subprocess.run(
        [sys.executable, "-m", "conformance.job", "pod", "--sim-gpus=1",
         "--requirement=GPU-DEFAULT-01"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**env, "NODE_NAME": "localhost", "SONOBUOY_RESULTS_DIR": str(results)},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    archive = results / job.ARCHIVE
    assert (results / "done").read_text() == str(archive)  # the worker sends what it names
    with tarfile.open(archive) as tar:
        assert sorted(tar.getnames()) == sorted(job.REPORTS)
    junit = (results / "junit.xml").read_text()
    assert "conformance-localhost" in junit
    assert "<failure" not in junit
    assert job.taken(run.stdout, tmp_path / "back") is not None  # the log carries the same
    report = json.loads((tmp_path / "back" / "conformance.json").read_text())
    assert (report["hostname"], report["gpu_count"]) == ("localhost", 8)  # the node, not the pod


def test_a_job_per_node_the_planted_node_fails_its_column_only(
    two_nodes: str, image: str, tmp_path: Path
) -> None:
    out = tmp_path / "fleet"
    run = subprocess.run(
        [sys.executable, "-m", "conformance.job", f"--out={out}", f"--image={image}",
         "--jobs=2", f"--api-server={API_SERVER}", "--sim-gpus=1", f"--requirement={CHECKED}"],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != NODE_ENV},
    )  # fmt: skip
    the_planted_node_failed_alone(run, out, two_nodes)
    for node in ("localhost", two_nodes):
        assert (out / "nodes" / node / "junit.xml").is_file(), node
        assert "collected" in (out / "nodes" / f"{node}.log").read_text()
    # Each Job is deleted once read back; the service account stays for the next run.
    driver = KubernetesDriver(GpuHost.open(HostConfig(state_dir=tmp_path)), "job-test")
    from kubernetes import client

    jobs = client.BatchV1Api(driver.api_client()).list_namespaced_job(
        driver.namespace, label_selector=job.RUN_LABEL, _preload_content=False
    )
    assert json_body(jobs)["items"] == []


def test_a_pod_that_cannot_start_fails_its_node_at_once_saying_why(tmp_path: Path) -> None:
    out = tmp_path / "fleet"
    run = subprocess.run(
        [sys.executable, "-m", "conformance.job", f"--out={out}",
         "--image=gpu-sandbox-catalogue:no-such-tag", f"--api-server={API_SERVER}",
         "--timeout=600", "--sim-gpus=1", "--requirement=GPU-DEFAULT-01"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != NODE_ENV},
    )  # fmt: skip
    said = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 1, said
    assert "node localhost: Job stuck: ErrImagePull" in run.stdout or (
        "node localhost: Job stuck: ImagePullBackOff" in run.stdout
    ), said
    assert "FAILED: Job stuck" in run.stdout, said


def test_a_pod_stuck_is_told_from_one_starting() -> None:
    waiting = {"state": {"waiting": {"reason": "ContainerCreating"}}}
    assert job.stuck({"status": {"containerStatuses": [waiting]}}) == ""
    pulling = {"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no registry"}}}
    assert (
        job.stuck({"status": {"containerStatuses": [pulling]}}) == "ImagePullBackOff: no registry"
    )
    unscheduled = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    assert job.stuck({"status": {"conditions": [unscheduled]}}) == "Unschedulable"
    assert job.stuck({}) == ""


@pytest.mark.parametrize(
    ("verb", "resource", "namespace", "allowed"),
    [
        ("create", "pods", OWN, True),
        ("create", "pods/exec", OWN, True),
        ("list", "pods", "", True),  # every pod that holds a GPU counts
        ("list", "nodes", "", True),
        ("create", "pods", "default", False),
        ("delete", "pods", "kube-system", False),
        ("get", "secrets", OWN, False),
        ("patch", "nodes", "", False),
        ("create", "clusterrolebindings", "", False),
    ],
)
def test_the_jobs_account_makes_pods_in_its_namespace_alone(
    verb: str, resource: str, namespace: str, allowed: bool, tmp_path: Path
) -> None:
    from kubernetes import client

    driver = KubernetesDriver(GpuHost.open(HostConfig(state_dir=tmp_path)), "job-rights")
    with driver.catalogue_turn():
        job.Runner(driver, argparse.Namespace(), []).grant()
    namespace = driver.namespace if namespace == OWN else namespace
    resource, _, subresource = resource.partition("/")
    group = "rbac.authorization.k8s.io" if resource.startswith("cluster") else ""
    review: Any = {
        "spec": {
            "user": f"system:serviceaccount:{driver.namespace}:{job.ACCOUNT}",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{driver.namespace}"],
            "resourceAttributes": {
                "verb": verb, "resource": resource, "subresource": subresource,
                "namespace": namespace, "group": group,
            },
        }
    }  # fmt: skip
    api = client.AuthorizationV1Api(driver.api_client())
    answer = json_body(api.create_subject_access_review(review, _preload_content=False))
    assert answer["status"].get("allowed", False) is allowed, answer["status"]
