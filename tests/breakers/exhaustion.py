"""Planted breakers of exhaustion and racing creates: GPU-EXHAUST-01/02, GPU-CONCURRENT-01/02.

More than is free fails promptly, and racing creates never share a GPU. Their tests:
conformance/test_exhaustion.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence

from conformance.bad_requests import EXHAUSTED_FIELDS
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpusExhausted
from gpuhost.leases import DEFAULT_SHARE_LIMIT, EXCLUSIVE, Holder, Lease, LeaseOwner
from gpuhost.spec import GpuPlan
from tests.breakers.base import BrokenDriver, BrokenRegistry, class_name, family


class ShortChangesOnExhaustion(BrokenDriver):
    """GPU-EXHAUST-01: when too few GPUs are free, the request silently gets the ones that are."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().allocate(sandbox_id, plan)
        except GpusExhausted as exc:
            if exc.available == 0:
                raise
            return super().allocate(sandbox_id, dataclasses.replace(plan, count=exc.available))


class WaitsForAFreeGpu(BrokenDriver):
    """GPU-EXHAUST-01: a request for more GPUs than are free waits for them, instead of failing."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        while True:
            try:
                return super().allocate(sandbox_id, plan)
            except GpusExhausted:
                time.sleep(0.2)  # "a GPU will free up soon"


class RetriesWhenExhausted(BrokenDriver):
    """GPU-EXHAUST-01: an exhausted request waits three seconds for a GPU before failing."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        deadline = time.monotonic() + 3
        while True:
            try:
                return super().allocate(sandbox_id, plan)
            except GpusExhausted:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


class HangsWhenExhausted(BrokenDriver):
    """GPU-EXHAUST-01: an exhausted request never returns: it queues for a GPU forever."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().allocate(sandbox_id, plan)
        except GpusExhausted:
            threading.Event().wait()
            raise


class ExhaustedCountsDefaultPool(BrokenDriver):
    """GPU-EXHAUST-01: GpusExhausted counts the default GPUs, whichever pool was asked."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().allocate(sandbox_id, plan)
        except GpusExhausted:
            inventory = self.inventory()
            free = self.host.leases.free(inventory)
            raise GpusExhausted(plan.count, len(free), len(inventory)) from None


def _swaps(pair: str) -> type[BrokenDriver]:
    one, _, other = pair.partition(" and ")

    class Swaps(BrokenDriver):
        __doc__ = f"GPU-EXHAUST-02: asked more than exist, GpusExhausted swaps {one} and {other}."
        BREAKS = "GPU-EXHAUST-02"

        def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
            try:
                return super().allocate(sandbox_id, plan)
            except GpusExhausted as exc:
                if exc.requested <= exc.total:
                    raise
                said = {field: getattr(exc, field) for field in EXHAUSTED_FIELDS}
                said[one], said[other] = said[other], said[one]
                raise GpusExhausted(**said) from None

    Swaps.__name__ = Swaps.__qualname__ = f"Swaps{class_name(pair)}"
    return Swaps


family(globals(), [f"{a} and {b}" for a, b in itertools.combinations(EXHAUSTED_FIELDS, 2)], _swaps)


class TotalCountsEveryDevice(BrokenDriver):
    """GPU-EXHAUST-02: asked more than exist, its total counts every device of every kind.

    "only 6 selectable of 22": the 6 default GPUs free, of 22 devices with MIG instances and
    DRI GPUs; a check that only finds the number 6 in the message passes it.
    """

    BREAKS = "GPU-EXHAUST-02"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().allocate(sandbox_id, plan)
        except GpusExhausted as exc:
            if exc.requested <= exc.total:
                raise
            raise GpusExhausted(exc.requested, exc.available, len(self.host.devices)) from None


RACE_WINDOW_S = 0.25
"""How long a grant of the unlocked registries takes between reading and writing: wide
enough that creates the catalogue starts together overlap, even on a loaded machine."""


class _UnlockedRegistry(BrokenRegistry):
    """Read-modify-write with no lock at all, and a grant slow enough to race."""

    _granting = threading.local()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        yield

    def acquire(
        self,
        inventory: Sequence[GpuDevice],
        owner: LeaseOwner,
        *,
        count: int = 0,
        exact: Sequence[GpuDevice] = (),
        mode: str = EXCLUSIVE,
        share_limit: int = DEFAULT_SHARE_LIMIT,
    ) -> tuple[GpuDevice, ...]:
        self._granting.on = True
        try:
            return super().acquire(
                inventory, owner, count=count, exact=exact, mode=mode, share_limit=share_limit
            )
        finally:
            self._granting.on = False

    def _load_mine(self) -> list[Lease]:
        leases = super()._load_mine()
        if getattr(self._granting, "on", False):
            time.sleep(RACE_WINDOW_S)
        return leases


class NoLocking(BrokenDriver):
    """GPU-CONCURRENT-01: the lease registry takes no lock: concurrent threads double-grant."""

    BREAKS = "GPU-CONCURRENT-01"
    # A race: threads double-grant, processes too, or two writers corrupt the lease file.
    BREAKS_ONE_OF = frozenset({"GPU-CONCURRENT-01", "GPU-CONCURRENT-02"})
    LEASES = _UnlockedRegistry


class CheckThenTakeOneByOne(BrokenDriver):
    """GPU-CONCURRENT-01: checks enough GPUs are free, then takes them one by one, each locked.

    Two racing requests of more than half the GPUs both start, each with a part.
    """

    BREAKS = "GPU-CONCURRENT-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.gpus or plan.count < 2 or plan.sharing != EXCLUSIVE:
            return super().allocate(sandbox_id, plan)
        pool = self.pool(plan)
        free = self.host.leases.free(pool)
        if len(free) < plan.count:
            raise GpusExhausted(plan.count, len(free), len(pool))
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        taken: list[GpuDevice] = []
        for _ in range(plan.count):
            time.sleep(0.02)  # what a scheduler round trip takes between two grants
            try:
                taken += self.host.leases.acquire(pool, owner, count=1)
            except GpusExhausted:
                break  # "as many as there were"
        return tuple(taken)


class StaleInjection(BrokenDriver):
    """GPU-CONCURRENT-01: injects the GPUs it saw free before leasing: racing creates share one."""

    BREAKS = "GPU-CONCURRENT-01"
    BREAKS_ONE_OF = frozenset({"GPU-CONCURRENT-01", "GPU-CONCURRENT-02"})
    _seen = threading.local()

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        self._seen.gpus = self.host.leases.free(self.inventory())[: plan.count]
        time.sleep(0.01)  # the time a real driver spends on its own bookkeeping
        return super().allocate(sandbox_id, plan)

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        seen = getattr(self._seen, "gpus", None)
        self._seen.gpus = None
        return super().bwrap_argv(sandbox_id, seen if seen and gpus else gpus)


class _ThreadLockedRegistry(_UnlockedRegistry):
    """A lock that excludes threads but not processes."""

    _lock = threading.Lock()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self._lock:
            yield


class ThreadsOnlyLock(BrokenDriver):
    """GPU-CONCURRENT-02: the lease registry locks threads but not processes."""

    BREAKS = "GPU-CONCURRENT-02"
    BREAKS_ONE_OF = frozenset({"GPU-CONCURRENT-02"})
    LEASES = _ThreadLockedRegistry
