"""Planted breakers of MIG: MIG-EXACT-01, MIG-PROFILE-01, MIG-ISOLATION-01, MIG-EXCLUSIVE-01.

MIG instances by ID and by profile, each exclusive and excluding its GPU whole. Their tests:
conformance/test_mig.py. MIG-EXCLUSIVE-01's holders (who holds an instance, who holds the GPU
whole) each have their breaker, blind to that holder: a holder without one fails at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from conformance.holders import MIG_INSTANCE_HOLDERS, MIG_WHOLE_HOLDERS
from drivers.base import Launch
from drivers.reference import ReferenceSandbox
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpusExhausted
from gpuhost.host import GpuHost
from gpuhost.leases import Holder, Lease, LeaseOwner, _Held
from gpuhost.spec import GpuPlan
from tests.breakers.base import BrokenDriver, BrokenRegistry, family, with_binds
from tests.breakers.visibility import OmitsUvmNode


class MigByGpuOnly(BrokenDriver):
    """MIG-EXACT-01: a MIG ID gets the first instance of the right GPU: the instance is unread."""

    BREAKS = "MIG-EXACT-01"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        first: dict[str | None, GpuDevice] = {}
        for mig in self.host.mig_devices:
            first.setdefault(mig.parent_uuid, mig)
        return tuple(first[gpu.parent_uuid] if gpu.is_mig else gpu for gpu in super().resolve(plan))


class MigCdiIndexFromOne(BrokenDriver):
    """MIG-EXACT-01: ``<kind>=<gpu>:<n>`` counts instances from 1, consistently with itself."""

    BREAKS = "MIG-EXACT-01"

    def device_ids(self, gpu: GpuDevice) -> tuple[str, ...]:
        if not gpu.is_mig:
            return super().device_ids(gpu)
        assert gpu.mig_index is not None
        return (gpu.uuid, f"{gpu.cdi_kind}={gpu.index}:{gpu.mig_index + 1}", gpu.cdi_names[1])


class MigAsWholeGpu(BrokenDriver):
    """MIG-PROFILE-01: counts and defaults choose among every GPU, those in MIG mode too."""

    BREAKS = "MIG-PROFILE-01"

    def inventory(self) -> tuple[GpuDevice, ...]:
        return self.host.gpus

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return super().pool(plan) if plan.mig_profile else self.host.gpus


class MigProfileFromFirstGpu(BrokenDriver):
    """MIG-PROFILE-01: a MIG profile count comes from the first GPU with the profile, never two."""

    BREAKS = "MIG-PROFILE-01"

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        found = super().pool(plan)
        if plan.mig_profile is None or not found:
            return found
        return tuple(mig for mig in found if mig.parent_uuid == found[0].parent_uuid)


class VendorPoolIncludesMig(BrokenDriver):
    """MIG-PROFILE-01: with a vendor named, any of its GPUs is taken: NVIDIA's in MIG mode too."""

    BREAKS = "MIG-PROFILE-01"

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.vendor is not None and plan.mig_profile is None:
            return tuple(gpu for gpu in self.exact_devices() if gpu.vendor == plan.vendor)
        return super().pool(plan)


class MigProfilePrefix(BrokenDriver):
    """MIG-PROFILE-01: a mig_profile is a prefix: "1g" is served; "1g.10gb" takes "1g.10gb+me"."""

    BREAKS = "MIG-PROFILE-01"

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.mig_profile is None:
            return super().pool(plan)
        return tuple(m for m in self.host.mig_devices if m.profile.startswith(plan.mig_profile))


class MigCountShortfallLeak(BrokenDriver):
    """MIG-PROFILE-01: a MIG profile count takes instances GPU by GPU; a shortfall keeps them."""

    BREAKS = "MIG-PROFILE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.mig_profile is None or plan.gpus:
            return super().allocate(sandbox_id, plan)
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        pool = self.pool(plan)
        taken: list[GpuDevice] = []
        for parent in dict.fromkeys(mig.parent_uuid for mig in pool):
            free = self.host.leases.free([mig for mig in pool if mig.parent_uuid == parent])
            need = min(plan.count - len(taken), len(free))
            if need > 0:
                taken += self.host.leases.acquire(free, owner, count=need)
        if len(taken) < plan.count:  # what was taken stays leased
            raise GpusExhausted(plan.count, len(taken), len(pool), f"{plan.mig_profile} instances")
        return tuple(taken)


class MigAllCaps(BrokenDriver):
    """MIG-ISOLATION-01: a MIG instance comes with the capabilities of every instance of its GPU."""

    BREAKS = "MIG-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        parents = {gpu.parent_uuid for gpu in gpus if gpu.is_mig}
        siblings = [mig for mig in self.host.mig_devices if mig.parent_uuid in parents]
        return super().bwrap_argv(sandbox_id, [*gpus, *(m for m in siblings if m not in gpus)])


