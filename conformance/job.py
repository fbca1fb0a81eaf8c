"""The catalogue as a Kubernetes Job per GPU node, run in the cluster, one fleet report.

    python -m conformance.job --out DIR [--image IMAGE] [--jobs N] [--nodes A,B]
        [--api-server HOST:PORT] [--timeout S] PYTEST_ARGS...
    python -m conformance.job sonobuoy-plugin [--image IMAGE]

For each node with allocatable GPUs, a Job whose one pod runs on that node (a required node
affinity on its name) the kubernetes lane pinned to it, in the cluster: the pod's service
account reaches the API server (``gpu-sandbox-catalogue``, given only what the driver asks
for), its sandboxes are pods on the same node. ``--jobs`` Jobs at a time. The pod writes its
reports where Sonobuoy's plugin contract expects them (``$SONOBUOY_RESULTS_DIR``, else
``/tmp/sonobuoy/results``; a ``done`` file naming the results archive) and prints the
archive on its log, from which this runner takes it: each node's reports under
DIR/nodes/NODE/, merged as ``conformance.nodes`` merges them into DIR.

``sonobuoy-plugin`` prints the same pod as a Sonobuoy plugin (a DaemonSet on the nodes GPU
feature discovery labels ``nvidia.com/gpu.present=true``): ``sonobuoy run --plugin FILE``.
The image is built from this machine (``make job-image``: scripts/cluster/job_image.py).
``--api-server`` is for a cluster whose pods cannot reach the API server through its
Service (no service proxy, as on the local cluster): the pod runs on the host's network and
is told HOST:PORT.
"""

from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import io
import os
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import yaml

from conformance.lanes import DEFAULT_JOBS
from conformance.nodes import EXIT_USAGE, chosen_nodes, fleet_report
from conformance.report import MAX_REPORT_BYTES
from drivers.kubernetes import KubernetesDriver
from drivers.kubernetes.api import json_body, said
from drivers.kubernetes.cluster import NODE_ENV

IMAGE = "gpu-sandbox-catalogue:latest"
ACCOUNT = "gpu-sandbox-catalogue"
RUN_LABEL = "gpu-sandbox.dev/catalogue-job"
RESULTS_DIR = "/tmp/sonobuoy/results"
"""Sonobuoy's default: its worker waits for ``done`` there."""
ARCHIVE = "results.tar.gz"
MARKER = "gpu-sandbox-results: "
"""Starts the log line that carries the pod's results archive, base64."""
REPORTS = ("conformance.json", "junit.xml", "conformance.html", "conformance.md", "output.txt")
"""What a pod's archive may hold; nothing else of it is taken."""
CLUSTER_RULES = [
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "create"]},
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
]
"""What the driver reads across the cluster: the nodes' GPUs, every pod that holds one."""
NAMESPACE_RULES = [
    {
        "apiGroups": [""],
        "resources": ["pods", "pods/exec", "pods/log"],
        "verbs": ["get", "list", "watch", "create", "delete", "deletecollection"],
    },
    {
        "apiGroups": ["networking.k8s.io"],
        "resources": ["networkpolicies"],
        "verbs": ["get", "create"],
    },
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "list", "create", "update", "patch", "delete"],
    },
]
"""What it makes and removes: its sandboxes' pods, their policy, its turn; in its namespace."""
POLL_S = 2.0
STUCK = {
    "ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
    "CreateContainerConfigError", "CreateContainerError", "Unschedulable",
}  # fmt: skip
"""Why a pod would wait until the timeout: its node fails now, saying so."""
PLUGIN_HEADER = """\
# The GPU sandbox catalogue as a Sonobuoy plugin: the kubernetes lane on each GPU node.
# Written by `python -m conformance.job sonobuoy-plugin [--image IMAGE]`; run with
# `sonobuoy run --plugin gpu-sandbox-plugin.yaml`. The image: `make job-image`, then push
# build/gpu-sandbox-catalogue.oci.tar where the nodes pull from (docs/drivers/kubernetes.md).
"""


