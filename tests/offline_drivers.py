"""Every built-in driver, answering from the simulated host alone, and starting nothing.

For tests of ``plan`` and of ``create`` up to ``start``: what the docker and podman drivers
would ask their engine (where it reads CDI specs) comes from the simulated host's own spec,
and what the kubernetes driver would ask its cluster (its nodes' GPUs) from the host's
GPUs. ``start`` raises ``NotStarted``, after the GPUs were taken, for ``create`` to give
back; ``allocations`` counts how often it got that far.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

from drivers.base import Driver, Launch
from drivers.container import ContainerDriver
from drivers.docker import DockerDriver
from drivers.kubernetes import KubernetesDriver
from drivers.podman import PodmanDriver
from drivers.reference import ReferenceDriver
from drivers.vm import VmDriver
from gpuhost.host import GpuHost


class NotStarted(Exception):
    """``start`` was reached: the request was accepted, and its GPUs taken."""


class Offline(Driver):
    """A driver that starts nothing."""

    allocations = 0
    """How many times ``create`` went as far as ``start``: past taking GPUs, or (where a
    scheduler allocates) as far as asking for them."""

    def start(self, launch: Launch) -> NoReturn:
        self.allocations += 1
        raise NotStarted(launch.sandbox_id)


def _spec_dirs(host: GpuHost) -> tuple[Path, ...]:
    assert host.simulated is not None, "offline drivers read a simulated host's CDI spec"
    return (host.simulated.root / "cdi",)


class OfflineReference(Offline, ReferenceDriver):
    pass


class OfflineVm(Offline, VmDriver):
    pass


class OfflineEngine(Offline, ContainerDriver):
    """A container driver that asks no engine.

    Its CDI specs are the host's, and it has no containers (``start`` never makes one), so a
    failed start gives its GPUs back.
    """

    def cdi_spec_dirs(self) -> tuple[Path, ...]:
        return _spec_dirs(self.host)

    def session_containers(self, session_id: str) -> dict[str, str]:
        return {}


class OfflineDocker(OfflineEngine, DockerDriver):
    pass


class OfflinePodman(OfflineEngine, PodmanDriver):
    pass


class OfflineKubernetes(Offline, KubernetesDriver):
    def nodes(self) -> list[dict[str, Any]]:
        allocatable = {self.resource: str(len(self.host.gpus))}
        return [{"metadata": {"name": "offline"}, "status": {"allocatable": allocatable}}]


OFFLINE: tuple[type[Offline], ...] = (
    OfflineReference,
    OfflineDocker,
    OfflinePodman,
    OfflineKubernetes,
    OfflineVm,
)
"""One for each built-in driver (``drivers.REGISTRY``), in its order."""
