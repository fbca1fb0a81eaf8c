"""How a host's GPUs reach its VMs: one strategy per kind of host.

GPUs: at most one per VM, whole and exclusive, an NVIDIA GPU not in MIG mode (passthrough is
of a PCI device; the instances of a GPU in MIG mode belong to the host's driver).

- On a real host it is passed through with VFIO (``-device vfio-pci,host=<BDF>``): its
  IOMMU group is bound to vfio-pci before the VM starts and given back to its drivers when
  the VM ends (``gpuhost.vfio``), and groups a crashed run left bound are given back when a
  sandbox starts or a session is reaped. The GPUs are those of the PCI bus: by default
  those bound to vfio-pci already (NVML and nvidia-smi do not list them), and with the
  opt-in (``GPU_SANDBOX_VM_REBIND=1``) those of the nvidia driver too. The guest image must
  bring the NVIDIA driver (``VfioPassthrough``).
- On a simulated host (``gpuhost.simulated``) there is no device to pass through: QEMU's
  multi-process device (``x-pci-proxy-dev``) presents a PCI function with NVIDIA's ids,
  served by ``gpuhost.simulated.pci_proxy`` from this process, and the guest's init makes a
  ``/dev/nvidia<minor>`` node for each NVIDIA function whose address the simulated host's
  inventory lists, as the NVIDIA driver makes one per GPU it probes. The simulated host's
  share (inventory, the ``nvidia-smi`` stand-in) reaches the guest at ``/run/gpu-sim``, in
  an initramfs overlay or through the agent. This is a simulation, and ``version()`` says so
  (``SimulatedPassthrough``).
"""

from __future__ import annotations

import abc
import base64
import os
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from drivers.host_process import HOST_PATH
from drivers.vm.image import GUEST_PATH, cpio, with_overlay
from drivers.vm.template import COLD, SNAPSHOT
from gpuhost import environ
from gpuhost.devices import GpuDevice, sorted_by_pci
from gpuhost.host import GpuHost
from gpuhost.leases import Holder
from gpuhost.simulated import SANDBOX_SHARE, SimulatedHost
from gpuhost.simulated.pci_proxy import GpuFunction
from gpuhost.vfio import (
    NVIDIA_DRIVER,
    REBIND_ENV,
    VFIO_DRIVER,
    BusGpu,
    VfioBinder,
    VfioClaim,
)


class GpuClaim(abc.ABC):
    """One GPU taken for one VM: the device QEMU gets, held until it is given back."""

    driver: ClassVar[str]
    """QEMU's device for it."""

    @abc.abstractmethod
    def options(self) -> str:
        """The device's options that name the GPU (less its bus and address)."""

    def fds(self) -> Sequence[int]:
        """The descriptors QEMU must inherit."""
        return ()

    @abc.abstractmethod
    def handed_over(self, holder: Holder) -> None:
        """QEMU has started, holding the GPU: ``holder`` is its process."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """Give the GPU back: its VM did not start."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give the GPU back: its VM has ended."""


class Passthrough(abc.ABC):
    """How the GPUs of one host reach its VMs, and what else the guest needs of the host."""

    description: ClassVar[str]
    """How the GPUs are passed, as ``version()`` says it."""
    default_boot: ClassVar[str]
    """How VMs come up unless ``GPU_SANDBOX_VM_BOOT`` says otherwise."""
    guest_path: ClassVar[str] = GUEST_PATH
    """The PATH of a command in the guest."""

    @abc.abstractmethod
    def unavailable(self) -> str | None:
        """Why VMs cannot be given GPUs on this host (the probe's reason), or None."""

    @abc.abstractmethod
    def claim(self, gpu: GpuDevice, sandbox_id: str) -> GpuClaim:
        """Take ``gpu`` for the VM of ``sandbox_id``, before its QEMU starts."""

    @abc.abstractmethod
    def reconcile(self) -> None:
        """Give back what VMs that died left taken (when a session is reaped)."""

    def gpus(self, listed: tuple[GpuDevice, ...]) -> tuple[GpuDevice, ...]:
        """The host's NVIDIA GPUs as VMs see them, given those NVML or nvidia-smi ``listed``."""
        return listed

    def offered(self, gpus: tuple[GpuDevice, ...]) -> tuple[GpuDevice, ...]:
        """Of the host's whole GPUs, those VMs may be given: all of them, unless the host says."""
        return gpus

    def why_none(self, gpus: tuple[GpuDevice, ...]) -> str:
        """Why ``offered`` left every one of ``gpus`` out, and how to opt in."""
        return ""

    def boot_initrd(self, base: Path) -> Path:
        """The initramfs a VM boots cold: ``base``, with what the guest needs of the host."""
        return base

    def guest_setup(self) -> str:
        """Shell commands a VM resumed from a template runs before its GPUs come up."""
        return ""


