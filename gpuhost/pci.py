"""GPUs of any vendor on the PCI bus (sysfs), with their IOMMU groups and DRI nodes.

The PCI bus knows every GPU, whichever driver it is bound to: one bound to ``vfio-pci``
for passthrough, which NVML and ``nvidia-smi`` do not list, too. Everything reads a sysfs
root given as a parameter, so that the tests run it on trees they construct.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Final

from gpuhost.devices import DeviceNode, GpuDevice, normalize_pci_bus_id, sorted_by_pci

GPU_PCI_CLASSES: Final = {
    "0300": "VGA compatible controller",
    "0302": "3D controller",
    "0380": "Display controller",
}
"""Data-centre GPUs are 3D controllers, and a secondary GPU is often a Display controller:
a filter on "VGA compatible controller" alone misses them."""
PCI_VENDORS: Final = {"10de": "nvidia", "1002": "amd", "8086": "intel"}
SYSFS_PCI_DEVICES: Final = Path("/sys/bus/pci/devices")
DRI_BY_PATH: Final = Path("/dev/dri/by-path")
PASSTHROUGH_DRIVERS: Final = frozenset({"vfio-pci", "nvgrace-gpu-vfio-pci", "pci-stub"})


@dataclass(frozen=True)
class PciDevice:
    """One PCI function; ids are lower-case hex without ``0x``, names empty when unknown."""

    slot: str
    class_code: str
    class_name: str
    vendor_id: str
    vendor_name: str
    device_id: str
    device_name: str
    driver: str = ""
    """The kernel driver bound to it (sysfs, or ``lspci -k``); empty when none or unknown."""
    iommu_group: str = ""
    """Its IOMMU group (sysfs only); empty when the IOMMU is off or it is not known."""

    @property
    def vendor(self) -> str:
        """``nvidia``, ``amd``, ``intel`` or ``other``."""
        return PCI_VENDORS.get(self.vendor_id, "other")


def gpu_pci_devices(devices: Iterable[PciDevice]) -> list[PciDevice]:
    return [device for device in devices if device.class_code in GPU_PCI_CLASSES]


def from_sysfs(root: Path = SYSFS_PCI_DEVICES) -> list[PciDevice]:
    """The PCI devices under ``root`` in slot order; sysfs has ids but no names.

    ``class_name`` is filled in for the GPU classes only; ``driver`` and ``iommu_group`` are
    the names their links point to. A missing ``root`` gives [].
    """
    if not root.is_dir():
        return []
    devices = []
    for path in sorted(root.iterdir()):
        class_code = (path / "class").read_text().strip().removeprefix("0x")[:4].lower()
        devices.append(
            PciDevice(
                slot=normalize_pci_bus_id(path.name),
                class_code=class_code,
                class_name=GPU_PCI_CLASSES.get(class_code, ""),
                vendor_id=(path / "vendor").read_text().strip().removeprefix("0x").lower(),
                vendor_name="",
                device_id=(path / "device").read_text().strip().removeprefix("0x").lower(),
                device_name="",
                driver=_link_name(path / "driver"),
                iommu_group=_link_name(path / "iommu_group"),
            )
        )
    return devices


def _link_name(link: Path) -> str:
    """The last part of where ``link`` points; empty where there is no link."""
    # Read once: a driver's link goes away at any moment while it unbinds.
    try:
        return PurePosixPath(os.readlink(link)).name
    except OSError:
        return ""


def iommu_groups(devices: Iterable[PciDevice]) -> dict[str, tuple[PciDevice, ...]]:
    """IOMMU group → its functions, in slot order: what passes to a VM together."""
    groups: dict[str, list[PciDevice]] = {}
    for device in devices:
        if device.iommu_group:
            groups.setdefault(device.iommu_group, []).append(device)
    return {group: tuple(members) for group, members in groups.items()}


_BY_PATH_NAME = re.compile(r"^pci-(?P<bus>[0-9a-fA-F:.]+)-(?P<kind>card|render)$")


def dri_nodes_by_pci(by_path: Path = DRI_BY_PATH) -> dict[str, tuple[DeviceNode, ...]]:
    """PCI bus id to the DRI nodes (``cardN``, ``renderDN``) its by-path links resolve to.

    Major and minor come from ``stat`` of the resolved node. A missing ``by_path`` gives {}.
    """
    if not by_path.is_dir():
        return {}
    nodes: dict[str, list[DeviceNode]] = {}
    for link in sorted(by_path.iterdir()):
        match = _BY_PATH_NAME.match(link.name)
        if not match:
            continue  # e.g. platform-simple-framebuffer.0-card
        target = link.resolve()
        rdev = target.stat().st_rdev
        node = DeviceNode(str(target), os.major(rdev), os.minor(rdev))
        nodes.setdefault(normalize_pci_bus_id(match["bus"]), []).append(node)
    return {bus: tuple(sorted(bus_nodes)) for bus, bus_nodes in nodes.items()}


def pci_gpus(
    pci_devices: Iterable[PciDevice],
    dri_nodes: Mapping[str, tuple[DeviceNode, ...]],
    *,
    vendor: str | None = None,
) -> tuple[GpuDevice, ...]:
    """GPUs of every vendor from the PCI bus, numbered in PCI bus order.

    PCI knows no vendor UUID, so ``uuid`` is the synthetic, stable ``PCI-<bus id>`` (for
    example ``PCI-0000:03:00.0``). ``nodes`` are the DRI nodes, except for NVIDIA GPUs,
    which containers get as ``/dev/nvidia<minor>``: that minor comes from NVML, nvidia-smi
    or /proc/driver/nvidia, not from PCI. ``vendor`` (``nvidia``, ``amd``, ``intel`` or
    ``other``) keeps one vendor's GPUs and numbers them alone, as that vendor's tools do;
    otherwise a server's BMC VGA (``other``) takes an index too.
    """
    gpus = []
    for device in gpu_pci_devices(pci_devices):
        device_vendor = device.vendor
        if vendor is not None and device_vendor != vendor:
            continue
        gpus.append(
            GpuDevice(
                index=0,  # numbered by sorted_by_pci
                uuid=f"PCI-{device.slot}",
                name=device.device_name or f"{device.vendor_id}:{device.device_id}",
                pci_bus_id=device.slot,
                vendor=device_vendor,
                nodes=() if device_vendor == "nvidia" else dri_nodes.get(device.slot, ()),
            )
        )
    return sorted_by_pci(gpus)


def discover_dri(
    sysfs_root: Path = SYSFS_PCI_DEVICES, by_path: Path = DRI_BY_PATH, kfd: Path = Path("/dev/kfd")
) -> tuple[GpuDevice, ...]:
    """The AMD and Intel GPUs of the PCI bus with their DRI nodes, in PCI order.

    Each vendor's are numbered from 0, as its tools number them. An AMD GPU's nodes
    include /dev/kfd, the compute interface every AMD GPU shares.
    """
    dri = dri_nodes_by_pci(by_path)
    kfd_nodes: tuple[DeviceNode, ...] = ()
    with contextlib.suppress(OSError):
        rdev = kfd.stat().st_rdev
        kfd_nodes = (DeviceNode(str(kfd), os.major(rdev), os.minor(rdev)),)
    devices = from_sysfs(sysfs_root)
    found = []
    for vendor in ("amd", "intel"):
        for gpu in pci_gpus(devices, dri, vendor=vendor):
            if gpu.nodes:  # a GPU without a loaded driver has no nodes to hand out
                extra = kfd_nodes if vendor == "amd" else ()
                found.append(replace(gpu, nodes=gpu.nodes + extra))
    return tuple(sorted(found, key=lambda gpu: gpu.pci_bus_id))
