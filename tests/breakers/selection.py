"""Planted breakers of which GPUs a request gets: GPU-DEFAULT-02, GPU-EXACT-01, GPU-BUSY-01.

Their tests: conformance/test_selection.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from conformance.forms import EXACT_FORMS, form_of
from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost
from gpuhost.leases import Holder, LeaseOwner
from gpuhost.spec import DriverRequest, GpuPlan, SandboxSpec
from tests.breakers.base import BrokenDriver, class_name, family


class RoundRobin(BrokenDriver):
    """GPU-DEFAULT-02: defaults go round-robin with no record of which GPU is in use."""

    BREAKS = "GPU-DEFAULT-02"
    _counter = itertools.count()

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.device_ids:
            return super().allocate(sandbox_id, plan)
        inventory = self.inventory()
        return tuple(inventory[next(self._counter) % len(inventory)] for _ in range(plan.count))


class SandboxIdsPerInstance(BrokenDriver):
    """GPU-DEFAULT-02: numbers sandboxes per driver instance: ids repeat across processes."""

    BREAKS = "GPU-DEFAULT-02"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        super().__init__(host, session_id, image)
        self._ids = itertools.count(1)

    def new_sandbox_id(self) -> str:
        return f"{self.name}-{next(self._ids)}"


class WrongDeviceForExactId(BrokenDriver):
    """GPU-EXACT-01: an exact ID gets the GPU after the one it names."""

    BREAKS = "GPU-EXACT-01"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        inventory = self.inventory()
        return tuple(inventory[(gpu.index + 1) % len(inventory)] for gpu in super().resolve(plan))


class PrefersFirstBlock(BrokenDriver):
    """GPU-EXACT-01: reads the first block of driver_config, whichever driver it is for."""

    BREAKS = "GPU-EXACT-01"

    def select(self, spec: SandboxSpec) -> DriverRequest:
        if len(spec.driver_config) > 1:
            first = next(iter(spec.driver_config.values()))
            spec = dataclasses.replace(spec, driver_config={self.name: first})
        return super().select(spec)


class SecondIdLowestFree(BrokenDriver):
    """GPU-EXACT-01: of two exact IDs, serves the first and the lowest free GPU for the second."""

    BREAKS = "GPU-EXACT-01"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        gpus = super().resolve(plan)
        if len(gpus) != 2:
            return gpus
        free = [gpu for gpu in self.host.leases.free(self.inventory()) if gpu != gpus[0]]
        return (gpus[0], free[0]) if free else gpus


class SharesBusyGpu(BrokenDriver):
    """GPU-BUSY-01: exact IDs bypass the lease registry, so a held GPU is handed out again."""

    BREAKS = "GPU-BUSY-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return plan.gpus if plan.device_ids else super().allocate(sandbox_id, plan)


class GrantsTheFreeOnes(BrokenDriver):
    """GPU-BUSY-01: exact devices, some busy: the free ones are granted, the busy ones dropped."""

    BREAKS = "GPU-BUSY-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if len(plan.device_ids) < 2:
            return super().allocate(sandbox_id, plan)
        held = {lease.gpu_uuid for lease in self.host.leases.leases()}
        wanted = [gpu for gpu in self.resolve(plan) if gpu.uuid not in held]
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        return self.host.leases.acquire(self.inventory(), owner, exact=wanted or ())


class CdiIndexFromOne(BrokenDriver):
    """GPU-EXACT-01: a GPU's CDI name by index counts from 1, consistently with itself."""

    BREAKS = "GPU-EXACT-01"

    def device_ids(self, gpu: GpuDevice) -> tuple[str, ...]:
        if gpu.is_mig or gpu.vendor != "nvidia":
            return super().device_ids(gpu)
        return (str(gpu.index), gpu.uuid, f"{gpu.cdi_kind}={gpu.index + 1}", gpu.cdi_names[1])


def _misroutes(form: str) -> type[BrokenDriver]:
    class Misroutes(BrokenDriver):
        __doc__ = f"GPU-EXACT-01: a GPU named by its {form} gets the GPU after it."
        BREAKS = "GPU-EXACT-01"

        def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
            inventory = self.inventory()
            gpus = super().resolve(plan)
            return tuple(
                inventory[(inventory.index(gpu) + 1) % len(inventory)]
                if gpu in inventory and form_of(gpu, device_id) == form
                else gpu
                for device_id, gpu in zip(plan.device_ids, gpus, strict=True)
            )

    Misroutes.__name__ = Misroutes.__qualname__ = f"Misroutes{class_name(form)}"
    return Misroutes


family(globals(), [form for form in EXACT_FORMS if form != "PCI address"], _misroutes)
