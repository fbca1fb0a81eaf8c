"""Planted breakers of giving GPUs back: GPU-RELEASE-01, GPU-RECLAIM-01/02, SANDBOX-REAP-01.

GPUs come back when a sandbox closes, dies or loses its creator, and reap leaves nothing of
a session. Their tests: conformance/test_lifecycle.py and conformance/test_reap.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import threading
from collections.abc import Callable, Sequence
from typing import ClassVar

from conformance.endings import CREATOR, ENDINGS, FROM_OUTSIDE, INIT, KILL, OOM, OUTERMOST
from conformance.test_reap import NEIGHBOUR_FORMS
from drivers import reference
from drivers.base import Launch
from drivers.reference import ReferenceSandbox
from gpuhost.devices import GpuDevice
from gpuhost.leases import Holder, LeaseOwner, process_running
from gpuhost.procfs import each_process
from gpuhost.spec import SHARED, GpuPlan
from gpuhost.wait import wait_for
from tests.breakers.base import BrokenDriver, family


class _ReleaseFirstSandbox(ReferenceSandbox):
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # "Give the GPUs back first: a stop that hangs must not strand them."
        if self._leases is not None:
            self._leases.release(self.id)
        self.stop()


class ReleasesBeforeStop(BrokenDriver):
    """GPU-RELEASE-01: close() releases the leases, then stops the sandbox: granted as it runs."""

    BREAKS = "GPU-RELEASE-01"

    SANDBOX = _ReleaseFirstSandbox


class _KeepsLeasesOnClose(ReferenceSandbox):
    def close(self) -> None:
        self.closed = True
        self.stop()


class LeakOnClose(BrokenDriver):
    """GPU-RELEASE-01: close() stops the sandbox but keeps its lease, held by the creator."""

    BREAKS = "GPU-RELEASE-01"

    SANDBOX = _KeepsLeasesOnClose

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        sandbox.holder = Holder.process(os.getpid())
        return sandbox


class _KeepsAllButFirstOnClose(ReferenceSandbox):
    def close(self) -> None:
        super().close()
        if len(self.gpus) > 1:  # taken again, held by the creator, under another sandbox id
            owner = LeaseOwner("reference", f"{self.id}-kept", "", Holder.process(os.getpid()))
            assert self._leases is not None
            self._leases.acquire(self.gpus, owner, exact=self.gpus[1:])


class LeaksAllButFirst(BrokenDriver):
    """GPU-RELEASE-01: close() gives back the first GPU of a sandbox and keeps the others."""

    BREAKS = "GPU-RELEASE-01"
    SANDBOX = _KeepsAllButFirstOnClose


class NoReclaimOnKill(BrokenDriver):
    """GPU-RECLAIM-01: leases name a holder nobody can check: a dead sandbox keeps its GPUs."""

    BREAKS = "GPU-RECLAIM-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        sandbox.holder = Holder("sandbox", str(sandbox.pid))
        return sandbox


class _FreesItsGpusWhenDead(ReferenceSandbox):
    def close(self) -> None:
        if self.closed:
            return
        dead = not process_running(self._child_pid, self._child_start)
        super().close()
        if dead and self._leases is not None:
            # "Its sandbox is gone: whatever lease is left on its GPUs is a stale one of its own."
            mine = {gpu.uuid for gpu in self.gpus}
            for lease in self._leases.leases():
                if lease.gpu_uuid in mine:
                    self._leases.release(lease.sandbox_id)


class CloseOfDeadSandboxFreesItsGpus(BrokenDriver):
    """GPU-RECLAIM-01: close() of a dead sandbox drops all leases on its GPUs, a successor's too."""

    BREAKS = "GPU-RECLAIM-01"
    SANDBOX = _FreesItsGpusWhenDead


class OutlivesItsCreator(BrokenDriver):
    """GPU-RECLAIM-02: sandboxes neither die with their creator nor notice it: orphans keep GPUs."""

    BREAKS = "GPU-RECLAIM-02"
    init_argv = ("sh", "-c", "echo ready; exec sleep infinity")
    close_timeout_s = 0.0

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        return [arg for arg in super().bwrap_argv(sandbox_id, gpus) if arg != "--die-with-parent"]


class _WatchedSandbox(ReferenceSandbox):
    """A sandbox whose creator holds its leases, released by a thread once it ends.

    The thread tells how it ended by how its bwrap did; it releases nothing after the ends it
    is blind to.
    """

    def watch(self, blind: frozenset[str]) -> None:
        self._blind = blind
        self._killed_here = False
        self._kmsg = _kernel_log_from_now()
        threading.Thread(target=self._watch, daemon=True).start()

    def kill(self) -> None:
        self._killed_here = True
        super().kill()

    def _watch(self) -> None:
        pidfd = os.pidfd_open(self._process.pid)
        try:
            select.select([pidfd], [], [])
        finally:
            os.close(pidfd)
        returncode = self._process.wait()
        if self.closed or self._leases is None:
            return
        if self._killed_here:
            how = KILL
        elif returncode == -signal.SIGKILL:
            how = OUTERMOST
        elif _oom_killed(self._kmsg, self._child_pid):
            how = OOM
        else:
            how = INIT
        if how not in self._blind:
            self._leases.release(self.id)


