"""The contract's exec: one argv rule, one timeout rule, one result, whatever the driver.

``Sandbox.exec`` and ``exec_stream`` are final in ``drivers.base``; a driver implements
``run``. These tries use a sandbox whose ``run`` records what it was handed, so that every
rule is seen to hold before a driver is asked anything.
"""

from __future__ import annotations

import math
import os

import pytest

from drivers.base import Command, CommandTimedOut, Output, Sandbox
from gpuhost.errors import ExecTimeout, SandboxExecError
from gpuhost.leases import Holder
from gpuhost.procfs import EXEC_MARKER_ENV


class Recording(Sandbox):
    """Answers every command with ``answer``; ``alive`` says whether it still runs."""

    def __init__(self, answer: int | BaseException = 0) -> None:
        super().__init__("rec", "recording", (), Holder.process(os.getpid()), None)
        self.answer = answer
        self.alive = True
        self.commands: list[Command] = []

    def run(self, command: Command, output: Output) -> int:
        self.commands.append(command)
        output.stdout("out \u00e9\r\n".encode())
        output.stderr(b"err \xff")
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    def running(self) -> bool:
        return self.alive

    def stop(self) -> None:
        pass

    def kill(self) -> None:
        self.alive = False


NOT_ARGV: list[object] = [
    [],
    "ls",
    b"ls",
    [""],
    ["A=B", "sh"],
    ["ls", 3],
    ["ls", "a\0b"],
    [None],
    42,
]


@pytest.mark.parametrize("argv", NOT_ARGV, ids=repr)
def test_an_argv_that_names_no_program_is_refused_before_the_driver_runs(argv: object) -> None:
    sandbox = Recording()
    with pytest.raises(SandboxExecError, match="argv must be a list of strings") as raised:
        sandbox.exec(argv)  # type: ignore[arg-type]
    assert "got " in str(raised.value)
    with pytest.raises(SandboxExecError, match="argv must"):
        sandbox.exec_stream(argv, 1, 2)  # type: ignore[arg-type]
    assert sandbox.commands == []


@pytest.mark.parametrize("timeout", [0, -1, math.nan, math.inf, True, "5", None], ids=repr)
def test_a_timeout_that_is_no_positive_number_is_refused(timeout: object) -> None:
    sandbox = Recording()
    with pytest.raises(SandboxExecError, match="timeout must be a positive number"):
        sandbox.exec(["true"], timeout)  # type: ignore[arg-type]
    assert sandbox.commands == []


def test_the_driver_gets_the_checked_command_with_a_fresh_marker() -> None:
    sandbox = Recording()
    sandbox.exec(["echo", "a=b"], 2)
    sandbox.exec(("echo",), 0.5)
    first, second = sandbox.commands
    assert (first.argv, first.timeout) == (("echo", "a=b"), 2.0)
    assert first.env == {EXEC_MARKER_ENV: first.marker}
    assert first.needle == f"{EXEC_MARKER_ENV}={first.marker}".encode()
    assert first.marker != second.marker


def test_exec_keeps_the_output_byte_for_byte_and_decodes_it_once() -> None:
    result = Recording(answer=7).exec(["x"])
    assert (result.argv, result.returncode) == (("x",), 7)
    assert (result.stdout, result.stderr) == ("out \u00e9\r\n", "err \ufffd")


def test_exec_stream_passes_the_output_to_the_descriptors() -> None:
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        assert Recording(answer=3).exec_stream(["x"], out_write, err_write) == 3
        assert os.read(out_read, 100) == "out \u00e9\r\n".encode()
        assert os.read(err_read, 100) == b"err \xff"
    finally:
        for fd in (out_read, out_write, err_read, err_write):
            os.close(fd)


def test_a_command_past_its_timeout_is_one_error() -> None:
    with pytest.raises(ExecTimeout, match=r"\['sleep', '9'\] ran past its timeout of 1.5 s"):
        Recording(answer=CommandTimedOut()).exec(["sleep", "9"], 1.5)


def test_a_closed_or_dead_sandbox_runs_nothing() -> None:
    closed = Recording()
    closed.close()
    with pytest.raises(SandboxExecError, match="sandbox rec is closed"):
        closed.exec(["true"])
    dead = Recording()
    dead.kill()
    with pytest.raises(SandboxExecError, match="sandbox rec is not running"):
        dead.exec_stream(["true"], 1, 2)
    assert closed.commands == dead.commands == []


def test_a_failure_in_a_sandbox_that_died_meanwhile_is_an_error_not_a_result() -> None:
    sandbox = Recording(answer=1)
    assert sandbox.exec(["false"]).returncode == 1
    real_run = sandbox.run

    def dies(command: Command, output: Output) -> int:
        sandbox.alive = False
        return real_run(command, output)

    sandbox.run = dies  # type: ignore[method-assign]
    with pytest.raises(SandboxExecError, match="not running"):
        sandbox.exec(["false"])
    sandbox.alive = True
    sandbox.answer = SandboxExecError("nsenter failed")
    with pytest.raises(SandboxExecError, match="not running") as raised:
        sandbox.exec(["true"])
    assert isinstance(raised.value.__cause__, SandboxExecError)
