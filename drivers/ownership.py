"""Host-wide GPU ownership: one lease registry per host, shared by every local driver.

The registry is a JSON file guarded by an ``flock`` on the file itself, so grants are
atomic across threads *and* processes: two drivers, two pytest-xdist workers or two users
never hand out the same GPU. Each lease names its holder with a liveness handle (a process
id plus its start time, or a container id a driver knows how to check); a lease whose holder
is gone is reclaimed by the next request, so a crashed sandbox cannot keep a GPU.

Selection is deterministic: the lowest free GPUs in PCI order. Every lease is exclusive
today; ``mode`` is recorded per lease so a later shared mode only has to change
``_conflicts``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from drivers.errors import GpuBusy, GpusExhausted
from drivers.gpus import GpuDevice

EXCLUSIVE = "exclusive"
_FORMAT_VERSION = 1


class LeaseFileCorrupt(RuntimeError):
    """The lease file holds something that is not a lease list (a write cut short)."""


@dataclass(frozen=True)
class Holder:
    """What keeps a lease alive: ``kind`` picks the liveness check, ``ref`` identifies it."""

    kind: str
    ref: str

    @classmethod
    def process(cls, pid: int) -> Holder:
        """The process ``pid``, pinned by its start time so a reused pid is not mistaken."""
        return cls("process", f"{_boot_id()}:{pid}:{process_start_time(pid)}")

    def __str__(self) -> str:
        return f"{self.kind} {self.ref}"


@dataclass(frozen=True)
class Lease:
    gpu_uuid: str
    driver: str
    sandbox_id: str
    session_id: str
    holder: Holder
    mode: str = EXCLUSIVE
    acquired_at: float = 0.0

    def describe(self) -> str:
        return f"sandbox {self.sandbox_id} of the {self.driver} driver, held by {self.holder}"


@dataclass(frozen=True)
class LeaseOwner:
    """Who asks: stamped on every lease the request grants."""

    driver: str
    sandbox_id: str
    session_id: str
    holder: Holder


LivenessCheck = Callable[[Holder], bool]


def _process_alive(holder: Holder) -> bool:
    try:
        boot_id, pid, start = holder.ref.split(":")
        pid_number = int(pid)
    except ValueError:
        return True  # not ours to judge: never take a GPU back on a guess
    if boot_id != _boot_id():
        return False
    try:
        fields = _stat_fields(pid_number)
    except (FileNotFoundError, ProcessLookupError):  # gone, or exiting as we read
        return False
    except OSError:  # hidden from us (/proc mounted with hidepid): not proof it is gone
        return True
    # A zombie has exited: its parent just has not reaped it yet.
    return fields[19] == start and fields[0] not in ("Z", "X")


LIVENESS_CHECKS: dict[str, LivenessCheck] = {"process": _process_alive}
"""Liveness per holder kind. Drivers whose sandboxes outlive a process (containers) add theirs.

