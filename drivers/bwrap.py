"""bwrap's command line for a reference sandbox: what of the host its root holds.

The root holds the host's system directories, read-only, and nothing else of the host: not
the credentials under ``/etc``, not what ``/sys`` shows of the host beyond devices (its
cgroup tree, its network interfaces), not the ``/proc/driver/nvidia`` and PCI sysfs entries
of GPUs the sandbox was not given. bwrap run by root makes the directories above a mount
point 0700: ``with_parents`` makes them first, searchable by anyone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from gpuhost.devices import GpuDevice

SYSTEM_DIRS = tuple(
    Path("/", name)
    for name in ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt", "sys")
)
"""What a sandbox's root holds of the host, read-only: programs, libraries, configuration,
add-on software (/opt: a GPU host's frameworks often live there) and /sys for NVML."""
_ETC_SECRETS = tuple(
    Path("/etc", name)
    for name in (
        "shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d", "ssh", "ssl/private"
    )
)  # fmt: skip
"""Credentials under /etc that a sandbox run by root could otherwise read."""
_SYSFS_HOST_VIEWS = tuple(
    Path("/sys", name) for name in ("fs/cgroup", "class/net", "devices/virtual/net")
)
"""What /sys shows of the host beyond devices: its cgroup tree (every service and container
on it), its network interfaces. A sandbox has a cgroup and a network namespace of its own."""
_PROC_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
_SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")


def host_root_argv() -> list[str]:
    """Bwrap arguments for a root of the host's system directories, their secrets masked."""
    argv = system_dirs_argv()
    for secret in _ETC_SECRETS:
        if secret.is_dir():
            argv += ["--tmpfs", str(secret)]
        elif secret.exists():
            argv += ["--ro-bind", "/dev/null", str(secret)]
    for view in _SYSFS_HOST_VIEWS:
        if view.is_dir():
            argv += ["--tmpfs", str(view)]
    return [*argv, "--perms", "1777", "--tmpfs", "/var/tmp", "--symlink", "../run", "/var/run"]


def system_dirs_argv() -> list[str]:
    """Bwrap arguments that bind the host's system directories read-only, and nothing else."""
    argv: list[str] = []
    for path in SYSTEM_DIRS:
        if path.is_symlink():  # /bin -> usr/bin on a merged-/usr system
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    return argv


def under_system_dirs(path: Path) -> bool:
    """Whether ``path`` is under a system directory the root binds (a real one, not a link)."""
    return any(path.is_relative_to(d) for d in SYSTEM_DIRS if not d.is_symlink())


def hidden_gpus_argv(all_gpus: Sequence[GpuDevice], given: Sequence[GpuDevice]) -> list[str]:
    """Hide every GPU but ``given`` from /proc/driver/nvidia and from PCI sysfs.

    Sysfs matters beyond information: a GPU's ``resource*`` files map its registers.
    """
    argv = []
    buses = {gpu.pci_bus_id for gpu in given}  # a MIG instance's is its GPU's
    if _PROC_NVIDIA_GPUS.is_dir():
        argv += ["--tmpfs", str(_PROC_NVIDIA_GPUS)]
        for bus in sorted(buses):
            entry = _PROC_NVIDIA_GPUS / bus
            if entry.exists():
                argv += ["--ro-bind", str(entry), str(entry)]
    for bus in sorted({gpu.pci_bus_id for gpu in all_gpus} - buses):
        device = _SYSFS_PCI_DEVICES / bus
        if device.exists():
            argv += ["--tmpfs", str(device.resolve())]
    return argv


_DEST_OPS = ("--dev", "--proc", "--tmpfs", "--dir", "--mqueue")
_SOURCE_DEST_OPS = ("--ro-bind", "--bind", "--dev-bind", "--symlink", "--ro-bind-try")
_ARITY = {
    **dict.fromkeys(_SOURCE_DEST_OPS, 2), **dict.fromkeys(_DEST_OPS, 1), "--setenv": 2,
    "--perms": 1, "--remount-ro": 1, "--chdir": 1, "--cap-add": 1, "--cap-drop": 1,
    "--info-fd": 1, "--uid": 1, "--gid": 1, "--unsetenv": 1, "--hostname": 1,
}  # fmt: skip


def with_parents(argv: list[str]) -> list[str]:
    """``argv`` with each directory above a mount point made first, searchable by anyone.

    bwrap run by root makes the directories it needs 0700: a sandbox whose user is not root
    could not reach /var/tmp, its device nodes under /dev/nvidia-caps, or its Python.
    """
    made = {Path("/")}
    out = argv[:1]
    i = 1
    while i < len(argv):
        start = i
        if argv[i] == "--perms":  # it applies to the operation after it
            i += 2
        op = argv[i]
        arity = _ARITY.get(op, 0)
        if op in _DEST_OPS or op in _SOURCE_DEST_OPS:
            dest = Path(argv[i + arity])
            for parent in reversed(dest.parents):
                if parent not in made:
                    out += ["--perms", "0755", "--dir", str(parent)]
                    made.add(parent)
            made.add(dest)
        out += argv[start : i + 1 + arity]
        i += 1 + arity
    return out
