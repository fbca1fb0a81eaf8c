"""Host-wide GPU ownership: one lease registry per host, shared by every local driver.

The protocol (docs/lease-protocol.md, docs/lease-file.schema.json) is small enough for a
client in any language (gpuhost/gpu-lease is one in POSIX sh with flock(1) and jq):

- the registry is a sticky, world-writable directory holding ``leases.<uid>.json`` for each
  user (gpuhost/leasefile.py): a user writes only its own, so only a lease's owner can
  release it or hand it on, and a grant judges the union of all of them. Every
  read-modify-write holds ``flock(LOCK_EX)`` on the directory; a file holds
  ``{"version": 4, "boot_id": ..., "leases": [...]}``, rewritten in place (several times
  faster than a new file renamed over it), then truncated: a reader parses the first JSON
  value and ignores bytes after it, which a writer killed between the write and the
  truncation leaves behind;
- each lease names its holder with a liveness handle (gpuhost/liveness.py): a lease whose
  holder is gone is reclaimed by the next request; a holder that cannot be judged is
  alive: a GPU is never taken back on a guess;
- every lease of an earlier boot is dead: a file of another boot's id, and a file written
  before this boot that cannot be read (a power loss in the middle of a write), hold
  nothing.

Checks that ask a container engine run outside the lock, bounded by their own timeouts, so
a hung engine delays only the request that needs its verdict, never the host's other grants.

What a request gets, given the leases that stand, is gpuhost/grants.py's policy: the lowest
free GPUs in PCI order, exclusive or shared, a MIG instance and its GPU one device.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpuhost import leasefile
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuAllocationError
from gpuhost.grants import grant
from gpuhost.leasefile import FORMAT_VERSION as FORMAT_VERSION
from gpuhost.leasefile import LeaseFileCorrupt as LeaseFileCorrupt
from gpuhost.liveness import PROCESS as PROCESS
from gpuhost.liveness import Holder as Holder
from gpuhost.liveness import LivenessCheck as LivenessCheck
from gpuhost.liveness import alive, dead_holders
from gpuhost.liveness import boot_id as boot_id
from gpuhost.liveness import boot_time as boot_time
from gpuhost.liveness import liveness_check as liveness_check
from gpuhost.liveness import process_running as process_running
from gpuhost.liveness import process_start_time as process_start_time
from gpuhost.liveness import register_liveness as register_liveness
from gpuhost.spec import EXCLUSIVE as EXCLUSIVE
from gpuhost.spec import SHARED as SHARED

DEFAULT_SHARE_LIMIT = 4
"""How many shared sandboxes may co-hold one GPU, unless a host says otherwise."""


class LeaseFileLocked(RuntimeError):
    """Another process held the registry's lock past the registry's bound."""


LOCK_TIMEOUT_S = 30.0
"""How long a registry waits for the lease file's lock. A grant holds it for milliseconds
(liveness checks run outside it); a holder for longer is stuck, or hostile."""


@dataclass(frozen=True)
class Lease:
    gpu_uuid: str
    driver: str
    sandbox_id: str
    session_id: str
    holder: Holder
    mode: str = EXCLUSIVE
    acquired_at: float = 0.0
    parent_uuid: str | None = None
    """The GPU of a leased MIG instance: leasing it makes the GPU busy too."""
    share_limit: int | None = None
    """For a shared lease: how many shared leases the GPU may hold at once, by its taker."""

    def describe(self) -> str:
        shared = " (shared)" if self.mode == SHARED else ""
        return (
            f"sandbox {self.sandbox_id} of the {self.driver} driver{shared}, held by {self.holder}"
        )


@dataclass(frozen=True)
class LeaseOwner:
    """Who asks: stamped on every lease the request grants."""

    driver: str
    sandbox_id: str
    session_id: str
    holder: Holder


def _leases(
    granted: Sequence[GpuDevice], owner: LeaseOwner, mode: str, share_limit: int
) -> list[Lease]:
    """The leases of a grant, stamped with its owner and the time."""
    now = time.time()
    limit = share_limit if mode == SHARED else None
    return [
        Lease(gpu.uuid, owner.driver, owner.sandbox_id, owner.session_id, owner.holder, mode,
              now, gpu.parent_uuid, limit)
        for gpu in granted
    ]  # fmt: skip


def _dead(leases: Collection[Lease]) -> set[Lease]:
    """The leases whose holders are gone, asking once per holder."""
    gone = dead_holders([lease.holder for lease in leases])
    return {lease for lease in leases if lease.holder in gone}


@dataclass
class _Held:
    """The leases under the lock.

    This user's are written back if they change; every other user's only their owners change.
    """

    mine: list[Lease]
    others: list[Lease]

    @property
    def all(self) -> list[Lease]:
        return [*self.mine, *self.others]


class LeaseRegistry:
    """The lease registry of one host (or of one simulated host) in ``directory``."""

    def __init__(self, directory: Path, lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        self.directory = directory
        self.lock_timeout_s = lock_timeout_s
        self.uid = os.geteuid()
        self.path = directory / leasefile.file_name(self.uid)
        """This user's lease file: the only one this registry writes."""
        self._thread_lock = threading.Lock()
        self._dir_fd = -1
        self._file_fd = -1
        _REGISTRIES.add(self)

    def acquire(
        self,
        inventory: Sequence[GpuDevice],
        owner: LeaseOwner,
        *,
        count: int = 0,
        exact: Sequence[GpuDevice] = (),
        mode: str = EXCLUSIVE,
        share_limit: int = DEFAULT_SHARE_LIMIT,
    ) -> tuple[GpuDevice, ...]:
        """Grant ``exact`` devices, or else ``count`` of ``inventory``, atomically.

        Exclusive requests take the lowest free devices; shared ones fill the lowest GPUs
        already shared (with room under the limit) before they take a free one.

        Holders are judged only when the leases as they stand refuse the grant, which keeps
        the host lock short (a /proc read per holder): then the leases of dead processes are
        dropped, and those whose holders only a container engine can judge are judged
        outside the lock, and the grant is tried again without the dead ones.
        """
        with self._locked(reclaim=False) as held, contextlib.suppress(GpuAllocationError):
            granted = grant(held.all, inventory, count, exact, mode, share_limit)
            held.mine.extend(_leases(granted, owner, mode, share_limit))
            return granted
        dead: set[Lease] = set()
        while True:
            with self._locked(drop=dead) as held:
                try:
                    granted = grant(held.all, inventory, count, exact, mode, share_limit)
                except GpuAllocationError as exc:
                    refusal = exc
                    suspects = [x for x in held.all if x.holder.kind != PROCESS and x not in dead]
                else:
                    held.mine.extend(_leases(granted, owner, mode, share_limit))
                    return granted
            newly_dead = _dead(suspects)
            if not newly_dead:
                raise refusal
            dead |= newly_dead

    def set_holder(self, sandbox_id: str, holder: Holder) -> None:
        """Hand a sandbox's leases to the process or container that now embodies it."""
        with self._locked_mine() as mine:
            mine[:] = [
                replace(lease, holder=holder) if lease.sandbox_id == sandbox_id else lease
                for lease in mine
            ]

    def release(self, sandbox_id: str) -> int:
        """Drop a sandbox's leases of this user; releasing twice is harmless.

        Returns how many were held. Another user's leases are theirs alone to release.
        """
        with self._locked_mine() as mine:
            kept = [lease for lease in mine if lease.sandbox_id != sandbox_id]
            released = len(mine) - len(kept)
            mine[:] = kept
            return released

    def release_session(self, session_id: str, driver: str | None = None) -> list[Lease]:
        """Drop every lease this user took in a session, or only ``driver``'s (``reap``)."""

        def reaped(lease: Lease) -> bool:
            return lease.session_id == session_id and driver in (None, lease.driver)

        with self._locked_mine() as mine:
            gone = [lease for lease in mine if reaped(lease)]
            mine[:] = [lease for lease in mine if not reaped(lease)]
            return gone

    def leases(self) -> list[Lease]:
        """Every user's live leases, after reclaiming this user's whose holders are gone."""
        with self._locked() as held:
            snapshot = held.all
        dead = _dead([lease for lease in snapshot if lease.holder.kind != PROCESS])
        if not dead:
            return snapshot
        with self._locked(drop=dead) as held:
            return held.all

    def free(self, inventory: Sequence[GpuDevice]) -> tuple[GpuDevice, ...]:
        held = {lease.gpu_uuid for lease in self.leases()}
        return tuple(gpu for gpu in inventory if gpu.uuid not in held)

    @contextmanager
    def _locked(self, reclaim: bool = True, drop: Collection[Lease] = ()) -> Iterator[_Held]:
        """Hold the host lock; yield the leases; write this user's back if they changed.

        With ``reclaim``, leases of dead processes are left out first, and so are ``drop``,
        leases already judged dead outside the lock: this user's are dropped from its file,
        other users' only from the view (their owners drop them).
        """

        def live(lease: Lease) -> bool:
            return not reclaim or (
                lease not in drop and (lease.holder.kind != PROCESS or self._judge(lease.holder))
            )

        with self._exclusive():
            stored = self._load_mine()
            held = _Held(
                [x for x in stored if live(x)], [x for x in self._load_others() if live(x)]
            )
            yield held
            if held.mine != stored:
                self._store(held.mine)

    @contextmanager
    def _locked_mine(self) -> Iterator[list[Lease]]:
        """Hold the host lock; yield this user's leases; write them back if they changed.

        Giving leases back or handing them on needs no liveness judgement, nor any other
        user's file: one that another user made unreadable stops grants, never a release.
        """
        with self._exclusive():
            stored = self._load_mine()
            mine = list(stored)
            yield mine
            if mine != stored:
                self._store(mine)

    def _judge(self, holder: Holder) -> bool:
        """Whether a process holder lives, judged under the lock."""
        return alive(holder)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Exclude every other user of the registry: threads here, and other processes.

        ``flock`` on the directory excludes other open file descriptions (other processes,
        other registry objects); the thread lock excludes threads sharing this one.
        """
        with self._thread_lock:
            fd = self._dir()
            self._flock(fd)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _flock(self, fd: int) -> None:
        """``flock(LOCK_EX)`` within ``lock_timeout_s``; ``LeaseFileLocked`` naming the holder."""
        deadline = time.monotonic() + self.lock_timeout_s
        interval = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holders = lock_holders(fd) or "a process not seen here"
                    raise LeaseFileLocked(
                        f"the lease registry {self.directory} was locked for over "
                        f"{self.lock_timeout_s:g} s by {holders}"
                    ) from None
                time.sleep(interval)
                interval = min(interval * 2, 0.05)

    def _dir(self) -> int:
        """The registry's directory, open: its lock, and the base of every file opened."""
        if self._dir_fd < 0:
            if not self.directory.exists():
                self.directory.mkdir(parents=True, exist_ok=True)
                # Every user's sandboxes share one host's GPUs: every user may add a file,
                # and none may remove or rename another's.
                with contextlib.suppress(PermissionError):
                    self.directory.chmod(0o1777)
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW
            try:
                fd = os.open(self.directory, flags)
            except NotADirectoryError:
                raise LeaseFileCorrupt(
                    f"the lease registry {self.directory} is not a directory: refusing to use it"
                ) from None
            try:
                leasefile.check_directory(self.directory, os.fstat(fd))
            except LeaseFileCorrupt:
                os.close(fd)
                raise
            self._dir_fd = fd
        return self._dir_fd

    def _fd(self) -> int:
        """The lease file of this user, made if need be, opened through the directory's fd.

        Whatever another user planted under its name is removed, never opened or followed
        (``leasefile.open_own``): a user who can write the directory would have root open a
        file of their choosing, hang on a FIFO, or write root's leases where they can change
        them.
        """
        if self._file_fd < 0:
            self._file_fd = leasefile.open_own(self._dir(), self.path, self.uid)
        return self._file_fd

    def close(self) -> None:
        """Close the registry's directory and file; the next use opens them again."""
        for fd in (self._dir_fd, self._file_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._dir_fd = self._file_fd = -1

    def __del__(self) -> None:
        self.close()

    def _after_fork_in_child(self) -> None:
        # The parent's open directory would share its flock with the child, and a thread of
        # the parent may have held the thread lock at the fork: start afresh.
        self.close()
        self._thread_lock = threading.Lock()

    def _load_mine(self) -> list[Lease]:
        fd = self._fd()
        st = os.fstat(fd)
        return self._read(self.path, os.pread(fd, st.st_size, 0), st.st_mtime)

    def _load_others(self) -> list[Lease]:
        """Every other user's leases, and a refusal while a file of version 3 holds one."""
        found: list[Lease] = []
        directory = self._dir()
        for owner, name in leasefile.others_files(directory, self.uid):
            path = self.directory / name
            read = leasefile.read_file(directory, path, owner)
            leases = [] if read is None else self._read(path, *read)
            if owner is None and leases:
                raise LeaseFileCorrupt(
                    f"{path} holds leases of a client of protocol version 3 or older, which "
                    "cannot share a host with this one: stop it, then delete the file"
                )
            found.extend(leases)
        return found

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        """The leases of this boot in a lease file: ``parse``, then the boot's rule."""
        if not data:
            return []
        try:
            document = leasefile.parse(data)
        except leasefile.InvalidLeaseFile as exc:
            if mtime < boot_time() and not isinstance(exc, leasefile.NewerVersion):
                return []  # cut short before this boot (a power loss): nothing of it lives
            raise leasefile.corrupt(path, exc) from None
        if document.boot_id not in (None, boot_id()):
            return []  # every lease of an earlier boot is dead
        return [lease_from_dict(item) for item in document.leases]

    def _store(self, leases: list[Lease]) -> None:
        # Rewritten in place; the lock keeps readers out until the write and the truncation
        # are both done. No fsync: a power loss loses the last writes, and every lease of an
        # earlier boot is dead anyway.
        payload = {
            "version": FORMAT_VERSION,
            "boot_id": boot_id(),
            "leases": [lease_to_dict(lease) for lease in leases],
        }
        data = json.dumps(payload).encode()
        fd = self._fd()
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
        os.ftruncate(fd, len(data))


_REGISTRIES: weakref.WeakSet[LeaseRegistry] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for registry in _REGISTRIES:
        registry._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def lease_to_dict(lease: Lease) -> dict[str, Any]:
    # Hand-written rather than dataclasses.asdict, which deep-copies and is the hot spot.
    return {
        "gpu_uuid": lease.gpu_uuid,
        "driver": lease.driver,
        "sandbox_id": lease.sandbox_id,
        "session_id": lease.session_id,
        "holder": {"kind": lease.holder.kind, "ref": lease.holder.ref},
        "mode": lease.mode,
        "acquired_at": lease.acquired_at,
        **({"parent_uuid": lease.parent_uuid} if lease.parent_uuid else {}),
        **({"share_limit": lease.share_limit} if lease.share_limit else {}),
    }


def lease_from_dict(item: Mapping[str, Any]) -> Lease:
    return Lease(**{**item, "holder": Holder(**item["holder"])})


def lock_holders(fd: int) -> str:
    """The processes /proc/locks says hold a lock on the file of ``fd``: pid, user, command."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return ""
    pids = sorted({f[4] for line in lines if len(f := line.split()) > 5 and f[5] == inode})
    held = []
    for pid in pids:
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            held.append(f"pid {pid}")
            continue
        held.append(f"pid {pid} (uid {uid}: {command.decode(errors='replace').strip()[:120]})")
    return ", ".join(held)