class ProfileCountsGetMonitorCap(BrokenDriver):
    """MIG-ISOLATION-01: mig_profile counts get the MIG monitor capability too (nvidia-cap2)."""

    BREAKS = "MIG-ISOLATION-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        argv = self.bwrap_argv(launch.sandbox_id, launch.gpus)
        if launch.plan is not None and launch.plan.mig_profile is not None:
            caps = next(
                n.major for g in self.host.mig_devices for n in g.nodes if "nvidia-caps" in n.path
            )
            node = self.host.leases.directory.parent / "nvidia-cap2"
            with contextlib.suppress(FileExistsError):
                os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(caps, 2))
            argv = with_binds(argv, "--dev-bind", str(node), "/dev/nvidia-caps/nvidia-cap2")
        return self._start(launch, argv)


class OmitsMigCapabilityNodes(OmitsUvmNode):
    """MIG-ISOLATION-01: binds a MIG instance's GPU node but no nvidia-caps node: no CUDA."""

    BREAKS = "MIG-ISOLATION-01"
    LEFT_OUT = "/dev/nvidia-caps/"


class MigCapsNodev(BrokenDriver):
    """MIG-ISOLATION-01: MIG capability nodes bound read-only ("tokens"): nodev, none opens."""

    BREAKS = "MIG-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        return [
            "--ro-bind" if arg == "--dev-bind" and argv[i + 2].startswith("/dev/nvidia-caps/")
            else arg
            for i, arg in enumerate(argv)
        ]  # fmt: skip


class MigIgnoresParent(BrokenDriver):
    """MIG-EXCLUSIVE-01: leases a MIG instance as a device of its own: its GPU stays grantable."""

    BREAKS = "MIG-EXCLUSIVE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        orphans = dataclasses.replace(
            plan, gpus=tuple(dataclasses.replace(gpu, parent_uuid=None) for gpu in plan.gpus)
        )
        by_uuid = {gpu.uuid: gpu for gpu in self.exact_devices()}
        return tuple(by_uuid[gpu.uuid] for gpu in super().allocate(sandbox_id, orphans))

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return tuple(dataclasses.replace(gpu, parent_uuid=None) for gpu in super().pool(plan))


class _NoParentRegistry(BrokenRegistry):
    """Writes MIG leases without parent_uuid; reads the parent back from its own inventory."""

    def __init__(self, directory: Path, parents: Mapping[str, str]) -> None:
        super().__init__(directory)
        self._parents = parents

    @classmethod
    def replacing(cls, host: GpuHost) -> Self:
        parents = {mig.uuid: mig.parent_uuid for mig in host.mig_devices if mig.parent_uuid}
        return cls(host.leases.directory, parents)

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        return [
            dataclasses.replace(lease, parent_uuid=self._parents.get(lease.gpu_uuid))
            if lease.parent_uuid is None
            else lease
            for lease in super()._read(path, data, mtime)
        ]

    def _store(self, leases: list[Lease]) -> None:
        super()._store([dataclasses.replace(lease, parent_uuid=None) for lease in leases])


class MigLeaseWithoutParent(BrokenDriver):
    """MIG-EXCLUSIVE-01: writes MIG leases without their GPU (it knows it from its inventory)."""

    BREAKS = "MIG-EXCLUSIVE-01"
    LEASES = _NoParentRegistry


class _ReleasesByPhysicalGpu(ReferenceSandbox):
    def close(self) -> None:
        was_open = not self.closed
        super().close()
        parents = {gpu.parent_uuid for gpu in self.gpus if gpu.parent_uuid}
        if was_open and parents and self._leases is not None:  # "free the GPU"
            with self._leases._locked(reclaim=False) as held:
                held.mine[:] = [lease for lease in held.mine if lease.parent_uuid not in parents]


class MigCloseReleasesSiblings(BrokenDriver):
    """MIG-EXCLUSIVE-01: closing a MIG sandbox drops every lease on its GPU's instances."""

    BREAKS = "MIG-EXCLUSIVE-01"
    SANDBOX = _ReleasesByPhysicalGpu


class GrantsGpuWithItsOwnInstance(BrokenDriver):
    """MIG-EXCLUSIVE-01: IDs told apart by UUID alone: a GPU and one of its instances, granted."""

    BREAKS = "MIG-EXCLUSIVE-01"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        index = self.device_index()
        chosen = {gpu.uuid: gpu for device_id in plan.device_ids for gpu in index[device_id]}
        return tuple(chosen.values())


