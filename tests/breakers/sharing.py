"""Planted breakers of shared GPUs: GPU-SHARED-01/02.

Shared GPUs are co-held by shared sandboxes only, up to the share limit. Their tests:
conformance/test_sharing.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from drivers.reference import ReferenceSandbox
from gpuhost.devices import GpuDevice
from gpuhost.leases import Holder, Lease, LeaseOwner
from gpuhost.spec import SHARED, DriverCapabilities, DriverRequest, GpuPlan
from tests.breakers.base import BrokenDriver, BrokenRegistry


class IgnoresSharing(BrokenDriver):
    """GPU-SHARED-01: declares it never shares, yet serves a shared request as an exclusive one."""

    BREAKS = "GPU-SHARED-01"

    @property
    def capabilities(self) -> DriverCapabilities:
        return dataclasses.replace(super().capabilities, shared=False)

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        if request.gpu is not None:
            request = dataclasses.replace(
                request, gpu=dataclasses.replace(request.gpu, sharing=None)
            )
        return super().plan(request)


class SharedBeyondLimit(BrokenDriver):
    """GPU-SHARED-01: any number of shared sandboxes on one GPU: the host's share limit unread."""

    BREAKS = "GPU-SHARED-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        return self.host.leases.acquire(
            self.pool(plan), owner, count=plan.count, exact=plan.gpus, mode=plan.sharing,
            share_limit=1000,
        )  # fmt: skip


class ExclusiveJoinsShared(BrokenDriver):
    """GPU-SHARED-01: takes every request shared: an exclusive one lands on a shared GPU."""

    BREAKS = "GPU-SHARED-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return super().allocate(sandbox_id, dataclasses.replace(plan, sharing=SHARED))


class _OwnLimitRegistry(BrokenRegistry):
    """Judges shared leases against the taker's limit only; keeps each lease's limit on disk."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.limits: dict[tuple[str, str], int | None] = {}

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        leases = super()._read(path, data, mtime)
        self.limits.update({(x.sandbox_id, x.gpu_uuid): x.share_limit for x in leases})
        return [dataclasses.replace(x, share_limit=None) for x in leases]

    def _store(self, leases: list[Lease]) -> None:
        super()._store(
            [
                dataclasses.replace(
                    x, share_limit=self.limits.get((x.sandbox_id, x.gpu_uuid), x.share_limit)
                )
                for x in leases
            ]
        )


class IgnoresOthersShareLimit(BrokenDriver):
    """GPU-SHARED-01: counts a GPU's sharers against its own limit, not the one each took."""

    BREAKS = "GPU-SHARED-01"
    LEASES = _OwnLimitRegistry

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        granted = super().allocate(sandbox_id, plan)
        registry = self.host.leases
        if plan.sharing == SHARED and isinstance(registry, _OwnLimitRegistry):
            for gpu in granted:  # its own leases keep the limit they were taken under
                registry.limits[(sandbox_id, gpu.uuid)] = self.host.share_limit
        return granted


class _DropsEverySharer(ReferenceSandbox):
    def close(self) -> None:
        registry = self._leases
        assert registry is not None
        mine = {gpu.uuid for gpu in self.gpus}
        sharers = {lease.sandbox_id for lease in registry.leases() if lease.gpu_uuid in mine}
        super().close()
        for sandbox_id in sharers:
            registry.release(sandbox_id)


class SharedReleaseDropsAll(BrokenDriver):
    """GPU-SHARED-02: closing one sharer of a GPU releases the leases of every sharer."""

    BREAKS = "GPU-SHARED-02"
    SANDBOX = _DropsEverySharer
