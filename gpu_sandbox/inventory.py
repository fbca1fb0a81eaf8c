"""What ``gpu-sandbox gpus`` lists: the host's GPUs, each driver's IDs for them, who holds them.

The GPUs are the host layer's (``GpuHost``: NVML, else nvidia-smi, and the PCI bus for AMD
and Intel; or a simulated host), with a line per discovery source saying what it found,
and the GPUs on the PCI bus that no driver hands out. The IDs are each registered driver's
own (``Driver.device_ids_offline``: no engine is asked), and the holders come from the
host-wide lease registry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from drivers import REGISTRY, get_driver_class
from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost, HostConfig
from gpuhost.leases import PROCESS, Lease

LISTING_SESSION = "gpu-sandbox-gpus"
"""The session the listing's driver objects are made with; they create nothing."""


@dataclass(frozen=True)
class Source:
    """A discovery source and what it found: a number of GPUs, or why it found none."""

    name: str
    found: int | None
    error: str = ""

    def describe(self) -> str:
        if not self.error:
            return f"{self.name}: {self.found} found"
        return self.error if self.error.startswith(self.name) else f"{self.name}: {self.error}"


@dataclass(frozen=True)
class DriverIds:
    """One driver's exact IDs per device UUID, or why it has none to list."""

    ids: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    note: str = ""


@dataclass(frozen=True)
class Inventory:
    host: str
    simulated: bool
    sources: list[Source]
    devices: tuple[GpuDevice, ...]
    drivers: dict[str, DriverIds]
    leases: list[Lease]
    leases_error: str = ""
    unused_pci: tuple[GpuDevice, ...] = ()
    """GPUs the PCI bus shows that no driver hands out (a GPU bound to vfio-pci, a BMC's VGA)."""

    def holders(self, device: GpuDevice) -> list[Lease]:
        return [lease for lease in self.leases if lease.gpu_uuid == device.uuid]

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "simulated": self.simulated,
            "sources": [
                {"source": s.name, "gpus": s.found, "error": s.error or None} for s in self.sources
            ],
            "drivers": {name: {"note": ids.note or None} for name, ids in self.drivers.items()},
            "gpus": [
                {
                    "device": label(device),
                    "uuid": device.uuid,
                    "pci_bus_id": device.pci_bus_id,
                    "name": device.name,
                    "vendor": device.vendor,
                    "parent_uuid": device.parent_uuid,
                    "mig_profile": device.profile or None,
                    "ids": {
                        name: list(ids.ids[device.uuid])
                        for name, ids in self.drivers.items()
                        if device.uuid in ids.ids
                    },
                    "held_by": [holding(lease) for lease in self.holders(device)],
                }
                for device in self.devices
            ],
            "leases_error": self.leases_error or None,
            "unused_pci": [
                {"pci_bus_id": gpu.pci_bus_id, "vendor": gpu.vendor, "name": gpu.name}
                for gpu in self.unused_pci
            ],
        }


def take(config: HostConfig, drivers: Sequence[str] = ()) -> Inventory:
    """The inventory of the host ``config`` names (simulated, or this machine's).

    With each driver's exact IDs: those named in ``drivers`` (built-in names or import
    paths), or every built-in one.
    """
    from gpuhost.discovery import DiscoveryError

    try:
        host = GpuHost.open(config)
        opened = ""
    except DiscoveryError as exc:  # GPUs waiting for a driver: list what the bus shows
        host = _empty_host(config)
        opened = str(exc)
    if host.simulated is not None:
        sources = [Source(f"simulated host under {host.simulated.root}", len(host.devices))]
        pci: tuple[GpuDevice, ...] = ()
    else:
        sources, pci = _sources()
    try:
        leases, leases_error = host.leases.leases(), ""
    except Exception as exc:  # unreadable or corrupt: the GPUs are still worth listing
        leases, leases_error = [], f"{type(exc).__name__}: {exc}"
    buses = {device.pci_bus_id for device in host.devices}
    return Inventory(
        host=opened or host.describe(),
        simulated=host.simulated is not None,
        sources=sources,
        devices=host.devices,
        drivers={name: _driver_ids(name, host) for name in drivers or REGISTRY},
        leases=leases,
        leases_error=leases_error,
        unused_pci=tuple(gpu for gpu in pci if gpu.pci_bus_id not in buses),
    )


def label(device: GpuDevice) -> str:
    """How the listing names a device: ``3``, ``0:2`` (MIG instance 2 of GPU 0), ``amd:1``."""
    if device.is_mig:
        return f"{device.index}:{device.mig_index}"
    if device.vendor != "nvidia":
        return f"{device.vendor}:{device.index}"
    return str(device.index)


