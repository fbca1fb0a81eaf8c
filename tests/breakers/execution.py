"""Planted breakers of running a command in a sandbox: SANDBOX-EXEC-01.

Exit code, output and timeout of ``exec`` and ``exec_stream``. Their tests: the exec tests of
conformance/test_exec.py. What a sandbox on one path to a command alone gets wrong is made
of ``OnePath`` and ``run_entered``, here too.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import ClassVar

from conformance.observe import COMMAND_PATHS
from conformance.test_exec import EXIT_KINDS, EXITS, SIGNALS
from drivers.base import (
    DEFAULT_EXEC_TIMEOUT_S,
    KEPT_BYTES,
    Command,
    CommandTimedOut,
    Output,
)
from drivers.host_process import HOST_ENV, tool
from drivers.reference import ReferenceSandbox
from drivers.reference_sandbox import NAMESPACES
from gpuhost.errors import SandboxExecError
from gpuhost.procfs import EXEC_MARKER_ENV, each_process, kill_marked, marked_processes
from tests.breakers.base import BrokenDriver, class_name, family


class _LyingSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        super().run(command, output)
        return 0


class ExecHidesExitCode(BrokenDriver):
    """SANDBOX-EXEC-01: exec() reports success whatever the command returned."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _LyingSandbox


def _rewritten(
    run: Callable[[Command, Output], int],
    command: Command,
    output: Output,
    stdout: Callable[[bytes], bytes],
    stderr: Callable[[bytes], bytes] = bytes,
) -> int:
    """``run`` whose whole output, once the command ended, is rewritten on its way out."""
    kept = Output()
    returncode = run(command, kept)
    out, err = kept.kept()
    output.stdout(stdout(out))
    output.stderr(stderr(err))
    return returncode


class _TruncatingSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        return _rewritten(super().run, command, output, lambda out: out[:65536])


class ExecTruncatesOutput(BrokenDriver):
    """SANDBOX-EXEC-01: exec() returns at most 64 KiB of output, as a fixed buffer would."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _TruncatingSandbox


class _HeadOnly(Output):
    """Passes on the first ``KEPT_BYTES`` of each stream, and drops the rest unseen."""

    def __init__(self, into: Output) -> None:
        super().__init__()
        self._into = into
        self._room = [KEPT_BYTES, KEPT_BYTES]

    def stdout(self, data: bytes) -> None:
        self._keep(0, data, self._into.stdout)

    def stderr(self, data: bytes) -> None:
        self._keep(1, data, self._into.stderr)

    def _keep(self, stream: int, data: bytes, into: Callable[[bytes], None]) -> None:
        taken = data[: self._room[stream]]
        self._room[stream] -= len(taken)
        if taken:
            into(taken)


class _HeadKeepingSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        return super().run(command, output if output.fds else _HeadOnly(output))


class ExecKeepsTheHead(BrokenDriver):
    """SANDBOX-EXEC-01: exec keeps a long stream's first 16 MiB, as a fixed buffer would."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _HeadKeepingSandbox


_SILENT_TOO_LONG = 231


_IDLE_WATCH = f"""
t=$1; shift; o=$(mktemp); e=$(mktemp); "$@" >"$o" 2>"$e" & pid=$!; size=-1; last=$(date +%s)
while kill -0 $pid 2>/dev/null; do
  now=$(cat "$o" "$e" | wc -c)
  if [ "$now" != "$size" ]; then size=$now; last=$(date +%s); fi
  if [ $(( $(date +%s) - last )) -ge "$t" ]; then kill -9 $pid; exit {_SILENT_TOO_LONG}; fi
  sleep 0.1
done
wait $pid; rc=$?; cat "$o"; cat "$e" >&2; exit $rc
"""


class _IdleTimeoutSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        if output.fds is not None:
            return super().run(command, output)
        # The command under a shell in the sandbox that kills it after `timeout` of silence.
        silence = str(max(1, round(command.timeout)))
        watched = ["sh", "-c", _IDLE_WATCH, "sh", silence, *command.argv]
        returncode = super().run(
            dataclasses.replace(command, argv=tuple(watched), timeout=DEFAULT_EXEC_TIMEOUT_S),
            output,
        )
        if returncode == _SILENT_TOO_LONG:
            raise CommandTimedOut
        return returncode


class ExecIdleTimeout(BrokenDriver):
    """SANDBOX-EXEC-01: exec's timeout counts silence: a command that keeps printing runs on."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _IdleTimeoutSandbox


class _TextModeSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        def text(out: bytes) -> bytes:  # what subprocess.run(text=True) does: universal newlines
            return out.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

        return _rewritten(super().run, command, output, text, text)


class ExecUniversalNewlines(BrokenDriver):
    """SANDBOX-EXEC-01: exec decodes output in text mode: each CR LF and lone CR is an LF."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _TextModeSandbox


