"""How a VM comes up: a boot, or a resume of a template.

A VM either boots (``cold``: its GPU on QEMU's command line from the start; the default on
real hosts) or resumes a template (``snapshot``, the default on simulated hosts): one VM per
guest image and layout of the host's GPU buses is booted once, with a root port at every
GPU's bus, and saved with QEMU's migration, its memory in a file of its own; each sandbox's
QEMU maps that file copy-on-write, loads the small rest (``-incoming``), and gets its GPU
hot-plugged into the root port at the GPU's bus (``device_add``, pciehp in the guest). A
resume costs a fifth of a boot's CPU under TCG. ``GPU_SANDBOX_VM_BOOT`` chooses.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from drivers.vm.agent import Channel, GuestAgent
from drivers.vm.image import prune, touch
from drivers.vm.qemu import KERNEL_ARGS, Machine, Qmp, VmSockets, boot_logs, root_ports, spawn_qemu
from gpuhost.spawn import stop_process
from gpuhost.wait import wait_until

BOOT_ENV = "GPU_SANDBOX_VM_BOOT"
SNAPSHOT, COLD = "snapshot", "cold"
BOOT_TIMEOUT_S = 180.0
"""A guest boots in ~2.5 s of one core under TCG; on a loaded 2-core machine with eight
booting at once (a test that takes every GPU) a boot has taken 40 s. Minutes mean it hangs."""
TEMPLATE_FORMAT = 2
"""Version of how templates are saved (2: memory in a file of its own, x-ignore-shared)."""
TEMPLATE_SAVE_TIMEOUT_S = 120.0
"""Saving a booted guest's state (~70 MB of touched memory) to a tmpfs takes a few seconds."""


def template(machine: Machine, layout: Sequence[str], directory: Path, qemu_version: str) -> Path:
    """The saved state of a booted VM with no GPU, for every VM of this layout to resume.

    Made once (one boot) per guest image, memory size, acceleration and layout of GPU
    buses, by whichever process needs it first, under a lock; others wait for it. Its
    memory is the file beside it (``.ram``: ``resumed_memory``).
    """
    image, initrd = machine.image, machine.initrd
    key = hashlib.sha256(
        json.dumps(
            [str(image.kernel), image.kernel.stat().st_mtime_ns, str(initrd),
             initrd.stat().st_mtime_ns, machine.accel, machine.memory_mib, layout,
             KERNEL_ARGS, qemu_version, TEMPLATE_FORMAT]
        ).encode()
    ).hexdigest()[:20]  # fmt: skip
    state = directory / f"{key}.state"
    if state.exists():
        touch(state)
        return state
    state.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(state.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        wait_until(
            lambda: fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB),
            retry_on=(BlockingIOError,),
            timeout_s=BOOT_TIMEOUT_S + TEMPLATE_SAVE_TIMEOUT_S,
            what=f"another process to make the VM template {state}",
        )
        if not state.exists():
            prune(state.parent, "*.state", also=(".ram", ".lock"))
            _make(machine, layout, state)
    finally:
        os.close(lock)
    return state


def resumed_memory(state: Path) -> str:
    """The memory backend of a VM resuming ``state``: the template's memory, copy-on-write."""
    return f"memory-backend-file,mem-path={state.with_suffix('.ram')},share=off"


def _make(machine: Machine, layout: Sequence[str], state: Path) -> None:
    """Boot a VM with a root port at every bus of ``layout`` and save it as ``state``."""
    directory = state.with_suffix(".boot")
    directory.mkdir(parents=True, exist_ok=True)
    sockets = VmSockets()
    partial = state.with_suffix(f".{os.getpid()}.tmp")
    ram = state.with_suffix(f".{os.getpid()}.ram.tmp")
    memory = f"memory-backend-file,mem-path={ram},share=on"
    argv = machine.argv(f"template-{state.stem}", directory, memory)
    argv += [*sockets.argv(), *root_ports(layout)]
    process = spawn_qemu(argv, directory, sockets.fds())
    try:
        sockets.handed_over()
        deadline = time.monotonic() + BOOT_TIMEOUT_S

        def alive() -> bool:
            return process.poll() is None

        agent = GuestAgent(state.stem, Channel(sockets.exec), Channel(sockets.control))
        agent.wait_ready(deadline, alive, lambda: boot_logs(directory))
        qmp = Qmp(Channel(sockets.qmp), time.monotonic() + TEMPLATE_SAVE_TIMEOUT_S, alive)
        qmp.save(partial)
        stop_process(process)  # its memory file is the template's memory from now on
        ram.rename(state.with_suffix(".ram"))
        partial.rename(state)
    finally:
        stop_process(process)
        partial.unlink(missing_ok=True)
        ram.unlink(missing_ok=True)
        sockets.close()
        shutil.rmtree(directory, ignore_errors=True)
