"""Planted breakers of the host-wide lease registry: GPU-HOSTWIDE-01.

GPUs another driver, process or client of the registry holds are never granted. Their tests:
conformance/test_hostwide.py. Besides the hand-written ones, a family per dimension of who
holds (conformance/holders.py), one breaker per value: a registry blind to that holder's
leases (``MUST_HOLD``), one that judges that holder alive though it is gone (``GONE``), one
that takes the registry's lock from a client that holds it long (``LOCK_HOLDERS``). A value
without its breaker fails at import.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self

from conformance.holders import (
    EARLIER_BOOT,
    GONE,
    LOCK_HOLDER,
    LOCK_HOLDERS,
    MUST_HOLD,
    NO_PROCESS,
    OTHER_PROCESS,
    OTHER_SESSION,
    OTHER_USER_PYTHON,
    OTHER_USER_SH,
    PID_REUSED,
    SH_CLIENT,
    UNJUDGED,
    ZOMBIE,
)
from drivers import REGISTRY
from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost
from gpuhost.leasefile import InvalidLeaseFile, corrupt, parse
from gpuhost.leases import PROCESS, Holder, Lease, LeaseOwner, boot_id, liveness_check
from tests.breakers.base import BrokenDriver, BrokenRegistry, family


class _NoBootIdMeansEarlierBoot(BrokenRegistry):
    """Reads a file without ``boot_id`` (version 1) as one of an earlier boot."""

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        if data and parse(data).boot_id != boot_id():
            return []  # "every lease of an earlier boot is dead"
        return super()._read(path, data, mtime)


class V1FileAsEarlierBoot(BrokenDriver):
    """GPU-HOSTWIDE-01: takes a version-1 lease file (no boot_id) for an earlier boot's: dead."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _NoBootIdMeansEarlierBoot


class _CutShortHoldsNothing(BrokenRegistry):
    """Reads a lease file it cannot parse as empty, whenever it was written."""

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        try:
            parse(data) if data else None
        except InvalidLeaseFile:
            return []  # "a half-written file holds nothing"
        return super()._read(path, data, mtime)


class CutShortFileHoldsNothing(BrokenDriver):
    """GPU-HOSTWIDE-01: a lease file cut short in this boot holds nothing; its GPUs are granted."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _CutShortHoldsNothing


class _CutShortAlwaysCorrupt(BrokenRegistry):
    """Refuses every grant over a lease file it cannot parse, of an earlier boot too."""

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        try:
            parse(data) if data else None
        except InvalidLeaseFile as exc:
            raise corrupt(path, exc) from None
        return super()._read(path, data, mtime)


class CutShortBeforeBootBlocks(BrokenDriver):
    """GPU-HOSTWIDE-01: a lease file cut short before this boot (a power loss) stops every grant."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _CutShortAlwaysCorrupt


class _RegistryOfItsOwn(BrokenRegistry):
    """A sound registry, in a directory of its own beside the host's."""

    @classmethod
    def replacing(cls, host: GpuHost) -> Self:
        return cls(host.leases.directory.parent / "own-registry")


class OwnRegistry(BrokenDriver):
    """GPU-HOSTWIDE-01: a sound, locked lease registry of its own, blind to the host's."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _RegistryOfItsOwn


def _pid_alive(holder: Holder) -> bool:
    """`kill -0 <pid>`: the holder's boot and start time go unread."""
    try:
        os.kill(int(holder.ref.split(":")[1]), 0)
    except ProcessLookupError:
        return False
    except (ValueError, IndexError, PermissionError):
        return True
    return True


class _PidOnlyRegistry(BrokenRegistry):
    def _judge(self, holder: Holder) -> bool:
        return _pid_alive(holder)


class PidOnlyLiveness(BrokenDriver):
    """GPU-HOSTWIDE-01: judges a process holder by its pid alone: a reused one keeps GPUs."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _PidOnlyRegistry


class _LockfRegistry(BrokenRegistry):
    """Locks the lease file with POSIX record locks ("lockf is the portable one"), not flock."""

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self._thread_lock:
            fd = self._fd()
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)


class PosixRecordLocks(BrokenDriver):
    """GPU-HOSTWIDE-01: locks the registry with lockf: every flock client of it races it."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _LockfRegistry


# -- generated: a breaker per holder of conformance/holders.py ------------------------------


class _Forgetful(BrokenRegistry):
    """Leaves out of every read the leases ``forgets`` picks; its own user's, from its file too.

    It remembers who asked through it (driver and session) and the sandboxes it granted.
    """

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.asked: set[tuple[str, str]] = set()
        self.granted: set[str] = set()

    def forgets(self, lease: Lease, mine: bool) -> bool:
        raise NotImplementedError

    def acquire(
        self, inventory: Sequence[GpuDevice], owner: LeaseOwner, **how: Any
    ) -> tuple[GpuDevice, ...]:
        self.asked.add((owner.driver, owner.session_id))
        granted = super().acquire(inventory, owner, **how)
        self.granted.add(owner.sandbox_id)
        return granted

    def _load_mine(self) -> list[Lease]:
        return [lease for lease in super()._load_mine() if not self.forgets(lease, True)]

    def _load_others(self) -> list[Lease]:
        return [lease for lease in super()._load_others() if not self.forgets(lease, False)]


Forgets = Callable[[_Forgetful, Lease, bool], bool]

