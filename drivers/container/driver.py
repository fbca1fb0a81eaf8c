"""The engine-independent container driver: probe, CDI devices, start, reap."""

from __future__ import annotations

import functools
import os
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from drivers.base import Availability, Driver, Launch, client_library
from drivers.container.api import REAP_TIMEOUT_S, ContainerRequest, EngineError
from drivers.container.keepalive import (
    KEEPALIVE_OPEN_TIMEOUT_S,
    KEEPALIVE_SCRIPT,
    Keepalive,
    keepalive_directory,
    remove_session,
)
from drivers.container.sandbox import ContainerSandbox
from drivers.images import DEFAULT_IMAGE
from drivers.labels import DEVICES_LABEL, DRIVER_LABEL, SANDBOX_LABEL, SESSION_LABEL
from gpuhost import cdi
from gpuhost.devices import CDI_KIND, GpuDevice
from gpuhost.errors import SandboxStartError, UnknownImage
from gpuhost.idforms import forms_text, ids_of
from gpuhost.leases import Holder
from gpuhost.spec import VENDORS, DriverCapabilities, GpuPlan
from gpuhost.wait import wait_for

OTHER_VENDOR_FORMS = ("pci", "dri")
"""How an AMD or Intel GPU is named: no CDI spec of the engine's names it (``cdi_devices``)."""