def container(image: str, pytest_args: Sequence[str], api_server: str = "") -> dict[str, Any]:
    """The pod's container: the catalogue's kubernetes lane on the pod's own node."""
    env: list[dict[str, Any]] = [
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "SONOBUOY_RESULTS_DIR", "value": RESULTS_DIR},
    ]
    if api_server:
        host, _, port = api_server.rpartition(":")
        env += [
            {"name": "KUBERNETES_SERVICE_HOST", "value": host},
            {"name": "KUBERNETES_SERVICE_PORT", "value": port},
        ]
    return {
        "name": "plugin",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "conformance.job", "pod", *pytest_args],
        "env": env,
        "volumeMounts": [{"name": "results", "mountPath": RESULTS_DIR}],
    }


def job(
    name: str, node: str, run_id: str, image: str, pytest_args: Sequence[str], api_server: str
) -> dict[str, Any]:
    """The Job of one node."""
    pod: dict[str, Any] = {
        "serviceAccountName": ACCOUNT,
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "hostNetwork": bool(api_server),
        "tolerations": [{"operator": "Exists"}],  # GPU nodes are often tainted for GPU pods
        "affinity": _on_node("matchFields", "metadata.name", node),
        "containers": [container(image, pytest_args, api_server)],
        "volumes": [{"name": "results", "emptyDir": {}}],
    }
    labels = {RUN_LABEL: run_id}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def sonobuoy_plugin(image: str) -> dict[str, Any]:
    """The same pod as a Sonobuoy plugin: a DaemonSet on the GPU nodes, JUnit results."""
    return {
        "sonobuoy-config": {
            "driver": "DaemonSet",
            "plugin-name": "gpu-sandbox",
            "result-format": "junit",
            "description": "The GPU sandbox conformance catalogue, kubernetes lane, per node.",
        },
        "podSpec": {
            "serviceAccountName": "sonobuoy-serviceaccount",
            "restartPolicy": "Never",
            "tolerations": [{"operator": "Exists"}],
            "affinity": _on_node("matchExpressions", "nvidia.com/gpu.present", "true"),
        },
        "spec": container(image, ["--sim-gpus=1"]),
    }


def _on_node(kind: str, key: str, value: str) -> dict[str, Any]:
    term = {kind: [{"key": key, "operator": "In", "values": [value]}]}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
        }
    }


# -- in the pod ------------------------------------------------------------------------------


def in_pod(pytest_args: Sequence[str]) -> int:
    """Run the kubernetes lane on this pod's node; leave its reports as Sonobuoy expects."""
    results = Path(os.environ.get("SONOBUOY_RESULTS_DIR") or RESULTS_DIR)
    results.mkdir(parents=True, exist_ok=True)
    node = os.environ.get("NODE_NAME", "")
    if not node:
        print("job: NODE_NAME is unset: the pod must be given spec.nodeName", file=sys.stderr)  # noqa: T201
        return EXIT_USAGE
    command = [
        sys.executable, "-m", "pytest", "conformance", "workloads", "-p", "no:cacheprovider",
        f"--driver={KubernetesDriver.name}", f"--junitxml={results / 'junit.xml'}",
        f"--conformance-json={results / 'conformance.json'}",
        f"--conformance-html={results / 'conformance.html'}",
        f"--conformance-markdown={results / 'conformance.md'}",
        "-o", f"junit_suite_name=conformance-{node}", *pytest_args,
    ]  # fmt: skip
    with open(results / "output.txt", "wb") as output:
        run = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, NODE_ENV: node}, cwd=Path(__file__).parents[1],
        )  # fmt: skip
        for line in cast(io.BufferedReader, run.stdout):
            output.write(line)
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        returncode = run.wait()
    archive = results / ARCHIVE
    with tarfile.open(archive, "w:gz") as tar:
        for name in REPORTS:
            if (results / name).is_file():
                tar.add(results / name, arcname=name)
    encoded = base64.b64encode(archive.read_bytes()).decode()
    print(f"{MARKER}{encoded}", flush=True)  # noqa: T201
    (results / "done").write_text(str(archive))  # last: Sonobuoy's worker then sends it
    return returncode


# -- the runner ------------------------------------------------------------------------------


