"""Starting sandbox processes that die with the process that created them, and ending them.

``PR_SET_PDEATHSIG`` (bwrap's ``--die-with-parent``, ``setpriv --pdeathsig``) fires when the
*thread* that forked the child exits, not the process: a sandbox created from a short-lived
worker thread would die with that thread. ``spawn`` therefore forks every sandbox from one
long-lived thread per process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpuhost.wait import intervals

TERM_GRACE_S = 2.0
"""How long a process group has between SIGTERM and SIGKILL, where it is given one."""

_spawners: dict[int, ThreadPoolExecutor] = {}
_spawners_lock = threading.Lock()


def _reset_spawners_lock() -> None:
    global _spawners_lock
    _spawners_lock = threading.Lock()


# A thread of the parent may hold the lock at fork(); the child's copy would stay locked.
os.register_at_fork(after_in_child=_reset_spawners_lock)


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` from this process's long-lived spawner thread."""
    with _spawners_lock:
        spawner = _spawners.get(os.getpid())
        if spawner is None:
            spawner = _spawners[os.getpid()] = ThreadPoolExecutor(1, "sandbox-spawner")

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, **kwargs)

    future = spawner.submit(start)
    try:
        return future.result()
    except BaseException:
        # Interrupted while the spawner may still start the sandbox: let it finish, then
        # stop what it started, so that no sandbox runs without a lease.
        with contextlib.suppress(BaseException):
            stop_process(future.result())
        raise


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Kill (if still running) and reap a process, and close our ends of its pipes."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            stream.close()


def kill_group(
    pgid: int, grace_s: float = 0.0, wait: Callable[[float], object] | None = None
) -> None:
    """End the process group ``pgid``: SIGTERM, up to ``grace_s`` to go, then SIGKILL.

    ``wait(grace_s)`` waits for it to go (a ``Popen``'s ``wait``; by default, until no
    process of the group is left). Without a grace, SIGKILL alone. The group gets SIGKILL
    even where its leader went in time: what the leader started may not have.
    """
    if grace_s > 0:
        _signal_group(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            (wait or functools.partial(_group_gone, pgid))(grace_s)
    _signal_group(pgid, signal.SIGKILL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    sleeps = intervals(0.02)
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass  # a member not ours to signal: still there
        time.sleep(next(sleeps))
