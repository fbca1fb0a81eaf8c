"""A Kubernetes device plugin (API v1beta1) that hands out a simulated host's GPUs.

``python -m gpuhost.simulated.device_plugin --sim-root R --resource nvidia.com/gpu
--proto-dir D [--inject granted|all] [--socket-dir /var/lib/kubelet/device-plugins]``

It serves the DevicePlugin service on a unix socket of its own in the kubelet's
device-plugins directory, then registers with ``kubelet.sock`` there, and registers again
whenever the kubelet re-creates that socket (a kubelet restart wipes the directory). Devices
are the host's GPUs by UUID. ``Allocate`` gives each container what the host's CDI spec
gives a docker container: the granted GPUs' ``/dev/nvidia<minor>`` nodes, the control nodes,
``share/`` at ``/run/gpu-sim`` and the stand-in nvidia-smi at ``/usr/bin/nvidia-smi``, both
read-only; and ``NVIDIA_VISIBLE_DEVICES`` with the granted UUIDs, as NVIDIA's plugin sets it.

``--inject all`` makes a deliberately broken plugin: every GPU's node goes into every
container, while ``NVIDIA_VISIBLE_DEVICES`` still names only the granted ones. Conformance
tests must catch it.

The gRPC code is generated from the kubelet's ``api.proto`` by ``scripts/cluster.sh
install`` (``<proto-dir>/v1beta1/api_pb2.py`` and ``api_pb2_grpc.py``), and imported from
there at run time.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc  # type: ignore[import-untyped]

from gpuhost.devices import GpuDevice
from gpuhost.simulated import SANDBOX_SHARE, SimulatedHost, load

API_VERSION = "v1beta1"
DEFAULT_SOCKET_DIR = Path("/var/lib/kubelet/device-plugins")
DEFAULT_PROTO_DIR = Path("/var/cache/gpu-sandbox/kubernetes/1.20.2/deviceplugin")
KUBELET_SOCKET = "kubelet.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
NVIDIA_SMI_PATH = "/usr/bin/nvidia-smi"
# How often the kubelet's socket and the devices' health are looked at: the kubelet waits
# for nothing, so a second's lag after its restart only delays the node's GPUs by a second.
POLL_S = 1.0
# Register is a local call; a kubelet that takes longer is not up yet: try again next poll.
REGISTER_TIMEOUT_S = 5.0
MAX_SOCKET_PATH = 107  # sockaddr_un.sun_path, less its terminating NUL

log = logging.getLogger("gpuhost.simulated.device_plugin")


class ApiMissing(RuntimeError):
    """The generated gRPC code of the device plugin API is not where it was looked for."""


@dataclass(frozen=True)
class Api:
    """The generated modules: ``messages`` (api_pb2) and ``services`` (api_pb2_grpc).

    They are imported at run time, so their attributes are ``Any`` to the type checker;
    this module's own functions keep typed signatures around them.
    """

    messages: ModuleType
    services: ModuleType


def load_api(proto_dir: Path = DEFAULT_PROTO_DIR) -> Api:
    """Import ``<proto_dir>/v1beta1/api_pb2{,_grpc}.py``."""
    if not (proto_dir / API_VERSION / "api_pb2_grpc.py").is_file():
        raise ApiMissing(
            f"no generated device plugin API under {proto_dir / API_VERSION}; "
            "`make cluster` (scripts/cluster.sh install) generates it"
        )
    if str(proto_dir) not in sys.path:
        sys.path.insert(0, str(proto_dir))  # api_pb2_grpc imports `v1beta1.api_pb2`
    return Api(
        messages=importlib.import_module(f"{API_VERSION}.api_pb2"),
        services=importlib.import_module(f"{API_VERSION}.api_pb2_grpc"),
    )


class SimulatedGpuPlugin:
    """The DevicePlugin servicer: one resource, the GPUs of one simulated host."""

    def __init__(
        self, api: Api, host: SimulatedHost, *, inject_all: bool = False, poll_s: float = POLL_S
    ) -> None:
        self.api = api
        self.host = host
        self.inject_all = inject_all
        self.poll_s = poll_s
        self.stopped = threading.Event()
        self._by_uuid = {gpu.uuid: gpu for gpu in host.gpus}

    def options(self) -> Any:
        return self.api.messages.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return self.options()

    def health(self) -> list[tuple[str, str]]:
        """Each GPU's UUID and health: unhealthy once its node is gone from the host."""
        return [
            (gpu.uuid, HEALTHY if all(Path(n.source).exists() for n in gpu.nodes) else UNHEALTHY)
            for gpu in self.host.gpus
        ]

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        last: list[tuple[str, str]] | None = None
        while not self.stopped.is_set() and (context is None or context.is_active()):
            current = self.health()
            if current != last:
                log.info("devices: %s", ", ".join(f"{u} {h}" for u, h in current))
                yield self.api.messages.ListAndWatchResponse(
                    devices=[self.api.messages.Device(ID=u, health=h) for u, h in current]
                )
                last = current
            self.stopped.wait(self.poll_s)

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        messages = self.api.messages
        responses = []
        for container in request.container_requests:
            chosen = preferred(
                self.host.gpus,
                available=list(container.available_deviceIDs),
                must_include=list(container.must_include_deviceIDs),
                size=container.allocation_size,
            )
            responses.append(messages.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return messages.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: Any, context: Any) -> Any:
        responses = []
        for container in request.container_requests:
            ids = list(container.devicesIDs)
            unknown = [i for i in ids if i not in self._by_uuid]
            if unknown:
                message = f"unknown device ids {unknown}; this plugin has {list(self._by_uuid)}"
                log.error("Allocate: %s", message)
                if context is not None:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                raise ValueError(message)
            log.info("Allocate %s%s", ids, " (injecting every GPU)" if self.inject_all else "")
            responses.append(self.container_response(ids))
        return self.api.messages.AllocateResponse(container_responses=responses)

    def container_response(self, ids: Sequence[str]) -> Any:
        """The edits of the host's CDI spec, for the GPUs ``ids`` (all with inject_all)."""
        messages = self.api.messages
        granted = set(ids)
        gpus = [g for g in self.host.gpus if self.inject_all or g.uuid in granted]
        nodes = [n for gpu in gpus for n in gpu.nodes] + list(self.host.control_nodes)
        return messages.ContainerAllocateResponse(
            envs={"NVIDIA_VISIBLE_DEVICES": ",".join(ids)},
            devices=[
                messages.DeviceSpec(container_path=n.path, host_path=n.source, permissions="rw")
                for n in nodes
            ],
            mounts=[
                messages.Mount(
                    container_path=SANDBOX_SHARE,
                    host_path=str(self.host.share_dir),
                    read_only=True,
                ),
                messages.Mount(
                    container_path=NVIDIA_SMI_PATH,
                    host_path=str(self.host.nvidia_smi),
                    read_only=True,
                ),
            ],
        )

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return self.api.messages.PreStartContainerResponse()


