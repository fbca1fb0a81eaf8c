"""How a sandbox ends: through its driver, from outside it, with its creator.

GPU-RECLAIM-01/02 and GPU-SHARED-01/02 end sandboxes every way in ``ENDINGS``, and the
planted breakers of tests/breakers/lifecycle.py and sharing.py are generated from the same
tuple, one per way. The ways from outside act on what the host sees of a sandbox, whatever
the driver: its init is the host process in the sandbox's pid namespace that is pid 1 there
(``/proc/<pid>/status``'s ``NSpid`` ends in 1); its outermost host process is the highest of
its init's ancestors that runs nothing but the sandbox (bubblewrap's outer process, an
engine's shim or conmon). A sandbox on a kernel of its own (a VM) has neither on the host:
those ways are dropped by name there.

The OOM kill is the kernel's own: the init is moved into a memory cgroup of the test's with a
small limit, its ``oom_score_adj`` raised to 1000 (the OOM killer's first choice), and a
process of the test's, in the same cgroup, fills memory that no process maps (a memfd) past
the limit; the kernel's OOM killer then sends the SIGKILL, and the cgroup's ``oom_kill``
count says it did. Where no memory cgroup can be made (not root), the way is dropped by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from conformance.fixtures import Dropped
from conformance.observe import BOOT_ID
from drivers.base import Sandbox
from gpuhost.leases import process_running, process_start_time
from gpuhost.procfs import kill_if
from gpuhost.spec import SandboxSpec
from gpuhost.wait import wait_for

CLOSE = "its close()"
KILL = "its driver's kill()"
INIT = "SIGKILL of its init, from the host"
OUTERMOST = "SIGKILL of its outermost host process, then of its init"
OOM = "the kernel's OOM killer, choosing its init"
CREATOR = "its creator's death (SIGKILL)"

FROM_OUTSIDE = (INIT, OUTERMOST, OOM)
"""The ways a sandbox's processes die that its driver neither makes nor is told of."""
KILLED = (KILL, *FROM_OUTSIDE)
"""GPU-RECLAIM-01: a sandbox whose processes were SIGKILLed, by its driver or from outside."""
ENDINGS = (KILL, *FROM_OUTSIDE, CREATOR)
"""Every way a sandbox ends but its close (GPU-RELEASE-01's): each must give its GPUs back."""
IDS = {CLOSE: "close", KILL: "kill", INIT: "init", OUTERMOST: "outermost", OOM: "oom",
       CREATOR: "creator"}  # fmt: skip
"""A short name of each way, for test ids and breaker names."""

OOM_LIMIT_BYTES = 32 << 20
"""The memory cgroup's limit: the filler passes it in a few dozen writes."""
OOM_TIMEOUT_S = 30.0
"""The OOM killer acts within the write that passes the limit; seconds mean it did not."""
_FILLER = """
import os, sys
init, limit = int(sys.argv[1]), int(sys.argv[2])
sys.stdin.readline()
fd, chunk = os.memfd_create("gpu-sandbox-oom"), b"x" * (1 << 20)
for _ in range(4 * limit >> 20):
    if not os.path.exists(f"/proc/{init}"):
        break
    os.write(fd, chunk)
print("filled", flush=True)
sys.stdin.readline()
"""
"""Fills shared memory charged to its cgroup and mapped by no process (so not counted in
its own OOM score), until the init is gone; then waits to be told to go."""


@dataclass(frozen=True)
class Seen:
    """What the host sees of a sandbox: its init and its pid namespace."""

    init: int
    start: str
    """The init's start time (``/proc/<pid>/stat``): the same process, not its pid reused."""
    namespace: str
    """``pid:[<inode>]``, as ``readlink /proc/<pid>/ns/pid`` says."""

    def running(self) -> bool:
        return process_running(self.init, self.start)


def seen_from_the_host(sandbox: Sandbox) -> Seen | str:
    """The sandbox's init as the host sees it, or why the host cannot see it."""
    __tracebackhide__ = True
    said = sandbox.exec(["sh", "-c", f"readlink /proc/self/ns/pid; cat {BOOT_ID}"])
    lines = said.stdout.split()
    if said.returncode != 0 or len(lines) != 2:
        return f"its pid namespace could not be read inside ({said})"
    namespace, boot = lines
    if boot != BOOT_ID.read_text().strip():
        own = "it runs on a kernel of its own (its boot id is not the host's)"
        return f"{own}: the host sees none of its processes"
    for pid in _pids():
        if _namespace(pid) == namespace and _nspid(pid)[-1:] == ["1"]:
            with contextlib.suppress(OSError):
                return Seen(pid, process_start_time(pid), namespace)
    return f"no process this host lists is pid 1 of its pid namespace {namespace}"


