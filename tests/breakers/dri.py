"""Planted breakers of AMD and Intel GPUs: DRI-ISOLATION-01, DRI-PAIRING-01, DRI-EXCLUSIVE-01.

Each GPU by its own card and render nodes, leased as NVIDIA's are. Their tests:
conformance/test_dri.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from conformance.holders import OTHER_USER_PYTHON, OTHER_USER_SH
from conformance.test_dri import OTHER_USERS
from drivers.base import Launch
from drivers.reference import ReferenceSandbox
from gpuhost.devices import GpuDevice
from gpuhost.leases import Holder, Lease, LeaseOwner, LeaseRegistry
from gpuhost.spec import GpuPlan
from tests.breakers.base import BrokenDriver, family


class DriLeaksNeighbour(BrokenDriver):
    """DRI-ISOLATION-01: an AMD or Intel GPU comes with the nodes of the next one on the bus."""

    BREAKS = "DRI-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        dri = list(self.host.dri_gpus)
        extra = [dri[(dri.index(gpu) + 1) % len(dri)] for gpu in gpus if gpu in dri]
        return super().bwrap_argv(sandbox_id, [*gpus, *(g for g in extra if g not in gpus)])


class AmdWithoutKfd(BrokenDriver):
    """DRI-ISOLATION-01: AMD GPUs get their card and render nodes, not /dev/kfd: no ROCm compute."""

    BREAKS = "DRI-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        no_kfd = [
            dataclasses.replace(gpu, nodes=tuple(n for n in gpu.nodes if n.path != "/dev/kfd"))
            for gpu in gpus
        ]
        return super().bwrap_argv(sandbox_id, no_kfd)


class DriRenderByNumber(BrokenDriver):
    """DRI-PAIRING-01: pairs card<N> with renderD<128+N>, as if numbers told which go together."""

    BREAKS = "DRI-PAIRING-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        nodes = {(n.major, n.minor): n for gpu in self.host.dri_gpus for n in gpu.nodes}

        def by_number(gpu: GpuDevice) -> GpuDevice:
            if gpu not in self.host.dri_gpus:
                return gpu
            card = next(n for n in gpu.nodes if "/card" in n.path)
            paired = nodes.get((card.major, 128 + card.minor))
            rest = [n for n in gpu.nodes if "/renderD" not in n.path]
            return dataclasses.replace(gpu, nodes=(*rest, *([paired] if paired else [])))

        return super().bwrap_argv(sandbox_id, [by_number(gpu) for gpu in gpus])


class DriUnleased(BrokenDriver):
    """DRI-EXCLUSIVE-01: hands out AMD and Intel GPUs unleased: only NVIDIA's are exclusive."""

    BREAKS = "DRI-EXCLUSIVE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.vendor in ("amd", "intel"):
            return self.pool(plan)[: plan.count]
        if plan.gpus and all(gpu.vendor != "nvidia" for gpu in plan.gpus):
            return plan.gpus
        return super().allocate(sandbox_id, plan)


class DriLeasedByPciAddress(BrokenDriver):
    """DRI-EXCLUSIVE-01: leases AMD and Intel GPUs by bare PCI address, not as PCI-<bus>."""

    BREAKS = "DRI-EXCLUSIVE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        def key(gpu: GpuDevice) -> GpuDevice:
            return dataclasses.replace(gpu, uuid=gpu.pci_bus_id) if gpu.vendor != "nvidia" else gpu

        back = {key(gpu).uuid: gpu for gpu in self.exact_devices()}
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        granted = self.host.leases.acquire(
            tuple(map(key, self.pool(plan))), owner, count=plan.count,
            exact=tuple(map(key, plan.gpus)), mode=plan.sharing, share_limit=self.host.share_limit,
        )  # fmt: skip
        return tuple(back[gpu.uuid] for gpu in granted)


class MixedVendorPartialLeak(BrokenDriver):
    """DRI-EXCLUSIVE-01: leases exact NVIDIA, then DRI GPUs; a busy second step keeps the first."""

    BREAKS = "DRI-EXCLUSIVE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        nvidia = tuple(gpu for gpu in plan.gpus if gpu.vendor == "nvidia")
        dri = tuple(gpu for gpu in plan.gpus if gpu.vendor != "nvidia")
        if not (nvidia and dri):
            return super().allocate(sandbox_id, plan)
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))

        def take(gpus: tuple[GpuDevice, ...]) -> tuple[GpuDevice, ...]:
            return self.host.leases.acquire(gpus, owner, count=len(gpus), exact=gpus)

        granted = take(nvidia) + take(dri)  # GpuBusy in the second: the first stays leased
        order = {gpu.uuid: at for at, gpu in enumerate(plan.gpus)}
        return tuple(sorted(granted, key=lambda gpu: order[gpu.uuid]))


class DriHeldByCreator(BrokenDriver):
    """DRI-EXCLUSIVE-01: AMD/Intel leases stay with the creating process ("it opens the DRI nodes").

    Not the sandbox: a killed sandbox's DRI GPUs come back only when its creator exits.
    """

    BREAKS = "DRI-EXCLUSIVE-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        if launch.gpus and all(gpu.vendor != "nvidia" for gpu in launch.gpus):
            launch.hand_over(Holder.process(os.getpid()))
        return sandbox


_CLIENTS = {OTHER_USER_PYTHON: ("reference", "Python"), OTHER_USER_SH: ("gpu-lease", "Sh")}
"""The driver each other-user holder's leases name: the Python client's, the sh client's."""


def _blind_to_other_users(who: str) -> type[BrokenDriver]:
    unseen, client = _CLIENTS[who]

    class _Registry(LeaseRegistry):
        def _load_others(self) -> list[Lease]:
            return [lease for lease in super()._load_others() if lease.driver != unseen]

    class Blind(BrokenDriver):
        __doc__ = (
            f"DRI-EXCLUSIVE-01: AMD and Intel GPUs are leased blind to {who}: other users' "
            f"files are read for NVIDIA GPUs only, or for other leases than {unseen!r}'s."
        )
        BREAKS = "DRI-EXCLUSIVE-01"

        def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
            dri = plan.vendor in ("amd", "intel") or (
                plan.gpus and all(gpu.vendor != "nvidia" for gpu in plan.gpus)
            )
            if not dri:
                return super().allocate(sandbox_id, plan)
            holder = Holder.process(os.getpid())
            owner = LeaseOwner(self.name, sandbox_id, self.session_id, holder)
            return _Registry(self.host.leases.directory).acquire(
                self.pool(plan), owner, count=plan.count, exact=plan.gpus, mode=plan.sharing,
                share_limit=self.host.share_limit,
            )  # fmt: skip

    Blind.__name__ = Blind.__qualname__ = f"DriBlindToOtherUsers{client}Client"
    return Blind


family(globals(), OTHER_USERS, _blind_to_other_users)