class _SignalStyleSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        returncode = super().run(command, output)
        # "128 + N: killed by signal N", as Python reports it
        return 128 - returncode if returncode > 128 else returncode


class ExecSignalStyleExitCodes(BrokenDriver):
    """SANDBOX-EXEC-01: exit codes past 128 come back as -N ("killed by signal N"): 130 is -2."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _SignalStyleSandbox


class _WholeSecondsSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        seconds = int(command.timeout)  # as timeout(1) takes it, where 0 means none
        timeout = seconds or DEFAULT_EXEC_TIMEOUT_S
        return super().run(dataclasses.replace(command, timeout=timeout), output)


class ExecTimeoutWholeSeconds(BrokenDriver):
    """SANDBOX-EXEC-01: exec takes its timeout in whole seconds: under one second there is none."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _WholeSecondsSandbox


class _FrameDecodingSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        def text(data: bytes) -> bytes:  # each 4 KiB frame decoded as it comes
            frames = (data[i : i + 4096] for i in range(0, len(data), 4096))
            return "".join(frame.decode(errors="replace") for frame in frames).encode()

        return _rewritten(super().run, command, output, text, text)


class ExecDecodesPerFrame(BrokenDriver):
    """SANDBOX-EXEC-01: exec decodes per 4 KiB frame: a UTF-8 character across two is lost."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _FrameDecodingSandbox


class _StreamWithoutTimeout(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        if output.fds is not None:
            command = dataclasses.replace(command, timeout=DEFAULT_EXEC_TIMEOUT_S)
        return super().run(command, output)


class ExecStreamIgnoresTimeout(BrokenDriver):
    """SANDBOX-EXEC-01: exec_stream (`gpu-sandbox run`) runs commands under the default timeout."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _StreamWithoutTimeout


class _ClosedFlagOnlySandbox(ReferenceSandbox):
    def running(self) -> bool:
        return True  # the contract's closed flag is enough, no /proc read per exec


class ExecSkipsLivenessCheck(BrokenDriver):
    """SANDBOX-EXEC-01: exec checks only close(): in a dead sandbox, nsenter's failure is exit 1."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _ClosedFlagOnlySandbox


class _TimeoutFloorSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        # "nsenter takes a second to start under load": never less than 5 s.
        return super().run(dataclasses.replace(command, timeout=max(command.timeout, 5.0)), output)


class ExecTimeoutFloor(BrokenDriver):
    """SANDBOX-EXEC-01: timeouts under 5 s are 5 s: a command given 0.5 s ending in 3 s returns."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _TimeoutFloorSandbox


class _KillsEverythingOnTimeout(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        try:
            return super().run(command, output)
        except CommandTimedOut:
            # "Leave nothing of it behind": every process that any exec started.
            marked = f"{EXEC_MARKER_ENV}=".encode()
            for pid, environ in each_process("environ"):
                if any(entry.startswith(marked) for entry in environ.split(b"\0")):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            raise


class TimeoutKillsTheWholeSandbox(BrokenDriver):
    """SANDBOX-EXEC-01: a timed-out exec kills every process any exec started, others too."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _KillsEverythingOnTimeout


class _HangsAtItsTimeout(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        try:
            return super().run(command, output)
        except CommandTimedOut:
            threading.Event().wait()  # "the command was killed": the exec never says so
            raise


class ExecNeverReturnsPastItsTimeout(BrokenDriver):
    """SANDBOX-EXEC-01: a command past its timeout is killed, but the exec never returns."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _HangsAtItsTimeout


_WAY: contextvars.ContextVar[str] = contextvars.ContextVar("way", default="exec")
"""The path the command being run came by, in this thread: ``exec`` or ``exec_stream``."""


class OnePath(ReferenceSandbox):
    """A sandbox whose defect is on one path to a command (``BROKEN_ON``) alone."""

    BROKEN_ON: ClassVar[str]

    def run(self, command: Command, output: Output) -> int:
        token = _WAY.set("exec" if output.fds is None else "exec_stream")
        try:
            return super().run(command, output)
        finally:
            _WAY.reset(token)

    def broken(self) -> bool:
        return _WAY.get() == self.BROKEN_ON


def way_name(way: str) -> str:
    return "ExecStream" if way == "exec_stream" else "Exec"


class EnteredOnOnePath(ReferenceSandbox):
    """On ``BROKEN_ON`` alone, a command is entered otherwise than the reference enters it.

    nsenter takes ``ENTER`` (the reference: every namespace, its root and working directory),
    then ``BEFORE_SETPRIV`` runs as the host's root before the command becomes the sandbox's
    user. Run by root, as the catalogue's planted breakers are.
    """

    BROKEN_ON: ClassVar[str]
    ENTER: ClassVar[tuple[str, ...]] = (*NAMESPACES, "--root", "--wd")

    def before_setpriv(self) -> list[str]:
        return []

    def run(self, command: Command, output: Output) -> int:
        if (output.fds is None) != (self.BROKEN_ON == "exec"):
            return super().run(command, output)
        assert os.geteuid() == 0, "a planted breaker that enters sandboxes as root"
        env = self.command_env(command)
        argv = [
            tool("nsenter"), f"--target={self._child_pid}", *self.ENTER, *self.before_setpriv(),
            "setpriv", *self._as_sandbox_user, *self.exec_privileges, "--",
            "env", "-i", *(f"{key}={value}" for key, value in env.items()), *command.argv,
        ]  # fmt: skip
        stdout, stderr = output.fds or (subprocess.PIPE, subprocess.PIPE)
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=HOST_ENV,
            start_new_session=True,
        )  # fmt: skip
        try:
            return output.read_from(process, command.timeout)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            kill_marked(command.needle)
            process.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise CommandTimedOut from None
            raise


