"""The guest image: the kernel and initramfs every VM boots, and initramfs built from it.

A kernel and a busybox initramfs carrying the exec agent, which ``make vm-image``
(``scripts/vm-image.sh``) builds from Debian's cloud kernel into ``/var/cache/gpu-sandbox/vm``:
``GPU_SANDBOX_VM_IMAGE`` names an image directory (default
``/var/cache/gpu-sandbox/vm/current``), or ``GPU_SANDBOX_VM_KERNEL`` and
``GPU_SANDBOX_VM_INITRD`` a kernel and an initramfs of the user's own. The guest keeps
nothing: its root is the initramfs.

What this process adds to an image, a second cpio archive appended to the image's
initramfs (``with_overlay``, ``cpio``), lives under the driver's run directory, in memory,
and is removed once unused for an hour (``prune``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from drivers.host_process import HOST_ENV
from gpuhost import strict
from gpuhost.errors import SandboxStartError

IMAGE_ENV = "GPU_SANDBOX_VM_IMAGE"
KERNEL_ENV = "GPU_SANDBOX_VM_KERNEL"
INITRD_ENV = "GPU_SANDBOX_VM_INITRD"
DEFAULT_IMAGE_DIR = Path("/var/cache/gpu-sandbox/vm/current")
GUEST_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
"""The PATH of a command in the guest."""
CPIO_TIMEOUT_S = 30.0
"""Packing a few files (the simulated host's share) takes milliseconds."""
_KERNEL_KEYS = ("kernel", "initramfs", "kernel_package", "kernel_version", "kernel_release")
IMAGE_META: dict[str, strict.Kind] = dict.fromkeys((*_KERNEL_KEYS, "busybox", "guest"), str)
"""The guest image's image.json, as scripts/vm-image.sh writes it."""
UNUSED_AFTER_S = 3600.0
"""Templates and combined initramfs files unused this long are removed (they live in /run,
in memory); simulated hosts come and go with each run."""


@dataclasses.dataclass(frozen=True)
class GuestImage:
    """The kernel and initramfs the VMs boot, and what they are."""

    kernel: Path
    initrd: Path
    description: str


def find_guest_image() -> GuestImage:
    """The kernel and initramfs to boot: the user's own, or ``make vm-image``'s."""
    kernel, initrd = os.environ.get(KERNEL_ENV), os.environ.get(INITRD_ENV)
    if kernel or initrd:
        if not (kernel and initrd and Path(kernel).is_file() and Path(initrd).is_file()):
            raise SandboxStartError(
                f"needed both {KERNEL_ENV} and {INITRD_ENV} naming files (found "
                f"{KERNEL_ENV}={kernel!r}, {INITRD_ENV}={initrd!r})"
            )
        return GuestImage(Path(kernel), Path(initrd), f"kernel {Path(kernel).name}")
    directory = Path(os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE_DIR)
    try:
        meta = strict.read_record(directory / "image.json", IMAGE_META)
    except strict.InvalidFile as exc:
        raise SandboxStartError(
            f"needed the guest image in {directory} (found none: {exc}; build it with "
            "`make vm-image`, or point GPU_SANDBOX_VM_KERNEL and GPU_SANDBOX_VM_INITRD at "
            "a kernel and an initramfs of your own)"
        ) from None
    return GuestImage(
        directory / meta["kernel"],
        directory / meta["initramfs"],
        f"{meta['kernel_package']} {meta['kernel_version']}",
    )


def with_overlay(
    base: Path, tree: Path, target: str, directory: Path, lock: threading.Lock
) -> Path:
    """The initramfs ``base`` with ``tree`` appended at ``target`` (a second cpio).

    Built once per initramfs and tree into ``directory``, then reused by every VM that
    boots it; ``lock`` keeps the threads of this process from building it twice.
    """
    digest = hashlib.sha256(str(base).encode())
    digest.update(str(base.stat().st_mtime_ns).encode())
    for path in sorted(tree.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(tree)).encode() + path.read_bytes())
    combined = directory / f"{digest.hexdigest()[:20]}.cpio"
    with lock:
        if combined.exists():
            touch(combined)
            return combined
        combined.parent.mkdir(parents=True, exist_ok=True)
        prune(combined.parent, "*.cpio")
        with tempfile.TemporaryDirectory(prefix="gpu-sandbox-vm-") as tmp:
            staging = Path(tmp) / "root"
            shutil.copytree(tree, staging / target.lstrip("/"))
            overlay = cpio(staging)
        partial = combined.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        partial.write_bytes(base.read_bytes() + overlay)
        partial.rename(combined)
    return combined


def cpio(root: Path) -> bytes:
    """A newc archive of ``root``'s tree, owned by root, as the kernel unpacks initramfs."""
    names = sorted(str(path.relative_to(root)) for path in root.rglob("*"))
    done = subprocess.run(
        ["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"],
        input="\n".join(names).encode() + b"\n",
        cwd=root,
        capture_output=True,
        check=False,
        env=HOST_ENV,
        timeout=CPIO_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise SandboxStartError(f"cpio could not pack the guest overlay: {done.stderr.decode()}")
    return done.stdout


def touch(path: Path) -> None:
    """Mark ``path`` used now, so that ``prune`` leaves it."""
    with contextlib.suppress(OSError):
        os.utime(path)


def prune(directory: Path, pattern: str, also: Sequence[str] = ()) -> None:
    """Remove what no VM has used for a while: templates and initramfs of hosts long gone.

    Each is read only as a VM starts (a running VM keeps its mapping of a template's memory
    file); an hour unused is long past any start. ``also``: suffixes of files that go with.
    """
    for path in directory.glob(pattern):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > UNUSED_AFTER_S:
                path.unlink()
                for suffix in also:
                    path.with_suffix(suffix).unlink(missing_ok=True)