class VfioPassthrough(Passthrough):
    """A real host: each GPU's IOMMU group bound to vfio-pci while its VM runs."""

    description = "VFIO"
    default_boot = COLD

    def __init__(self, binder: VfioBinder) -> None:
        self.binder = binder

    def unavailable(self) -> str | None:
        container = self.binder.dev / "vfio" / "vfio"
        if container.exists():
            return None
        return (
            f"needed VFIO (found no {container}: modprobe vfio-pci, and enable the "
            "IOMMU with intel_iommu=on or amd_iommu=on)"
        )

    def gpus(self, listed: tuple[GpuDevice, ...]) -> tuple[GpuDevice, ...]:
        """Every NVIDIA GPU of the PCI bus, whichever driver has it, numbered in bus order.

        Those NVML or nvidia-smi list keep what they say (UUID, name, MIG mode). One they do
        not list (bound to vfio-pci) is named by its PCI address (``PCI-<bus id>``, as
        ``gpuhost.pci`` names GPUs no tool gives a UUID for), or by the UUID the nvidia
        driver gave it where a claim of this host took it from that driver and recorded it.
        """
        by_bus = {gpu.pci_bus_id: gpu for gpu in listed}
        found = [
            by_bus.pop(gpu.bus) if gpu.bus in by_bus else _unlisted(gpu)
            for gpu in self.binder.bus_gpus()
        ]
        return sorted_by_pci([*found, *by_bus.values()])

    def offered(self, gpus: tuple[GpuDevice, ...]) -> tuple[GpuDevice, ...]:
        # A GPU serving the nvidia driver may be in use (a persistence daemon, another job, a
        # display): it is taken from it only when asked (the binder's rebind).
        on_bus = {gpu.bus: gpu for gpu in self.binder.bus_gpus()}
        return tuple(gpu for gpu in gpus if self._offers(on_bus.get(gpu.pci_bus_id)))

    def _offers(self, gpu: BusGpu | None) -> bool:
        if gpu is None:  # listed by NVML, but not on the bus as sysfs shows it
            return self.binder.rebind
        if gpu.passes_through:
            return True
        return self.binder.rebind and gpu.driver == NVIDIA_DRIVER and bool(gpu.group)

    def why_none(self, gpus: tuple[GpuDevice, ...]) -> str:
        on_bus = {gpu.bus: gpu for gpu in self.binder.bus_gpus()}
        found = ", ".join(
            on_bus[gpu.pci_bus_id].describe() if gpu.pci_bus_id in on_bus else gpu.pci_bus_id
            for gpu in gpus
        )
        prepare = (
            f"bind each GPU's IOMMU group to {VFIO_DRIVER} beforehand (driverctl "
            f"set-override <BDF> {VFIO_DRIVER})"
        )
        if self.binder.rebind:
            return (
                f"needed NVIDIA GPUs bound to {VFIO_DRIVER}, or to {NVIDIA_DRIVER} in an "
                f"IOMMU group (found: {found}); {prepare}"
            )
        return (
            f"needed NVIDIA GPUs bound to {VFIO_DRIVER} (found: {found}); {prepare}, or let "
            f"VMs take GPUs from the {NVIDIA_DRIVER} driver, those no process holds open: "
            f"--vm-rebind-gpus, or {REBIND_ENV}=1"
        )

    def claim(self, gpu: GpuDevice, sandbox_id: str) -> GpuClaim:
        self.binder.reconcile()  # groups that a VM which died left bound
        claim = self.binder.claim(gpu.pci_bus_id, sandbox_id, Holder.process(os.getpid()))
        return VfioGpu(self.binder, claim, gpu.pci_bus_id, sandbox_id)

    def reconcile(self) -> None:
        self.binder.reconcile()


