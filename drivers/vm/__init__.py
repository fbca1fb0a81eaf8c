"""The vm driver: a QEMU micro-VM per sandbox, holding at most one GPU, passed through.

Each sandbox is a VM of its own, booted from a guest image (a kernel and a busybox
initramfs carrying the exec agent) with no network and no disk; commands run through the
agent on two virtio-serial ports. GPUs: at most one per VM, whole and exclusive, passed
through with VFIO on a real host, presented by QEMU's multi-process device on a simulated
one. Leases are held by the QEMU process: SIGKILL of QEMU frees its GPU.

``driver.py`` (``VmDriver``: the contract, a VM's start step by step, reaping),
``sandbox.py`` (``VmSandbox``: a running VM), ``agent.py`` (the guest agent's ports and
protocol), ``qemu.py`` (QEMU's command line, its process, QMP, the acceleration),
``template.py`` (cold boots, and resumes of a saved template), ``passthrough.py`` (how a
host's GPUs reach its VMs: VFIO, or the simulated host's PCI proxy), ``image.py`` (the guest
image, and initramfs built from it).

Options, from the environment (README: "The vm driver"): ``GPU_SANDBOX_VM_IMAGE`` (an image
directory), ``GPU_SANDBOX_VM_KERNEL`` and ``GPU_SANDBOX_VM_INITRD`` (a kernel and initramfs
of your own), ``GPU_SANDBOX_VM_ACCEL`` (``kvm``, ``tcg`` or ``auto``), ``GPU_SANDBOX_VM_BOOT``
(``snapshot`` or ``cold``), ``GPU_SANDBOX_VM_MEMORY_MIB``, ``GPU_SANDBOX_VM_RUN_DIR``.
"""

from drivers.vm.driver import RUN_DIR_ENV, VmDriver
from drivers.vm.image import IMAGE_ENV, INITRD_ENV, KERNEL_ENV, GuestImage
from drivers.vm.qemu import ACCEL_ENV, MEMORY_ENV, QEMU
from drivers.vm.sandbox import VmSandbox
from drivers.vm.template import BOOT_ENV, COLD, SNAPSHOT

__all__ = [
    "ACCEL_ENV",
    "BOOT_ENV",
    "COLD",
    "IMAGE_ENV",
    "INITRD_ENV",
    "KERNEL_ENV",
    "MEMORY_ENV",
    "QEMU",
    "RUN_DIR_ENV",
    "SNAPSHOT",
    "GuestImage",
    "VmDriver",
    "VmSandbox",
]
