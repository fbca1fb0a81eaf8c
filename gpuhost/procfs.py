"""Reading every process's /proc entries, for finding sandbox processes by their marks."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from gpuhost.wait import intervals


def each_process(entry: str) -> Iterator[tuple[int, bytes]]:
    """(pid, contents of ``/proc/<pid>/<entry>``) of every process whose entry is readable.

    Processes exit while the listing is read, and others' entries may be unreadable: both
    are left out.
    """
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            yield int(proc.name), (proc / entry).read_bytes()
        except OSError:
            continue


EXEC_MARKER_ENV = "GPU_SANDBOX_EXEC"
"""Set on every command a sandbox runs, and inherited by whatever it starts, setsid or not:
how a timeout finds them all. A process that clears its own environment escapes."""
KILL_MARKED_TIMEOUT_S = 5.0
"""After SIGKILL a process is gone in milliseconds; seconds mean it keeps forking."""


def exec_marker() -> tuple[str, bytes]:
    """A fresh ``(value, needle)`` for one command.

    ``value`` goes into ``EXEC_MARKER_ENV``; ``needle`` (``KEY=value``) finds the processes.
    """
    value = uuid.uuid4().hex
    return value, f"{EXEC_MARKER_ENV}={value}".encode()


def marked_processes(needle: bytes) -> list[int]:
    """Pids of the processes whose environment holds ``needle`` (``KEY=value``)."""
    return [pid for pid, environ in each_process("environ") if needle in environ.split(b"\0")]


def kill_if(pid: int, still_it: Callable[[int], bool]) -> None:
    """SIGKILL ``pid`` if, once it is pinned by a pidfd, ``still_it(pid)`` says it is the one.

    A pid found by a listing may be reused by another process before the signal: the pidfd
    names one process for good, and the check after opening it reads that very process.
    """
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if still_it(pid):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    finally:
        os.close(pidfd)


def has_mark(pid: int, needle: bytes) -> bool:
    """Whether the process ``pid``'s environment holds ``needle``."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return needle in environ.split(b"\0")


def kill_marked(needle: bytes, timeout_s: float = KILL_MARKED_TIMEOUT_S) -> None:
    """SIGKILL every process carrying ``needle``, again and again until none is left.

    It looks again a millisecond after a kill, then less often (``intervals``): a process
    killed a moment ago is usually gone by then, and a kill at an exec's timeout is timed.
    """
    deadline = time.monotonic() + timeout_s
    sleeps = intervals(0.02)
    while time.monotonic() < deadline:
        found = marked_processes(needle)
        if not found:
            return
        for pid in found:
            kill_if(pid, lambda pid: has_mark(pid, needle))
        time.sleep(next(sleeps))


def owner(pid: int) -> int | None:
    """The uid of a process whose real, effective, saved and filesystem uids are that one.

    None when they differ, or when it is gone.

    What any user can start, any user can name as they like: a process's command line or
    name says nothing of who started it; its uid does.
    """
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            ids = set(line.split()[1:])
            return int(ids.pop()) if len(ids) == 1 else None
    return None
