"""The kubernetes driver: a pod per sandbox, its GPUs handed out by the cluster.

The request becomes the pod's ``resources.limits["nvidia.com/gpu"]`` (a default request is
1; no request, no limit); the scheduler picks a node with that many free, and the node's
device plugin (NVIDIA's on GPU clusters, ``gpuhost.simulated.device_plugin`` on the local
cluster of ``make cluster``) picks the GPUs and injects them. Exact device IDs are refused
(``UnsupportedGpuRequest``): a pod cannot name the devices it gets. The host-wide lease
registry has no part here: the cluster owns its nodes' GPUs.

What a sandbox was given is what the device plugin told the container:
``NVIDIA_VISIBLE_DEVICES`` (the UUIDs it allocated, as NVIDIA's plugin sets them), which the
pod prints once at start; where it holds no UUIDs (another plugin strategy), ``nvidia-smi -L``
inside. The details of those GPUs (index, PCI address, device node) come from the node's
``gpu-sandbox.dev/gpus`` annotation, JSON lists by resource name that ``make cluster``
writes for its simulated GPUs and a user publishes for a real node (README: "The
kubernetes lane");
without it the inventory is one placeholder per allocatable GPU.

Exhaustion: a pod the scheduler reports Unschedulable for ``Insufficient nvidia.com/gpu``
becomes ``GpusExhausted`` (requested, the most free on one node, allocatable in all) and is
deleted, unless pods being deleted would make room (the scheduler tries again once they are
gone). A scheduler answers in a round trip: ``exhaustion_grace_s`` is 3 s. A count above
every node's allocatable fails before any pod is made.

A sandbox's processes ending (``kill``) leave the pod Failed, which neither the scheduler
nor the kubelet count as holding GPUs. A pod belongs to the API server, not to the process
that made it: ``reap`` (one delete by label) removes a session's pods from any process.

Options, from the environment: ``KUBECONFIG`` (else ``/run/gpu-sandbox-cluster/kubeconfig``,
the local cluster's, when it exists, else ``~/.kube/config``), ``GPU_SANDBOX_K8S_CONTEXT``,
``GPU_SANDBOX_K8S_NAMESPACE`` (default ``gpu-sandbox``: one namespace for every session,
its pods labelled by session: a namespace being deleted refuses new pods, and a session is
reaped after every test), ``GPU_SANDBOX_K8S_RESOURCE`` (default ``nvidia.com/gpu``),
``GPU_SANDBOX_K8S_START_TIMEOUT_S`` (default 120), ``GPU_SANDBOX_K8S_TURN_TIMEOUT_S``
(default 600). Per sandbox, ``template.driver_config.kubernetes`` takes ``runtime_class_name``,
``node_selector`` and ``image``.

Catalogue runs take turns on a cluster (``catalogue_turn``): each expects every GPU of the
cluster free, so a run holds the Lease ``gpu-sandbox-catalogue`` of the driver's namespace
while it runs the lane, and another run waits for it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, cast

import yaml

from drivers.base import (
    Availability,
    Command,
    CommandTimedOut,
    Driver,
    Launch,
    Output,
    Sandbox,
)
from gpuhost.devices import GpuDevice, gpus_from_json
from gpuhost.errors import (
    DriverError,
    ExecTimeout,
    GpusExhausted,
    InvalidDriverConfig,
    SandboxExecError,
    SandboxStartError,
    UnknownImage,
    named,
    shown,
)
from gpuhost.host import GpuHost
from gpuhost.leases import Holder
from gpuhost.procfs import EXEC_MARKER_ENV
from gpuhost.spec import (
    DriverCapabilities,
    DriverRequest,
    GpuPlan,
    block_field,
    check_image,
    thawed,
)
from gpuhost.wait import wait_for

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, CoordinationV1Api, CoreV1Api
    from kubernetes.client.configuration import Configuration

LOCAL_KUBECONFIG = Path("/run/gpu-sandbox-cluster/kubeconfig")
DEFAULT_IMAGE = "gpu-sandbox-busybox:latest"
DEFAULT_NAMESPACE = "gpu-sandbox"
DEFAULT_RESOURCE = "nvidia.com/gpu"
INVENTORY_ANNOTATION = "gpu-sandbox.dev/gpus"
"""A node's GPUs by resource name, as JSON: ``{"nvidia.com/gpu": [<gpus_to_json>]}``."""
LABEL_PREFIX = "gpu-sandbox.dev/"
SESSION_LABEL = LABEL_PREFIX + "session"
SANDBOX_LABEL = LABEL_PREFIX + "sandbox"
DRIVER_LABEL = LABEL_PREFIX + "driver"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpu-sandbox"}
SECURITY_CONTEXT: Mapping[str, Any] = MappingProxyType(
    {
        "privileged": False,
        "allowPrivilegeEscalation": False,  # no_new_privs in every process of the container
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
)
"""A sandbox's container: no privilege, no capability, no way to gain one."""
OPTION_KEYS = ("runtime_class_name", "node_selector", "image")
"""The keys of its own block it reads, beside the common ones: a pod's runtime class, the
nodes it may go to, the image its container runs."""
_DNS_SUBDOMAIN = re.compile(
    r"(?=.{1,253}\Z)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
_LABEL_VALUE = re.compile(r"(?=.{1,63}\Z)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
"""Kubernetes' syntax of names (RFC 1123 subdomains) and label values (and label names
after their prefix)."""


def _label_name(name: str) -> bool:
    prefix, slash, rest = name.rpartition("/")
    if slash and not _DNS_SUBDOMAIN.fullmatch(prefix):
        return False
    return bool(_LABEL_VALUE.fullmatch(rest))


START_TIMEOUT_S = 120.0
DELETE_TIMEOUT_S = 60.0
CATALOGUE_LEASE = "gpu-sandbox-catalogue"
"""The Lease a catalogue run holds while it runs the lane: one run at a time per cluster."""
TURN_DURATION_S = 15
"""How long a turn outlives its holder's last renewal (renewed every third of it): a run that
crashed gives its turn up by itself within 15 s, and a stall of seconds loses nothing."""
TURN_TIMEOUT_S = 600.0
"""How long a run waits for its turn: five lanes of the local cluster (119 s each), and below
the per-test bound (900 s), so that a wait given up on says whom it waited for."""
TURN_POLL_S = 0.5
GRANT_TIMEOUT_S = 10.0
"""A running pod has printed its first line within milliseconds; seconds mean it cannot."""
GRANT_LINE = "gpu-sandbox: NVIDIA_VISIBLE_DEVICES="
# The pod's main process: it says what the device plugin gave it, then waits; SIGTERM ends
# it at once (a pod's first process has no default handlers), and so does the death of its
# child, so that SIGKILL of the sandbox's processes ends the pod as a crash would.
MAIN_SCRIPT = (
    f'echo "{GRANT_LINE}${{NVIDIA_VISIBLE_DEVICES-}}"; trap "exit 0" TERM; '
    "while :; do sleep 86400 & wait $! || exit 137; done"
)
# Kills, inside the pod, every process that carries an exec's marker (``$1``), until none
# is left: the API has no call to stop an exec, and what it started may have left its
# process group. Busybox and coreutils images alike have tr, grep and kill.
KILL_MARKED_SCRIPT = (
    "n=0; while :; do found=; for p in /proc/[0-9]*; do "
    'tr "\\0" "\\n" < "$p/environ" 2>/dev/null | grep -qxF "$1" && '
    '{ kill -9 "${p#/proc/}" 2>/dev/null; found=1; }; done; '
    '[ -z "$found" ] && exit 0; n=$((n+1)); [ "$n" -ge 100 ] && exit 1; sleep 0.05; done'
)
_IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName")
_START_ERRORS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


@dataclass(frozen=True)
class Cluster:
    """Where the driver found its cluster: for probe() and reports."""

    kubeconfig: str
    context: str


def find_kubeconfig() -> Path | None:
    """``KUBECONFIG`` (its first file), the local cluster's, or ``~/.kube/config``."""
    if os.environ.get("KUBECONFIG"):
        return Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
    if LOCAL_KUBECONFIG.exists():
        return LOCAL_KUBECONFIG
    default = Path.home() / ".kube" / "config"
    return default if default.exists() else None


def pod_manifest(
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    image: str,
    env: Mapping[str, str],
    resource: str,
    gpus: int,
    runtime_class_name: str | None = None,
    node_selector: Mapping[str, str] | None = None,
    security_context: Mapping[str, Any] = MappingProxyType({}),
) -> dict[str, Any]:
    """The pod of one sandbox, as the API takes it.

    No service account token, no service links, no host namespaces, and its container's
    ``security_context`` (``SECURITY_CONTEXT`` by default: no privilege, no capability,
    no-new-privileges, the runtime's default seccomp profile); the GPU limit only when GPUs
    are asked for (extended resources are requested by their limit).
    """
    container: dict[str, Any] = {
        "name": "sandbox",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", MAIN_SCRIPT],
        "env": [{"name": key, "value": value} for key, value in sorted(env.items())],
        "securityContext": thawed(security_context or SECURITY_CONTEXT),
    }
    if gpus:
        container["resources"] = {"limits": {resource: str(gpus)}}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    if runtime_class_name:
        spec["runtimeClassName"] = runtime_class_name
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": spec,
    }


def pod_gpu_request(pod: Mapping[str, Any], resource: str) -> int:
    """The GPUs a pod (as the API returns it, a dict) asks for: its containers' limits."""
    total = 0
    for container in pod.get("spec", {}).get("containers") or []:
        resources = container.get("resources") or {}
        amount = (resources.get("limits") or {}).get(resource) or (
            resources.get("requests") or {}
        ).get(resource)
        total += int(amount or 0)
    return total


def free_gpus(
    nodes: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]], resource: str
) -> tuple[int, int, int]:
    """(most free on one node, most free once deleting pods are gone, allocatable in all).

    Pods bound to a node and not finished hold their GPUs; a finished pod (Succeeded,
    Failed) holds none, as the scheduler and the kubelet count them.
    """
    held: dict[str, int] = {}
    leaving: dict[str, int] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if not node or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        amount = pod_gpu_request(pod, resource)
        held[node] = held.get(node, 0) + amount
        if pod.get("metadata", {}).get("deletionTimestamp"):
            leaving[node] = leaving.get(node, 0) + amount
    total = free_now = free_later = 0
    for node in nodes:
        name = node["metadata"]["name"]
        allocatable = int((node.get("status", {}).get("allocatable") or {}).get(resource) or 0)
        total += allocatable
        free_now = max(free_now, allocatable - held.get(name, 0))
        free_later = max(free_later, allocatable - held.get(name, 0) + leaving.get(name, 0))
    return max(free_now, 0), max(free_later, 0), total


