"""Planted broken container drivers: docker and podman with one defect each.

Each defect is written once, as a mixin over ``ContainerDriver``, and planted in both
engines' drivers. ``BREAKS`` names the requirement the catalogue must fail for it;
``tests/drivers/test_engines.py`` runs those tests against every one of them.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shlex
import subprocess
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any, ClassVar, cast

import docker

from drivers.container import (
    KEEPALIVE_PATH,
    KEEPALIVE_SCRIPT,
    ContainerDriver,
    ContainerRequest,
)
from drivers.docker import DockerDriver
from drivers.podman import PodmanDriver
from gpuhost import cdi
from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost
from gpuhost.leases import Holder, register_liveness
from gpuhost.spec import DEVICE_IDS_KEY, DriverRequest, GpuPlan


class BrokenContainerDriver(ContainerDriver):
    BREAKS: ClassVar[str]


class RoundRobinDefault(BrokenContainerDriver):
    """GPU-DEFAULT-02: defaults go round-robin with no record of which GPU is in use."""

    BREAKS = "GPU-DEFAULT-02"
    _next: ClassVar[itertools.count[int]] = itertools.count()

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.device_ids:
            return super().allocate(sandbox_id, plan)
        inventory = self.inventory()
        return tuple(inventory[next(self._next) % len(inventory)] for _ in range(plan.count))


class AllOnDefault(BrokenContainerDriver):
    """GPU-DEFAULT-01: a default request injects nvidia.com/gpu=all, though it leases one."""

    BREAKS = "GPU-DEFAULT-01"

    def cdi_devices(self, plan: GpuPlan | None, gpus: Sequence[GpuDevice]) -> tuple[str, ...]:
        if plan is not None and not plan.device_ids:
            return (cdi.all_devices(self.cdi_kind),)
        return super().cdi_devices(plan, gpus)


class LeaseKeptAfterRemoval(BrokenContainerDriver):
    """GPU-RECLAIM-03: leases held by the creating process, not the container: kept."""

    BREAKS = "GPU-RECLAIM-03"

    def holder_for(self, container_id: str) -> Holder:
        return Holder.process(os.getpid())


class InjectsNeighbour(BrokenContainerDriver):
    """GPU-ORACLE-01: exact IDs inject the next GPU's CDI device, reported as the one asked."""

    BREAKS = "GPU-ORACLE-01"

    def cdi_devices(self, plan: GpuPlan | None, gpus: Sequence[GpuDevice]) -> tuple[str, ...]:
        if plan is None or not plan.device_ids:
            return super().cdi_devices(plan, gpus)
        inventory = self.inventory()
        return tuple(
            self.device_ids(inventory[(gpu.index + 1) % len(inventory)])[0] for gpu in gpus
        )


class AllHoldsOne(BrokenContainerDriver):
    """GPU-ALL-01: nvidia.com/gpu=all injects every GPU but leases only the first."""

    BREAKS = "GPU-ALL-01"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if cdi.all_devices(self.cdi_kind) in plan.device_ids:
            return self.inventory()[:1]
        return super().resolve(plan)


class CloseReturnsEarly(BrokenContainerDriver):
    """GPU-RELEASE-01: close returns once the keepalive is closed: leases go back too soon."""

    BREAKS = "GPU-RELEASE-01"

    def stop_container(self, container_id: str) -> None:
        return None


class KeepaliveDirMounted(BrokenContainerDriver):
    """SANDBOX-FS-01: binds the keepalive directory, every sandbox's FIFO, not its own FIFO."""

    BREAKS = "SANDBOX-FS-01"

    def create_container(self, request: ContainerRequest) -> str:
        own = f"{KEEPALIVE_PATH}/{request.keepalive.name}"
        script = KEEPALIVE_SCRIPT.replace(KEEPALIVE_PATH, shlex.quote(own))
        changed = dataclasses.replace(
            request, keepalive=request.keepalive.parent, command=("sh", "-c", script)
        )
        return super().create_container(changed)  # type: ignore[safe-super]


class EngineSocketMounted(BrokenContainerDriver):
    """SANDBOX-FS-01: mounts the engine's API socket, to start sibling containers."""

    BREAKS = "SANDBOX-FS-01"

    def create_container(self, request: ContainerRequest) -> str:
        socket = self.url.removeprefix("unix://")
        changed = dataclasses.replace(
            request, tool_mounts=(*request.tool_mounts, (socket, "/var/run/engine.sock"))
        )
        return super().create_container(changed)  # type: ignore[safe-super]


class ReapSeesRunningOnly(BrokenContainerDriver):
    """SANDBOX-REAP-01: reap and ``sandboxes`` see running containers only (no ``--all``).

    A container whose creator died between creating and starting it is never removed.
    """

    BREAKS = "SANDBOX-REAP-01"

    def session_containers(self, session_id: str) -> dict[str, str]:
        found = super().session_containers(session_id)  # type: ignore[safe-super]
        return {sandbox: ref for sandbox, ref in found.items() if self._running(ref)}

    def _running(self, container_id: str) -> bool:
        argv = self.cli_argv("inspect", "--format", "{{.State.Running}}", container_id)
        inspected = subprocess.run(argv, capture_output=True, text=True, check=False)
        return inspected.stdout.strip() == "true"


