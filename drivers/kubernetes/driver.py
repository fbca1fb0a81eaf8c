"""The kubernetes driver: a pod per sandbox, its GPUs handed out by the cluster.

The request becomes the pod's GPU limit (``pods.py``); the scheduler picks a node with that
many free, and the node's device plugin (NVIDIA's on GPU clusters,
``gpuhost.simulated.device_plugin`` on the local cluster of ``make cluster``) picks the GPUs
and injects them. Exact device IDs are refused (``UnsupportedGpuRequest``): a pod cannot
name the devices it gets. The host-wide lease registry has no part here: the cluster owns
its nodes' GPUs.

What a sandbox was given is what the device plugin told the container:
``NVIDIA_VISIBLE_DEVICES`` (the UUIDs it allocated, as NVIDIA's plugin sets them), which the
pod prints once at start; where it holds no UUIDs (another plugin strategy), ``nvidia-smi -L``
inside. The details of those GPUs (index, PCI address, device node) come from the node's
``gpu-sandbox.dev/gpus`` annotation, JSON lists by resource name that ``make cluster``
writes for its simulated GPUs and a user publishes for a real node (README: "The
kubernetes lane"); without it the inventory is one placeholder per allocatable GPU.

Exhaustion: a pod the scheduler reports Unschedulable for ``Insufficient nvidia.com/gpu``
becomes ``GpusExhausted`` (requested, the most free on one node, allocatable in all) and is
deleted, unless pods being deleted would make room (the scheduler tries again once they are
gone). A scheduler answers in a round trip: ``exhaustion_grace_s`` is 3 s. A count above
every node's allocatable fails before any pod is made. A start is bounded by
``GPU_SANDBOX_K8S_START_TIMEOUT_S`` (default 120 s).
"""

from __future__ import annotations

import functools
import json
import os
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, cast

from drivers.base import (
    Availability,
    Command,
    CommandTimedOut,
    Elsewhere,
    Launch,
    Sandbox,
    client_library,
)
from drivers.images import DEFAULT_IMAGE
from drivers.kubernetes.api import LOCAL_KUBECONFIG, json_body, said
from drivers.kubernetes.cluster import NODE_ENV, ClusterDriver
from drivers.kubernetes.exec import ignore
from drivers.kubernetes.options import OPTION_KEYS, check_options
from drivers.kubernetes.pods import (
    MANAGED_BY,
    SECURITY_CONTEXT,
    free_gpus,
    granted_uuids,
    pod_manifest,
)
from drivers.kubernetes.sandbox import KubernetesSandbox
from drivers.kubernetes.turn import (
    CATALOGUE_LEASE,
    TURN_DURATION_S,
    TURN_TIMEOUT_S,
    CatalogueTurn,
    node_lease,
)
from drivers.labels import DRIVER_LABEL, LABEL_PREFIX, SANDBOX_LABEL, SESSION_LABEL
from gpuhost import environ, strict
from gpuhost.devices import GpuDevice, gpus_from_json
from gpuhost.errors import (
    DriverError,
    ExecTimeout,
    GpusExhausted,
    SandboxStartError,
    UnknownImage,
)
from gpuhost.host import GpuHost
from gpuhost.spec import DRIVER_SCHEDULER, DriverCapabilities, DriverRequest, GpuPlan, block_field
from gpuhost.wait import wait_for

SIMULATED_LABEL = LABEL_PREFIX + "simulated"
"""A node label: ``true`` where the node's GPUs are simulated (the local cluster's)."""
DRIVER_VERSION_LABEL = "nvidia.com/cuda.driver-version.full"
"""GPU feature discovery's node label of the NVIDIA driver's version."""
INVENTORY_ANNOTATION = LABEL_PREFIX + "gpus"
"""A node's GPUs by resource name, as JSON: ``{"nvidia.com/gpu": [<gpus_to_json>]}``."""
START_TIMEOUT_S = 120.0
GRANT_TIMEOUT_S = 10.0
"""A running pod has printed its first line within milliseconds; seconds mean it cannot."""
_IMAGE_ERRORS = ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName")
_START_ERRORS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")


