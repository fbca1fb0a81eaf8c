"""Handing a GPU to a VM with VFIO: its IOMMU group bound to vfio-pci, and given back.

A PCI device passes through to a QEMU guest (``-device vfio-pci,host=<BDF>``) only when
every function of its IOMMU group (a GPU's audio function, say) is bound to ``vfio-pci``
or to no driver. ``VfioBinder.claim`` binds them, the kernel's way:

1. ``driver_override`` set to ``vfio-pci`` (so that no other driver takes the function back),
2. the function unbound from its driver (``drivers/<driver>/unbind``),
3. bound to vfio-pci (``drivers/vfio-pci/bind``), and waited for until its ``driver`` link
   names vfio-pci;

It takes a function from the driver it has only where it was asked to (``rebind``; by
default only groups already bound to vfio-pci, or to no driver, are claimed), takes a GPU
only from the nvidia driver, and never an NVIDIA GPU whose device node a process holds
open: a GPU serving the nvidia driver may be in use by a persistence daemon, another job or
a display, and its unbind can block in the kernel. Every refusal is ``VfioRefused``, raised
before anything is written.

``bus_gpus`` finds the NVIDIA GPUs on the PCI bus, whichever driver they are bound to, with
their IOMMU groups: NVML and nvidia-smi do not list a GPU bound to vfio-pci. Such a GPU has
no UUID the host can tell (the UUID is read from the GPU by the NVIDIA driver), except one
this binder took from the nvidia driver: its record keeps the UUID the driver gave it.

``release`` undoes it: ``driver_override`` cleared, unbound from vfio-pci, bound to the
driver it had. What a claim changed is written to the state directory *before* it changes
it (one JSON file per IOMMU group, naming the sandbox and the process that holds it), so a
run that crashed leaves a record: ``reconcile`` restores every group whose holder is gone.
Claims, releases and reconciles of one host exclude each other with a lock in the state
directory.

Everything works on a sysfs root given as a parameter (``/sys`` on a real host), so the
tests run it on trees they construct.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuhost import strict
from gpuhost.discovery import parse_proc_driver_information
from gpuhost.leases import Holder, liveness_check
from gpuhost.pci import from_sysfs, gpu_pci_devices, iommu_groups
from gpuhost.strict import Kind, MapOf
from gpuhost.wait import wait_for

VFIO_DRIVER = "vfio-pci"
NVIDIA_DRIVER = "nvidia"
REBIND_ENV = "GPU_SANDBOX_VM_REBIND"
"""Set to 1 to let the vm driver take GPUs from the nvidia driver (those no process uses)."""
BIND_TIMEOUT_S = 10.0
"""Binding is synchronous in the kernel; a GPU driver's unbind can take a second or two
(it waits for the GPU to idle). Ten seconds means something holds the device."""


class VfioError(RuntimeError):
    """A device could not be bound to vfio-pci or given back; the message says which step."""


class VfioRefused(VfioError):
    """A group the binder will not take from its driver: not asked to, or a GPU in use."""


class VfioRecordCorrupt(strict.InvalidFile, VfioError):
    """A claim's record that cannot be read as this binder writes it: ``field`` is where."""


RECORD: dict[str, Kind] = {
    "sandbox": str,
    "holder": {"kind": str, "ref": str},
    "functions": MapOf((str, type(None))),
    "uuids": MapOf(str),
}
"""A claim's record (``<state>/vfio/<group>.json``): what ``VfioBinder._write`` writes."""