def _hides_exit_code(way: str) -> type[BrokenDriver]:
    class _Sandbox(OnePath):
        BROKEN_ON = way

        def run(self, command: Command, output: Output) -> int:
            returncode = super().run(command, output)
            return 0 if (output.fds is None) == (way == "exec") else returncode

    class HidesExitCode(BrokenDriver):
        __doc__ = f"SANDBOX-EXEC-01: {way} reports success whatever the command returned."
        BREAKS = "SANDBOX-EXEC-01"
        SANDBOX = _Sandbox

    HidesExitCode.__name__ = HidesExitCode.__qualname__ = f"HidesExitCodeOn{way_name(way)}"
    return HidesExitCode


HIDES_EXIT_CODE = family(globals(), COMMAND_PATHS, _hides_exit_code)


TERM_GRACES_S = (2, 5, 10)
"""What a driver may wait after SIGTERM: docker stop waits 10 s by default."""


def _term_then_wait(grace: str) -> type[BrokenDriver]:
    seconds = float(grace)

    class _Sandbox(ReferenceSandbox):
        def run(self, command: Command, output: Output) -> int:
            termed = threading.Event()

            def term() -> None:  # "let it end cleanly": SIGTERM first, SIGKILL after a grace
                termed.set()
                for pid in marked_processes(command.needle):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGTERM)

            timer = threading.Timer(command.timeout, term)
            timer.start()
            try:
                later = dataclasses.replace(command, timeout=command.timeout + seconds)
                returncode = super().run(later, output)
            finally:
                timer.cancel()
            if termed.is_set():
                raise CommandTimedOut
            return returncode

    class TermThenWait(BrokenDriver):
        __doc__ = (
            f"SANDBOX-EXEC-01: at a timeout, SIGTERM, then SIGKILL {grace} s later: a command "
            "deaf to SIGTERM runs that much past its timeout."
        )
        BREAKS = "SANDBOX-EXEC-01"
        SANDBOX = _Sandbox

    TermThenWait.__name__ = TermThenWait.__qualname__ = f"TermThenWait{grace}s"
    return TermThenWait


TERM_THEN_WAIT = family(globals(), [str(grace) for grace in TERM_GRACES_S], _term_then_wait)


def _exit_raised(kind: str) -> type[BrokenDriver]:
    codes = {EXITS[kind]} if kind in EXITS else {128 + SIGNALS[kind], -SIGNALS[kind]}

    class _Sandbox(ReferenceSandbox):
        def run(self, command: Command, output: Output) -> int:
            returncode = super().run(command, output)
            if returncode in codes:
                raise SandboxExecError(
                    f"cannot run {list(command.argv)!r} in sandbox {self.id}: exit {returncode}"
                )
            return returncode

    class ExitRaised(BrokenDriver):
        __doc__ = (
            f"SANDBOX-EXEC-01: a command's {kind} is raised as SandboxExecError, not returned "
            "(an engine's reserved code, mapped to a typed error)."
        )
        BREAKS = "SANDBOX-EXEC-01"
        SANDBOX = _Sandbox

    ExitRaised.__name__ = ExitRaised.__qualname__ = f"{class_name(kind)}RaisedAsAnError"
    return ExitRaised


EXIT_RAISED = family(globals(), EXIT_KINDS, _exit_raised)