A holder of a kind with no check is treated as alive: the registry never takes a GPU back
from a holder it cannot prove is gone.
"""


class LeaseRegistry:
    """The lease file of one host (or of one simulated host) under ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._path = directory / "leases.json"
        self._thread_lock = threading.Lock()
        self._file_fd = -1
        _REGISTRIES.add(self)

    def acquire(
        self,
        inventory: Sequence[GpuDevice],
        owner: LeaseOwner,
        *,
        count: int = 0,
        exact: Sequence[GpuDevice] = (),
    ) -> tuple[GpuDevice, ...]:
        """Grant ``exact`` devices, or else the ``count`` lowest free ones, atomically."""
        with self._locked() as leases:
            held = {lease.gpu_uuid: lease for lease in leases}
            if exact:
                for gpu in exact:
                    if _conflicts(held.get(gpu.uuid), EXCLUSIVE):
                        raise GpuBusy(gpu.describe(), held[gpu.uuid].describe())
                granted = tuple(exact)
            else:
                free = [gpu for gpu in inventory if not _conflicts(held.get(gpu.uuid), EXCLUSIVE)]
                if len(free) < count:
                    raise GpusExhausted(count, len(free), len(inventory))
                granted = tuple(free[:count])
            now = time.time()
            leases.extend(
                Lease(
                    gpu.uuid,
                    owner.driver,
                    owner.sandbox_id,
                    owner.session_id,
                    owner.holder,
                    EXCLUSIVE,
                    now,
                )
                for gpu in granted
            )
            return granted

    def set_holder(self, sandbox_id: str, holder: Holder) -> None:
        """Hand a sandbox's leases to the process or container that now embodies it."""
        with self._locked(reclaim=False) as leases:
            leases[:] = [
                replace(lease, holder=holder) if lease.sandbox_id == sandbox_id else lease
                for lease in leases
            ]

    def release(self, sandbox_id: str) -> int:
        """Drop a sandbox's leases; releasing twice is harmless. Returns how many were held."""
        with self._locked(reclaim=False) as leases:
            kept = [lease for lease in leases if lease.sandbox_id != sandbox_id]
            released = len(leases) - len(kept)
            leases[:] = kept
            return released

    def release_session(self, session_id: str, driver: str | None = None) -> list[Lease]:
        """Drop every lease a test session took, or only ``driver``'s (what ``reap`` calls)."""

        def reaped(lease: Lease) -> bool:
            return lease.session_id == session_id and driver in (None, lease.driver)

        with self._locked(reclaim=False) as leases:
            gone = [lease for lease in leases if reaped(lease)]
            leases[:] = [lease for lease in leases if not reaped(lease)]
            return gone

    def leases(self) -> list[Lease]:
        """The live leases, after reclaiming those whose holders are gone."""
        with self._locked() as leases:
            return list(leases)

    def free(self, inventory: Sequence[GpuDevice]) -> tuple[GpuDevice, ...]:
        held = {lease.gpu_uuid for lease in self.leases()}
        return tuple(gpu for gpu in inventory if gpu.uuid not in held)

    @contextmanager
    def _locked(self, reclaim: bool = True) -> Iterator[list[Lease]]:
        """Hold the host lock; yield the leases; write them back if they changed.

        With ``reclaim``, leases whose holders are gone are dropped first. Giving leases
        back or handing them on needs no such judgement, which may cost a call to a
        container engine per lease: those leave it to the next grant.
        """
        with self._exclusive() as fd:
            stored = self._load(fd)
            leases = [lease for lease in stored if not reclaim or _alive(lease.holder)]
            yield leases
            if leases != stored:
                self._store(fd, leases)

    @contextmanager
    def _exclusive(self) -> Iterator[int]:
        """Exclude every other holder of the lease file: threads here, and other processes.

        ``flock`` excludes other open file descriptions (other processes, other registry
        objects); the thread lock excludes threads sharing this one.
        """
        with self._thread_lock:
            fd = self._fd()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield fd
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _fd(self) -> int:
        if self._file_fd < 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._file_fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            # Every user's sandboxes share one host's GPUs, so every user may take leases.
            with contextlib.suppress(PermissionError):
                os.fchmod(self._file_fd, 0o666)
        return self._file_fd

    def _after_fork_in_child(self) -> None:
        # The parent's open file would share its flock with the child, and a thread of the
        # parent may have held the thread lock at the fork: start afresh.
        if self._file_fd >= 0:
            os.close(self._file_fd)
        self._file_fd = -1
        self._thread_lock = threading.Lock()

    @staticmethod
    def _load(fd: int) -> list[Lease]:
        size = os.fstat(fd).st_size
        if size == 0:
            return []
        # raw_decode: a writer killed between pwrite and ftruncate leaves stale bytes behind.
        text = os.pread(fd, size, 0).decode(errors="replace")
        try:
            raw, _ = json.JSONDecoder().raw_decode(text)
            return [_lease_from_dict(item) for item in raw["leases"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise LeaseFileCorrupt(
                f"the GPU lease file (fd {fd}) cannot be read ({exc}); no GPU can be granted "
                "safely until it is fixed: stop every sandbox on this host, then delete it"
            ) from exc

    @staticmethod
    def _store(fd: int, leases: list[Lease]) -> None:
        # Rewritten in place, which is several times faster than write-and-rename; the lock
        # keeps readers out until the write and the truncation are both done.
        payload = {"version": _FORMAT_VERSION, "leases": [_lease_to_dict(x) for x in leases]}
        data = json.dumps(payload).encode()
        written = 0
        while written < len(data):
            written += os.pwrite(fd, data[written:], written)
        os.ftruncate(fd, len(data))


_REGISTRIES: weakref.WeakSet[LeaseRegistry] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for registry in _REGISTRIES:
        registry._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _conflicts(existing: Lease | None, mode: str) -> bool:
    # Exclusive is the only mode today: any existing lease conflicts.
    return existing is not None


def _alive(holder: Holder) -> bool:
    check = LIVENESS_CHECKS.get(holder.kind) or _built_in_check(holder.kind)
    return True if check is None else check(holder)


def _built_in_check(kind: str) -> LivenessCheck | None:
    """The check a built-in driver registers for its holders, importing it on first need.

    A process that never used the docker driver must still see a removed container's GPUs
    as free.
    """
    from drivers import REGISTRY

    target = REGISTRY.get(kind)
    if target is None:
        return None
    try:
        importlib.import_module(target.partition(":")[0])
    except Exception:  # its client library is missing or broken: the holder cannot be judged
        return None
    return LIVENESS_CHECKS.get(kind)


def _lease_to_dict(lease: Lease) -> dict[str, Any]:
    # Hand-written rather than dataclasses.asdict, which deep-copies and is the hot spot.
    return {
        "gpu_uuid": lease.gpu_uuid,
        "driver": lease.driver,
        "sandbox_id": lease.sandbox_id,
        "session_id": lease.session_id,
        "holder": {"kind": lease.holder.kind, "ref": lease.holder.ref},
        "mode": lease.mode,
        "acquired_at": lease.acquired_at,
    }


def _lease_from_dict(item: Mapping[str, Any]) -> Lease:
    return Lease(**{**item, "holder": Holder(**item["holder"])})


_BOOT_ID: str | None = None


def _boot_id() -> str:
    global _BOOT_ID
    if _BOOT_ID is None:
        _BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return _BOOT_ID


def _stat_fields(pid: int) -> list[str]:
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    with open(f"/proc/{pid}/stat", "rb") as stat:
        raw = stat.read().decode()
    return raw[raw.rindex(")") + 2 :].split()


def process_start_time(pid: int) -> str:
    """When ``pid`` started, in clock ticks since boot: with the pid, a unique identity."""
    return _stat_fields(pid)[19]
