"""A simulated NVIDIA PCI function for QEMU guests: the remote end of ``x-pci-proxy-dev``.

QEMU 7.2's multi-process device (``-device x-pci-proxy-dev,fd=N``) forwards every access
the guest makes to a PCI function's configuration space and BARs over a socket, to a
"remote device" process. This module is such a remote end, of the project's own: a config
space with NVIDIA's vendor id, a data-centre GPU's device id and class (3D controller), and
one 16 MiB memory BAR whose registers read as zero. It is a simulation: no GPU is behind it,
and nothing in the guest can compute with it; it lets a guest find an NVIDIA function at the
granted GPU's own PCI address, as it would find a GPU passed through with VFIO.

The protocol (QEMU's include/hw/remote/mpqemu-link.h, a private one between QEMU and its
remote processes): a message is a 16-byte header, ``int cmd`` and ``size_t size`` (native
byte order, padded), then ``size`` bytes of data, with file descriptors as SCM_RIGHTS.
Config reads and writes, BAR reads and writes and device resets await a ``RET`` message
carrying a 64-bit value; the memory map (``SYNC_SYSMEM``) and the interrupt eventfds
(``SET_IRQFD``) do not, and their descriptors are closed here.

One VM per GPU, as a VFIO group allows: ``GpuFunction.claim`` takes an exclusive lock per
PCI address under a directory of the host's, and a second claim while the first holder
lives fails with ``GpuFunctionBusy`` (EBUSY). The lock's file descriptor goes to QEMU, so the
claim lasts exactly as long as the VM's process, as an open ``/dev/vfio/<group>`` does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from gpuhost.wait import wait_until

VENDOR_NVIDIA = 0x10DE
DEVICE_H100 = 0x2330
"""GH100 [H100 SXM5 80GB], the simulated host's model."""
SUBSYSTEM = (0x10DE, 0x16C1)
CLASS_3D_CONTROLLER = 0x030200
BAR0_SIZE = 16 << 20
EXIT_GRACE_S = 3.0
"""A killed QEMU's main thread is a zombie (dead, to the lease registry) while its other
threads still tear down and hold its files: its claim goes a moment later."""

# MPQemuCmd (include/hw/remote/mpqemu-link.h, QEMU 7.2).
SYNC_SYSMEM, RET, PCI_CFGWRITE, PCI_CFGREAD, BAR_WRITE, BAR_READ, SET_IRQFD, DEVICE_RESET = range(8)
_HEADER = struct.Struct("=i4xQ")  # int cmd; size_t size (x86-64: 4 bytes of padding)
_CONF = struct.Struct("=IIi")  # PciConfDataMsg: addr, val, len
_BAR = struct.Struct("=QQI?3x")  # BarAccessMsg: addr, val, size, memory
_U64 = struct.Struct("=Q")
_MAX_DATA = 192  # sizeof the data union (SyncSysmemMsg: 8 x (gpa, size, offset))
_MAX_FDS = 8


class GpuFunctionBusy(OSError):
    """Another VM holds the PCI function (EBUSY), as a second open of a VFIO group fails."""


def config_space(device_id: int = DEVICE_H100) -> bytearray:
    """The 256 bytes of a type-0 header: NVIDIA's ids, a 3D controller, BAR0, INTA."""
    config = bytearray(256)
    struct.pack_into("<HH", config, 0x00, VENDOR_NVIDIA, device_id)
    config[0x08] = 0xA1  # revision
    config[0x09:0x0C] = CLASS_3D_CONTROLLER.to_bytes(3, "little")
    struct.pack_into("<HH", config, 0x2C, *SUBSYSTEM)
    config[0x3D] = 0x01  # interrupt pin INTA
    return config