def preferred(
    gpus: Sequence[GpuDevice], *, available: Sequence[str], must_include: Sequence[str], size: int
) -> list[str]:
    """The must-include IDs, then the lowest available GPUs in PCI order, ``size`` in all."""
    chosen = list(must_include)
    pool = set(available)
    for gpu in gpus:  # the host lists its GPUs in PCI order
        if len(chosen) >= size:
            break
        if gpu.uuid in pool and gpu.uuid not in chosen:
            chosen.append(gpu.uuid)
    return chosen[: max(size, len(must_include))]


def endpoint_name(resource: str) -> str:
    """The plugin's socket file name in the device-plugins directory, one per resource."""
    return "gpu-sandbox-" + resource.replace("/", "_") + ".sock"


class PluginRunner:
    """Serves the plugin and keeps it registered across kubelet restarts."""

    def __init__(self, plugin: SimulatedGpuPlugin, resource: str, socket_dir: Path) -> None:
        self.plugin = plugin
        self.resource = resource
        self.socket_dir = socket_dir
        self.socket = socket_dir / endpoint_name(resource)
        self.server: Any = None
        if len(str(self.socket).encode()) > MAX_SOCKET_PATH:
            raise ValueError(
                f"{self.socket}: a unix socket path has {MAX_SOCKET_PATH} bytes at most"
            )

    def serve(self) -> None:
        self.stop_server()
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.plugin.api.services.add_DevicePluginServicer_to_server(self.plugin, server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self.server = server
        log.info("serving %s on %s", self.resource, self.socket)

    def stop_server(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1).wait()
            self.server = None

    def register(self) -> None:
        messages = self.plugin.api.messages
        kubelet = self.socket_dir / KUBELET_SOCKET
        with grpc.insecure_channel(f"unix://{kubelet}") as channel:
            stub = self.plugin.api.services.RegistrationStub(channel)
            stub.Register(
                messages.RegisterRequest(
                    version=API_VERSION,
                    endpoint=self.socket.name,
                    resource_name=self.resource,
                    options=self.plugin.options(),
                ),
                timeout=REGISTER_TIMEOUT_S,
            )
        log.info("registered %s with %s", self.resource, kubelet)

    def run(self, stop: threading.Event) -> None:
        """Until ``stop``: (re)serve and (re)register whenever kubelet.sock is new."""
        kubelet = self.socket_dir / KUBELET_SOCKET
        registered_with: tuple[int, int] | None = None
        waiting_logged = False
        while not stop.is_set():
            try:
                st = kubelet.stat()
                identity: tuple[int, int] | None = (st.st_ino, st.st_mtime_ns)
            except FileNotFoundError:
                identity = None
            if identity is None and not waiting_logged:
                log.info("waiting for %s", kubelet)
                waiting_logged = True
            # A new kubelet socket, or ours removed (the kubelet wipes the directory).
            stale = identity != registered_with or not self.socket.exists()
            if identity is not None and stale:
                try:
                    self.serve()
                    self.register()
                    registered_with = identity
                    waiting_logged = False
                except (grpc.RpcError, RuntimeError) as exc:  # RuntimeError: bind failed
                    log.warning("registering with %s failed: %s; retrying", kubelet, exc)
            stop.wait(POLL_S)
        self.plugin.stopped.set()
        self.stop_server()
        self.socket.unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpuhost.simulated.device_plugin",
        description="Serve a simulated GPU host's GPUs to the kubelet (device plugin v1beta1).",
    )
    parser.add_argument("--sim-root", type=Path, required=True, help="the simulated host")
    parser.add_argument("--resource", default="nvidia.com/gpu", help="extended resource name")
    parser.add_argument(
        "--proto-dir",
        type=Path,
        default=DEFAULT_PROTO_DIR,
        help=f"where {API_VERSION}/api_pb2.py was generated (default: %(default)s)",
    )
    parser.add_argument(
        "--inject",
        choices=("granted", "all"),
        default="granted",
        help="device nodes to inject: the granted GPUs' (default), or every GPU's (broken)",
    )
    parser.add_argument(
        "--socket-dir",
        type=Path,
        default=DEFAULT_SOCKET_DIR,
        help="the kubelet's device-plugins directory (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr
    )
    try:
        api = load_api(args.proto_dir)
    except ApiMissing as exc:
        parser.error(str(exc))
    host = load(args.sim_root)
    plugin = SimulatedGpuPlugin(api, host, inject_all=args.inject == "all")
    log.info(
        "%s: %d GPUs of %s, inject %s (pid %d)",
        args.resource,
        len(host.gpus),
        host.root,
        args.inject,
        os.getpid(),
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    PluginRunner(plugin, args.resource, args.socket_dir).run(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
