"""Who holds a lease, and whether they still live: the registry's liveness rules.

A ``process`` holder is ``<boot id>:<pid>:<start time>``, judged from /proc (a reused pid
or a zombie is not its holder); other kinds (a container, a pod, a VM) are judged by the
check their driver registers (``register_liveness``, or an entry point in the
``gpu_sandbox.liveness`` group). A holder nobody can judge is alive: the registry never
takes a GPU back on a guess.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PROCESS = "process"
LIVENESS_ENTRY_POINTS = "gpu_sandbox.liveness"
CHECKS_AT_ONCE = 16
"""How many holders a read judges at once (each check bounded by its own timeout)."""


@dataclass(frozen=True)
class Holder:
    """What keeps a lease alive: ``kind`` picks the liveness check, ``ref`` identifies it."""

    kind: str
    ref: str

    @classmethod
    def process(cls, pid: int) -> Holder:
        """The process ``pid``, pinned by its start time so a reused pid is not mistaken."""
        return cls(PROCESS, f"{boot_id()}:{pid}:{process_start_time(pid)}")

    def __str__(self) -> str:
        return f"{self.kind} {self.ref}"


LivenessCheck = Callable[[Holder], bool]
"""True while the holder lives. It must return within seconds (its own timeout), and return
True when it cannot tell: the registry never takes a GPU back on a guess."""


def _process_alive(holder: Holder) -> bool:
    try:
        holder_boot, pid, start = holder.ref.split(":")
        pid_number = int(pid)
    except ValueError:
        return True  # not ours to judge: never take a GPU back on a guess
    return holder_boot == boot_id() and process_running(pid_number, start)


def process_running(pid: int, start: str) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (a zombie does not)."""
    try:
        fields = _stat_fields(pid)
    except (FileNotFoundError, ProcessLookupError):  # gone, exiting as we read, or hidden
        return _hidden(pid)
    except OSError:  # hidden from us (/proc mounted with hidepid=noaccess): not proof it is gone
        return True
    # A zombie has exited: its parent just has not reaped it yet.
    return fields[19] == start and fields[0] not in ("Z", "X")


def _hidden(pid: int) -> bool:
    """Whether a process that /proc does not list exists all the same.

    Another user's, under ``hidepid=invisible``; its start time cannot be read, so it counts
    as the holder.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return False  # ours, and /proc does not list it: it was exiting as we read


_CHECKS: dict[str, LivenessCheck] = {PROCESS: _process_alive}
_NO_CHECK: set[str] = set()
"""Kinds whose entry points were looked for and not found: not looked for again."""


def register_liveness(kind: str, check: LivenessCheck) -> None:
    """Judge holders of ``kind`` with ``check`` (a driver whose sandboxes outlive processes).

    A process that never imported the driver finds the check through the driver's entry
    point in the ``gpu_sandbox.liveness`` group; without either, such holders live forever.
    """
    _CHECKS[kind] = check
    _NO_CHECK.discard(kind)


def liveness_check(kind: str) -> LivenessCheck | None:
    """The check of ``kind``: registered in this process, or else its entry point."""
    if kind not in _CHECKS and kind not in _NO_CHECK:
        from importlib import metadata  # slow to import, and needed only for such a holder

        for entry in metadata.entry_points(group=LIVENESS_ENTRY_POINTS, name=kind):
            with contextlib.suppress(Exception):  # a broken plugin judges nothing
                _CHECKS[kind] = entry.load()
                break
        else:
            _NO_CHECK.add(kind)
    return _CHECKS.get(kind)


def alive(holder: Holder) -> bool:
    """Whether ``holder`` lives, by its kind's check; alive when no check can tell."""
    check = liveness_check(holder.kind)
    return True if check is None else check(holder)


def dead_holders(holders: Collection[Holder]) -> set[Holder]:
    """The holders that are gone, several asked at once.

    A holder of a kind nobody can judge is alive, and asks nothing.
    """
    judged = [holder for holder in set(holders) if liveness_check(holder.kind)]
    if not judged:
        return set()
    with ThreadPoolExecutor(min(len(judged), CHECKS_AT_ONCE)) as pool:
        alive_now = dict(zip(judged, pool.map(alive, judged), strict=True))
    return {holder for holder, live in alive_now.items() if not live}


_BOOT_ID: str | None = None
_BOOT_TIME: float | None = None


def boot_id() -> str:
    """The id of the running boot (``/proc/sys/kernel/random/boot_id``).

    Leases of other boots are dead.
    """
    global _BOOT_ID
    if _BOOT_ID is None:
        _BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return _BOOT_ID


def boot_time() -> float:
    """When this machine booted, in seconds since the epoch (``btime`` of /proc/stat)."""
    global _BOOT_TIME
    if _BOOT_TIME is None:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                _BOOT_TIME = float(line.split()[1])
                break
        else:
            _BOOT_TIME = 0.0
    return _BOOT_TIME


def _stat_fields(pid: int) -> list[str]:
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    with open(f"/proc/{pid}/stat", "rb") as stat:
        raw = stat.read().decode()
    return raw[raw.rindex(")") + 2 :].split()


def process_start_time(pid: int) -> str:
    """When ``pid`` started, in clock ticks since boot: with the pid, a unique identity."""
    return _stat_fields(pid)[19]