class KubernetesDriver(ClusterDriver):
    name = "kubernetes"
    exhaustion_grace_s = 3.0
    security_context: ClassVar[Mapping[str, Any]] = SECURITY_CONTEXT

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        super().__init__(host, session_id, image)
        self.start_timeout_s = environ.seconds("GPU_SANDBOX_K8S_START_TIMEOUT_S", START_TIMEOUT_S)
        self.turn_timeout_s = environ.seconds("GPU_SANDBOX_K8S_TURN_TIMEOUT_S", TURN_TIMEOUT_S)
        self.turn_lease = CATALOGUE_LEASE if self.node is None else node_lease(self.node)
        self.turn_duration_s = TURN_DURATION_S
        self._known_gpus: dict[str, GpuDevice] = {}

    # -- the contract --------------------------------------------------------------------

    @property
    def capabilities(self) -> DriverCapabilities:
        return DriverCapabilities(
            max_gpus_per_sandbox=self._largest_node,
            exact_ids=False,
            exact_id_forms="none: a pod gets the GPUs its node's device plugin picks",
            config_keys=OPTION_KEYS,
            allocated_by=DRIVER_SCHEDULER,  # the scheduler and the node's device plugin
        )

    @functools.cached_property
    def _largest_node(self) -> int:
        try:
            counts = [self._allocatable(node) for node in self.nodes()]
        except Exception:  # a cluster that does not answer: probe() says why
            return 8
        return max(counts, default=0) or 8

    def gpu_nodes(self, nodes: list[dict[str, Any]] | None = None) -> list[str]:
        """The names of the nodes (of ``nodes()``) with allocatable GPUs of ``resource``."""
        nodes = self.nodes() if nodes is None else nodes
        return [node["metadata"]["name"] for node in nodes if self._allocatable(node)]

    def _allocatable(self, node: Mapping[str, Any]) -> int:
        return int((node.get("status", {}).get("allocatable") or {}).get(self.resource) or 0)

    def probe(self) -> Availability:
        if no_client := client_library("kubernetes", "kubernetes"):
            return no_client
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
        with_gpus = self.gpu_nodes(nodes)
        where = f"{cluster.kubeconfig} (context {cluster.context or 'none'}, server {version})"
        if self.node is not None and not nodes:
            return Availability(
                False,
                f"needed the node {self.node!r} ({NODE_ENV}) in the cluster of {where} (found "
                "no node of that name)",
            )
        if not with_gpus:
            return Availability(
                False,
                f"needed a node with allocatable {self.resource} in the cluster of {where} "
                f"(found {len(nodes)} nodes, none with it: is the device plugin running?)",
            )
        return Availability(True, f"{where}: {self.resource} on {', '.join(with_gpus)}")

    def runs_on(self) -> Elsewhere | None:
        """The node a pinned driver's pods go to (``GPU_SANDBOX_K8S_NODE``), else None.

        Its GPUs, its device plugins' resources (allocatable), and its GPUs' driver as GPU
        feature discovery labels it (``simulated`` where the local cluster labels it so).
        """
        if self.node is None:
            return None
        nodes = self.nodes()
        if not nodes:
            raise LookupError(f"the cluster has no node {self.node!r} ({NODE_ENV})")
        meta, status = nodes[0]["metadata"], nodes[0].get("status", {})
        labels = meta.get("labels") or {}
        allocatable = status.get("allocatable") or {}
        resources = [f"{key} {allocatable[key]}" for key in sorted(allocatable) if "/" in key]
        kubelet = status.get("nodeInfo", {}).get("kubeletVersion", "unknown")
        version = labels.get(DRIVER_VERSION_LABEL)
        return Elsewhere(
            name=meta["name"],
            description=(
                f"node {meta['name']} of {self.configuration.host} (kubelet {kubelet}); its "
                f"device plugins' resources: {', '.join(resources) or 'none'}"
            ),
            gpus=self.inventory(),
            identity=(self.configuration.host, str(meta.get("uid", ""))),
            simulated=labels.get(SIMULATED_LABEL) == "true",
            kernel_driver=f"nvidia {version}"
            if version
            else f"unknown (no {DRIVER_VERSION_LABEL})",
        )

    def _server_version(self) -> str:
        from kubernetes import client

        return str(client.VersionApi(self.api_client()).get_code().git_version)

    def catalogue_turn(self) -> CatalogueTurn:
        """The Lease ``turn_lease`` in the driver's namespace, held by this session.

        Each catalogue test expects every GPU of the cluster free; runs sharing the cluster
        (a second ``make conformance`` on the machine, another CI job) wait for it in turn.
        A run pinned to a node (``GPU_SANDBOX_K8S_NODE``) expects that node's free, and takes
        its turn on the node's own Lease: runs on other nodes go side by side (the runner of
        such runs, ``conformance.nodes``, holds the cluster's meanwhile).
        """
        from kubernetes import client

        self._ensure_namespace()
        return CatalogueTurn(
            client.CoordinationV1Api(self.api_client()),
            self.namespace,
            self.turn_lease,
            f"{self.session_id} (pid {os.getpid()} on {socket.gethostname()})",
            cluster=self.configuration.host,
            labels=MANAGED_BY,
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
            published = strict.parse_json(
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

    def validate(self, request: DriverRequest) -> GpuPlan | None:
        check_options(request.config, block_field(self.name))
        return super().validate(request)

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
            node=self.node,
            security_context=self.security_context,
        )
        try:
            self._ensure_namespace()
            self.core.create_namespaced_pod(
                self.namespace, cast(Any, manifest), _preload_content=False
            )
        except Exception as exc:  # the API's refusal, or no API at all
            raise SandboxStartError(
                f"cannot create pod {self.namespace}/{name}: {said(exc)}"
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
                    f"pod {self.namespace}/{name} did not start: {said(exc)}"
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

    # -- a pod's start -------------------------------------------------------------------

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
            pod = json_body(
                self.core.read_namespaced_pod(name, self.namespace, _preload_content=False)
            )
            status = pod.get("status") or {}
            conditions = "; ".join(
                f"{c['type']}={c['status']}"
                + (f" ({c.get('reason')}: {c.get('message')})" if c.get("reason") else "")
                for c in status.get("conditions") or []
            )
            events = json_body(
                self.core.list_namespaced_event(
                    self.namespace,
                    field_selector=f"involvedObject.name={name}",
                    _preload_content=False,
                )
            )["items"]
            latest = sorted(
                events, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or "")
            )[-5:]
            told = " | ".join(f"{e.get('reason')}: {e.get('message')}" for e in latest)
        except Exception as exc:  # the description is best effort
            return f"(cannot describe the pod: {exc})"
        return (
            f"phase {status.get('phase')}; conditions: {conditions or 'none'}; "
            f"events: {told or 'none'}"
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
            self.execs.run(name, Command.of(["nvidia-smi", "-L"], 60.0), out.append, ignore)
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

    def remove_session(self, session_id: str) -> list[str]:
        pods = self.session_pods(session_id)
        if pods:
            self.delete_pods([pod["metadata"]["name"] for pod in pods])
        return [pod["metadata"]["labels"][SANDBOX_LABEL] for pod in pods]