def _unlisted(gpu: BusGpu) -> GpuDevice:
    """A GPU no NVIDIA tool lists: its PCI address names it, unless its UUID was recorded."""
    return GpuDevice(0, gpu.uuid or f"PCI-{gpu.bus}", f"NVIDIA GPU at {gpu.bus}", gpu.bus)


class VfioGpu(GpuClaim):
    """A GPU whose IOMMU group is bound to vfio-pci: recorded with its holder, until released."""

    driver = "vfio-pci"

    def __init__(self, binder: VfioBinder, claim: VfioClaim, bus: str, sandbox_id: str) -> None:
        self.binder = binder
        self.claim = claim
        self.bus = bus
        self.sandbox_id = sandbox_id

    def options(self) -> str:
        return f"host={self.bus}"

    def handed_over(self, holder: Holder) -> None:
        self.binder.set_holder(self.claim, self.sandbox_id, holder)

    def abandon(self) -> None:
        self.binder.release(self.claim.group)

    def release(self) -> None:
        self.binder.release(self.claim.group)


class SimulatedPassthrough(Passthrough):
    """A simulated host: a PCI function served from this process, and the host's share."""

    description = "simulated GPUs (x-pci-proxy-dev)"
    default_boot = SNAPSHOT
    guest_path = f"{SANDBOX_SHARE}/bin:{GUEST_PATH}"

    def __init__(self, simulated: SimulatedHost, run_dir: Path) -> None:
        self.simulated = simulated
        self.run_dir = run_dir
        self._initrd_lock = threading.Lock()
        self._share_archive: bytes | None = None

    def unavailable(self) -> str | None:
        if shutil.which("cpio", path=HOST_PATH):
            return None
        return "needed cpio (found none; apt-get install cpio)"

    def claim(self, gpu: GpuDevice, sandbox_id: str) -> GpuClaim:
        return SimulatedGpu(GpuFunction.claim(self.simulated.root / "vfio-groups", gpu.pci_bus_id))

    def reconcile(self) -> None:
        pass  # a function's lock is QEMU's: it was freed as QEMU exited

    def boot_initrd(self, base: Path) -> Path:
        """The guest's initramfs with the simulated host's share appended (a second cpio).

        Built once per image and share, then reused by every VM of the host that boots cold.
        """
        share = self.simulated.share_dir
        return with_overlay(base, share, SANDBOX_SHARE, self.run_dir / "initrd", self._initrd_lock)

    def guest_setup(self) -> str:
        """The simulated host's share into /run/gpu-sim, read-only."""
        archive = base64.b64encode(self.share_archive()).decode()
        return (
            f"echo {archive} | base64 -d | (cd {SANDBOX_SHARE} && cpio -i -d 2>/dev/null) "
            f"&& mount -o remount,ro {SANDBOX_SHARE} && "
        )

    def share_archive(self) -> bytes:
        """The simulated host's share as a cpio archive of its own tree (for /run/gpu-sim)."""
        if self._share_archive is None:
            self._share_archive = cpio(self.simulated.share_dir)
        return self._share_archive


class SimulatedGpu(GpuClaim):
    """A simulated GPU's PCI function: its lock goes to QEMU, and with QEMU's end, ends."""

    driver = "x-pci-proxy-dev"

    def __init__(self, function: GpuFunction) -> None:
        self.function = function

    def options(self) -> str:
        return f"fd={self.function.qemu_socket.fileno()}"

    def fds(self) -> Sequence[int]:
        return self.function.fds()

    def handed_over(self, holder: Holder) -> None:
        self.function.handed_over()

    def abandon(self) -> None:
        self.function.handed_over()

    def release(self) -> None:
        pass  # QEMU held the function's lock; it was freed as QEMU exited


def passthrough_for(host: GpuHost, run_dir: Path) -> Passthrough:
    """The strategy for ``host``: VFIO on a real host, the PCI proxy on a simulated one."""
    if host.simulated is not None:
        return SimulatedPassthrough(host.simulated, run_dir)
    rebind = environ.flag(REBIND_ENV)
    return VfioPassthrough(VfioBinder(host.config.state_directory(), rebind=rebind))