class ConfigSpace:
    """A config space whose writable bits are those of the command register and BAR0."""

    def __init__(self, device_id: int = DEVICE_H100) -> None:
        self.bytes = config_space(device_id)

    def read(self, addr: int, length: int) -> int:
        if not addr >= 0 and addr + length <= len(self.bytes):
            return 0xFFFFFFFF
        return int.from_bytes(self.bytes[addr : addr + length], "little")

    def write(self, addr: int, value: int, length: int) -> None:
        if addr == 0x04 and length >= 2:  # command register: memory space, bus master
            struct.pack_into("<H", self.bytes, 0x04, value & 0x0406)
        elif addr == 0x10 and length == 4:  # BAR0: 32-bit memory, sized by its mask
            struct.pack_into("<I", self.bytes, 0x10, value & ~(BAR0_SIZE - 1) & 0xFFFFFFF0)
        elif addr == 0x3C:  # interrupt line: the guest's to set
            self.bytes[0x3C] = value & 0xFF


def serve(connection: socket.socket, device_id: int = DEVICE_H100) -> None:
    """Answer QEMU on ``connection`` until it closes it (the VM ended)."""
    config = ConfigSpace(device_id)
    with connection:
        while True:
            message = _receive(connection)
            if message is None:
                return
            cmd, data = message
            if cmd == PCI_CFGREAD:
                addr, _, length = _CONF.unpack_from(data)
                _reply(connection, config.read(addr, length))
            elif cmd == PCI_CFGWRITE:
                addr, value, length = _CONF.unpack_from(data)
                config.write(addr, value, length)
                _reply(connection, 0)
            elif cmd in (BAR_READ, BAR_WRITE, DEVICE_RESET):
                _reply(connection, 0)  # registers that read as zero
            # SYNC_SYSMEM and SET_IRQFD need no answer: the device never touches guest
            # memory and raises no interrupt.


def _receive(connection: socket.socket) -> tuple[int, bytes] | None:
    """One message (its descriptors closed), or None when QEMU has gone."""
    try:
        header, fds, _, _ = socket.recv_fds(connection, _HEADER.size, _MAX_FDS)
    except OSError:
        return None
    for fd in fds:
        os.close(fd)
    if not header:
        return None
    header += _read_exactly(connection, _HEADER.size - len(header))
    cmd, size = _HEADER.unpack(header)
    if size > _MAX_DATA:
        return None  # not QEMU's protocol: drop the connection
    return cmd, _read_exactly(connection, size)


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise EOFError("QEMU closed the connection in the middle of a message")
        data += chunk
    return data


def _reply(connection: socket.socket, value: int) -> None:
    connection.sendall(_HEADER.pack(RET, _U64.size) + _U64.pack(value & 0xFFFFFFFFFFFFFFFF))


@dataclass
class GpuFunction:
    """A simulated GPU's PCI function, claimed for one VM: QEMU's socket end and the lock."""

    pci_bus_id: str
    qemu_socket: socket.socket
    """The end QEMU gets (``x-pci-proxy-dev,fd=...``)."""
    lock_fd: int
    """The claim: QEMU inherits it, so it lasts as long as the VM's process."""

    @classmethod
    def claim(cls, lock_dir: Path, pci_bus_id: str, device_id: int = DEVICE_H100) -> GpuFunction:
        """Claim the function at ``pci_bus_id`` and serve it from a thread of this process.

        Raises ``GpuFunctionBusy`` while another VM holds it.
        """
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(lock_dir / f"{pci_bus_id}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            wait_until(
                lambda: fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB),
                retry_on=(BlockingIOError,),
                timeout_s=EXIT_GRACE_S,
                what=f"the VM holding the PCI function {pci_bus_id} to let go of it",
            )
        except TimeoutError:
            os.close(lock_fd)
            raise GpuFunctionBusy(
                errno.EBUSY, f"the PCI function {pci_bus_id} is held by another VM"
            ) from None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        thread = threading.Thread(
            target=serve, args=(ours, device_id), name=f"pci-proxy {pci_bus_id}", daemon=True
        )
        thread.start()
        return cls(pci_bus_id, theirs, lock_fd)

    def fds(self) -> tuple[int, int]:
        """The descriptors QEMU must inherit."""
        return self.qemu_socket.fileno(), self.lock_fd

    def handed_over(self) -> None:
        """Close this process's copies once QEMU holds its own (or never will)."""
        self.qemu_socket.close()
        with contextlib.suppress(OSError):
            os.close(self.lock_fd)
