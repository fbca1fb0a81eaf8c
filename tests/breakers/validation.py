"""Planted breakers of refusing bad requests: GPU-VALIDATE-01/02/03, GPU-EXHAUST-02.

A bad request fails with a typed error naming the field and the value, taking nothing.
Their tests: conformance/test_validation.py. Those generated (``family``) are one per value of
the dimensions the tests try: whose block a request holds (GPU-VALIDATE-01: each other
driver's, a program's, each name near the driver's own), each near miss of a sharing
(GPU-VALIDATE-02). The near misses of names (GPU-VALIDATE-03, MIG-PROFILE-01): forms.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import uuid

from conformance.bad_requests import (
    EVERY_OTHER,
    OTHER_BLOCKS,
    SHARING_MODES,
    SHARING_NEAR_MISSES,
    block_name,
    sharing_near_miss,
)
from gpuhost.devices import GpuDevice
from gpuhost.errors import DuplicateGpuDevice, GpusExhausted, InvalidDriverConfig, InvalidGpuCount
from gpuhost.leases import EXCLUSIVE, Holder, LeaseOwner
from gpuhost.spec import (
    CHOICE_KEYS,
    DEVICE_IDS_KEY,
    MIG_PROFILE_KEY,
    SHARED,
    VENDOR_KEY,
    VENDORS,
    DriverCapabilities,
    DriverRequest,
    GpuPlan,
    GpuRequest,
    SandboxSpec,
)
from tests.breakers.base import BrokenDriver, class_name, family


class LaxDriverConfig(BrokenDriver):
    """GPU-VALIDATE-01: a malformed driver_config is ignored instead of rejected."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        try:
            return super().plan(request)
        except InvalidDriverConfig:
            return super().plan(dataclasses.replace(request, config={}))


