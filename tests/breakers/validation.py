"""Planted breakers of refusing bad requests: GPU-VALIDATE-01/02/03, GPU-EXHAUST-02.

A bad request fails with a typed error naming the field and the value, taking nothing.
Their tests: conformance/test_validation.py. Those generated (``family``) are one per value of
the dimensions the tests try: whose block a request holds (GPU-VALIDATE-01), each near miss
of an ID, each form whose prefix or letter case a driver could take, each letter case of a
PCI address (GPU-VALIDATE-03, conformance/forms.py), each near miss of a MIG profile
(MIG-PROFILE-01, which conformance/test_validation.py tries).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from collections.abc import Callable

from conformance.bad_requests import EVERY_OTHER, OTHER_BLOCKS
from conformance.forms import (
    CASE_FORMS,
    PCI_CASES,
    PREFIX_FORMS,
    PROFILE_TRANSFORMS,
    TRANSFORMS,
    form_of,
    is_pci_address,
    pci_case,
    profile_near_miss,
    respellings,
)
from drivers.base import Sandbox
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
    select,
)
from tests.breakers.base import BrokenDriver, class_name, family

Index = dict[str, tuple[GpuDevice, ...]]
TakenFor = Callable[[str, Index], str | None]
"""The ID a spelling the driver does not list is taken for, if any."""


class LaxDriverConfig(BrokenDriver):
    """GPU-VALIDATE-01: a malformed driver_config is ignored instead of rejected."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        try:
            return super().plan(request)
        except InvalidDriverConfig:
            return super().plan(dataclasses.replace(request, config={}))


class ReadsDockerBlock(BrokenDriver):
    """GPU-VALIDATE-01: without a block of its own, it takes the docker driver's as its own."""

    BREAKS = "GPU-VALIDATE-01"

    def create(self, spec: SandboxSpec) -> Sandbox:
        config = dict(spec.driver_config)
        if self.name not in config and "docker" in config:
            config[self.name] = config.pop("docker")
        return super().create(dataclasses.replace(spec, driver_config=config))


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

    def create(self, spec: SandboxSpec) -> Sandbox:
        early = f"early-{uuid.uuid4().hex}"
        owner = LeaseOwner(self.name, early, self.session_id, Holder.process(os.getpid()))
        with contextlib.suppress(GpusExhausted):
            self.host.leases.acquire(self.inventory(), owner, count=1)
        self.plan(select(spec, self.name))
        self.host.leases.release(early)
        return super().create(spec)


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

        def create(self, spec: SandboxSpec) -> Sandbox:
            ids = spec.driver_config.get(whose, {}).get(DEVICE_IDS_KEY)
            gpu = spec.gpu
            unsized = gpu is not None and gpu.count is None
            if unsized and self.name not in spec.driver_config and isinstance(ids, tuple | list):
                assert gpu is not None
                spec = dataclasses.replace(spec, gpu=GpuRequest(len(ids), gpu.sharing))
            return super().create(spec)

    SizesTheDefault.__name__ = SizesTheDefault.__qualname__ = (
        f"SizesTheDefaultFromBlockOf{class_name(whose)}"
    )
    return SizesTheDefault


family(
    globals(),
    [b for b in OTHER_BLOCKS if b not in ("reference", EVERY_OTHER)],
    _sizes_the_default_from,
)


class TakesTheOnlyBlock(BrokenDriver):
    """GPU-VALIDATE-01: a request whose one block is another driver's takes it as its own."""

    BREAKS = "GPU-VALIDATE-01"

    def create(self, spec: SandboxSpec) -> Sandbox:
        if len(spec.driver_config) == 1 and self.name not in spec.driver_config:
            only = next(iter(spec.driver_config.values()))
            spec = dataclasses.replace(spec, driver_config={self.name: only})
        return super().create(spec)


