"""A running sandbox, the part of the contract that observes: exec and close written once.

A driver implements ``run`` (one command, its output to an ``Output``, its exit status
back), ``stop`` and ``kill``, and ``running`` where it can tell cheaply; the argv and
timeout rules, the result and the errors are this class's, the same for every driver.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import TracebackType
from typing import final

from drivers import watch
from drivers.commands import DEFAULT_EXEC_TIMEOUT_S, Command, CommandTimedOut, ExecResult, Output
from gpuhost.devices import GpuDevice
from gpuhost.errors import ExecTimeout, SandboxExecError, shown
from gpuhost.leases import Holder, LeaseRegistry


class Sandbox(ABC):
    """A running sandbox; a context manager that closes it.

    ``gpus`` are the GPUs the driver says it assigned, in host PCI order; ``holder`` is what
    keeps their leases alive while the sandbox lives (its process, its container). A driver
    constructs it in ``Driver.start`` with ``launch.sandbox_id``, ``launch.gpus``, that holder
    (``Holder.process(pid)`` for a process) and ``host.leases``, the registry ``close``
    releases them from; it implements ``run``, ``stop`` and ``kill``, and ``running`` where it
    can tell cheaply.
    """

    def __init__(
        self,
        sandbox_id: str,
        driver: str,
        gpus: tuple[GpuDevice, ...],
        holder: Holder,
        leases: LeaseRegistry | None,
    ) -> None:
        self.id = sandbox_id
        self.driver = driver
        self.gpus = gpus
        self.holder = holder
        self.closed = False
        self._leases = leases
        self._close_lock = threading.Lock()

    @final
    def exec(self, argv: Sequence[str], timeout: float = DEFAULT_EXEC_TIMEOUT_S) -> ExecResult:
        """Run ``argv`` inside the sandbox and wait for it.

        A non-zero exit is a result, not an error; ``ExecTimeout`` is raised when the command
        outlives ``timeout`` (it is killed, with everything it started), ``SandboxExecError``
        when it cannot be run. Output is decoded as UTF-8, bytes that are not replaced. Each
        stream is kept whole up to ``KEPT_BYTES``; of a longer one its last ``KEPT_BYTES``,
        and the result counts the bytes cut before them (``stdout_cut``, ``stderr_cut``).
        """
        output = Output()
        returncode = self._exec(argv, timeout, output)
        stdout, stderr = output.kept()
        return ExecResult(
            tuple(argv),
            returncode,
            stdout.decode(errors="replace"),
            stderr.decode(errors="replace"),
            *output.cut(),
        )

    @final
    def exec_stream(
        self,
        argv: Sequence[str],
        stdout: int,
        stderr: int,
        timeout: float = DEFAULT_EXEC_TIMEOUT_S,
    ) -> int:
        """Run ``argv`` inside the sandbox, its output going to ``stdout`` and ``stderr``.

        Those are file descriptors; it returns the command's exit code, and fails as ``exec``
        does. The output passes through whole, as the driver receives it, and nothing of it
        is kept (``gpu-sandbox run`` streams through it).
        """
        return self._exec(argv, timeout, Output(stdout, stderr))

    def _exec(self, argv: Sequence[str], timeout: float, output: Output) -> int:
        def checked_run() -> int:
            return self._checked_run(argv, timeout, output)

        return watch.current().exec(self, argv, timeout, checked_run)

    def _checked_run(self, argv: Sequence[str], timeout: float, output: Output) -> int:
        command = Command.of(argv, timeout)
        self._check_running(command)
        try:
            returncode = self.run(command, output)
        except CommandTimedOut:
            raise ExecTimeout(command.argv, command.timeout) from None
        except SandboxExecError as exc:
            self._check_running(command, exc)
            raise
        if returncode != 0:
            self._check_running(command)  # a sandbox that died meanwhile is an error, not a result
        return returncode

    def _check_running(self, command: Command, cause: BaseException | None = None) -> None:
        if self.closed or not self.running():
            state = "closed" if self.closed else "not running"
            raise SandboxExecError(
                f"sandbox {self.id} is {state}; cannot run {shown(list(command.argv))}"
            ) from cause

    @abstractmethod
    def run(self, command: Command, output: Output) -> int:
        """Run ``command`` inside the sandbox and return its exit code: each driver's own way.

        The contract has checked the argv and the timeout, and that the sandbox runs; it builds
        the result and raises the errors callers see. This hook:

        - runs ``command.argv`` in the sandbox's pid namespace (the same one for every
          command), with the sandbox's environment and ``command.env`` over it, no stdin;
        - gives its output to ``output`` (``output.fds`` to the process, or
          ``output.stdout(data)`` and ``output.stderr(data)`` in parts as it comes, never
          gathered whole: ``output.read_from(process, timeout)`` reads a process's pipes so);
        - at ``command.timeout`` kills every process of the sandbox whose environment holds
          ``command.needle`` (the command and whatever it started, setsid or not), then raises
          ``CommandTimedOut``;
        - raises ``SandboxExecError`` when the command cannot be run.
        """

    def running(self) -> bool:
        """Whether the sandbox still runs, where that can be told without a round trip.

        The contract asks before each command and after one that failed, so that a command in
        a sandbox that died is an error, not a result. True by default.
        """
        return True

    def close(self) -> None:
        """Stop the sandbox and release its GPUs; calling it again does nothing.

        When ``stop`` raises, the sandbox may still hold its GPUs: the leases stay, and
        ``close`` may be called again.
        """
        watch.current().close(self, self._stop_and_release)

    def _stop_and_release(self) -> None:
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        try:
            self.stop()
        except BaseException:
            self.closed = False
            raise
        if self._leases is not None:
            self._leases.release(self.id)

    @abstractmethod
    def stop(self) -> None:
        """End the sandbox and everything in it; return once it is gone."""

    @abstractmethod
    def kill(self) -> None:
        """Kill the sandbox's processes with SIGKILL and release nothing, as a crash would.

        The conformance suite uses it to check that the GPUs come back by themselves.
        """

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        gpus = ", ".join(gpu.uuid for gpu in self.gpus) or "no GPUs"
        return f"<{type(self).__name__} {self.id} of {self.driver} with {gpus}>"
