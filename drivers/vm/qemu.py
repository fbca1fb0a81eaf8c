"""QEMU: a VM's command line, its process, its machine protocol, and the acceleration.

Each sandbox is a VM of its own: ``-M q35``, no network device, no disk, a root that is the
initramfs, read-only once the guest's init has set it up (``/tmp`` is a tmpfs). QEMU runs
under its own seccomp filter (``SECCOMP``) and dies with its creator (``setpriv
--pdeathsig``, forked from a long-lived thread: ``gpuhost.spawn``). Every QEMU process
carries ``-name gpu-sandbox/<session>/<sandbox>``, which is how ``reap`` finds a session's
VMs from any process (``QEMU_PROCESSES``). The agent's two ports and QEMU's machine protocol
(QMP) are socketpairs whose other ends QEMU inherits (``VmSockets``).

A GPU's PCI function appears in the guest at its own host address: a ``pxb-pcie`` expander
and a ``pcie-root-port`` whose bus number puts it there (``root_ports``).

Acceleration: KVM when a short boot probe under KVM reaches the guest's init, TCG otherwise;
the verdict is kept per boot of the host under the run directory (``decide_acceleration``;
``GPU_SANDBOX_VM_ACCEL``: ``kvm``, ``tcg`` or ``auto``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from drivers.host_process import HOST_ENV, SandboxProcesses, tool
from drivers.vm.agent import CONTROL_PORT, EXEC_PORT, Channel
from drivers.vm.image import GuestImage
from gpuhost import environ, strict
from gpuhost.leases import boot_id
from gpuhost.spawn import spawn
from gpuhost.wait import wait_for

QEMU = "qemu-system-x86_64"
SECCOMP = ("-sandbox", "on,obsolete=deny,elevateprivileges=deny,resourcecontrol=deny")
"""QEMU's own seccomp filter: no obsolete system calls, no setuid or capability changes, no
scheduling or affinity changes. Spawning stays allowed: a template's state is saved and
loaded through ``exec:cat``, which QEMU 7.2 (Debian 12's) has no other file transport for."""
ACCEL_ENV = "GPU_SANDBOX_VM_ACCEL"
MEMORY_ENV = "GPU_SANDBOX_VM_MEMORY_MIB"
DEFAULT_MEMORY_MIB = 256
"""Enough for the busybox guest and a mebibyte of output twice over; a guest that runs CUDA
workloads needs several GiB (GPU_SANDBOX_VM_MEMORY_MIB)."""
NAME_PREFIX = "gpu-sandbox"
KERNEL_ARGS = (
    "console=ttyS0 quiet panic=-1 mitigations=off nokaslr tsc=reliable no_timer_check "
    "i8042.noaux i8042.nokbd i8042.nopnp random.trust_cpu=on cryptomgr.notests"
)
"""A quiet serial console, and no work a guest without a keyboard or secrets needs: about a
fifth less boot time under TCG (3.3 s of CPU instead of 4.2 s, measured here)."""
ROOT_PORT_MEMORY = "32M"
"""What each root port reserves for a hot-plugged GPU's BARs: the simulated GPU's is 16 MiB."""
PROBE_TIMEOUT_S = 30.0
"""The KVM probe boots to the guest's init and powers off: a second or two under working
KVM; a nested hypervisor that crawls (a guest still in early boot after minutes) is no use."""
_NAME = re.compile(rf"^{NAME_PREFIX}/(?P<session>[^/]+)/(?P<sandbox>[^/]+)$")


@dataclasses.dataclass(frozen=True)
class Machine:
    """What every VM of a driver boots: its guest, acceleration and memory, in its session."""

    session_id: str
    image: GuestImage
    initrd: Path
    accel: str
    memory_mib: int

    def argv(
        self,
        sandbox_id: str,
        directory: Path,
        memory_backend: str = "memory-backend-memfd,share=on",
    ) -> list[str]:
        """QEMU's command line for a sandbox, less its ports, root ports and GPUs.

        Its memory is a backend with a file descriptor, which the multi-process (proxy)
        device needs: a memfd, or a template's memory file, mapped copy-on-write. Its logs,
        QEMU's and the guest console's, go to ``directory``.
        """
        memory = f"{self.memory_mib}M"
        return [
            "setpriv", "--pdeathsig", "SIGKILL", "--",
            tool(QEMU),
            "-name", f"{NAME_PREFIX}/{self.session_id}/{sandbox_id}",
            *SECCOMP,
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-accel", self.accel, *(["-cpu", "host"] if self.accel == "kvm" else []),
            "-M", "q35,memory-backend=mem",
            "-object", f"{memory_backend},id=mem,size={memory}",
            "-m", memory,
            "-kernel", str(self.image.kernel),
            "-initrd", str(self.initrd),
            "-append", KERNEL_ARGS,
            "-chardev", f"file,id=console,path={directory / 'console.log'}",
            "-serial", "chardev:console",
            "-device", "virtio-serial-pci,id=ports",
        ]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class QemuDevice:
    """A device of a VM, on QEMU's command line or hot-plugged: a GPU behind its root port."""

    id: str
    driver: str
    options: str

    def argv(self) -> list[str]:
        return ["-device", f"{self.driver},id={self.id},{self.options}"]


def root_ports(buses: Sequence[str]) -> list[str]:
    """Root ports ``port<i>`` that put a device behind them at the host's bus ``buses[i]``.

    Each on a PCIe expander bridge numbered one below the GPU's bus: the device behind the
    port gets the GPU's own bus number, at device 0, function 0. Each reserves room for a
    GPU's registers, for one hot-plugged into a VM restored from the template.
    """
    argv = []
    for position, bus_id in enumerate(buses):
        bus = int(bus_id.split(":")[1], 16)
        argv += [
            "-device", f"pxb-pcie,id=pxb{position},bus_nr={bus - 1},bus=pcie.0",
            "-device", f"pcie-root-port,id=port{position},bus=pxb{position},"
            f"chassis={position + 1},slot=0,mem-reserve={ROOT_PORT_MEMORY}",
        ]  # fmt: skip
    return argv


class VmSockets:
    """A VM's three socketpairs: the agent's exec and control ports, and QMP.

    This process keeps ``exec``, ``control`` and ``qmp``; QEMU inherits the other ends,
    which its command line names (``argv``), and this process closes its copies of them
    once QEMU has started (``handed_over``).
    """

    def __init__(self) -> None:
        self.exec, exec_theirs = socket.socketpair()
        self.control, control_theirs = socket.socketpair()
        self.qmp, qmp_theirs = socket.socketpair()
        self._theirs = (exec_theirs, control_theirs, qmp_theirs)

    def argv(self) -> list[str]:
        exec_theirs, control_theirs, qmp_theirs = (end.fileno() for end in self._theirs)
        return [
            *_chardev("exec", exec_theirs, EXEC_PORT),
            *_chardev("ctl", control_theirs, CONTROL_PORT),
            "-chardev", f"socket,id=qmp,fd={qmp_theirs}",
            "-mon", "chardev=qmp,mode=control",
        ]  # fmt: skip

    def fds(self) -> list[int]:
        """The descriptors QEMU must inherit."""
        return [end.fileno() for end in self._theirs]

    def handed_over(self) -> None:
        for end in self._theirs:
            end.close()

    def close(self) -> None:
        for end in (self.exec, self.control, self.qmp, *self._theirs):
            end.close()


def _chardev(name: str, fd: int, port: str) -> list[str]:
    return [
        "-chardev", f"socket,id={name},fd={fd}",
        "-device", f"virtserialport,bus=ports.0,chardev={name},name={port}",
    ]  # fmt: skip


def spawn_qemu(argv: list[str], directory: Path, fds: Sequence[int]) -> subprocess.Popen[bytes]:
    """Start QEMU with the host's environment, its output in ``directory/qemu.log``."""
    with open(directory / "qemu.log", "wb") as log:
        return spawn(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=fds, env=HOST_ENV
        )


def boot_logs(directory: Path) -> str:
    """The last lines of what QEMU and the guest's console said, for an error."""
    return f"{_tail(directory / 'qemu.log')} console: {_tail(directory / 'console.log')}"


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(none)"
    shown = [line for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(shown) or "(empty)"


def _named(args: list[str], session_id: str) -> str | None:
    """The sandbox a QEMU command line's ``-name`` names, if one of ``session_id``'s."""
    for flag, value in itertools.pairwise(args):
        if flag == "-name":
            match = _NAME.match(value)
            if match is None:
                continue
            return match["sandbox"] if match["session"] == session_id else None
    return None


QEMU_PROCESSES = SandboxProcesses(QEMU, _named, called="QEMU", sandboxes="VMs")
"""Every VM's QEMU process, named for its session and sandbox."""


def qemu_processes(session_id: str) -> list[tuple[str, int]]:
    """(sandbox id, pid) of every QEMU process named for ``session_id``."""
    return QEMU_PROCESSES.find(session_id)


class Qmp:
    """QEMU's machine protocol on a socketpair: resume an incoming VM, hot-plug, save."""

    def __init__(self, channel: Channel, deadline: float, alive: Callable[[], bool]) -> None:
        self.channel = channel
        self.deadline = deadline
        self.alive = alive
        self.channel.read_line(deadline, alive)  # the greeting
        self.command("qmp_capabilities")

    def command(self, name: str, **arguments: object) -> object:
        request = {"execute": name, "arguments": arguments} if arguments else {"execute": name}
        self.channel.send(json.dumps(request).encode() + b"\n")
        while True:
            reply = json.loads(self.channel.read_line(self.deadline, self.alive))
            if "error" in reply:
                raise OSError(f"QEMU refused {name}: {reply['error'].get('desc', reply)}")
            if "return" in reply:
                return reply["return"]

    def _migration(self) -> str:
        status = self.command("query-migrate")
        return str(status.get("status", "")) if isinstance(status, dict) else ""

    def _until_migrated(self, what: str) -> None:
        def done() -> bool:
            status = self._migration()
            if status == "failed":
                raise OSError(f"QEMU could not {what}")
            return status == "completed"

        wait_for(
            done,
            bool,
            timeout_s=max(0.0, self.deadline - time.monotonic()),
            what=f"QEMU to {what}",
            hint="see the VM's qemu.log under the driver's run directory",
            interval_s=0.02,
        )

    def resume_incoming(self, state: Path) -> None:
        """Load the template's state (its memory is mapped already), then run the VM."""
        self.command("migrate-set-capabilities", capabilities=_IGNORE_SHARED)
        self.command("migrate-incoming", uri=f"exec:cat {shlex.quote(str(state))}")
        self._until_migrated("load the VM template")
        self.command("cont")

    def add_device(self, device: QemuDevice) -> None:
        arguments: dict[str, object] = {"driver": device.driver, "id": device.id}
        for option in device.options.split(","):
            key, _, value = option.partition("=")
            arguments[key] = value
        self.command("device_add", **arguments)

    def save(self, path: Path) -> None:
        """Stop the VM and save its state, less its memory (in its shared file), to ``path``."""
        self.command("stop")
        self.command("migrate-set-capabilities", capabilities=_IGNORE_SHARED)
        self.command("migrate", uri=f"exec:cat > {shlex.quote(str(path))}")
        self._until_migrated(f"save the VM template to {path}")


_IGNORE_SHARED = [{"capability": "x-ignore-shared", "state": True}]
"""Memory in a shared file is not copied into the saved state: the template's file is it."""


def decide_acceleration(run_dir: Path, image: Callable[[], GuestImage]) -> tuple[str, str]:
    """``("kvm" | "tcg", why)``: asked for, or decided by a probe of ``image()`` once per boot."""
    wanted = environ.choice(ACCEL_ENV, ("auto", "kvm", "tcg"), "auto")
    if wanted in ("kvm", "tcg"):
        return wanted, f"{ACCEL_ENV}={wanted}"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg", "/dev/kvm cannot be opened"
    guest = image()
    key = hashlib.sha256(f"{boot_id()} {guest.kernel} {QEMU}".encode()).hexdigest()[:16]
    cache = run_dir / f"accel-{key}.json"
    with contextlib.suppress(strict.InvalidFile):
        verdict = strict.read_record(cache, {"accel": str, "why": str})
        return verdict["accel"], verdict["why"]
    accel, why = _probe_kvm(guest)
    with contextlib.suppress(OSError):
        run_dir.mkdir(parents=True, exist_ok=True)
        partial = cache.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"accel": accel, "why": why}))
        partial.rename(cache)
    return accel, why


def _probe_kvm(image: GuestImage) -> tuple[str, str]:
    """Boot the guest under KVM to its init, with a deadline: ``("kvm", ...)`` if it got there."""
    argv = [
        tool(QEMU), *SECCOMP,
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-accel", "kvm", "-cpu", "host", "-M", "q35", "-m", f"{DEFAULT_MEMORY_MIB}M",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd),
        "-append", f"{KERNEL_ARGS} gpu_sandbox.probe=1", "-serial", "stdio",
    ]  # fmt: skip
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=PROBE_TIMEOUT_S, check=False, env=HOST_ENV
        )
    except subprocess.TimeoutExpired:
        return "tcg", f"a KVM guest had not reached its init after {PROBE_TIMEOUT_S:g} s"
    if b"gpu-sandbox: probe booted" in done.stdout:
        return "kvm", "a KVM guest booted"
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return "tcg", f"KVM failed (qemu exit {done.returncode}: {lines[-1] if lines else ''})"