@dataclass(frozen=True)
class BusGpu:
    """An NVIDIA GPU on the PCI bus, as passthrough sees it: its IOMMU group and drivers."""

    bus: str
    """Its PCI address, ``0000:2a:00.0``: the ID that names it whichever driver has it."""
    group: str
    """Its IOMMU group; empty when it is in none (the IOMMU is off)."""
    functions: dict[str, str | None]
    """Every function of its group (itself included) → the driver bound to it (None: none)."""
    uuid: str | None = None
    """The UUID the nvidia driver gave it, where this binder recorded it when taking it."""

    @property
    def driver(self) -> str | None:
        return self.functions.get(self.bus)

    @property
    def passes_through(self) -> bool:
        """Whether a VM can be given it as it is: its whole group bound to vfio-pci or none."""
        return bool(self.group) and all(d in (None, VFIO_DRIVER) for d in self.functions.values())

    def describe(self) -> str:
        """``0000:2a:00.0 bound to nvidia``, and what else of its group keeps it from a VM."""
        text = f"{self.bus} bound to {self.driver or 'no driver'}"
        if not self.group:
            return f"{text}, in no IOMMU group"
        others = [
            f"{fn} bound to {driver}"
            for fn, driver in self.functions.items()
            if fn != self.bus and driver not in (None, VFIO_DRIVER)
        ]
        return f"{text} (IOMMU group {self.group} also: {', '.join(others)})" if others else text


@dataclass(frozen=True)
class VfioClaim:
    """An IOMMU group bound to vfio-pci for one sandbox."""

    group: str
    functions: dict[str, str | None]
    """Every function of the group → the driver it had before (None: none)."""
    device: Path
    """``/dev/vfio/<group>``, which QEMU opens."""