def exit_status(error_channel: str) -> int | None:
    """The exit code the API's exec stream reports on its error channel; None if none."""
    if not error_channel.strip():
        return None
    status = yaml.safe_load(error_channel)
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause["message"])
    raise SandboxExecError(f"the API server could not run the command: {status.get('message')}")


def granted_uuids(log: str) -> list[str] | None:
    """The UUIDs the pod printed at start (``GRANT_LINE``); None while it has not."""
    for line in log.splitlines():
        if line.startswith(GRANT_LINE):
            value = line[len(GRANT_LINE) :].strip()
            return [item for item in value.split(",") if item.startswith(("GPU-", "MIG-"))]
    return None


class KubernetesSandbox(Sandbox):
    def __init__(
        self,
        sandbox_id: str,
        gpus: tuple[GpuDevice, ...],
        pod_name: str,
        driver: KubernetesDriver,
    ) -> None:
        super().__init__(sandbox_id, driver.name, gpus, Holder.process(os.getpid()), None)
        self.pod_name = pod_name
        self._driver = driver

    def run(self, command: Command, output: Output) -> int:
        return self._driver.exec_in(self.pod_name, command, output.stdout, output.stderr)

    def stop(self) -> None:
        self._driver.delete_pods([self.pod_name])

    def kill(self) -> None:
        self._driver.kill_processes(self.pod_name)