def taken(log: str, directory: Path) -> Path | None:
    """The pod's reports, from its log, into ``directory``: its JSON report, if any.

    The log is the pod's to write, and a sandbox's output may be in it: the last marked line
    is taken (the pod prints it once its run ended), and of its archive only the regular
    files of the names in ``REPORTS``, each at most ``MAX_REPORT_BYTES``; an archive that does
    not read gives none.
    """
    lines = [line for line in log.splitlines() if line.startswith(MARKER)]
    if not lines:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    try:
        data = base64.b64decode(lines[-1][len(MARKER) :], validate=True)
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar.getmembers():
                if member.name in REPORTS and member.isfile() and member.size <= MAX_REPORT_BYTES:
                    source = tar.extractfile(member)
                    if source is not None:
                        (directory / member.name).write_bytes(source.read(MAX_REPORT_BYTES))
    except (ValueError, tarfile.TarError, EOFError, OSError):
        return None
    report = directory / "conformance.json"
    return report if report.is_file() else None


class Runner:
    """The Jobs of one run: made, watched, read back and deleted."""

    def __init__(self, driver: KubernetesDriver, args: argparse.Namespace, rest: list[str]):
        from kubernetes import client

        self.driver, self.args, self.pytest_args = driver, args, rest
        self.run_id = uuid.uuid4().hex[:8]
        self.batch = client.BatchV1Api(driver.api_client())
        self.rbac = client.RbacAuthorizationV1Api(driver.api_client())
        self.namespace = driver.namespace

    def name(self, node: str) -> str:
        """The node's Job in this run: a Job of an earlier run may still be going away."""
        return (
            f"gpu-sandbox-catalogue-{hashlib.sha256(node.encode()).hexdigest()[:8]}-{self.run_id}"
        )

    def grant(self) -> None:
        """The Jobs' service account, and what it may ask: made once, kept.

        In the driver's namespace, which its catalogue turn makes.
        """
        core, ns = self.driver.core, self.namespace
        rbac, partial = self.rbac, functools.partial
        cluster_role: Any = {"metadata": {"name": ACCOUNT}, "rules": CLUSTER_RULES}
        role: Any = {"metadata": {"name": ACCOUNT}, "rules": NAMESPACE_RULES}
        _made_or_kept(partial(core.create_namespaced_service_account, ns, _named(ACCOUNT)))
        _made_or_kept(
            partial(rbac.create_cluster_role, cluster_role),
            partial(rbac.replace_cluster_role, ACCOUNT, cluster_role),
        )
        _made_or_kept(partial(rbac.create_cluster_role_binding, _binding("ClusterRole", ns)))
        _made_or_kept(
            partial(rbac.create_namespaced_role, ns, role),
            partial(rbac.replace_namespaced_role, ACCOUNT, ns, role),
        )
        _made_or_kept(partial(rbac.create_namespaced_role_binding, ns, _binding("Role", ns)))

    def run(self, nodes: list[str]) -> dict[str, tuple[str, str]]:
        """Each node's Job, ``--jobs`` at a time; how each ended and its log, by node."""
        waiting, running, ended = list(nodes), dict[str, float](), dict[str, tuple[str, str]]()
        deadline = time.monotonic() + self.args.timeout
        try:
            while waiting or running:
                while waiting and len(running) < self.args.jobs:
                    node = waiting.pop(0)
                    manifest: Any = job(
                        self.name(node), node, self.run_id, self.args.image, self.pytest_args,
                        self.args.api_server,
                    )  # fmt: skip
                    self.batch.create_namespaced_job(self.namespace, manifest)
                    running[node] = time.monotonic()
                    _say(f"node {node}: Job {self.name(node)} started")
                for node in list(running):
                    status = self._status(node)
                    if not status and time.monotonic() > deadline:
                        status = f"timed out after {self.args.timeout:g} s"
                    if status:
                        seconds = time.monotonic() - running.pop(node)
                        ended[node] = (f"Job {status} in {seconds:.0f} s", self._log(node))
                        _say(f"node {node}: {ended[node][0]}")
                        self._delete(node)
                time.sleep(POLL_S)
        finally:
            for node in running:
                self._delete(node)
        return ended

    def _status(self, node: str) -> str:
        body = json_body(
            self.batch.read_namespaced_job_status(
                self.name(node), self.namespace, _preload_content=False
            )
        )
        status = body.get("status") or {}
        if status.get("succeeded") or status.get("failed"):
            return "succeeded" if status.get("succeeded") else "failed"
        pod = self._pod(node)
        return f"stuck: {stuck(pod)}" if pod and stuck(pod) else ""

    def _pod(self, node: str) -> dict[str, Any] | None:
        pods = json_body(
            self.driver.core.list_namespaced_pod(
                self.namespace, label_selector=f"job-name={self.name(node)}",
                _preload_content=False,
            )
        )["items"]  # fmt: skip
        return dict(pods[0]) if pods else None

    def _log(self, node: str) -> str:
        pod = self._pod(node)
        if pod is None:
            return ""
        try:
            name = pod["metadata"]["name"]
            return str(self.driver.core.read_namespaced_pod_log(name, self.namespace))
        except Exception as exc:  # a pod that never started has no log: say why
            return f"no log: {said(exc)}"

    def _delete(self, node: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.batch.delete_namespaced_job(
                self.name(node), self.namespace, propagation_policy="Foreground"
            )
        except ApiException as exc:
            if exc.status != 404:
                raise


def stuck(pod: dict[str, Any]) -> str:
    """Why ``pod`` cannot start, where it is one of ``STUCK`` (its reason and message)."""
    status = pod.get("status") or {}
    waits = [
        (container.get("state") or {}).get("waiting") or {}
        for container in status.get("containerStatuses") or []
    ]
    unscheduled = [
        condition
        for condition in status.get("conditions") or []
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False"
    ]
    for why in [*waits, *unscheduled]:
        if why.get("reason") in STUCK:
            return f"{why['reason']}: {why.get('message', '')}".rstrip(": ")
    return ""


def _named(name: str) -> Any:
    return {"metadata": {"name": name}}


def _binding(kind: str, namespace: str) -> Any:
    """The account's binding to its role of ``kind`` (ClusterRole or Role)."""
    return {
        "metadata": {"name": ACCOUNT},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": ACCOUNT},
        "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": namespace}],
    }