class ContainerDriver(Driver):
    """A driver that runs sandboxes as containers of one engine, reached through its API."""

    url_env: ClassVar[str]
    """The environment variable naming the engine's API endpoint, as its CLI reads it."""
    client_package: ClassVar[str]
    """The Python package of the engine's client, an extra of this project of the same name."""
    default_url: ClassVar[str]
    cli: ClassVar[str]
    cli_url_flag: ClassVar[str]
    """The CLI's flag naming the engine: ``--host`` for docker, ``--url`` for podman."""

    @property
    def url(self) -> str:
        return self.configured_url()

    @classmethod
    def configured_url(cls) -> str:
        """The engine's address: ``url_env`` in the environment, else ``default_url``."""
        return os.environ.get(cls.url_env) or cls.default_url

    @property
    def capabilities(self) -> DriverCapabilities:
        return DriverCapabilities(
            max_gpus_per_sandbox=len(self.host.devices),
            exact_ids=True,
            exact_id_forms=(
                f"a CDI name: {self.cdi_kind}=<index>, {self.cdi_kind}=<UUID>, "
                f"{self.cdi_kind}=<gpu>:<mig instance>, or {cdi.all_devices(self.cdi_kind)} "
                f"for every GPU; for AMD and Intel GPUs {forms_text(OTHER_VENDOR_FORMS)}"
            ),
            other_vendor_id_forms=OTHER_VENDOR_FORMS,
            exclusive=True,
            shared=True,
            mig_profiles=True,
            vendors=VENDORS,
            device_id_aliases=("cdi_devices",),  # upstream's later name for gpu_device_ids
        )

    # -- what each engine implements -----------------------------------------------------

    @abstractmethod
    def ping(self) -> None:
        """Raise when the engine does not answer."""

    @abstractmethod
    def cdi_spec_dirs(self) -> tuple[Path, ...]:
        """Where the engine reads CDI specs; raise ``EngineError`` when CDI is off."""

    @abstractmethod
    def has_image(self, image: str) -> bool: ...

    @classmethod
    @abstractmethod
    def engine_errors(cls) -> tuple[type[Exception], ...]:
        """What the engine's client library raises when the engine refuses or fails a call.

        A method, so that the client library is imported only once an engine is used.
        """

    @abstractmethod
    def create_container(self, request: ContainerRequest) -> str:
        """Create (not start) the container; return its id."""

    @abstractmethod
    def start_created(self, container_id: str) -> int:
        """Start the created container; return its first process's pid on the host."""

    @abstractmethod
    def exec_in(
        self,
        container_id: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdout: Callable[[bytes], None],
        stderr: Callable[[bytes], None],
    ) -> int:
        """Run a command in the container and wait for it: its exit code.

        Its output goes to ``stdout`` and ``stderr`` in parts, as the engine sends it, never
        gathered whole; ``EngineError`` if it cannot run.
        """

    @abstractmethod
    def remove_container(self, container_id: str) -> None:
        """Kill and remove the container; a container already gone is not an error."""

    def stop_container(self, container_id: str) -> None:
        """Return once the container is gone; its keepalive is already closed."""
        self.remove_container(container_id)

    @abstractmethod
    def kill_container(self, container_id: str) -> None:
        """SIGKILL the container's main process; a container already gone is not an error."""

    @abstractmethod
    def session_containers(self, session_id: str) -> dict[str, str]:
        """Sandbox id → container id of every container labelled with ``session_id``."""

    @classmethod
    @abstractmethod
    def container_exists(cls, url: str, container_id: str) -> bool:
        """Whether the engine at ``url`` still knows the container; raise if it cannot tell.

        Within ``LIVENESS_TIMEOUT_S``: the lease registry asks while a request waits.
        """

    @classmethod
    def holder_alive(cls, holder: Holder) -> bool:
        """The liveness check of this engine's lease holders: the container still exists.

        Registered with the lease registry (``gpu_sandbox.liveness`` entry points), so that a
        process that never used this driver still frees a removed container's GPUs.
        """
        url, _, container_id = holder.ref.rpartition(" ")
        if url != cls.configured_url():
            # An address read from the lease file is never connected to (a forged one would
            # make this process, root perhaps, talk to a socket or start ssh of its choosing):
            # only the engine this process is configured with can tell.
            return True
        try:
            return cls.container_exists(url, container_id)
        except Exception:  # engine unreachable or hung: never take a GPU back on a guess
            return True

    # -- the driver contract ---------------------------------------------------------------

    def probe(self) -> Availability:
        if no_client := client_library(self.client_package, self.client_package):
            return no_client
        try:
            self.ping()
        except Exception as exc:  # every client library raises its own kinds
            return Availability(
                False,
                f"needed {self.name} answering at {self.url} (found: {type(exc).__name__}: "
                f"{exc}; start it with `make engines`, or point {self.url_env} at it)",
            )
        try:
            registry = self.cdi_registry
        except EngineError as exc:
            return Availability(False, str(exc))
        if not self.host.gpus:
            return Availability(
                False,
                "needed NVIDIA GPUs (found none through NVML or nvidia-smi; "
                "use --sim-gpus=N for a simulated GPU host)",
            )
        missing = registry.missing([*self.host.gpus, *self.host.mig_devices])
        if missing:
            hint = (
                f"register the simulated host with `python -m gpuhost.simulated setup --root "
                f"{self.host.simulated.root} --cdi-dir /var/run/cdi`"
                if self.host.simulated
                else "generate one with `nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml`"
            )
            problems = f"; unreadable: {'; '.join(registry.problems)}" if registry.problems else ""
            return Availability(
                False,
                f"needed a CDI spec in {', '.join(map(str, registry.spec_dirs))} naming each GPU "
                f"(found none for {len(missing)} of {len(self.host.gpus)}, first "
                f"{missing[0].describe()}"
                f"{problems}; {hint})",
            )
        image = self.image or DEFAULT_IMAGE
        if not self.has_image(image):
            return Availability(
                False,
                f"needed the image {image} in {self.name} (found none; `make engines` builds "
                f"{DEFAULT_IMAGE}, or pass --image=IMAGE)",
            )
        return Availability(True)

    @property
    def cdi_kind(self) -> str:
        """The CDI kind of the host's GPUs: NVIDIA's, or a simulated host's own."""
        return self.host.gpus[0].cdi_kind if self.host.gpus else CDI_KIND

    @functools.cached_property
    def cdi_registry(self) -> cdi.CdiRegistry:
        """The specs the engine reads, once per driver; ``EngineError`` when CDI is off."""
        return cdi.load(self.cdi_spec_dirs(), self.cdi_kind)

    def inventory(self) -> tuple[GpuDevice, ...]:
        return self.host.default_devices

    def exact_devices(self) -> tuple[GpuDevice, ...]:
        return self.host.devices

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return self.host.pool(plan.vendor, plan.mig_profile)

    def device_ids(self, gpu: GpuDevice) -> tuple[str, ...]:
        return self._device_ids(gpu, lambda: self.cdi_registry)

    def device_ids_offline(self, gpu: GpuDevice) -> tuple[str, ...]:
        """The names in the CDI specs of the default directories, without asking the engine.

        Engines read those unless configured otherwise (docker says where it reads them).
        """
        return self._device_ids(gpu, lambda: self._default_cdi_registry)

    @functools.cached_property
    def _default_cdi_registry(self) -> cdi.CdiRegistry:
        return cdi.load(cdi.DEFAULT_SPEC_DIRS, self.cdi_kind)

    def _device_ids(
        self, gpu: GpuDevice, registry: Callable[[], cdi.CdiRegistry]
    ) -> tuple[str, ...]:
        if gpu.vendor != "nvidia":  # no CDI spec of the engine's names them
            return ids_of(gpu, OTHER_VENDOR_FORMS)
        return registry().names_of(gpu)

    def device_index(self) -> dict[str, tuple[GpuDevice, ...]]:
        """Each device's IDs, and ``<kind>=all`` for every NVIDIA GPU at once, whole.

        Those in MIG mode too: the spec's ``all`` injects every GPU's node, as nvidia-ctk's
        does, and a GPU held whole holds its MIG instances.
        """
        return {**super().device_index(), cdi.all_devices(self.cdi_kind): self.host.gpus}

    def start(self, launch: Launch) -> ContainerSandbox:
        """Create the container, hand it the leases, start it; leave none behind on failure.

        The container holds the leases from before it starts: a creator dying at any point
        leaves either no container (its process's leases are reclaimed) or a container that
        holds them until it is removed, never a GPU handed out while a container has it.
        The creator holds the keepalive FIFO's only write end, in every process that
        creates: the container's reader sees end-of-file when the creator dies.
        """
        keepalive = Keepalive.open(self.keepalive_dir(), f"{self.session_id}.{launch.sandbox_id}")
        devices = self.cdi_devices(launch.plan, launch.gpus)
        nodes = tuple(
            dict.fromkeys(n for gpu in launch.gpus if gpu.vendor != "nvidia" for n in gpu.nodes)
        )
        request = ContainerRequest(
            name=f"gpu-sandbox-{launch.sandbox_id}",
            image=launch.request.image or self.image or DEFAULT_IMAGE,
            command=("sh", "-c", KEEPALIVE_SCRIPT),
            labels={
                SESSION_LABEL: self.session_id,
                SANDBOX_LABEL: launch.sandbox_id,
                DRIVER_LABEL: self.name,
                DEVICES_LABEL: ",".join(devices),
            },
            cdi_devices=devices,
            env=dict(launch.env),
            keepalive=keepalive.path,
            device_nodes=nodes,
            tool_mounts=tuple((str(source), target) for source, target in self.host.tool_mounts)
            if nodes and not devices
            else (),
        )
        try:
            keepalive.check_path()  # the engine binds what the path names: it must be the FIFO
            container_id = self._create(request)
            holder = self.holder_for(container_id)
            try:
                launch.hand_over(holder)
                keepalive.check_path()
                keepalive.seal(self.start_created(container_id), KEEPALIVE_OPEN_TIMEOUT_S)
            except BaseException as exc:
                self.remove_container(container_id)
                if isinstance(exc, self.engine_errors()):
                    raise SandboxStartError(
                        f"{self.name} could not start {request.name} with CDI devices "
                        f"{list(request.cdi_devices)}: {self.explain(exc)}"
                    ) from exc
                raise
        except BaseException:
            keepalive.close()
            raise
        return ContainerSandbox(
            launch.sandbox_id, self.name, launch.gpus, holder, container_id, devices,
            keepalive, self, self.host.leases,
        )  # fmt: skip

    def _create(self, request: ContainerRequest) -> str:
        try:
            return self.create_container(request)
        except self.engine_errors() as exc:
            if not self.has_image(request.image):
                raise UnknownImage(
                    "image",
                    request.image,
                    f"image '{request.image}' is not in {self.name} ({self.explain(exc)}); the "
                    "driver never pulls: load or build it first",
                ) from exc
            raise SandboxStartError(
                f"{self.name} could not create {request.name} from {request.image}: "
                f"{self.explain(exc)}"
            ) from exc

    def holder_for(self, container_id: str) -> Holder:
        """The lease holder a container is: the engine and its id, judged by holder_alive."""
        return Holder(self.holder_kind, f"{self.url} {container_id}")

    def abandon(self, sandbox_id: str) -> None:
        """Release a sandbox's leases, unless its container may still exist and hold them.

        Such a lease stays with the container, and the liveness check frees it once the
        container is gone.
        """
        try:
            left = sandbox_id in self.session_containers(self.session_id)
        except Exception:  # the engine cannot tell: never free a GPU on a guess
            left = True
        if not left:
            self.host.leases.release(sandbox_id)

    def cdi_devices(self, plan: GpuPlan | None, gpus: Sequence[GpuDevice]) -> tuple[str, ...]:
        """The CDI names to inject for the NVIDIA devices.

        The user's own names when exact (``=all`` among them), else each device's first name.
        """
        everything = cdi.all_devices(self.cdi_kind)
        if plan is not None and everything in plan.device_ids:
            return (everything,)
        named = set(plan.device_ids) if plan is not None else set()
        return tuple(
            next((name for name in self.device_ids(gpu) if name in named), self.device_ids(gpu)[0])
            for gpu in gpus
            if gpu.vendor == "nvidia"
        )

    def keepalive_dir(self) -> Path:
        """Where the keepalive FIFOs of this user go: a directory of the registry of its own."""
        return keepalive_directory(self.host.leases.directory)

    def sandboxes(self, session_id: str) -> list[str]:
        return sorted(self.session_containers(session_id))

    def remove_session(self, session_id: str) -> list[str]:
        found = self.session_containers(session_id)
        for container_id in found.values():
            self.remove_container(container_id)

        wait_for(
            lambda: self.session_containers(session_id),
            lambda left: not left,
            timeout_s=REAP_TIMEOUT_S,
            what=f"{self.name} to remove the containers of session {session_id}",
            hint=f"see `{self.cli} ps --all --filter label={SESSION_LABEL}={session_id}`",
        )
        remove_session(self.keepalive_dir(), session_id)
        return list(found)

    def explain(self, exc: Exception) -> str:
        """The engine's own words for a refused call."""
        return str(exc)

    def cli_argv(self, *args: str) -> list[str]:
        """A command line of the engine's own CLI, pointed at the engine this driver uses."""
        return [self.cli, f"--{self.cli_url_flag}={self.url}", *args]

    def oracle_argv(
        self, cdi_devices: Sequence[str], image: str | None, argv: Sequence[str]
    ) -> list[str]:
        """The engine's CLI running ``argv`` with these CDI devices, outside any driver."""
        image = image or self.image or DEFAULT_IMAGE
        devices = [f"--device={device}" for device in cdi_devices]
        return self.cli_argv("run", "--rm", "--network=none", *devices, image, *argv)