def micro_time(at: datetime) -> str:
    """``at`` as a Lease's times are written, always with six digits of fraction.

    The client writes a datetime with ``isoformat()``, which leaves out a zero fraction, and
    the API server parses these times with the fraction required: never give it a zero one.
    """
    at = at.astimezone(UTC)
    return (at if at.microsecond else at.replace(microsecond=1)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class CatalogueTurn:
    """A catalogue run's turn on a cluster: a coordination.k8s.io/v1 Lease it holds.

    Entering takes the Lease: it creates it, or takes it over once it has no holder or has
    expired (not renewed for its ``leaseDurationSeconds`` by its ``renewTime``, or, whatever
    the clocks say, seen unchanged that long). While another run holds it, a line on stderr
    says who, and it waits, up to ``timeout_s`` (then ``TimeoutError``). A daemon thread
    renews it every third of ``duration_s``; exiting deletes it if it is still this run's,
    and raises ``DriverError`` if another run took it meanwhile (a renewal that could not
    reach the API server for a whole lease). Every write is conditional (a create fails when
    the Lease exists; a replace or a delete names the version it read), so two runs never
    both believe they hold it.
    """

    def __init__(
        self,
        api: CoordinationV1Api,
        namespace: str,
        name: str,
        identity: str,
        *,
        cluster: str,
        duration_s: int = TURN_DURATION_S,
        timeout_s: float = TURN_TIMEOUT_S,
        poll_s: float = TURN_POLL_S,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.cluster = cluster
        self.duration_s = duration_s
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.lost: str | None = None
        """Who took the turn while this run held it; None while it is (or was) this run's."""
        self._held: dict[str, Any] | None = None
        self._seen: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._writing = threading.Lock()
        self._renewer: threading.Thread | None = None

    @property
    def lease(self) -> str:
        return f"{self.namespace}/{self.name}"

    def __enter__(self) -> None:
        started = time.monotonic()
        announced = ""
        while (holder := self._take()) is not None:
            if holder and holder != announced:
                _say(
                    f"waiting for another conformance run on cluster {self.cluster} "
                    f"(lease {self.name} held by {holder})"
                )
                announced = holder
            waited = time.monotonic() - started
            if waited >= self.timeout_s:
                raise TimeoutError(
                    f"gave up waiting for the catalogue turn on cluster {self.cluster} after "
                    f"{waited:.0f} s (GPU_SANDBOX_K8S_TURN_TIMEOUT_S): lease {self.lease} is "
                    f"held by {announced or 'another run'}. Hint: a run gives it back when its "
                    f"lane ends, and one that crashed within {self.duration_s} s; see kubectl "
                    f"get lease -n {self.namespace} {self.name} -o yaml"
                )
            time.sleep(self.poll_s)
        self._renewer = threading.Thread(
            target=self._renew_until_stopped, name=f"renew lease {self.lease}", daemon=True
        )
        self._renewer.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        with self._writing:  # no renewal once this is taken
            held, self._held = self._held, None
        if self._renewer is not None:
            self._renewer.join(timeout=self.duration_s)
        if held is not None:
            try:
                self._give_back()
            except Exception as error:  # it expires by itself; the lane's own error matters more
                _say(
                    f"could not give lease {self.lease} back ({_said(error)}): it expires by "
                    f"itself within {self.duration_s} s"
                )
        if self.lost is not None and exc is None:
            raise DriverError(
                f"the catalogue turn on cluster {self.cluster} (lease {self.lease}) went to "
                f"{self.lost} while this run held it: another run may have used the cluster's "
                "GPUs at the same time"
            )

    # -- the Lease -----------------------------------------------------------------------

    def _read(self) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return cast(
                "dict[str, Any]",
                _json(
                    self.api.read_namespaced_lease(
                        self.name,
                        self.namespace,
                        _preload_content=False,
                        _request_timeout=self.duration_s,
                    )
                ),
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _take(self) -> str | None:
        """Take the Lease if it is free; None once this run holds it, else its holder.

        "" when another run changed it between the read and the write: look again.
        """
        from kubernetes.client.exceptions import ApiException

        lease = self._read() or {}
        spec = lease.get("spec") or {}
        version = str((lease.get("metadata") or {}).get("resourceVersion") or "")
        holder = str(spec.get("holderIdentity") or "")
        taken_over = holder not in ("", self.identity)
        if taken_over and not self._expired(spec, version):
            return holder
        now = micro_time(datetime.now(UTC))
        body: dict[str, Any] = {
            "metadata": {"name": self.name, "labels": dict(MANAGED_BY)},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": self.duration_s,
                "acquireTime": now,
                "renewTime": now,
                "leaseTransitions": int(spec.get("leaseTransitions") or 0) + taken_over,
            },
        }
        try:
            if not lease:
                made = self.api.create_namespaced_lease(
                    self.namespace, cast(Any, body), _preload_content=False
                )
            else:
                body["metadata"]["resourceVersion"] = version
                made = self.api.replace_namespaced_lease(
                    self.name, self.namespace, cast(Any, body), _preload_content=False
                )
        except ApiException as exc:
            if exc.status in (404, 409):  # made, taken or removed by another run just now
                return ""
            raise
        self._held = _json(made)
        return None

    def _expired(self, spec: Mapping[str, Any], version: str) -> bool:
        duration = timedelta(seconds=int(spec.get("leaseDurationSeconds") or self.duration_s))
        renewed = spec.get("renewTime")
        if renewed and datetime.fromisoformat(renewed) + duration < datetime.now(UTC):
            return True
        # A holder whose clock runs ahead writes times in our future: a Lease seen unchanged
        # for its duration has expired, whatever it says.
        if self._seen is None or self._seen[0] != version:
            self._seen = (version, time.monotonic())
        return time.monotonic() - self._seen[1] > duration.total_seconds()

    def _renew_until_stopped(self) -> None:
        while not self._stop.wait(self.duration_s / 3):
            with self._writing:
                if self._held is None:
                    return
                try:
                    self._renew(self._held)
                except Exception:  # the API server away for a moment: the next round tries again
                    continue
                if self.lost is not None:
                    self._held = None
                    return

    def _renew(self, held: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException

        body = {
            "metadata": {
                "name": self.name,
                "labels": held["metadata"].get("labels") or {},
                "resourceVersion": held["metadata"]["resourceVersion"],
            },
            "spec": {**held["spec"], "renewTime": micro_time(datetime.now(UTC))},
        }
        try:
            self._held = _json(
                self.api.replace_namespaced_lease(
                    self.name,
                    self.namespace,
                    cast(Any, body),
                    _preload_content=False,
                    _request_timeout=self.duration_s / 3,
                )
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            lease = self._read()
            holder = ((lease or {}).get("spec") or {}).get("holderIdentity")
            if lease is not None and holder == self.identity:
                self._held = lease  # written by a renewal whose answer was lost
            else:
                self.lost = str(holder or "nobody (it was deleted)")

    def _give_back(self) -> None:
        """Delete the Lease if it is still this run's (it names the version it read)."""
        from kubernetes.client.exceptions import ApiException

        for _ in range(3):
            lease = self._read()
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                return
            precondition = {"resourceVersion": lease["metadata"]["resourceVersion"]}
            try:
                self.api.delete_namespaced_lease(
                    self.name,
                    self.namespace,
                    body=cast(Any, {"preconditions": precondition}),
                    _preload_content=False,
                )
                return
            except ApiException as exc:
                if exc.status == 404:
                    return
                if exc.status != 409:
                    raise


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")  # looked up late: pytest swaps sys.stderr
    sys.stderr.flush()


def _ignore(_: bytes) -> None:
    pass


class KubernetesDriver(Driver):
    name = "kubernetes"
    exhaustion_grace_s = 3.0
    security_context: ClassVar[Mapping[str, Any]] = SECURITY_CONTEXT

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        super().__init__(host, session_id, image)
        self.namespace = os.environ.get("GPU_SANDBOX_K8S_NAMESPACE") or DEFAULT_NAMESPACE
        self.resource = os.environ.get("GPU_SANDBOX_K8S_RESOURCE") or DEFAULT_RESOURCE
        self.start_timeout_s = _env_float("GPU_SANDBOX_K8S_START_TIMEOUT_S", START_TIMEOUT_S)
        self.turn_timeout_s = _env_float("GPU_SANDBOX_K8S_TURN_TIMEOUT_S", TURN_TIMEOUT_S)
        self.turn_lease = CATALOGUE_LEASE
        self.turn_duration_s = TURN_DURATION_S
        self._namespace_ready = threading.Lock()
        self._namespace_made = False
        self._known_gpus: dict[str, GpuDevice] = {}

    # -- the cluster ---------------------------------------------------------------------

    @functools.cached_property
    def cluster(self) -> Cluster:
        from kubernetes import config

        path = find_kubeconfig()
        if path is None:
            raise FileNotFoundError(
                f"no kubeconfig: KUBECONFIG is unset, and neither {LOCAL_KUBECONFIG} nor "
                "~/.kube/config exists"
            )
        contexts, active = config.list_kube_config_contexts(config_file=str(path))  # type: ignore[no-untyped-call]
        wanted = os.environ.get("GPU_SANDBOX_K8S_CONTEXT") or (active or {}).get("name", "")
        if contexts and wanted not in {c["name"] for c in contexts}:
            raise LookupError(f"{path} has no context {wanted!r}")
        return Cluster(str(path), wanted)

    @functools.cached_property
    def configuration(self) -> Configuration:
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=self.cluster.kubeconfig,
            context=self.cluster.context or None,
            client_configuration=configuration,
        )
        # Concurrent creates (the catalogue's threads) each hold a connection.
        configuration.connection_pool_maxsize = 64
        return configuration

    def api_client(self) -> ApiClient:
        from kubernetes import client

        return client.ApiClient(self.configuration)

    @functools.cached_property
    def core(self) -> CoreV1Api:
        from kubernetes import client

        return client.CoreV1Api(self.api_client())

    def nodes(self) -> list[dict[str, Any]]:
        return list(_json(self.core.list_node(_preload_content=False))["items"])

    def pods(self) -> list[dict[str, Any]]:
        pods = self.core.list_pod_for_all_namespaces(_preload_content=False)
        return list(_json(pods)["items"])

    def session_pods(self, session_id: str) -> list[dict[str, Any]]:
        pods = self.core.list_namespaced_pod(
            self.namespace,
            label_selector=f"{SESSION_LABEL}={session_id},{DRIVER_LABEL}={self.name}",
            _preload_content=False,
        )
        return list(_json(pods)["items"])

    # -- the contract --------------------------------------------------------------------

    @property
    def capabilities(self) -> DriverCapabilities:
        return DriverCapabilities(
            max_gpus_per_sandbox=self._largest_node,
            exact_ids=False,
            exact_id_forms="none: a pod gets the GPUs its node's device plugin picks",
            config_keys=OPTION_KEYS,
        )

    @functools.cached_property
    def _largest_node(self) -> int:
        try:
            counts = [self._allocatable(node) for node in self.nodes()]
        except Exception:  # a cluster that does not answer: probe() says why
            return 8
        return max(counts, default=0) or 8

    def _allocatable(self, node: Mapping[str, Any]) -> int:
        return int((node.get("status", {}).get("allocatable") or {}).get(self.resource) or 0)

    def probe(self) -> Availability:
        try:
            cluster = self.cluster
            version = self._server_version()
            nodes = self.nodes()
        except Exception as exc:  # config errors, connection errors, API errors
            return Availability(
                False,
                f"needed a Kubernetes cluster answering through KUBECONFIG, {LOCAL_KUBECONFIG} "
                f"or ~/.kube/config (found: {type(exc).__name__}: {exc}); start the local one "
                "with `make cluster`, or point KUBECONFIG at yours",
            )
        with_gpus = [node["metadata"]["name"] for node in nodes if self._allocatable(node)]
        where = f"{cluster.kubeconfig} (context {cluster.context or 'none'}, server {version})"
        if not with_gpus:
            return Availability(
                False,
                f"needed a node with allocatable {self.resource} in the cluster of {where} "
                f"(found {len(nodes)} nodes, none with it: is the device plugin running?)",
            )
        return Availability(True, f"{where}: {self.resource} on {', '.join(with_gpus)}")

    def _server_version(self) -> str:
        from kubernetes import client

        return str(client.VersionApi(self.api_client()).get_code().git_version)

    def catalogue_turn(self) -> CatalogueTurn:
        """The Lease ``turn_lease`` in the driver's namespace, held by this session.

        Each catalogue test expects every GPU of the cluster free; runs sharing the cluster
        (a second ``make conformance`` on the machine, another CI job) wait for it in turn.
        """
        from kubernetes import client

        self._ensure_namespace()
        return CatalogueTurn(
            client.CoordinationV1Api(self.api_client()),
            self.namespace,
            self.turn_lease,
            f"{self.session_id} (pid {os.getpid()} on {socket.gethostname()})",
            cluster=self.configuration.host,
            duration_s=self.turn_duration_s,
            timeout_s=self.turn_timeout_s,
        )

    def version(self) -> str:
        nodes = self.nodes()
        runtimes = sorted(
            {
                f"{n['status']['nodeInfo']['kubeletVersion']} kubelet, "
                f"{n['status']['nodeInfo']['containerRuntimeVersion']}"
                for n in nodes
            }
        )
        return f"kubernetes {self._server_version()} ({'; '.join(runtimes)})"

    def inventory(self) -> tuple[GpuDevice, ...]:
        """The GPUs of every node with allocatable GPUs, from its annotation when it has one."""
        gpus: list[GpuDevice] = []
        for node in self.nodes():
            count = self._allocatable(node)
            if not count:
                continue
            name = node["metadata"]["name"]
            published = json.loads(
                (node["metadata"].get("annotations") or {}).get(INVENTORY_ANNOTATION) or "{}"
            )
            if self.resource in published:
                gpus.extend(gpus_from_json(json.dumps(published[self.resource])))
            else:
                gpus.extend(
                    GpuDevice(index=i, uuid=f"{name}/{self.resource}/{i}", name=name, pci_bus_id="")
                    for i in range(count)
                )
        return tuple(gpus)

    def device_ids(self, gpu: GpuDevice) -> tuple[str, ...]:
        """The device plugin's ID of the GPU (its UUID): never accepted in a request."""
        return (gpu.uuid,)

    def device_ids_offline(self, gpu: GpuDevice) -> tuple[str, ...]:
        """None: listings show the IDs a request may name, and a pod names none."""
        return ()

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        self._check_options(request.config)
        return super().plan(request)

    def _check_options(self, block: Mapping[str, Any]) -> None:
        """The pod's options, by the API's own rules: one it would refuse is refused here."""
        prefix = block_field(self.name)
        if block.get("image") is not None:
            check_image(block["image"], f"{prefix}.image", InvalidDriverConfig)
        runtime_class = block.get("runtime_class_name")
        if runtime_class is not None and not (
            isinstance(runtime_class, str) and _DNS_SUBDOMAIN.fullmatch(runtime_class)
        ):
            raise InvalidDriverConfig(
                f"{prefix}.runtime_class_name",
                runtime_class,
                f"{prefix}.runtime_class_name must be a RuntimeClass's name (lower-case "
                f"letters, digits, '-' and '.', at most 253), got {shown(runtime_class)}",
            )
        selector = thawed(block.get("node_selector"))
        if selector is None:
            return
        if not isinstance(selector, dict):
            raise InvalidDriverConfig(
                f"{prefix}.node_selector",
                selector,
                f"{prefix}.node_selector must map label names to strings, got {shown(selector)}",
            )
        for name, value in selector.items():
            if not _label_name(name):
                raise InvalidDriverConfig(
                    f"{prefix}.node_selector",
                    name,
                    f"{prefix}.node_selector has a key {shown(name)} that is no label name "
                    "([prefix/]name: letters, digits, '-', '_' and '.', at most 63)",
                )
            if not (isinstance(value, str) and (not value or _LABEL_VALUE.fullmatch(value))):
                raise InvalidDriverConfig(
                    f"{prefix}.node_selector.{name}",
                    value,
                    f"{prefix}.node_selector.{named(name)} must be a label value (letters, digits, "
                    f"'-', '_' and '.', at most 63), got {shown(value)}",
                )

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        """Nothing here: the scheduler and the node's device plugin allocate."""
        return ()

    def start(self, launch: Launch) -> Sandbox:
        count = 0 if launch.plan is None else launch.plan.count
        if count:
            self._refuse_more_than_any_node(count)
        block = launch.request.config
        image = block.get("image") or launch.request.image or self.image or DEFAULT_IMAGE
        name = f"gpu-sandbox-{launch.sandbox_id}"
        manifest = pod_manifest(
            name=name,
            namespace=self.namespace,
            labels={
                **MANAGED_BY,
                SESSION_LABEL: self.session_id,
                SANDBOX_LABEL: launch.sandbox_id,
                DRIVER_LABEL: self.name,
            },
            image=str(image),
            env=launch.env,
            resource=self.resource,
            gpus=count,
            runtime_class_name=block.get("runtime_class_name"),
            node_selector=block.get("node_selector"),
            security_context=self.security_context,
        )
        try:
            self._ensure_namespace()
            self.core.create_namespaced_pod(
                self.namespace, cast(Any, manifest), _preload_content=False
            )
        except Exception as exc:  # the API's refusal, or no API at all
            raise SandboxStartError(
                f"cannot create pod {self.namespace}/{name}: {_said(exc)}"
            ) from exc
        try:
            self._wait_running(name, count, str(image))
            uuids = self._granted(name, count)
            gpus = self._devices(uuids)
        except DriverError:
            self.delete_pods([name])
            raise
        except BaseException as exc:
            self.delete_pods([name])
            if isinstance(exc, Exception):
                raise SandboxStartError(
                    f"pod {self.namespace}/{name} did not start: {_said(exc)}"
                ) from exc
            raise
        return KubernetesSandbox(launch.sandbox_id, gpus, name, self)

    def _refuse_more_than_any_node(self, count: int) -> None:
        if count <= self._largest_node:
            return
        nodes = self.nodes()
        if count > max((self._allocatable(node) for node in nodes), default=0):
            free, _, total = free_gpus(nodes, self.pods(), self.resource)
            raise GpusExhausted(
                count,
                free,
                total,
                f"no node has {count} allocatable {self.resource}; the cluster has {total} in all",
            )

    def _ensure_namespace(self) -> None:
        from kubernetes.client.exceptions import ApiException

        with self._namespace_ready:
            if self._namespace_made:
                return
            try:
                self.core.create_namespace(
                    cast(Any, {"metadata": {"name": self.namespace, "labels": dict(MANAGED_BY)}})
                )
            except ApiException as exc:
                if exc.status != 409:
                    raise
            self._deny_network()
            self._namespace_made = True

    def _deny_network(self) -> None:
        """No traffic in or out of the sandboxes, where the cluster's network enforces it."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        policy = {
            "metadata": {"name": "gpu-sandbox-deny-all", "labels": dict(MANAGED_BY)},
            "spec": {
                "podSelector": {"matchLabels": dict(MANAGED_BY)},
                "policyTypes": ["Ingress", "Egress"],
            },
        }
        try:
            client.NetworkingV1Api(self.api_client()).create_namespaced_network_policy(
                self.namespace, cast(Any, policy)
            )
        except ApiException as exc:
            if exc.status != 409:
                raise

    def _wait_running(self, name: str, count: int, image: str) -> None:
        """Watch the pod (the API's JSON, not the client's models) until ``_judge`` decides."""
        from kubernetes.watch.watch import iter_resp_lines

        deadline = time.monotonic() + self.start_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SandboxStartError(
                    f"pod {self.namespace}/{name} was not Running after {self.start_timeout_s:g} s "
                    f"(GPU_SANDBOX_K8S_START_TIMEOUT_S): {self._describe(name)}"
                )
            response: Any = self.core.list_namespaced_pod(
                self.namespace,
                field_selector=f"metadata.name={name}",
                watch=True,
                timeout_seconds=max(1, int(min(left, 30))),
                _request_timeout=min(left, 30) + 5,
                _preload_content=False,
            )
            try:
                for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                    event = json.loads(line)
                    if event.get("type") in ("ADDED", "MODIFIED") and self._judge(
                        event["object"], count, image
                    ):
                        return
            finally:
                response.release_conn()

    def _judge(self, pod: Mapping[str, Any], count: int, image: str) -> bool:
        """True once ``pod`` (the API's JSON) runs; the typed error of a pod that never will."""
        status = pod.get("status") or {}
        name = pod["metadata"]["name"]
        phase = status.get("phase")
        if phase == "Running":
            return True
        if phase in ("Failed", "Succeeded"):
            why = f"{status.get('reason') or ''} {status.get('message') or ''}".strip()
            if self.resource in why:  # the kubelet's device manager refused it (admission)
                free, _, total = free_gpus(self.nodes(), self.pods(), self.resource)
                raise GpusExhausted(count, free, total, why)
            raise SandboxStartError(
                f"pod {self.namespace}/{name} ended before it ran ({phase}): "
                f"{why or self._describe(name)}"
            )
        for condition in status.get("conditions") or []:
            if (
                condition.get("type") == "PodScheduled"
                and condition.get("status") == "False"
                and condition.get("reason") == "Unschedulable"
                and f"Insufficient {self.resource}" in (condition.get("message") or "")
            ):
                free, free_later, total = free_gpus(self.nodes(), self.pods(), self.resource)
                if free_later < count:
                    raise GpusExhausted(count, free, total, condition.get("message") or "")
        for container in status.get("containerStatuses") or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason, message = waiting.get("reason"), waiting.get("message") or ""
            if reason in _IMAGE_ERRORS:
                raise UnknownImage(
                    "image",
                    image,
                    f"the cluster cannot get the image {image!r} for pod {self.namespace}/{name}: "
                    f"{reason}: {message}",
                )
            if reason in _START_ERRORS:
                raise SandboxStartError(
                    f"pod {self.namespace}/{name} cannot start: {reason}: {message}"
                )
        return False

    def _describe(self, name: str) -> str:
        """The pod's phase and conditions and its latest events, for a start that failed."""
        try:
            pod = _json(self.core.read_namespaced_pod(name, self.namespace, _preload_content=False))
            status = pod.get("status") or {}
            conditions = "; ".join(
                f"{c['type']}={c['status']}"
                + (f" ({c.get('reason')}: {c.get('message')})" if c.get("reason") else "")
                for c in status.get("conditions") or []
            )
            events = _json(
                self.core.list_namespaced_event(
                    self.namespace,
                    field_selector=f"involvedObject.name={name}",
                    _preload_content=False,
                )
            )["items"]
            latest = sorted(
                events, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or "")
            )[-5:]
            said = " | ".join(f"{e.get('reason')}: {e.get('message')}" for e in latest)
        except Exception as exc:  # the description is best effort
            return f"(cannot describe the pod: {exc})"
        return (
            f"phase {status.get('phase')}; conditions: {conditions or 'none'}; "
            f"events: {said or 'none'}"
        )

    def _granted(self, name: str, count: int) -> list[str]:
        """The UUIDs the device plugin gave the pod, as it printed them at start."""
        if not count:
            return []
        uuids = wait_for(
            lambda: granted_uuids(
                self.core.read_namespaced_pod_log(name, self.namespace, container="sandbox")
            ),
            lambda found: found is not None,
            timeout_s=GRANT_TIMEOUT_S,
            what=f"pod {self.namespace}/{name} to say which GPUs it was given",
            hint=f"see its log: kubectl logs -n {self.namespace} {name}",
        )
        if uuids:
            return uuids
        # Another device plugin strategy (volume mounts, CDI): ask nvidia-smi inside.
        out: list[bytes] = []
        try:
            self.exec_in(name, Command.of(["nvidia-smi", "-L"], 60.0), out.append, _ignore)
        except CommandTimedOut:
            raise ExecTimeout(["nvidia-smi", "-L"], 60.0) from None
        text = b"".join(out).decode()
        return [
            line.split("UUID: ")[1].rstrip(")").strip()
            for line in text.splitlines()
            if "UUID: " in line
        ]

    def _devices(self, uuids: Sequence[str]) -> tuple[GpuDevice, ...]:
        """The granted GPUs as the nodes publish them (read again for a UUID not known yet)."""
        known = self._known_gpus
        if not set(uuids) <= known.keys():
            known = self._known_gpus = {gpu.uuid: gpu for gpu in self.inventory()}
        return tuple(
            known.get(uuid) or GpuDevice(index=-1, uuid=uuid, name="", pci_bus_id="")
            for uuid in uuids
        )

    def sandboxes(self, session_id: str) -> list[str]:
        """The session's pods that still run or may: a finished pod is no sandbox any more."""
        return sorted(
            pod["metadata"]["labels"][SANDBOX_LABEL]
            for pod in self.session_pods(session_id)
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        )

    def reap(self, session_id: str) -> list[str]:
        pods = self.session_pods(session_id)
        if pods:
            self.delete_pods([pod["metadata"]["name"] for pod in pods])
        return sorted(pod["metadata"]["labels"][SANDBOX_LABEL] for pod in pods)

    def kill_processes(self, pod_name: str) -> None:
        """SIGKILL every process in the pod but its first, which then ends as its child did.

        What is left is a pod whose processes are all gone, Failed once the kubelet sees it.
        """
        kill = Command.of(["sh", "-c", "kill -9 -1"], 30.0)
        with contextlib.suppress(SandboxExecError, CommandTimedOut):  # an ended pod has none
            self.exec_in(pod_name, kill, _ignore, _ignore)

    def delete_pods(self, names: Sequence[str]) -> None:
        """End pods' processes, delete them, and return once the API server no longer has them.

        Their processes are killed first (from inside, ``kill -9 -1``, which ends the pod's
        first process too): then nothing of them can hold a GPU, and the delete needs no
        grace period, which would make the kubelet's housekeeping (every 2 s) the one to
        confirm it. Once a pod is gone from the API, the scheduler and the kubelet's device
        manager give its GPUs to the next pod.
        """
        from kubernetes.client.exceptions import ApiException

        if len(names) > 1:
            with ThreadPoolExecutor(min(len(names), 16)) as pool:
                list(pool.map(self.kill_processes, names))
        elif names:
            self.kill_processes(names[0])
        for name in names:
            try:
                self.core.delete_namespaced_pod(
                    name, self.namespace, grace_period_seconds=0, _preload_content=False
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
        wanted = set(names)
        wait_for(
            lambda: [p["metadata"]["name"] for p in self.pods_named(wanted)],
            lambda left: not left,
            timeout_s=DELETE_TIMEOUT_S,
            what=f"the API server to remove pods {sorted(wanted)} of {self.namespace}",
            hint=f"see kubectl get pods -n {self.namespace} -l {DRIVER_LABEL}={self.name}",
        )

    def pods_named(self, names: set[str]) -> list[dict[str, Any]]:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{DRIVER_LABEL}={self.name}", _preload_content=False
        )
        return [pod for pod in _json(pods)["items"] if pod["metadata"]["name"] in names]

    # -- exec ----------------------------------------------------------------------------

    def exec_in(
        self,
        pod_name: str,
        command: Command,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None],
    ) -> int:
        """Run ``command`` in the pod through the API's exec stream; its exit code.

        At its timeout every process it started (those carrying its marker) is killed from a
        second exec, and ``CommandTimedOut`` raised.
        """
        argv = command.argv
        # The marker set by the image's shell, which reports a missing program as "not found".
        marker = f'{EXEC_MARKER_ENV}={command.marker}; export {EXEC_MARKER_ENV}; exec "$@"'
        wrapped = ["sh", "-c", marker, "sh", *argv]
        socket = self._open_exec(pod_name, wrapped, argv)
        deadline = time.monotonic() + command.timeout
        try:
            while socket.is_open():
                left = deadline - time.monotonic()
                if left <= 0:
                    self._kill_marked(pod_name, command.needle.decode())
                    raise CommandTimedOut
                socket.update(timeout=min(left, 1.0))
                self._drain(socket, on_stdout, on_stderr)
            self._drain(socket, on_stdout, on_stderr)
            returncode = exit_status(_text(socket.read_channel(3)))
        finally:
            socket.close()
        if returncode is None:
            raise SandboxExecError(
                f"the exec stream of {list(argv)!r} in pod {self.namespace}/{pod_name} ended "
                "without an exit status"
            )
        return returncode

    def _open_exec(self, pod_name: str, command: Sequence[str], argv: Sequence[str]) -> Any:
        from kubernetes import client
        from kubernetes.stream import stream

        # ``stream`` swaps its API client's transport while it opens: one client per exec.
        core = client.CoreV1Api(self.api_client())
        try:
            return stream(
                core.connect_get_namespaced_pod_exec,
                pod_name,
                self.namespace,
                container="sandbox",
                command=list(command),
                stdin=False,
                stdout=True,
                stderr=True,
                tty=False,
                binary=True,
                _preload_content=False,
            )
        except Exception as exc:  # the API's refusal, and websocket errors of every kind
            raise SandboxExecError(
                f"cannot run {list(argv)!r} in pod {self.namespace}/{pod_name}: {_said(exc)}"
            ) from exc

    @staticmethod
    def _drain(
        socket: Any, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
    ) -> None:
        if data := socket.read_channel(1):
            on_stdout(data)
        if data := socket.read_channel(2):
            on_stderr(data)

    def _kill_marked(self, pod_name: str, needle: str) -> None:
        socket = self._open_exec(pod_name, ["sh", "-c", KILL_MARKED_SCRIPT, "sh", needle], ["kill"])
        try:
            socket.run_forever(timeout=15)
        finally:
            socket.close()


def _text(data: bytes | str) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _json(response: object) -> Any:
    """The JSON body of a call made with ``_preload_content=False`` (no model objects)."""
    return json.loads(cast(Any, response).data)


def _said(exc: Exception) -> str:
    """What the API server (or the connection to it) said, in one line."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message")
        except ValueError:
            message = None
        return f"{exc.status} {exc.reason}: {message or exc.body}"
    return f"{type(exc).__name__}: {exc}"