class UnknownVendorMeansDefault(BrokenDriver):
    """GPU-VALIDATE-01: an unknown vendor ("nvida") is dropped: the request gets a default GPU."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config or None
        if block is not None and block.get("vendor", "nvidia") not in VENDORS:
            kept = {key: value for key, value in block.items() if key != "vendor"}
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class EmptyChoiceMeansNone(BrokenDriver):
    """GPU-VALIDATE-01: an empty mig_profile or vendor ("", 0) is not given: a default GPU."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config or None
        if block is not None and any(key in block and not block[key] for key in CHOICE_KEYS):
            kept = {k: v for k, v in block.items() if k not in CHOICE_KEYS or v}
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class ExactIdsOverrideChoice(BrokenDriver):
    """GPU-VALIDATE-01: exact IDs beside a mig_profile or vendor win; the choice is dropped."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config or None
        if block is not None and DEVICE_IDS_KEY in block:
            kept = {k: v for k, v in block.items() if k not in CHOICE_KEYS}
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class AcceptsEveryDriversKeys(BrokenDriver):
    """GPU-VALIDATE-01: one schema for every block: other drivers' keys taken (or ignored)."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config or None
        if block is not None:
            aliases = {"cdi_devices"}
            options = {"runtime_class_name", "node_selector", "image"}
            kept = {
                DEVICE_IDS_KEY if key in aliases else key: value
                for key, value in block.items()
                if key not in options
            }
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class MigProfileWithIntelVendor(BrokenDriver):
    """GPU-VALIDATE-01: a MIG profile beside `vendor: intel` drops the vendor (`amd` refused)."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config
        if MIG_PROFILE_KEY in block and block.get(VENDOR_KEY) == "intel":
            kept = {key: value for key, value in block.items() if key != VENDOR_KEY}
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class LaxCount(BrokenDriver):
    """GPU-VALIDATE-02: a count that is not a positive integer is taken as the default request."""

    BREAKS = "GPU-VALIDATE-02"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        try:
            return super().plan(request)
        except InvalidGpuCount:
            return GpuPlan(count=1)


class LeakOnInvalidRequest(BrokenDriver):
    """GPU-VALIDATE-02: a GPU leased before the request is validated is kept when it fails."""

    BREAKS = "GPU-VALIDATE-02"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        early = f"early-{uuid.uuid4().hex}"
        owner = LeaseOwner(self.name, early, self.session_id, Holder.process(os.getpid()))
        with contextlib.suppress(GpusExhausted):
            self.host.leases.acquire(self.inventory(), owner, count=1)
        plan = super().plan(request)
        self.host.leases.release(early)
        return plan


class CoercesCount(BrokenDriver):
    """GPU-VALIDATE-02: takes a count of "2" for 2 instead of refusing it with InvalidGpuCount."""

    BREAKS = "GPU-VALIDATE-02"

    def coerces(self, count: object) -> bool:
        return isinstance(count, str) and count.isdigit()

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        gpu = request.gpu
        if gpu is not None and self.coerces(gpu.count):
            count = int(gpu.count)
            request = dataclasses.replace(request, gpu=dataclasses.replace(gpu, count=count))
        return super().plan(request)


class CoercesIntegralFloatCount(CoercesCount):
    """GPU-VALIDATE-02: takes a count of 2.0 for 2, as `int(count) == count` would."""

    def coerces(self, count: object) -> bool:
        return isinstance(count, float) and count.is_integer()


class UnknownSharingIsExclusive(BrokenDriver):
    """GPU-VALIDATE-02: any sharing but "shared" ("Shared", "exclusve", "") is served exclusive."""

    BREAKS = "GPU-VALIDATE-02"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        gpu = request.gpu
        if gpu is not None and gpu.sharing not in (None, SHARED):
            request = dataclasses.replace(request, gpu=dataclasses.replace(gpu, sharing=EXCLUSIVE))
        return super().plan(request)


class DuplicatesAccepted(BrokenDriver):
    """GPU-VALIDATE-03: duplicate device IDs are silently merged."""

    BREAKS = "GPU-VALIDATE-03"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        try:
            return super().plan(request)
        except DuplicateGpuDevice as exc:
            ids = tuple(dict.fromkeys(request.config["gpu_device_ids"]))
            return GpuPlan(count=len(ids), device_ids=ids, field=exc.field)

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().resolve(plan)
        except DuplicateGpuDevice:
            return super().resolve(dataclasses.replace(plan, device_ids=plan.device_ids[:1]))


class IndexBoundOffByOne(BrokenDriver):
    """GPU-VALIDATE-03: checks an index with > for >=: the index past the last is an IndexError."""

    BREAKS = "GPU-VALIDATE-03"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        ids = []
        for device_id in plan.device_ids:
            if device_id.isdigit() and int(device_id) <= len(self.host.gpus):
                device_id = self.host.gpus[int(device_id)].uuid  # IndexError at len()
            ids.append(device_id)
        return super().resolve(dataclasses.replace(plan, device_ids=tuple(ids)))


class DropsUnknownBesideKnown(BrokenDriver):
    """GPU-VALIDATE-03: drops exact IDs it cannot resolve beside known ones; all unknown fails."""

    BREAKS = "GPU-VALIDATE-03"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        index = self.device_index()
        known = tuple(device_id for device_id in plan.device_ids if device_id in index)
        if known:
            plan = dataclasses.replace(plan, device_ids=known)
        return super().resolve(plan)


class NegativeIndexWraps(BrokenDriver):
    """GPU-VALIDATE-03: an index ID is ``host.gpus[int(id)]``, bounded above: "-1" is the last."""

    BREAKS = "GPU-VALIDATE-03"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        ids = [
            str(self.host.gpus[int(i)].index) if i.lstrip("-").isdigit() and int(i) < 0 else i
            for i in plan.device_ids
        ]
        return super().resolve(dataclasses.replace(plan, device_ids=tuple(ids)))


class UuidPrefixIds(BrokenDriver):
    """GPU-VALIDATE-03: UUIDs may be abbreviated, as CUDA_VISIBLE_DEVICES allows: first match."""

    BREAKS = "GPU-VALIDATE-03"

    def respelled(self, device_id: str, known: dict[str, tuple[GpuDevice, ...]]) -> str:
        """The known ID a spelling is taken for (itself when none)."""
        return next((g.uuid for g in self.host.gpus if g.uuid.startswith(device_id)), device_id)

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        known = self.device_index()
        ids = [i if i in known else self.respelled(i, known) for i in plan.device_ids]
        return super().resolve(dataclasses.replace(plan, device_ids=tuple(ids)))


class ClampsOversizedCount(BrokenDriver):
    """GPU-EXHAUST-02: a count above the number of GPUs is clamped to all of them, not refused."""

    BREAKS = "GPU-EXHAUST-02"

    @property
    def capabilities(self) -> DriverCapabilities:
        return dataclasses.replace(super().capabilities, max_gpus_per_sandbox=10**9)

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        plan = super().plan(request)
        if plan is not None and plan.count > len(self.inventory()):
            return dataclasses.replace(plan, count=len(self.inventory()))
        return plan


# -- generated: one breaker per value of a dimension the tests try ---------------------------


def _sizes_the_default_from(whose: str) -> type[BrokenDriver]:
    class SizesTheDefault(BrokenDriver):
        __doc__ = (
            f"GPU-VALIDATE-01: a request with no count and no block of its own is sized by the "
            f"device IDs in {whose}'s block."
        )
        BREAKS = "GPU-VALIDATE-01"

        def select(self, spec: SandboxSpec) -> DriverRequest:
            ids = spec.driver_config.get(block_name(whose, self.name), {}).get(DEVICE_IDS_KEY)
            gpu = spec.gpu
            unsized = gpu is not None and gpu.count is None
            if unsized and self.name not in spec.driver_config and isinstance(ids, tuple | list):
                assert gpu is not None
                spec = dataclasses.replace(spec, gpu=GpuRequest(len(ids), gpu.sharing))
            return super().select(spec)

    SizesTheDefault.__name__ = SizesTheDefault.__qualname__ = (
        f"SizesTheDefaultFromBlockOf{_part(whose)}"
    )
    return SizesTheDefault


def _part(value: str) -> str:
    """``value`` as part of a class name, what is not a word or a number left out."""
    return class_name(re.sub(r"'s\b|[^A-Za-z0-9 .=_-]", " ", value))


def _reads_the_block_of(whose: str) -> type[BrokenDriver]:
    class ReadsTheBlock(BrokenDriver):
        __doc__ = f"GPU-VALIDATE-01: without a block of its own, it takes {whose}'s as its own."
        BREAKS = "GPU-VALIDATE-01"

        def select(self, spec: SandboxSpec) -> DriverRequest:
            config = dict(spec.driver_config)
            other = block_name(whose, self.name)
            if self.name not in config and other in config:
                config[self.name] = config.pop(other)
            return super().select(dataclasses.replace(spec, driver_config=config))

    ReadsTheBlock.__name__ = ReadsTheBlock.__qualname__ = f"ReadsTheBlockOf{_part(whose)}"
    return ReadsTheBlock


OTHERS_ALONE = [b for b in OTHER_BLOCKS if b not in ("reference", EVERY_OTHER)]
"""Whose blocks the reference is handed, one at a time: none of them its own."""
family(globals(), OTHERS_ALONE, _sizes_the_default_from)
family(globals(), OTHERS_ALONE, _reads_the_block_of)


def _takes_a_sharing_that_is(how: str) -> type[BrokenDriver]:
    class TakesASharing(BrokenDriver):
        __doc__ = (
            f"GPU-VALIDATE-02: a sharing that is a mode {how} ({sharing_near_miss(SHARED, how)!r})"
            f" is served as that mode."
        )
        BREAKS = "GPU-VALIDATE-02"

        def plan(self, request: DriverRequest) -> GpuPlan | None:
            gpu = request.gpu
            mode = next(
                (m for m in SHARING_MODES if gpu and sharing_near_miss(m, how) == gpu.sharing),
                None,
            )
            if gpu is not None and mode is not None:
                request = dataclasses.replace(request, gpu=dataclasses.replace(gpu, sharing=mode))
            return super().plan(request)

    TakesASharing.__name__ = TakesASharing.__qualname__ = f"TakesASharingThatIs{_part(how)}"
    return TakesASharing


family(globals(), SHARING_NEAR_MISSES, _takes_a_sharing_that_is)


class TakesTheOnlyBlock(BrokenDriver):
    """GPU-VALIDATE-01: a request whose one block is another driver's takes it as its own."""

    BREAKS = "GPU-VALIDATE-01"

    def select(self, spec: SandboxSpec) -> DriverRequest:
        if len(spec.driver_config) == 1 and self.name not in spec.driver_config:
            only = next(iter(spec.driver_config.values()))
            spec = dataclasses.replace(spec, driver_config={self.name: only})
        return super().select(spec)