def _respelling(breaks: str, doc: str, name: str, taken_for: TakenFor) -> type[BrokenDriver]:
    """A breaker that resolves an ID it does not list to the one ``taken_for`` takes it for."""

    class Respelling(BrokenDriver):
        __doc__ = f"{breaks}: {doc}"
        BREAKS = breaks

        def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
            index = self.device_index()
            ids = tuple(i if i in index else (taken_for(i, index) or i) for i in plan.device_ids)
            return super().resolve(dataclasses.replace(plan, device_ids=ids))

    Respelling.__name__ = Respelling.__qualname__ = name
    return Respelling


def _takes(transform: str) -> type[BrokenDriver]:
    def taken_for(device_id: str, index: Index) -> str | None:
        spelled = respellings(index, lambda known: index[known][0], TRANSFORMS[transform])
        return spelled.get(device_id)

    name = class_name(transform.replace(":", " ").replace("/", " ").replace("'s", ""))
    return _respelling(
        "GPU-VALIDATE-03",
        f"takes a spelling of an ID ({transform}) for the ID itself.",
        f"Takes{name}",
        taken_for,
    )


def _takes_a_unique_prefix_of(form: str) -> type[BrokenDriver]:
    def taken_for(device_id: str, index: Index) -> str | None:
        found = [k for k in index if k.startswith(device_id) and form_of(index[k][0], k) == form]
        return found[0] if len(found) == 1 and device_id else None

    return _respelling(
        "GPU-VALIDATE-03",
        f"takes a prefix only one {form} has for that {form}, as CUDA_VISIBLE_DEVICES does.",
        f"TakesAUniquePrefixOf{class_name(form)}",
        taken_for,
    )


def _folds_the_case_of(form: str) -> type[BrokenDriver]:
    def taken_for(device_id: str, index: Index) -> str | None:
        folded = device_id.lower()
        found = [k for k in index if k.lower() == folded and form_of(index[k][0], k) == form]
        return found[0] if found else None

    return _respelling(
        "GPU-VALIDATE-03",
        f"matches a {form} in any letter case.",
        f"FoldsTheCaseOf{class_name(form)}",
        taken_for,
    )


family(globals(), TRANSFORMS, _takes)
family(globals(), PREFIX_FORMS, _takes_a_unique_prefix_of)
family(globals(), [form for form in CASE_FORMS if form != "DRI node"], _folds_the_case_of)


def _refuses_a_pci_address_in(case: str) -> type[BrokenDriver]:
    class RefusesAPciAddress(BrokenDriver):
        __doc__ = f"GPU-VALIDATE-03: a PCI address it lists is an ID only as listed: not in {case}."
        BREAKS = "GPU-VALIDATE-03"

        def device_index(self) -> Index:
            return {
                device_id: gpus
                for device_id, gpus in super().device_index().items()
                if not is_pci_address(device_id)
                or device_id.lower() == device_id.upper()
                or device_id != pci_case(device_id, case)
            }

    RefusesAPciAddress.__name__ = RefusesAPciAddress.__qualname__ = (
        f"RefusesAPciAddressIn{class_name(case)}"
    )
    return RefusesAPciAddress


family(globals(), PCI_CASES, _refuses_a_pci_address_in)


def _takes_a_profile_as(transform: str) -> type[BrokenDriver]:
    class TakesAProfile(BrokenDriver):
        __doc__ = (
            f"MIG-PROFILE-01: a MIG profile the host lacks is served as the host's profile it "
            f"is {transform} of."
        )
        BREAKS = "MIG-PROFILE-01"

        def plan(self, request: DriverRequest) -> GpuPlan | None:
            asked = request.config.get(MIG_PROFILE_KEY)
            have = sorted({mig.profile for mig in self.host.mig_devices})
            if isinstance(asked, str) and asked not in have:
                mine = next(
                    (p for p in have if profile_near_miss(p, have, transform) == asked), None
                )
                if mine is not None:
                    config = {**request.config, MIG_PROFILE_KEY: mine}
                    request = dataclasses.replace(request, config=config)
            return super().plan(request)

    TakesAProfile.__name__ = TakesAProfile.__qualname__ = "TakesAProfileThatIs" + class_name(
        transform.replace("'s", "")
    )
    return TakesAProfile


family(globals(), PROFILE_TRANSFORMS, _takes_a_profile_as)