class _Unseeing(BrokenRegistry):
    """Judges a request against the leases as ``seen`` shows them (None: not there at all).

    ``seen(lease, asking, in_mig_mode)``: ``asking`` is the driver asking, ``in_mig_mode``
    the UUIDs of the host's GPUs in MIG mode.
    """

    seen: Callable[[Lease, str, frozenset[str]], Lease | None]

    def __init__(self, directory: Path, in_mig_mode: frozenset[str]) -> None:
        super().__init__(directory)
        self._in_mig_mode = in_mig_mode
        self._asking = threading.local()

    @classmethod
    def replacing(cls, host: GpuHost) -> Self:
        in_mig_mode = frozenset(gpu.uuid for gpu in host.gpus if gpu.mig_enabled)
        return cls(host.leases.directory, in_mig_mode)

    def acquire(
        self, inventory: Sequence[GpuDevice], owner: LeaseOwner, **request: Any
    ) -> tuple[GpuDevice, ...]:
        self._asking.driver = owner.driver
        try:
            return super().acquire(inventory, owner, **request)
        finally:
            self._asking.driver = None

    @contextlib.contextmanager
    def _locked(self, reclaim: bool = True, drop: Collection[Lease] = ()) -> Iterator[_Held]:
        asking = getattr(self._asking, "driver", None)
        with super()._locked(reclaim, drop) as held:
            if asking is None:
                yield held
                return
            yield _Unseen(held.mine, held.others, lambda lease: (
                type(self).seen(lease, asking, self._in_mig_mode)
            ))  # fmt: skip


class _OwnWholeGpusOnlyRegistry(_Unseeing):
    """Other clients' whole GPUs in MIG mode unseen: "only we take a GPU in MIG mode whole"."""

    @staticmethod
    def seen(lease: Lease, asking: str, in_mig_mode: frozenset[str]) -> Lease | None:
        return None if lease.driver != asking and lease.gpu_uuid in in_mig_mode else lease


class _OthersWholeGpusOnlyRegistry(_Unseeing):
    """Its own whole GPUs in MIG mode unseen: "what we take whole, our sandboxes track"."""

    @staticmethod
    def seen(lease: Lease, asking: str, in_mig_mode: frozenset[str]) -> Lease | None:
        return None if lease.driver == asking and lease.gpu_uuid in in_mig_mode else lease


class _OwnInstancesOnlyRegistry(_Unseeing):
    """Other clients' leases of MIG instances seen without their GPU: "only we split GPUs"."""

    @staticmethod
    def seen(lease: Lease, asking: str, in_mig_mode: frozenset[str]) -> Lease | None:
        if lease.driver != asking and lease.parent_uuid is not None:
            return dataclasses.replace(lease, parent_uuid=None)
        return lease


@dataclasses.dataclass
class _Unseen(_Held):
    """The leases under the lock, ``all`` as ``seen`` shows them (None: left out)."""

    seen: Callable[[Lease], Lease | None] = lambda lease: lease

    @property
    def all(self) -> list[Lease]:
        return [shown for lease in super().all if (shown := self.seen(lease)) is not None]


class InstancesBlindToOtherClientsWholeGpus(BrokenDriver):
    """MIG-EXCLUSIVE-01: an instance is refused while this driver holds its GPU whole, only."""

    BREAKS = "MIG-EXCLUSIVE-01"
    LEASES = _OwnWholeGpusOnlyRegistry


class InstancesBlindToItsOwnWholeGpus(BrokenDriver):
    """MIG-EXCLUSIVE-01: an instance is refused while another client holds its GPU whole, only.

    Who holds the GPU whole: the driver's sandbox.
    """

    BREAKS = "MIG-EXCLUSIVE-01"
    LEASES = _OthersWholeGpusOnlyRegistry


class WholeGpusBlindToOtherClientsInstances(BrokenDriver):
    """MIG-EXCLUSIVE-01: a GPU is busy while its own driver holds one of its instances, only.

    Another client's instance it sees busy, but not as its GPU's.

    Who holds an instance: the sh client, with --parent.
    """

    BREAKS = "MIG-EXCLUSIVE-01"
    LEASES = _OwnInstancesOnlyRegistry


_BLIND_TO: dict[str, type[BrokenDriver]] = {
    MIG_INSTANCE_HOLDERS[0]: MigIgnoresParent,
    MIG_INSTANCE_HOLDERS[1]: WholeGpusBlindToOtherClientsInstances,
    MIG_WHOLE_HOLDERS[0]: InstancesBlindToItsOwnWholeGpus,
    MIG_WHOLE_HOLDERS[1]: InstancesBlindToOtherClientsWholeGpus,
}
HOLDERS_FAMILY = family(
    globals(), (*MIG_INSTANCE_HOLDERS, *MIG_WHOLE_HOLDERS), _BLIND_TO.__getitem__
)
"""A breaker per holder of MIG-EXCLUSIVE-01, each blind to that holder alone."""
