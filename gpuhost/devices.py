"""The one inventory type every discovery source produces."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace

from gpuhost import strict

NVIDIA_MAJOR = 195
"""Character-device major of /dev/nvidia<minor> and /dev/nvidiactl (minor 255)."""
DRM_MAJOR = 226
"""/dev/dri/card<N> and renderD<N>: AMD, Intel and NVIDIA display GPUs."""
SIMULATED_NVIDIA_MAJOR = 120
"""A simulated host's GPU nodes and nvidiactl. 120 to 127 are kept for local use by the
kernel's list of devices: no driver registers them, so a simulated node opens nothing on
any host, whatever GPU drivers it has loaded (ENXIO, as a host whose driver is unloaded)."""
SIMULATED_DRM_MAJOR = 124
"""A simulated host's DRI card and render nodes (see ``SIMULATED_NVIDIA_MAJOR``)."""
NVIDIA_GPU_MAJORS = frozenset({NVIDIA_MAJOR, SIMULATED_NVIDIA_MAJOR})
"""The majors a sandbox's NVIDIA GPU nodes have: a real host's, or a simulated one's."""
DRM_MAJORS = frozenset({DRM_MAJOR, SIMULATED_DRM_MAJOR})
NVIDIACTL_MINOR = 255
CDI_KIND = "nvidia.com/gpu"
"""The CDI kind of NVIDIA GPUs (``nvidia-ctk cdi generate``); each simulated host has its own."""

_BUS_ID = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{4,8}):)?(?P<bus>[0-9a-fA-F]{2}):(?P<dev>[0-9a-fA-F]{2})\.(?P<fn>[0-7])$"
)


def normalize_pci_bus_id(bus_id: str) -> str:
    """Return the sysfs form ``0000:18:00.0`` of a PCI address.

    nvidia-smi and NVML print an 8-digit domain (``00000000:18:00.0``), lspci without -D
    none at all; sysfs, CDI specs and the vm driver use four lower-case digits.
    """
    match = _BUS_ID.match(bus_id.strip())
    if not match:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain = int(match["domain"] or "0", 16)
    return f"{domain:04x}:{match['bus'].lower()}:{match['dev'].lower()}.{match['fn']}"


def pci_spellings(device_id: str) -> tuple[str, ...]:
    """The spellings that name what ``device_id`` names: itself, and a PCI address's other case.

    A PCI address is one ID in either letter case: the kernel writes its hex digits in lower
    case (``0000:c1:00.0``), NVML in upper case (``0000:C1:00.0``). Any other ID is spelled
    one way only, and so is a PCI address in another form (another domain width, none).
    """
    if not _BUS_ID.fullmatch(device_id):
        return (device_id,)
    return tuple(dict.fromkeys((device_id, device_id.lower(), device_id.upper())))


@dataclass(frozen=True, order=True)
class DeviceNode:
    """A character device that carries a GPU into a sandbox.

    ``path`` is where the node appears inside a sandbox; ``host_path`` is where it lives on
    the host when that differs (a simulated host keeps its nodes under its own directory).
    """

    path: str
    major: int
    minor: int
    host_path: str | None = None

    @property
    def source(self) -> str:
        return self.host_path or self.path


@dataclass(frozen=True)
class GpuDevice:
    """One GPU a driver can hand out.

    ``index`` is the host's index in PCI bus order (what nvidia-smi prints on the host);
    inside a sandbox GPUs are renumbered, so tests compare ``uuid``, never ``index``.
    """

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    memory_mib: int | None = None
    vendor: str = "nvidia"
    minor: int | None = None
    nodes: tuple[DeviceNode, ...] = field(default=())
    cdi_kind: str = CDI_KIND
    parent_uuid: str | None = None
    """A MIG instance's GPU; ``index`` is then that GPU's index."""
    mig_index: int | None = None
    """A MIG instance's number among its GPU's instances, as nvidia-smi -L and CDI count."""
    profile: str = ""
    """A MIG instance's profile, e.g. ``1g.10gb``."""
    mig_enabled: bool = False
    """A GPU in MIG mode: counts hand out its instances, not the GPU whole."""

    @property
    def is_mig(self) -> bool:
        return self.parent_uuid is not None

    @property
    def dri_paths(self) -> tuple[str, ...]:
        """The paths of its DRI nodes (``/dev/dri/card1``, ``/dev/dri/renderD129``), if any."""
        return tuple(node.path for node in self.nodes if "/dri/" in node.path)

    @property
    def cdi_names(self) -> tuple[str, ...]:
        """The CDI device names an nvidia-ctk spec gives this device: by index and by UUID.

        A MIG instance's index is ``<gpu>:<instance>``; GPUs of other vendors have none.
        """
        if self.vendor != "nvidia":
            return ()
        index = f"{self.index}:{self.mig_index}" if self.is_mig else str(self.index)
        return (f"{self.cdi_kind}={index}", f"{self.cdi_kind}={self.uuid}")

    def describe(self) -> str:
        if self.is_mig:
            return f"MIG {self.profile} device {self.mig_index} of GPU {self.index} ({self.uuid})"
        if self.vendor != "nvidia":
            return f"{self.vendor} GPU {self.index} ({self.uuid}, {self.pci_bus_id})"
        return f"GPU {self.index} ({self.uuid}, {self.pci_bus_id})"


def sorted_by_pci(gpus: list[GpuDevice]) -> tuple[GpuDevice, ...]:
    """Order GPUs by PCI bus id and renumber them from 0, as nvidia-smi does."""
    ordered = sorted(gpus, key=lambda gpu: gpu.pci_bus_id)
    return tuple(replace(gpu, index=i) for i, gpu in enumerate(ordered))


def gpus_to_json(gpus: tuple[GpuDevice, ...] | list[GpuDevice]) -> str:
    """Whole NVIDIA GPUs as a JSON list, each with its device node's minor.

    What a cluster node publishes of its GPUs; ``gpus_from_json`` reads it back.
    """
    return json.dumps(
        [
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "pci_bus_id": gpu.pci_bus_id,
                "memory_mib": gpu.memory_mib,
                "minor": gpu.minor,
                "major": gpu.nodes[0].major if gpu.nodes else NVIDIA_MAJOR,
            }
            for gpu in gpus
        ]
    )


def gpus_from_json(text: str) -> tuple[GpuDevice, ...]:
    """The GPUs of ``gpus_to_json``, each with its ``/dev/nvidia<minor>`` node."""
    gpus = []
    for item in strict.parse_json(text):
        minor, major = item.get("minor"), int(item.get("major", NVIDIA_MAJOR))
        nodes = () if minor is None else (DeviceNode(f"/dev/nvidia{minor}", major, minor),)
        gpus.append(
            GpuDevice(
                index=int(item["index"]),
                uuid=str(item["uuid"]),
                name=str(item.get("name", "")),
                pci_bus_id=str(item.get("pci_bus_id", "")),
                memory_mib=item.get("memory_mib"),
                minor=minor,
                nodes=nodes,
            )
        )
    return tuple(gpus)
