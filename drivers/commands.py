"""What the contract runs in a sandbox: a checked command, where its output goes, its result.

``Sandbox.exec`` and ``exec_stream`` (``drivers.base``) build a ``Command`` (one argv rule,
one timeout rule, a marker of its own) and an ``Output``, hand both to the driver's ``run``,
and build the ``ExecResult``: a driver writes none of that itself.
"""

from __future__ import annotations

import math
import os
import selectors
import shlex
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gpuhost.errors import SandboxExecError, shown
from gpuhost.procfs import EXEC_MARKER_ENV, exec_marker

DEFAULT_EXEC_TIMEOUT_S = 120.0
"""Long enough for a workload payload to import CUDA libraries on a cold host."""
KEPT_BYTES = 16 * 1024 * 1024
"""What ``exec`` keeps of each stream: its last 16 MiB, and the count of the bytes before them.

A payload may print without end; the runner must not hold what it prints. Sixteen MiB is
hundreds of times what any check, workload report or error reads (``nvidia-smi -q`` of eight
GPUs is tens of KiB), and the end of a stream is where a failure says why. ``exec_stream``
keeps nothing: its output passes to the caller's descriptors whole.
"""
READ_SIZE = 1 << 20
"""The most one read of a command's pipe takes (a pipe holds 64 KiB unless enlarged)."""


@dataclass(frozen=True)
class ExecResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    """The command's stdout, whole up to ``KEPT_BYTES``; beyond, its last ``KEPT_BYTES``."""
    stderr: str
    stdout_cut: int = 0
    """How many bytes of stdout came before what ``stdout`` holds (0: it is whole)."""
    stderr_cut: int = 0

    def check(self) -> ExecResult:
        """Return self when the command succeeded; fail the test with its output otherwise."""
        __tracebackhide__ = True
        if self.returncode != 0:
            raise AssertionError(
                f"{shlex.join(self.argv)} exited {self.returncode}\n"
                f"stdout: {self.stdout.strip()}\nstderr: {self.stderr.strip()}{self.cuts()}"
            )
        return self

    def cuts(self) -> str:
        """A line saying what was cut from each stream; empty when both are whole."""
        cut = [
            f"the first {count:,} bytes of {name} were cut (its last {KEPT_BYTES:,} are kept)"
            for name, count in (("stdout", self.stdout_cut), ("stderr", self.stderr_cut))
            if count
        ]
        return "\n" + "; ".join(cut) if cut else ""


class CommandTimedOut(Exception):
    """Raised by ``Sandbox.run`` once it has killed everything a command started at its timeout.

    The contract turns it into ``ExecTimeout``, the one error a caller sees.
    """


@dataclass(frozen=True)
class Command:
    """One command the contract hands ``Sandbox.run``: checked, with its own marker."""

    argv: tuple[str, ...]
    timeout: float
    """Seconds it may run, a positive number: at this timeout everything it started is killed."""
    marker: str
    """The value of ``EXEC_MARKER_ENV`` for this command alone."""

    @classmethod
    def of(cls, argv: Sequence[str], timeout: float) -> Command:
        """A command for ``argv`` and ``timeout``, checked, with a fresh marker."""
        return cls(check_argv(argv), check_timeout(timeout), exec_marker()[0])

    @property
    def env(self) -> dict[str, str]:
        """What the command's environment adds to the sandbox's own: the marker.

        Every process the command starts inherits it, setsid or not: how a timeout finds them.
        """
        return {EXEC_MARKER_ENV: self.marker}

    @property
    def needle(self) -> bytes:
        """``KEY=value`` as it appears in /proc/<pid>/environ of the processes it started."""
        return f"{EXEC_MARKER_ENV}={self.marker}".encode()


class Tail:
    """The last ``KEPT_BYTES`` of a stream given in parts, and how many bytes came before them."""

    def __init__(self) -> None:
        self.kept = bytearray()
        self.cut = 0

    def add(self, data: bytes) -> None:
        if len(data) >= KEPT_BYTES:
            self.cut += len(self.kept) + len(data) - KEPT_BYTES
            self.kept = bytearray(memoryview(data)[-KEPT_BYTES:])
            return
        self.kept += data
        excess = len(self.kept) - KEPT_BYTES
        if excess > 0:
            del self.kept[:excess]  # CPython moves the start: no copy each time
            self.cut += excess


class Output:
    """Where a command's output goes: two file descriptors, or kept for an ``ExecResult``.

    To descriptors as it comes for ``exec_stream``, whole; for ``exec``, the last
    ``KEPT_BYTES`` of each stream are kept, and the bytes cut before them counted.
    ``Sandbox.run`` hands ``fds`` to the command's process when it can; otherwise it passes
    the output on through ``stdout`` and ``stderr`` as it receives it, in any number of
    parts, and never gathers it itself (``read_from`` reads a process's pipes so).
    """

    def __init__(self, stdout_fd: int | None = None, stderr_fd: int | None = None) -> None:
        self.fds = None if stdout_fd is None or stderr_fd is None else (stdout_fd, stderr_fd)
        self._kept = (Tail(), Tail())

    def stdout(self, data: bytes) -> None:
        self._write(0, data)

    def stderr(self, data: bytes) -> None:
        self._write(1, data)

    def _write(self, stream: int, data: bytes) -> None:
        if self.fds is None:
            self._kept[stream].add(data)
        else:
            write_all(self.fds[stream], data)

    def kept(self) -> tuple[bytes, bytes]:
        """What was kept of stdout and stderr (nothing when it went to descriptors)."""
        return bytes(self._kept[0].kept), bytes(self._kept[1].kept)

    def cut(self) -> tuple[int, int]:
        """How many bytes of stdout and of stderr were cut before what is kept."""
        return self._kept[0].cut, self._kept[1].cut

    def read_from(self, process: subprocess.Popen[bytes], timeout: float) -> int:
        """Pass ``process``'s stdout and stderr pipes on in parts, until both end and it exits.

        Its exit code; ``subprocess.TimeoutExpired`` once ``timeout`` seconds have passed
        (the process is left running: what it started is the caller's to kill). A pipe is
        closed once it ends; a process given ``fds`` instead of pipes is only waited for.
        """
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            for pipe, write in ((process.stdout, self.stdout), (process.stderr, self.stderr)):
                if pipe is not None:
                    selector.register(pipe, selectors.EVENT_READ, write)
            while selector.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(process.args, timeout)
                for key, _ in selector.select(left):
                    data = os.read(key.fd, READ_SIZE)
                    if data:
                        key.data(data)
                    else:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()  # type: ignore[union-attr]
        return process.wait(max(0.0, deadline - time.monotonic()))


def check_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """``argv`` as a tuple, when it names a program to run; SandboxExecError naming it otherwise.

    A list of strings without NUL characters, whose first names a program: not empty, and
    without '=' (which ``env``, and so every driver that runs commands through it, reads as a
    variable to set).
    """
    if (
        isinstance(argv, (str, bytes))
        or not isinstance(argv, Sequence)
        or not argv
        or not all(isinstance(arg, str) and "\0" not in arg for arg in argv)
        or not argv[0]
        or "=" in argv[0]
    ):
        raise SandboxExecError(
            f"argv must be a list of strings without NUL characters whose first names a "
            f"program to run (not empty, no '='), got {shown(argv)}"
        )
    return tuple(argv)


def check_timeout(timeout: float) -> float:
    """``timeout`` in seconds, when it is a positive number; SandboxExecError otherwise."""
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise SandboxExecError(
            f"timeout must be a positive number of seconds, got {shown(timeout)}"
        )
    return float(timeout)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd``: a pipe takes a large write in parts."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