def _made_or_kept(create: Any, replace: Any = None) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        create()
    except ApiException as exc:
        if exc.status != 409:
            raise
        if replace is not None:
            replace()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pod"]:
        return in_pod(argv[1:])
    if argv[:1] == ["sonobuoy-plugin"]:
        plugin = argparse.ArgumentParser(prog="python -m conformance.job sonobuoy-plugin")
        plugin.add_argument("--image", default=IMAGE)
        image = plugin.parse_args(argv[1:]).image
        print(PLUGIN_HEADER + yaml.safe_dump(sonobuoy_plugin(image), sort_keys=False), end="")  # noqa: T201
        return 0
    parser = argparse.ArgumentParser(
        prog="python -m conformance.job",
        description="Run the catalogue's kubernetes lane as a Job on each GPU node of the "
        "cluster, and merge the nodes' reports into one fleet report. Other arguments go to "
        "each pod's pytest.",
        allow_abbrev=False,
    )
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--image", default=IMAGE, help=f"the catalogue's image ({IMAGE})")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="nodes at once")
    parser.add_argument("--nodes", help="which nodes, comma-separated (default: every GPU node)")
    parser.add_argument("--api-server", default="", metavar="HOST:PORT",
                        help="the API server as the host's network reaches it")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for each Job")
    args, pytest_args = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, not {args.jobs}")
    if args.api_server and not args.api_server.rpartition(":")[2].isdigit():
        parser.error(f"--api-server must be HOST:PORT, not {args.api_server!r}")
    if any(
        arg.startswith(("--driver", "--lane", "--junitxml", "--conformance-"))
        for arg in pytest_args
    ):
        parser.error("--driver, --lane and the reports are the Job's: each is the kubernetes lane")
    driver, names = chosen_nodes(parser, "job", args.nodes)
    runner = Runner(driver, args, pytest_args)
    _say(f"{len(names)} nodes, {min(args.jobs, len(names))} at a time, image {args.image}")
    with driver.catalogue_turn():  # in the driver's namespace, made for it
        runner.grant()
        ended = runner.run(names)
    directory = args.out / "nodes"
    reported, missing = [], {}
    for node in names:
        how, log = ended.get(node, ("never started", ""))
        (directory / node).mkdir(parents=True, exist_ok=True)
        (directory / f"{node}.log").write_text(
            "\n".join(line for line in log.splitlines() if not line.startswith(MARKER))
        )
        report = taken(log, directory / node)
        if report is None:
            missing[node] = f"{how}, no report in its pod's log; see {directory / node}.log"
        else:
            reported.append(report)
    return fleet_report(reported, missing, args.out, _say)


def _say(line: str) -> None:
    print(f"job: {line}", flush=True)  # noqa: T201


if __name__ == "__main__":
    sys.exit(main())