class VfioBinder:
    """Binds IOMMU groups to vfio-pci under ``sysfs`` and records it under ``state_dir``."""

    def __init__(
        self,
        state_dir: Path,
        sysfs: Path = Path("/sys"),
        dev: Path = Path("/dev"),
        *,
        rebind: bool = False,
        proc: Path = Path("/proc"),
    ) -> None:
        self.sysfs = sysfs
        self.dev = dev
        self.proc = proc
        self.rebind = rebind
        """Whether a function bound to another driver (nvidia) may be taken from it."""
        self.records = state_dir / "vfio"

    # -- reading sysfs ----------------------------------------------------------------

    def _device(self, bdf: str) -> Path:
        return self.sysfs / "bus" / "pci" / "devices" / bdf

    def _driver_dir(self, driver: str) -> Path:
        return self.sysfs / "bus" / "pci" / "drivers" / driver

    def group_of(self, bdf: str) -> str:
        """The IOMMU group of a PCI function; VfioError when it has none (no IOMMU)."""
        link = self._device(bdf) / "iommu_group"
        if not self._device(bdf).exists():
            raise VfioError(f"no PCI device {bdf} under {self.sysfs}/bus/pci/devices")
        if not link.is_symlink():
            raise VfioError(
                f"{bdf} is in no IOMMU group ({link} is missing): enable the IOMMU "
                "(intel_iommu=on or amd_iommu=on on the kernel command line) for VFIO"
            )
        return Path(os.readlink(link)).name

    def group_functions(self, group: str) -> list[str]:
        """Every PCI function of an IOMMU group, in address order."""
        return sorted(
            p.name for p in (self.sysfs / "kernel" / "iommu_groups" / group / "devices").iterdir()
        )

    def bus_gpus(self) -> list[BusGpu]:
        """The NVIDIA GPUs on the PCI bus in address order, whichever driver has them."""
        devices = from_sysfs(self.sysfs / "bus" / "pci" / "devices")
        groups = iommu_groups(devices)
        uuids = self.recorded_uuids()
        return [
            BusGpu(
                gpu.slot,
                gpu.iommu_group,
                {fn.slot: fn.driver or None for fn in groups.get(gpu.iommu_group, (gpu,))},
                uuids.get(gpu.slot),
            )
            for gpu in gpu_pci_devices(devices)
            if gpu.vendor == "nvidia"
        ]

    def driver_of(self, bdf: str) -> str | None:
        # Read the link once: a driver being unbound or bound removes it at any moment.
        try:
            return Path(os.readlink(self._device(bdf) / "driver")).name
        except OSError:
            return None

    # -- claiming and giving back ---------------------------------------------------------

    def claim(self, bdf: str, sandbox_id: str, holder: Holder) -> VfioClaim:
        """Bind ``bdf``'s whole IOMMU group to vfio-pci for ``sandbox_id``, held by ``holder``."""
        group = self.group_of(bdf)
        functions = {fn: self.driver_of(fn) for fn in self.group_functions(group)}
        self._may_take(bdf, group, functions)
        with self._locked():
            record = self._record(group)
            if record.exists():
                previous = self._read(record)
                raise VfioError(
                    f"IOMMU group {group} of {bdf} is bound for sandbox {previous['sandbox']} "
                    f"(record {record})"
                )
            self._write(record, sandbox_id, holder, functions, self._uuids(functions))
            try:
                for fn in functions:
                    self._bind(fn, VFIO_DRIVER)
            except BaseException:
                self._restore(functions)
                record.unlink(missing_ok=True)
                raise
        return VfioClaim(group, functions, self.dev / "vfio" / group)

    def _may_take(self, bdf: str, group: str, functions: dict[str, str | None]) -> None:
        """Refuse, before any write, a group this binder was not asked to take, or in use."""
        bound = {
            fn: driver for fn, driver in functions.items() if driver not in (None, VFIO_DRIVER)
        }
        if bound.get(bdf, NVIDIA_DRIVER) != NVIDIA_DRIVER:
            raise VfioRefused(
                f"{bdf} (IOMMU group {group}) is bound to {bound[bdf]}; a GPU is taken only "
                f"from the {NVIDIA_DRIVER} driver, or bound to {VFIO_DRIVER} beforehand"
            )
        if bound and not self.rebind:
            drivers = ", ".join(f"{fn} to {driver}" for fn, driver in bound.items())
            raise VfioRefused(
                f"IOMMU group {group} of {bdf} is bound to other drivers ({drivers}); only "
                f"groups bound to {VFIO_DRIVER} are taken, unless rebinding is asked for "
                f"(--vm-rebind-gpus, or {REBIND_ENV}=1)"
            )
        for fn, driver in bound.items():
            if driver == NVIDIA_DRIVER:
                node, users = self.users_of_nvidia_gpu(fn)
                if users:
                    raise VfioRefused(
                        f"{fn} (IOMMU group {group}) is in use: {node} is open in "
                        f"{', '.join(users)}; it is left bound to nvidia"
                    )

    def users_of_nvidia_gpu(self, bdf: str) -> tuple[str, list[str]]:
        """The device node of an NVIDIA GPU bound to nvidia, and the processes holding it.

        Each as ``pid <pid> (<command>)``. A GPU whose node cannot be told is refused.
        """
        information = self._nvidia_information(bdf)
        try:
            lines = information.read_text().splitlines()
            minor = next(line.split(":")[1].strip() for line in lines if "Device Minor" in line)
        except (OSError, StopIteration, IndexError) as exc:
            raise VfioRefused(
                f"cannot tell whether {bdf} is in use (no device minor in {information}: "
                f"{exc}); it is left bound to nvidia"
            ) from None
        node = str(self.dev / f"nvidia{minor}")
        users = []
        for fd_dir in self.proc.glob("[0-9]*/fd"):
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) == node for fd in fd_dir.iterdir()):
                    command = (fd_dir.parent / "comm").read_text().strip()
                    users.append(f"pid {fd_dir.parent.name} ({command})")
        return node, sorted(users)

    def _uuids(self, functions: dict[str, str | None]) -> dict[str, str]:
        """The UUIDs the nvidia driver gives the functions it has, to keep while they are VFIO's."""
        uuids = {}
        for fn, driver in functions.items():
            if driver == NVIDIA_DRIVER:
                with contextlib.suppress(OSError):
                    text = self._nvidia_information(fn).read_text()
                    if uuid := parse_proc_driver_information(text).get("GPU UUID"):
                        uuids[fn] = uuid
        return uuids

    def _nvidia_information(self, bdf: str) -> Path:
        return self.proc / "driver" / "nvidia" / "gpus" / bdf / "information"

    def recorded_uuids(self) -> dict[str, str]:
        """PCI address → UUID, of the GPUs that claims took from the nvidia driver."""
        uuids: dict[str, str] = {}
        for record in sorted(self.records.glob("*.json")):
            with contextlib.suppress(VfioRecordCorrupt):
                uuids.update(self._read(record)["uuids"])
        return uuids

    def set_holder(self, claim: VfioClaim, sandbox_id: str, holder: Holder) -> None:
        """Record the process that now holds the group (the VM, once it runs)."""
        with self._locked():
            record = self._record(claim.group)
            uuids = self._read(record)["uuids"]
            self._write(record, sandbox_id, holder, claim.functions, uuids)

    def release(self, group: str) -> None:
        """Give every function of ``group`` back to the driver it had; forget the record."""
        with self._locked():
            self._release(group)

    def reconcile(self) -> list[str]:
        """Give back the groups whose holders are gone (a run that crashed); returns them."""
        restored = []
        with self._locked():
            for record in sorted(self.records.glob("*.json")):
                holder = Holder(**self._read(record)["holder"])
                check = liveness_check(holder.kind)
                if check is not None and not check(holder):
                    self._release(record.stem)
                    restored.append(record.stem)
        return restored

    def claims(self) -> dict[str, str]:
        """IOMMU group → the sandbox it is bound for, as recorded."""
        if not self.records.is_dir():
            return {}
        return {
            record.stem: self._read(record)["sandbox"] for record in self.records.glob("*.json")
        }

    def _release(self, group: str) -> None:
        record = self._record(group)
        if not record.exists():
            return
        functions: dict[str, str | None] = self._read(record)["functions"]
        self._restore(functions)
        record.unlink()

    def _restore(self, functions: dict[str, str | None]) -> None:
        for fn, original in functions.items():
            self._bind(fn, original)

    def _bind(self, bdf: str, driver: str | None) -> None:
        """Move ``bdf`` to ``driver`` (None: no driver), as the kernel wants it done."""
        current = self.driver_of(bdf)
        if current == driver:
            self._write_attribute(self._device(bdf) / "driver_override", _override(driver))
            return
        self._write_attribute(self._device(bdf) / "driver_override", _override(driver))
        if current is not None:
            self._write_attribute(self._driver_dir(current) / "unbind", bdf)
            self._wait_for_driver(bdf, None)
        if driver is not None:
            self._write_attribute(self._driver_dir(driver) / "bind", bdf)
            self._wait_for_driver(bdf, driver)

    def _wait_for_driver(self, bdf: str, driver: str | None) -> None:
        wait_for(
            lambda: self.driver_of(bdf),
            lambda current: current == driver,
            timeout_s=BIND_TIMEOUT_S,
            what=f"{bdf} to be bound to {driver or 'no driver'}",
            hint=f"see `dmesg` and {self._device(bdf)}/driver",
        )

    def _write_attribute(self, path: Path, value: str) -> None:
        try:
            with open(path, "w") as attribute:
                attribute.write(value + "\n")
        except OSError as exc:
            raise VfioError(f"cannot write {value!r} to {path}: {exc}") from exc

    # -- the records ---------------------------------------------------------------------

    def _record(self, group: str) -> Path:
        return self.records / f"{group}.json"

    def _read(self, record: Path) -> dict[str, Any]:
        """A claim's record, as ``_write`` wrote it; else ``VfioRecordCorrupt`` naming the field."""
        return strict.read_record(record, RECORD, VfioRecordCorrupt)

    def _write(
        self,
        record: Path,
        sandbox_id: str,
        holder: Holder,
        functions: dict[str, str | None],
        uuids: dict[str, str],
    ) -> None:
        data = {
            "sandbox": sandbox_id,
            "holder": {"kind": holder.kind, "ref": holder.ref},
            "functions": functions,
            "uuids": uuids,
        }
        partial = record.with_suffix(".tmp")
        partial.write_text(json.dumps(data))
        partial.rename(record)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.records.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.records / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def _override(driver: str | None) -> str:
    """What ``driver_override`` gets: the driver to bind, or empty to clear it."""
    return driver if driver == VFIO_DRIVER else ""