_FORGETS: dict[str, tuple[str, str, Forgets]] = {
    SH_CLIENT: (
        "ReclaimsUnknownDrivers",
        "takes its user's leases of drivers it does not know (the sh client's gpu-lease) for "
        "leftovers of a driver since removed",
        lambda registry, lease, mine: mine and lease.driver not in REGISTRY,
    ),
    NO_PROCESS: (
        "ReclaimsNonProcessHolders",
        "drops leases whose holders are no process (a container, a VM) as stale",
        lambda registry, lease, mine: mine and lease.holder.kind != PROCESS,
    ),
    OTHER_PROCESS: (
        "ReclaimsItsSessionsUnknownSandboxes",
        "drops leases of its own driver and session that it did not grant itself, as "
        "leftovers of a crashed run of the session",
        lambda registry, lease, mine: (
            mine
            and (lease.driver, lease.session_id) in registry.asked
            and lease.sandbox_id not in registry.granted
        ),
    ),
    OTHER_SESSION: (
        "ReclaimsOtherSessions",
        "drops its driver's leases of other sessions, as crashed runs' leftovers",
        lambda registry, lease, mine: (
            mine
            and any(
                lease.driver == driver and lease.session_id != session
                for driver, session in registry.asked
            )
        ),
    ),
    OTHER_USER_PYTHON: (
        "ReadsItsOwnUsersFileOnly",
        "reads its own user's leases.<uid>.json and no other user's",
        lambda registry, lease, mine: not mine,
    ),
    OTHER_USER_SH: (
        "TrustsOtherUsersKnownDriversOnly",
        "reads another user's leases of the drivers it knows only (the sh client's gpu-lease "
        "is none of them: anyone may write anything in their own file)",
        lambda registry, lease, mine: not mine and lease.driver not in REGISTRY,
    ),
    UNJUDGED: (
        "ReclaimsKindsItCannotJudge",
        "takes a holder of a kind it has no liveness check for (slurm-job) for dead",
        lambda registry, lease, mine: (
            lease.holder.kind != PROCESS and liveness_check(lease.holder.kind) is None
        ),
    ),
}


def _blind_to(value: str) -> type[BrokenDriver]:
    name, defect, forgets = _FORGETS[value]
    registry = type(f"_{name}Registry", (_Forgetful,), {"forgets": forgets})
    doc = f"GPU-HOSTWIDE-01: {defect}. Who holds: {value}."
    return type(
        name, (BrokenDriver,), {"__doc__": doc, "BREAKS": "GPU-HOSTWIDE-01", "LEASES": registry}
    )


def _state(pid: str) -> str:
    """The state letter of ``/proc/<pid>/stat``, "" when there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return ""
    return raw[raw.rindex(")") + 2 :].split()[0]


def _start(pid: str) -> str:
    """The start time of ``/proc/<pid>/stat``, "" when there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, ValueError):
        return ""
    return raw[raw.rindex(")") + 2 :].split()[19]


Judge = Callable[[str, str, str], bool]
"""Whether a process holder (boot, pid, start time) lives, by a defective rule."""

_MISJUDGES: dict[str, tuple[str, str, Judge]] = {
    ZOMBIE: (
        "CountsZombiesAlive",
        "judges a process holder by its boot, pid and start time, not its state: a zombie "
        "(exited, not yet reaped) keeps its GPUs",
        lambda boot, pid, start: boot == boot_id() and _state(pid) != "" and _start(pid) == start,
    ),
    EARLIER_BOOT: (
        "IgnoresTheHoldersBoot",
        "judges a process holder by its pid and start time, not its boot: a holder of an "
        "earlier boot whose pid and start time a process has again keeps its GPUs",
        lambda boot, pid, start: _state(pid) not in ("", "Z", "X") and _start(pid) == start,
    ),
    PID_REUSED: (
        "IgnoresTheHoldersStartTime",
        "judges a process holder by its boot and pid, not its start time: a pid another "
        "process has now keeps the GPUs of the one that is gone",
        lambda boot, pid, start: boot == boot_id() and _state(pid) not in ("", "Z", "X"),
    ),
}


def _misjudging(value: str) -> type[BrokenDriver]:
    name, defect, judge = _MISJUDGES[value]

    def _judge(self: BrokenRegistry, holder: Holder) -> bool:
        try:
            boot, pid, start = holder.ref.split(":")
        except ValueError:
            return True
        return judge(boot, pid, start)

    registry = type(f"_{name}Registry", (BrokenRegistry,), {"_judge": _judge})
    doc = f"GPU-HOSTWIDE-01: {defect}. Who held, now gone: {value}."
    return type(
        name, (BrokenDriver,), {"__doc__": doc, "BREAKS": "GPU-HOSTWIDE-01", "LEASES": registry}
    )


LOCK_BROKEN_AFTER_S = 2.0


class _LockBreakingRegistry(BrokenRegistry):
    """Waits for the registry's lock a while, then goes on without it ("a stale lock")."""

    def _flock(self, fd: int) -> None:
        deadline = time.monotonic() + LOCK_BROKEN_AFTER_S
        while time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                time.sleep(0.01)


_TAKES_THE_LOCK: dict[str, tuple[str, str]] = {
    LOCK_HOLDER: (
        "BreaksTheLockAfter2s",
        f"takes a lock held over {LOCK_BROKEN_AFTER_S:g} s for a stale one and grants without it",
    ),
}


def _taking_the_lock(value: str) -> type[BrokenDriver]:
    name, defect = _TAKES_THE_LOCK[value]
    doc = f"GPU-HOSTWIDE-01: {defect}. Who holds the lock: {value}."
    return type(
        name,
        (BrokenDriver,),
        {"__doc__": doc, "BREAKS": "GPU-HOSTWIDE-01", "LEASES": _LockBreakingRegistry},
    )


BLIND = family(globals(), MUST_HOLD, _blind_to)
MISJUDGING = family(globals(), GONE, _misjudging)
LOCK_TAKING = family(globals(), LOCK_HOLDERS, _taking_the_lock)