def _kernel_log_from_now() -> int:
    """The kernel's log, read from its end (-1 where it cannot be read)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return -1
    os.lseek(fd, 0, os.SEEK_END)
    return fd


def _oom_killed(fd: int, pid: int) -> bool:
    """Whether the kernel logged, since ``fd`` was opened, that its OOM killer chose ``pid``."""
    if fd < 0:
        return False
    records = []
    try:
        while True:
            try:
                records.append(os.read(fd, 8192).decode(errors="replace"))
            except BrokenPipeError:  # records overwritten meanwhile: read on
                continue
            except BlockingIOError:
                break
    finally:
        os.close(fd)
    return any(f"Killed process {pid} (" in r or f",pid={pid}," in r for r in records)


class _WatchesItsEnds(BrokenDriver):
    """Leases held by the creator (or the creator's parent), released by a watching thread."""

    SANDBOX = _WatchedSandbox
    BLIND: ClassVar[frozenset[str]]
    SHARED_ONLY: ClassVar[bool] = False
    """Only shared sandboxes are held so; the others as the reference's are."""

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        if self.SHARED_ONLY and (launch.plan is None or launch.plan.sharing != SHARED):
            return sandbox
        assert isinstance(sandbox, _WatchedSandbox)
        # "The process that asked": a creator started by a wrapper names the wrapper.
        sandbox.holder = Holder.process(os.getppid() if CREATOR in self.BLIND else os.getpid())
        sandbox.watch(self.BLIND)
        return sandbox


class CreatorHoldsAndKillReleases(_WatchesItsEnds):
    """GPU-RECLAIM-01: its creator holds the leases and its kill() releases them.

    A sandbox killed from outside (its init, its bwrap, the OOM killer) keeps its GPUs for good.
    """

    BREAKS = "GPU-RECLAIM-01"
    BLIND = frozenset(FROM_OUTSIDE)


_MISSES: dict[str, tuple[str, str]] = {
    KILL: (
        "ForgetsWhatItKilled",
        "waits, after its own kill(), for a close that a crash never makes",
    ),
    INIT: (
        "MissesAKilledInit",
        "takes a sandbox whose init died of SIGKILL for one that restarts it",
    ),
    OUTERMOST: (
        "MissesAKilledBwrap",
        "takes a bwrap killed by a signal for one whose sandbox still runs",
    ),
    OOM: ("KeepsGpusOfTheOomKilled", "keeps an OOM-killed sandbox's GPUs for its restart"),
    CREATOR: ("NamesTheCreatorsParent", "names the creator's parent their holder: it outlives it"),
}
"""For each way a sandbox ends, a driver that gets that way alone wrong: its creator holds
its leases and a thread releases them once it sees the sandbox end, but not that way."""


def misses(
    requirement: Callable[[str], str], prefix: str = "", shared_only: bool = False
) -> Callable[[str], type[BrokenDriver]]:
    """The maker (for ``family``) of the breaker that misses a way, failing ``requirement(way)``.

    With ``shared_only``, only shared sandboxes are held so; the name is ``prefix`` and the
    way's breaker's own.
    """

    def make(way: str) -> type[BrokenDriver]:
        name, defect = _MISSES[way]
        whose = "a shared sandbox's" if shared_only else "a sandbox's"
        released = "go once a thread of its creator sees it end"
        doc = f"{requirement(way)}: {whose} leases {released}; it {defect}."
        attrs = {"__doc__": f"{doc} Missed: {way}.", "BREAKS": requirement(way),
                 "BLIND": frozenset({way}), "SHARED_ONLY": shared_only}  # fmt: skip
        return type(f"{prefix}{name}", (_WatchesItsEnds,), attrs)

    return make


def _reclaim(way: str) -> str:
    return "GPU-RECLAIM-02" if way == CREATOR else "GPU-RECLAIM-01"


RECLAIM_FAMILY = family(globals(), ENDINGS, misses(_reclaim))
"""One breaker per way a sandbox ends (``conformance.endings.ENDINGS``), each missing that way."""


class ReapDoesNothing(BrokenDriver):
    """SANDBOX-REAP-01: reap() removes nothing."""

    BREAKS = "SANDBOX-REAP-01"

    def reap(self, session_id: str) -> list[str]:
        return []


_CREATED_HERE: set[str] = set()


class ReapsOnlyItsOwn(BrokenDriver):
    """SANDBOX-REAP-01: reap() knows only the sandboxes this process made: after a crash, none."""

    BREAKS = "SANDBOX-REAP-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        _CREATED_HERE.add(launch.sandbox_id)
        return super().start(launch)

    def reap(self, session_id: str) -> list[str]:
        mine = [s for s in self.sandboxes(session_id) if s in _CREATED_HERE]
        for sandbox_id, pid in reference._bwrap_processes(session_id):
            if sandbox_id in mine:
                os.kill(pid, 9)
        for sandbox_id in mine:
            self.host.leases.release(sandbox_id)
        return mine


class ReapReleasesOnlyFound(BrokenDriver):
    """SANDBOX-REAP-01: reap releases the leases of the sandboxes it finds running, no others."""

    BREAKS = "SANDBOX-REAP-01"

    def reap(self, session_id: str) -> list[str]:
        found = reference._bwrap_processes(session_id)
        for _, pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        wait_for(
            lambda: reference._bwrap_processes(session_id),
            lambda left: not left,
            timeout_s=10,
            what=f"the sandboxes of session {session_id} to exit",
        )
        found_ids = sorted({sandbox_id for sandbox_id, _ in found})
        for sandbox_id in found_ids:
            self.host.leases.release(sandbox_id)
        return found_ids


class LeasesWithoutSession(BrokenDriver):
    """SANDBOX-REAP-01: leases stamped with no session (allowed): no reap finds a half-made one."""

    BREAKS = "SANDBOX-REAP-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        owner = LeaseOwner(self.name, sandbox_id, "", Holder.process(os.getpid()))
        return self.host.leases.acquire(
            self.pool(plan), owner, count=plan.count, exact=plan.gpus, mode=plan.sharing,
            share_limit=self.host.share_limit,
        )  # fmt: skip


def _running_sessions() -> set[str]:
    """The sessions stamped on running bwrap processes."""
    stamp = reference.SESSION_ENV.encode()
    found = set()
    for _, cmdline in each_process("cmdline"):
        argv = cmdline.split(b"\0")
        if argv[0].endswith(b"bwrap"):
            pairs = zip(argv, argv[1:], argv[2:], strict=False)
            found |= {
                value.decode() for flag, key, value in pairs if (flag, key) == (b"--setenv", stamp)
            }
    return found


_CONFUSIONS: dict[str, tuple[str, Callable[[str, str], bool], str]] = {
    "id0": (
        "NumberedRetries",
        lambda asked, other: other.startswith(asked) and other[len(asked) :].isdigit(),
        "a session and its numbered retries",
    ),
    "id.1": (
        "DottedSubsessions",
        lambda asked, other: other.startswith(f"{asked}."),
        "a session and its sub-sessions, id.<n>",
    ),
    "id-retry": (
        "WordBoundary",
        lambda asked, other: re.search(rf"\b{re.escape(asked)}\b", other) is not None,
        "the sessions its id matches as a word, as `grep -w` does",
    ),
    "id_2": (
        "UnderscoreSuffix",
        lambda asked, other: other.startswith(f"{asked}_"),
        "a session and those its id names with '_' after it",
    ),
    "ID": (
        "CaseFolded",
        lambda asked, other: other.lower() == asked.lower(),
        "session ids compared in lower case, as DNS names are",
    ),
    "pre-id": (
        "Substring",
        lambda asked, other: asked in other,
        "every session whose id holds its id, as a plain `grep` does",
    ),
    "id with its '.' another character": (
        "Pattern",
        lambda asked, other: re.fullmatch(asked, other) is not None,
        "its id read as a regular expression, where '.' is any character",
    ),
    "id cut at its last '.'": (
        "ParentSession",
        lambda asked, other: asked.startswith(f"{other}."),
        "a session and the one its id extends, <run>.<attempt>: the run's leftovers too",
    ),
}
"""For each neighbour session of conformance/test_reap.py, a matcher that takes it for the
reaped one (``asked``) and the story of a reap written that way."""


def _reap_confusing(form: str) -> type[BrokenDriver]:
    name, confuses, story = _CONFUSIONS[form]

    class ReapConfuses(BrokenDriver):
        __doc__ = f"SANDBOX-REAP-01: reaping session id takes session {form} too: {story}."
        BREAKS = "SANDBOX-REAP-01"

        def reap(self, session_id: str) -> list[str]:
            leased = {lease.session_id for lease in self.host.leases.leases()}
            sessions = _running_sessions() | leased
            matching = {s for s in sessions if s == session_id or confuses(session_id, s)}
            return sorted(
                sandbox for session in sorted(matching) for sandbox in super().reap(session)
            )

    ReapConfuses.__name__ = ReapConfuses.__qualname__ = f"ReapTakes{name}"
    return ReapConfuses


REAP_CONFUSIONS = family(globals(), NEIGHBOUR_FORMS, _reap_confusing)
"""One per neighbour session form: each reaps the sessions of that form beside the asked one."""


class ReapTakesOtherClientsLeases(BrokenDriver):
    """SANDBOX-REAP-01: reap drops every lease of the session, other drivers' and clients' too."""

    BREAKS = "SANDBOX-REAP-01"

    def reap(self, session_id: str) -> list[str]:
        reaped = super().reap(session_id)
        released = self.host.leases.release_session(session_id)  # no driver= filter
        return sorted({*reaped, *(lease.sandbox_id for lease in released)})


class _StopNeverReturns(ReferenceSandbox):
    def stop(self) -> None:
        super().stop()
        threading.Event().wait()  # waits for an exit status that was already collected


class CloseNeverReturns(BrokenDriver):
    """GPU-RELEASE-01: close ends the sandbox, then waits forever and releases nothing."""

    BREAKS = "GPU-RELEASE-01"
    SANDBOX = _StopNeverReturns