def outermost(seen: Seen) -> int | str:
    """The highest ancestor of the init that runs nothing but the sandbox, or why there is none.

    Each ancestor in turn counts while every child of it is the one below it or a process of
    the sandbox's pid namespace; never this process, its ancestors, or the host's pid 1. A
    sandbox beside it, made by the same creator or daemon, keeps those out of the reckoning.
    """
    parents = {pid: parent for pid in _pids() if (parent := _parent(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    spared = {0, 1, *_ancestors(os.getpid(), parents)}
    below, found = seen.init, None
    while (above := parents.get(below)) is not None and above not in spared:
        others = [
            pid
            for pid in children.get(above, [])
            if pid != below and _namespace(pid) != seen.namespace
        ]
        if others:
            break
        below = found = above
    if found is None:
        parent = parents.get(seen.init, 0)
        return (
            f"no host process above its init (pid {seen.init}) runs it alone: its parent, pid "
            f"{parent} ({_comm(parent)}), runs other processes too or is the host's own"
        )
    return found


def sigkill(pid: int, start: str) -> None:
    """SIGKILL ``pid`` if it is still the process that started at ``start``."""
    kill_if(pid, lambda pid: process_running(pid, start))


def end(
    way: str, victim: Sandbox, beside: Callable[[SandboxSpec], Sandbox], dropped: Dropped
) -> bool:
    """End ``victim`` the way named (one of ``KILLED``); False where this host cannot.

    Then the case is dropped, naming why. ``beside`` makes a sandbox with no GPU beside it,
    whose processes keep the creator's and a daemon's out of its outermost ones.
    """
    __tracebackhide__ = True
    if way == KILL:
        victim.kill()
        return True
    seen = seen_from_the_host(victim)
    if isinstance(seen, str):
        dropped(way, seen)
        return False
    if way == INIT:
        sigkill(seen.init, seen.start)
    elif way == OUTERMOST:
        beside(SandboxSpec())
        top = outermost(seen)
        if isinstance(top, str):
            dropped(way, top)
            return False
        with contextlib.suppress(OSError):
            sigkill(top, process_start_time(top))
        sigkill(seen.init, seen.start)
    elif way == OOM:
        why = oom_kill(seen)
        if why:
            dropped(way, why)
            return False
    else:
        raise ValueError(f"not a way to end a sandbox here: {way!r}")
    return True


def oom_kill(seen: Seen) -> str:
    """Have the kernel's OOM killer kill the init; "" once it has, else why it cannot here."""
    __tracebackhide__ = True
    hierarchy = memory_cgroups()
    if isinstance(hierarchy, str):
        return hierarchy
    root, v2 = hierarchy
    group = root / f"gpu-sandbox-oom-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        return f"no memory cgroup could be made in {root} ({exc})"
    filler: subprocess.Popen[str] | None = None
    try:
        _limit(group, v2)
        Path(f"/proc/{seen.init}/oom_score_adj").write_text("1000")
        (group / "cgroup.procs").write_text(str(seen.init))
        filler = subprocess.Popen(
            [sys.executable, "-c", _FILLER, str(seen.init), str(OOM_LIMIT_BYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        (group / "cgroup.procs").write_text(str(filler.pid))
        assert filler.stdin is not None
        filler.stdin.write("go\n")
        filler.stdin.flush()
        wait_for(
            seen.running,
            lambda running: not running,
            timeout_s=OOM_TIMEOUT_S,
            what=f"the OOM killer to kill the init (pid {seen.init}) in {group}",
        )
        kills = _oom_kills(group, v2)
        assert kills >= 1, f"the init (pid {seen.init}) died in {group}, but not by the OOM killer"
    except PermissionError as exc:
        return f"the init could not be put in a memory cgroup ({exc})"
    finally:
        if filler is not None:
            filler.kill()
            filler.communicate()
        _remove(group)
    return ""


def memory_cgroups() -> tuple[Path, bool] | str:
    """Where memory cgroups are made here, and whether it is cgroup v2; else why not."""
    if os.geteuid() != 0:
        return "only root may move a sandbox's init into a memory cgroup"
    v1 = None
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        mount, (kind, _, options) = fields[0].split(), fields[1].split()[:3]
        point = Path(mount[4])
        if kind == "cgroup2" and mount[3] == "/":
            with contextlib.suppress(OSError):
                if "memory" in (point / "cgroup.subtree_control").read_text().split():
                    return point, True
        elif kind == "cgroup" and "memory" in options.split(",") and mount[3] == "/":
            v1 = point
    if v1 is not None:
        return v1, False
    return "this host has no memory cgroup hierarchy whose root it mounts"


def _limit(group: Path, v2: bool) -> None:
    limit = str(OOM_LIMIT_BYTES)
    if v2:
        (group / "memory.max").write_text(limit)
        with contextlib.suppress(OSError):
            (group / "memory.swap.max").write_text("0")
        return
    (group / "memory.limit_in_bytes").write_text(limit)
    with contextlib.suppress(OSError):  # no swap accounting: no swap to spill to either
        (group / "memory.memsw.limit_in_bytes").write_text(limit)


def _oom_kills(group: Path, v2: bool) -> int:
    text = (group / ("memory.events" if v2 else "memory.oom_control")).read_text()
    counts = dict(line.split() for line in text.splitlines() if len(line.split()) == 2)
    return int(counts.get("oom_kill", 0))


def _remove(group: Path) -> None:
    """Remove the cgroup once the processes in it are gone (an exiting one lingers a moment)."""
    deadline = time.monotonic() + OOM_TIMEOUT_S
    while True:
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.05)


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def _namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def _nspid(pid: int) -> list[str]:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return []
    return next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _ancestors(pid: int, parents: dict[int, int]) -> set[int]:
    found = {pid}
    while (pid := parents.get(pid, 0)) > 0 and pid not in found:
        found.add(pid)
    return found


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
