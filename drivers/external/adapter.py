"""What the two external adapters share: a ``Driver`` made of one manifest.

Its capabilities, the environment its driver runs with, the GPUs it takes (declared by the
driver's inventory, else by the manifest's vendors, MIG and ID forms) and their IDs, whose
allocation it is (``allocation: host-registry`` leases here; otherwise the driver chooses),
and ``reap`` until the driver lists nothing of the session. How the driver is asked is a
sibling's: argv templates (``drivers.external.driver``) or one long-lived process speaking
JSON lines (``drivers.external.jsonl``).
"""

from __future__ import annotations

import functools
import time
from abc import abstractmethod
from collections.abc import Mapping
from typing import ClassVar

from drivers.base import Driver
from drivers.external.manifest import Manifest
from drivers.external.process import ExternalDriverError, command_env
from gpuhost.devices import GpuDevice
from gpuhost.idforms import ids_of
from gpuhost.spec import DRIVER_SCHEDULER, HOST_REGISTRY, DriverCapabilities, GpuPlan

REAP_POLL_S = 0.2


class ExternalDriver(Driver):
    """A driver judged through its manifest (``exec:PATH``): each class is one manifest."""

    manifest: ClassVar[Manifest]

    # -- what the manifest declares ----------------------------------------------------

    @property
    def capabilities(self) -> DriverCapabilities:
        caps = self.manifest.capabilities
        most = caps["maxGpusPerSandbox"]
        forms = caps.get("idForms", ())
        return DriverCapabilities(
            max_gpus_per_sandbox=max(1, len(self.exact_devices())) if most == "all" else most,
            exact_ids=caps["exactIds"],
            id_forms=tuple(forms),
            exclusive=caps.get("exclusive", True),
            shared=caps.get("shared", False),
            mig_profiles=caps.get("mig", False),
            vendors=tuple(caps.get("vendors", ("nvidia",))),
            config_keys=tuple(self.manifest.driver_config),
            allocated_by=HOST_REGISTRY if self.manifest.host_registry else DRIVER_SCHEDULER,
        )

    @functools.cached_property
    def env(self) -> dict[str, str]:
        """What the driver runs with: the host's PATH and LANG, the manifest's passEnv."""
        return command_env(self.manifest.pass_env)

    # -- the devices -------------------------------------------------------------------

    def declared(self) -> Mapping[str, tuple[str, ...]] | None:
        """The GPUs the driver says it could give (UUID: its IDs), or None (not declared).

        Asked once per driver object; a UUID this host lacks is an ``ExternalDriverError``.
        """
        if not self.manifest.inventory:
            return None
        cached: Mapping[str, tuple[str, ...]] | None = getattr(self, "_declared", None)
        if cached is None:
            cached = self._declared = self.ask_inventory()
            unknown = sorted(set(cached) - {gpu.uuid for gpu in self.host.devices})
            if unknown:
                raise ExternalDriverError(
                    f"{self.name} inventory: GPUs this host lacks: {', '.join(unknown)}"
                )
        return cached

    @abstractmethod
    def ask_inventory(self) -> dict[str, tuple[str, ...]]:
        """The driver's inventory: each GPU's UUID, with the IDs the driver names it by."""

    def _takes(self, gpu: GpuDevice) -> bool:
        declared = self.declared()
        if declared is not None:
            return gpu.uuid in declared
        caps = self.manifest.capabilities
        if gpu.vendor not in caps.get("vendors", ("nvidia",)):
            return False
        if gpu.is_mig and not caps.get("mig", False):
            return False
        return not self.manifest.host_registry or bool(self.device_ids(gpu))

    def inventory(self) -> tuple[GpuDevice, ...]:
        return tuple(gpu for gpu in self.host.default_devices if self._takes(gpu))

    def exact_devices(self) -> tuple[GpuDevice, ...]:
        return tuple(gpu for gpu in self.host.devices if self._takes(gpu))

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return tuple(
            gpu for gpu in self.host.pool(plan.vendor, plan.mig_profile) if self._takes(gpu)
        )

    def device_ids(self, gpu: GpuDevice) -> tuple[str, ...]:
        declared = self.declared()
        if declared is not None:
            return declared.get(gpu.uuid, ())
        # The table in the manifest's forms (not capabilities': its count asks for the IDs).
        return ids_of(gpu, self.manifest.capabilities.get("idForms", ()))

    # -- the session's end ---------------------------------------------------------------

    def remove_session(self, session_id: str) -> list[str]:
        found = left = self.sandboxes(session_id)
        deadline = time.monotonic() + self.manifest.timeouts["reap"]
        # Again until list shows none: a CLI may remove only some at a time (podman 4.3's
        # `rm --filter` does), or they may take a while to go.
        while left and time.monotonic() < deadline:
            self.reap_once(session_id)
            left = self.sandboxes(session_id)
            if left:
                time.sleep(REAP_POLL_S)
        if left:
            raise ExternalDriverError(
                f"{self.name} reap of session {session_id} left sandboxes {left}: list still "
                f"shows them after {self.manifest.timeouts['reap']:g} s"
            )
        return found

    @abstractmethod
    def reap_once(self, session_id: str) -> None:
        """Ask the driver once to remove everything of ``session_id``."""
