"""A host user of its own for each sandbox that runs as a user of this host.

Processes of one host user share the kernel's per-user state, whatever their namespaces: the
user keyrings (not namespaced), the process limit (``RLIMIT_NPROC`` counts every process of
the user), the per-user quotas of keys, inotify instances and message queues. Sandboxes that
all ran as one uid could see and spend each other's: a key one added was found by the next,
after the first had closed. So each sandbox that a root-run driver makes runs as a uid and gid
of its own, from ``SANDBOX_UIDS``, claimed here for as long as the sandbox lives.

The claim is host-wide and any client can take part, in any language (docs/security.md,
"Sandbox users"): the uid is the name of a file in ``UID_DIR``, a directory only root can
write, and whoever holds an exclusive ``flock`` on that file owns the uid. The creator keeps
the lock for the sandbox's life, and the kernel drops it when the creator exits, however it
ends. A uid is taken only when its lock is free *and* no process of the host runs as it: the
processes of a sandbox whose creator was killed may still be exiting.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from gpuhost.errors import SandboxStartError
from gpuhost.procfs import each_process

UID_DIR = Path("/run/gpu-sandbox-uids")
"""Where the claims live: one per host, whatever the run's lease registry or simulated host,
since what a shared uid shares is the host kernel's."""
SANDBOX_UIDS = range(1_999_100_000, 1_999_100_000 + 65_536)
"""The uids (each also a gid) sandboxes run as: no account's, no simulated node group's
(``gpuhost.simulated.NODE_GID``), below 2**31 for tools that read ids as signed numbers."""


@dataclass
class SandboxUser:
    """A uid (and gid of the same number) held for one sandbox until ``release``."""

    uid: int
    _lock_fd: int = field(repr=False)

    @property
    def gid(self) -> int:
        return self.uid

    def release(self) -> None:
        """Give the uid back: once no process of it is left, another sandbox may take it."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def claim(directory: Path = UID_DIR) -> SandboxUser:
    """A uid of ``SANDBOX_UIDS`` that no other sandbox holds and no process runs as.

    SandboxStartError when none is free, or when ``directory`` is not root's alone.
    """
    dir_fd = _private_directory(directory)
    try:
        start = secrets.randbelow(len(SANDBOX_UIDS))
        for step in range(len(SANDBOX_UIDS)):
            uid = SANDBOX_UIDS[(start + step) % len(SANDBOX_UIDS)]
            lock_fd = _lock(dir_fd, directory, uid)
            if lock_fd is not None:
                return SandboxUser(uid, lock_fd)
    finally:
        os.close(dir_fd)
    raise SandboxStartError(
        f"no sandbox uid is free: all {len(SANDBOX_UIDS)} of {SANDBOX_UIDS.start}.."
        f"{SANDBOX_UIDS.stop - 1} are held (claims in {directory}) or run a process"
    )


def _lock(dir_fd: int, directory: Path, uid: int) -> int | None:
    """The locked claim file of ``uid``, when its lock is free and no process runs as it."""
    name = str(uid)
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NO_LINKS, 0o600, dir_fd=dir_fd)
        fresh = True  # nobody claimed it since boot (the directory is on a tmpfs): no process
    except FileExistsError:
        try:
            fd = os.open(name, os.O_RDWR | _NO_LINKS, dir_fd=dir_fd)
        except OSError as exc:  # a link (ELOOP), a FIFO... where only root writes
            raise SandboxStartError(
                f"the sandbox uid claim {directory / name} cannot be opened: {exc.strerror}"
            ) from None
        fresh = False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SandboxStartError(f"the sandbox uid claim {directory / name} is not a file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    except BaseException:
        os.close(fd)
        raise
    if not fresh and runs_a_process(uid):
        os.close(fd)
        return None
    return fd


def runs_a_process(uid: int) -> bool:
    """Whether a process of the host has ``uid`` as a uid or gid: real, effective, saved or fs."""
    ids = str(uid)
    for _, status in each_process("status"):
        for line in status.splitlines():
            if line.startswith((b"Uid:", b"Gid:")) and ids in line.decode().split()[1:]:
                return True
    return False


_NO_LINKS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _private_directory(directory: Path) -> int:
    """An open fd of ``directory``, made when missing: root's (this user's) alone, not a link."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxStartError(
            f"the sandbox uid claims {directory} cannot be opened as a directory: {exc.strerror}"
        ) from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        os.close(fd)
        raise SandboxStartError(
            f"the sandbox uid claims {directory} belong to uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):o}: only uid {os.geteuid()} may write there; remove it"
        )
    return fd
