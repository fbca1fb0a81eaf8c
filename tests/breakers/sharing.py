"""Planted breakers of shared GPUs: GPU-SHARED-01/02, and GPU-BUSY-01 of a GPU held shared.

Shared GPUs are co-held by shared sandboxes only, up to the share limit, and a sharer's
share comes back however it ends; an exclusive request for a GPU held shared is busy. Their
tests: conformance/test_sharing.py, and the busy tests of conformance/test_selection.py.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from conformance.endings import ENDINGS
from conformance.test_selection import SHARED_HOLDERS
from conformance.test_sharing import (
    ANOTHER_CLIENT,
    ANOTHER_PROCESS,
    EXCLUSIVE_HOLDERS,
    THIS_PROCESS,
)
from drivers.base import Launch
from drivers.reference import ReferenceSandbox
from gpuhost.devices import GpuDevice
from gpuhost.grants import grant
from gpuhost.leases import EXCLUSIVE, Holder, Lease, LeaseOwner, _leases
from gpuhost.spec import SHARED, DriverCapabilities, DriverRequest, GpuPlan
from tests.breakers.base import BrokenDriver, BrokenRegistry, family
from tests.breakers.lifecycle import misses


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


SHARE_FAMILY = family(globals(), ENDINGS, misses(lambda _: "GPU-SHARED-01", "Share", True))
"""One breaker per way a sharer ends: its share is not given back that way (a full GPU)."""
LAST_SHARE_FAMILY = family(globals(), ENDINGS, misses(lambda _: "GPU-SHARED-02", "LastShare", True))
"""One breaker per way a last sharer ends: its GPU is not exclusive again that way."""

_MADE_HERE: set[str] = set()
"""The sandboxes this process made (of the drivers below)."""
_UNSEEN: dict[str, tuple[str, str, Callable[[Lease, str], bool]]] = {
    THIS_PROCESS: (
        "SharesOwnExclusiveGpus",
        "takes its own exclusive sandboxes for ones it will share with",
        lambda lease, driver: lease.sandbox_id in _MADE_HERE,
    ),
    ANOTHER_PROCESS: (
        "SharesOtherProcessesExclusiveGpus",
        "counts only this process's sandboxes of its own driver as holding GPUs whole",
        lambda lease, driver: lease.driver == driver and lease.sandbox_id not in _MADE_HERE,
    ),
    ANOTHER_CLIENT: (
        "SharesOtherClientsExclusiveGpus",
        "counts only its own driver's leases as holding GPUs whole",
        lambda lease, driver: lease.driver != driver,
    ),
}


class _JoinsUnseenExclusive(BrokenDriver):
    """A shared request does not see some exclusive leases (``UNSEEN``) and joins their GPUs."""

    UNSEEN: ClassVar[Callable[[Lease, str], bool]]

    def start(self, launch: Launch) -> ReferenceSandbox:
        _MADE_HERE.add(launch.sandbox_id)
        return super().start(launch)

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.sharing != SHARED:
            _MADE_HERE.add(sandbox_id)
            return super().allocate(sandbox_id, plan)
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        unseen = type(self).UNSEEN
        limit = self.host.share_limit
        with self.host.leases._locked() as held:
            seen = [x for x in held.all if x.mode != EXCLUSIVE or not unseen(x, self.name)]
            granted = grant(seen, self.pool(plan), plan.count, plan.gpus, SHARED, limit)
            held.mine.extend(_leases(granted, owner, SHARED, limit))
        return granted


def _joins(holder: str) -> type[BrokenDriver]:
    name, defect, unseen = _UNSEEN[holder]
    doc = f"GPU-SHARED-01: a shared request {defect}, and joins the others. Held by: {holder}."
    attrs = {"__doc__": doc, "BREAKS": "GPU-SHARED-01", "UNSEEN": staticmethod(unseen)}
    return type(name, (_JoinsUnseenExclusive,), attrs)


JOINS_FAMILY = family(globals(), EXCLUSIVE_HOLDERS, _joins)
"""One breaker per exclusive holder a shared request must not join."""


def _joins_sharers(held_by: str) -> type[BrokenDriver]:
    of_this_driver = held_by == SHARED_HOLDERS[0]

    class JoinsSharers(BrokenDriver):
        __doc__ = (
            f"GPU-BUSY-01: an exclusive request naming a GPU held by {held_by}, with room "
            "left, joins its sharers instead of failing with GpuBusy."
        )
        BREAKS = "GPU-BUSY-01"

        def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
            mine: set[str] = vars(self).setdefault("_made", set())
            if plan.gpus and plan.sharing == EXCLUSIVE:
                named = {gpu.uuid for gpu in plan.gpus}
                on = [x for x in self.host.leases.leases() if x.gpu_uuid in named]
                if on and all(
                    x.mode == SHARED and (x.sandbox_id in mine) == of_this_driver for x in on
                ):
                    plan = dataclasses.replace(plan, sharing=SHARED)
            granted = super().allocate(sandbox_id, plan)
            mine.add(sandbox_id)
            return granted

    JoinsSharers.__name__ = JoinsSharers.__qualname__ = (
        "ExactJoinsSharersOfThisDriver" if of_this_driver else "ExactJoinsSharersOfAnotherProcess"
    )
    return JoinsSharers


JOINS_SHARERS = family(globals(), SHARED_HOLDERS, _joins_sharers)