def holding(lease: Lease) -> dict[str, Any]:
    return {
        "driver": lease.driver,
        "sandbox": lease.sandbox_id,
        "session": lease.session_id,
        "holder": {"kind": lease.holder.kind, "ref": lease.holder.ref},
        "mode": lease.mode,
        "since": since(lease),
    }


def since(lease: Lease) -> str:
    return datetime.fromtimestamp(lease.acquired_at, UTC).isoformat(timespec="seconds")


def holder_text(lease: Lease) -> str:
    """A lease's holder, short: ``pid 4242``, ``docker 3f2a9c1b7d0e``."""
    if lease.holder.kind == PROCESS:
        return f"pid {lease.holder.ref.split(':')[1]}" if lease.holder.ref.count(":") == 2 else ""
    return f"{lease.holder.kind} {lease.holder.ref.rpartition(' ')[2][:12]}"


def _driver_ids(name: str, host: GpuHost) -> DriverIds:
    try:
        driver = get_driver_class(name)(host, LISTING_SESSION)
        if not driver.capabilities.exact_ids:
            return DriverIds(note="counts only: no exact device IDs")
        exact = {device.uuid for device in driver.exact_devices()}
        ids = {
            device.uuid: driver.device_ids_offline(device)
            for device in host.devices
            if device.uuid in exact
        }
    except Exception as exc:  # a driver that cannot even say: named, and the others listed
        return DriverIds(note=f"{type(exc).__name__}: {exc}")
    unnamed = [
        label(device) for device in host.devices if device.uuid in ids and not ids[device.uuid]
    ]
    note = (
        f"no exact ID found without asking its engine for {', '.join(unnamed)}" if unnamed else ""
    )
    return DriverIds(ids, note)


def _sources() -> tuple[list[Source], tuple[GpuDevice, ...]]:
    """What each discovery source finds on this machine, and the GPUs of the PCI bus."""
    from gpuhost import discovery

    sources = []
    for name, source in (("NVML", discovery.from_nvml), ("nvidia-smi", discovery.from_nvidia_smi)):
        try:
            sources.append(Source(name, len(source())))
        except discovery.DiscoveryError as exc:
            sources.append(Source(name, None, str(exc)))
    try:
        pci = discovery.pci_gpus(discovery.from_sysfs(), discovery.dri_nodes_by_pci())
    except OSError as exc:
        sources.append(Source("PCI bus (sysfs)", None, f"{type(exc).__name__}: {exc}"))
        return sources, ()
    sources.append(Source("PCI bus (sysfs)", len(pci)))
    return sources, pci


def _empty_host(config: HostConfig) -> GpuHost:
    from gpuhost.leases import LeaseRegistry

    registry = LeaseRegistry(config.state_directory() / "leases")
    return GpuHost(config=config, gpus=(), control_nodes=(), leases=registry)


def text(inventory: Inventory) -> list[str]:
    """The listing of ``gpu-sandbox gpus``: the sources, the GPUs and their holders, the IDs."""
    lines = [f"GPU host: {inventory.host}"]
    lines += [f"  {source.describe()}" for source in inventory.sources]
    if inventory.leases_error:
        lines.append(f"  lease registry: {inventory.leases_error}")
    rows = []
    for device in inventory.devices:
        held = "; ".join(
            f"{lease.driver} sandbox {lease.sandbox_id} session {lease.session_id} "
            f"{holder_text(lease)} since {since(lease)}"
            + (" (shared)" if lease.mode == "shared" else "")
            for lease in inventory.holders(device)
        )
        name = device.name if not device.is_mig else f"MIG {device.profile}"
        rows.append([label(device), device.uuid, device.pci_bus_id, name, held or "free"])
    if rows:
        lines += ["", *table(["DEVICE", "UUID", "PCI", "MODEL", "HELD BY"], rows)]
    id_rows = [
        [label(device), name, " ".join(ids.ids[device.uuid])]
        for device in inventory.devices
        for name, ids in inventory.drivers.items()
        if ids.ids.get(device.uuid)
    ]
    if id_rows:
        lines += ["", *table(["DEVICE", "DRIVER", "EXACT IDS (gpu_device_ids)"], id_rows)]
    for name, ids in inventory.drivers.items():
        if ids.note:
            lines.append(f"{name}: {ids.note}")
    for gpu in inventory.unused_pci:
        lines.append(f"on the PCI bus, handed out by no driver: {gpu.pci_bus_id} {gpu.name}")
    return lines


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Columns as wide as their widest cell, two spaces apart."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