class AliasesFirstWins(BrokenContainerDriver):
    """GPU-VALIDATE-01: ``gpu_device_ids`` read first: ``cdi_devices`` beside it is dropped."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config
        if DEVICE_IDS_KEY in block:
            aliases = self.capabilities.device_id_aliases
            kept = {k: v for k, v in block.items() if k not in aliases}
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class LivenessRunningOnly(BrokenContainerDriver):
    """GPU-BUSY-01: a container holder is alive only while it runs: a paused one's GPUs go."""

    BREAKS = "GPU-BUSY-01"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        super().__init__(host, session_id, image)
        register_liveness(self.holder_kind, type(self).holder_alive)

    @classmethod
    def container_exists(cls, url: str, container_id: str) -> bool:
        argv = [cls.cli, f"--{cls.cli_url_flag}={url}", "inspect", "--format", "{{.State.Status}}"]
        status = subprocess.run([*argv, container_id], capture_output=True, text=True, check=False)
        return status.stdout.strip() == "running"


class DockerRoundRobinDefault(RoundRobinDefault, DockerDriver):
    pass


class DockerAllOnDefault(AllOnDefault, DockerDriver):
    pass


class DockerLeaseKeptAfterRemoval(LeaseKeptAfterRemoval, DockerDriver):
    pass


class DockerInjectsNeighbour(InjectsNeighbour, DockerDriver):
    pass


class DockerAllHoldsOne(AllHoldsOne, DockerDriver):
    pass


class PodmanRoundRobinDefault(RoundRobinDefault, PodmanDriver):
    pass


class PodmanAllOnDefault(AllOnDefault, PodmanDriver):
    pass


class PodmanLeaseKeptAfterRemoval(LeaseKeptAfterRemoval, PodmanDriver):
    pass


class PodmanInjectsNeighbour(InjectsNeighbour, PodmanDriver):
    pass


class PodmanAllHoldsOne(AllHoldsOne, PodmanDriver):
    pass


class DockerCloseReturnsEarly(CloseReturnsEarly, DockerDriver):
    pass


class DockerKeepaliveDirMounted(KeepaliveDirMounted, DockerDriver):
    pass


class DockerEngineSocketMounted(EngineSocketMounted, DockerDriver):
    pass


class PodmanCloseReturnsEarly(CloseReturnsEarly, PodmanDriver):
    pass


class PodmanKeepaliveDirMounted(KeepaliveDirMounted, PodmanDriver):
    pass


class PodmanEngineSocketMounted(EngineSocketMounted, PodmanDriver):
    pass


class DockerReapSeesRunningOnly(ReapSeesRunningOnly, DockerDriver):
    pass


class DockerAliasesFirstWins(AliasesFirstWins, DockerDriver):
    pass


class PodmanAliasesFirstWins(AliasesFirstWins, PodmanDriver):
    pass


class DockerLivenessRunningOnly(LivenessRunningOnly, DockerDriver):
    pass


class PodmanLivenessRunningOnly(LivenessRunningOnly, PodmanDriver):
    pass


class PodmanReapSeesRunningOnly(ReapSeesRunningOnly, PodmanDriver):
    pass


class DockerGainsPrivileges(BrokenContainerDriver, DockerDriver):
    """SANDBOX-PRIV-01: no ``no-new-privileges``: a setuid program in a container gains them."""

    BREAKS = "SANDBOX-PRIV-01"
    security_opt = ()


class DockerSystemPathsUnconfined(BrokenContainerDriver, DockerDriver):
    """SANDBOX-PRIV-01: ``systempaths=unconfined``: /proc/sys, the host's settings, writable."""

    BREAKS = "SANDBOX-PRIV-01"
    security_opt = ("no-new-privileges", "systempaths=unconfined")


class PodmanNoNewPrivilegesAsSecurityOpt(BrokenContainerDriver, PodmanDriver):
    """SANDBOX-PRIV-01: no-new-privileges in ``security_opt``: podman-py sends SELinux options."""

    BREAKS = "SANDBOX-PRIV-01"
    security = MappingProxyType({"security_opt": ["no-new-privileges"]})


class _ConfigProxiesApi:
    """docker-py's client as it is by default: ``use_config_proxy=True`` on each create."""

    def __init__(self, api: docker.APIClient) -> None:
        self._api = api

    def __getattr__(self, name: str) -> Any:
        return getattr(self._api, name)

    def create_container(self, *args: Any, **kwargs: Any) -> Any:
        return self._api.create_container(*args, **{**kwargs, "use_config_proxy": True})


class DockerForwardsConfigProxies(BrokenContainerDriver, DockerDriver):
    """SANDBOX-ENV-01: docker-py's default: its client configuration's proxies go inside."""

    BREAKS = "SANDBOX-ENV-01"

    @property
    def api(self) -> docker.APIClient:
        return cast("docker.APIClient", _ConfigProxiesApi(DockerDriver.api.fget(self)))  # type: ignore[attr-defined]


ALL: tuple[type[BrokenContainerDriver], ...] = (
    DockerRoundRobinDefault,
    DockerAllOnDefault,
    DockerLeaseKeptAfterRemoval,
    DockerInjectsNeighbour,
    DockerAllHoldsOne,
    PodmanRoundRobinDefault,
    PodmanAllOnDefault,
    PodmanLeaseKeptAfterRemoval,
    PodmanInjectsNeighbour,
    PodmanAllHoldsOne,
    DockerCloseReturnsEarly,
    DockerKeepaliveDirMounted,
    DockerEngineSocketMounted,
    PodmanCloseReturnsEarly,
    PodmanKeepaliveDirMounted,
    PodmanEngineSocketMounted,
    DockerReapSeesRunningOnly,
    PodmanReapSeesRunningOnly,
    DockerAliasesFirstWins,
    PodmanAliasesFirstWins,
    DockerLivenessRunningOnly,
    PodmanLivenessRunningOnly,
    DockerGainsPrivileges,
    DockerSystemPathsUnconfined,
    PodmanNoNewPrivilegesAsSecurityOpt,
    DockerForwardsConfigProxies,
)
