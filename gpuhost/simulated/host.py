"""A simulated host's fixed shape: its constants, its devices' numbers, the host object."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuhost.devices import (
    NVIDIACTL_MINOR,
    SIMULATED_DRM_MAJOR,
    SIMULATED_NVIDIA_MAJOR,
    DeviceNode,
    GpuDevice,
)

DEFAULT_ROOT = Path("/run/gpu-sandbox-sim")
DEFAULT_COUNT = 8
SANDBOX_SHARE = "/run/gpu-sim"
MODEL = "NVIDIA H100 80GB HBM3"
MEMORY_MIB = 81559
# nvidia-uvm's major is assigned dynamically on real hosts; one kept for local use here.
NVIDIA_MAJOR = SIMULATED_NVIDIA_MAJOR
UVM_MAJOR = 121
# The bus ids of an 8-GPU DGX H100 (from recorded lspci captures), then made-up ones.
DGX_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
# nvidia-caps and kfd have dynamic majors on real hosts too.
CAPS_MAJOR = 122
KFD_MAJOR = 123
DRM_MAJOR = SIMULATED_DRM_MAJOR
MIG_PROFILE = re.compile(r"^(?P<slices>[1-8])g\.(?P<gb>\d+)gb$")
DRI_VENDORS = {
    "intel": ("8086", "56a0", "Intel Arc A770", 16384),
    "amd": ("1002", "740f", "AMD Instinct MI210", 65520),
}
# Where the simulated DRI GPUs sit on the PCI bus, per vendor, and how their nodes are
# numbered: not in PCI order, and the render nodes crossed against the cards.
DRI_BUSES = {"intel": ("0000:00:02.0", "0000:00:03.0"), "amd": ("0000:c1:00.0", "0000:c3:00.0")}
MARKER = "simulated-gpu-host"
OWNER = "owner"
"""The lease holder (kind and ref) whose end ends the host, for ``sweep``."""
CDI_VENDOR_SUFFIX = ".nvidia.com"
REGISTERED_PREFIX = "gpu-sandbox-sim-"


class SimulatedHostError(RuntimeError):
    """The simulated host could not be set up, or a directory is not one."""


@dataclass(frozen=True)
class SimulatedHost:
    root: Path
    gpus: tuple[GpuDevice, ...]
    cdi_kind: str
    mig_devices: tuple[GpuDevice, ...] = ()
    dri_gpus: tuple[GpuDevice, ...] = ()

    @property
    def share_dir(self) -> Path:
        return self.root / "share"

    @property
    def nvidia_smi(self) -> Path:
        return self.share_dir / "bin" / "nvidia-smi"

    @property
    def cdi_spec(self) -> Path:
        return self.root / "cdi" / "nvidia-sim.yaml"

    @property
    def lease_dir(self) -> Path:
        return self.root / "leases"

    @property
    def control_nodes(self) -> tuple[DeviceNode, ...]:
        """NVIDIA's control nodes; none on a host of AMD and Intel GPUs alone."""
        if not self.gpus:
            return ()
        return tuple(
            DeviceNode(f"/dev/{name}", major, minor, str(self.root / "dev" / name))
            for name, major, minor in CONTROL_NODES
        )


CONTROL_NODES = (
    ("nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR),
    ("nvidia-uvm", UVM_MAJOR, 0),
    ("nvidia-uvm-tools", UVM_MAJOR, 1),
)


MigLayout = Mapping[int, Sequence[str]]
"""GPU position (PCI order) → the profiles of its MIG instances, e.g. {0: ["1g.10gb"] * 7}."""
DriLayout = Mapping[str, int]
"""Vendor (``intel``, ``amd``) → how many DRI GPUs of it."""


NODE_GID = 1_999_000_001
"""The group of the simulated nodes, mode 0660: root, and the sandboxes given them (a root-run
reference sandbox gets its nodes' groups), may open them; no other local user. Their majors
are the real drivers' (the suite tells NVIDIA's nodes by them): on a host where those drivers
are loaded, they open real devices, so a GPU host is never simulated by the suite."""


def mknod(path: Path, major: int, minor: int) -> None:
    try:
        os.mknod(path, 0o660 | stat.S_IFCHR, os.makedev(major, minor))
    except PermissionError as exc:
        raise SimulatedHostError(
            f"cannot create the character device {path} ({major}:{minor}): {exc}; "
            "setting up a simulated GPU host needs root (CAP_MKNOD)"
        ) from None
    os.chown(path, 0, NODE_GID)
    path.chmod(0o660)  # mknod's mode is filtered by the umask
