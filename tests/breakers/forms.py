"""Planted breakers of the forms of a name: GPU-VALIDATE-03's near misses, MIG-PROFILE-01's.

Each generated (``family``), one per value of a dimension conformance/forms.py enumerates and
conformance/test_validation.py tries: each near miss of an ID (``TRANSFORMS``: letter case,
prefixes, other CDI kinds, node paths, an index as ``int()`` reads it, a PCI address in
another tool's form, a UUID spelled otherwise), each form whose prefix or letter case a
driver could take, each letter case of a PCI address, each near miss of a MIG profile.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

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
from gpuhost.devices import GpuDevice
from gpuhost.spec import MIG_PROFILE_KEY, DriverRequest, GpuPlan
from tests.breakers.base import BrokenDriver, class_name, family

Index = dict[str, tuple[GpuDevice, ...]]
TakenFor = Callable[[str, Index], str | None]
"""The ID a spelling the driver does not list is taken for, if any."""


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

    name = class_name(re.sub(r"'s\b|[^A-Za-z0-9 .=_-]", " ", transform))
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
