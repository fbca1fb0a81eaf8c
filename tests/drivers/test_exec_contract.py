"""The contract's exec: one argv rule, one timeout rule, one result, whatever the driver.

``Sandbox.exec`` and ``exec_stream`` are final in ``drivers.base``; a driver implements
``run``. These tries use a sandbox whose ``run`` records what it was handed, so that every
rule is seen to hold before a driver is asked anything.
"""

from __future__ import annotations

import math
import os
import subprocess
import time

import pytest

from drivers.base import KEPT_BYTES, Command, CommandTimedOut, Output, Sandbox
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


class Loud(Recording):
    """Prints ``sizes`` bytes on stdout, part by part, and exactly ``KEPT_BYTES`` on stderr."""

    def __init__(self, sizes: list[int]) -> None:
        super().__init__()
        self.sizes = sizes

    def run(self, command: Command, output: Output) -> int:
        for size in self.sizes:
            output.stdout(PATTERN[:size])
        output.stderr(PATTERN[:KEPT_BYTES])
        return 1


PATTERN = bytes(range(251)) * (3 * KEPT_BYTES // 251)
"""Bytes whose place shows in them (251 is prime: no power of two lines up with it)."""


@pytest.mark.parametrize(
    "sizes",
    [[KEPT_BYTES], [KEPT_BYTES + 1], [1] * 3 + [KEPT_BYTES], [65536] * 300, [2 * KEPT_BYTES + 7]],
    ids=["at-the-bound", "one-past", "small-then-bound", "many-parts", "one-large-part"],
)
def test_exec_keeps_the_last_kept_bytes_of_each_stream_and_counts_what_it_cut(
    sizes: list[int],
) -> None:
    result = Loud(sizes).exec(["loud"])
    printed = b"".join(PATTERN[:size] for size in sizes)
    cut = max(0, len(printed) - KEPT_BYTES)
    kept = Output()
    for size in sizes:
        kept.stdout(PATTERN[:size])
    # Compared first, asserted after: pytest would diff the 16 MiB on a failure.
    tail = kept.kept()[0] == printed[cut:]
    assert tail, "Output kept something else than the end"
    assert kept.cut() == (cut, 0)
    assert (result.stdout_cut, result.stderr_cut) == (cut, 0)
    decoded = result.stdout == printed[cut:].decode(errors="replace")
    assert decoded, "exec's stdout is not the end of what was printed"
    whole = result.stderr == PATTERN[:KEPT_BYTES].decode(errors="replace")
    assert whole, "exec's stderr, at the bound, is not whole"
    with pytest.raises(AssertionError) as failed:
        result.check()
    said = str(failed.value).splitlines()[-1]
    if cut:
        assert (
            said == f"the first {cut:,} bytes of stdout were cut (its last {KEPT_BYTES:,} are kept)"
        )
    else:
        assert "were cut" not in str(failed.value)


def test_what_exec_holds_stays_within_the_bound_however_much_comes() -> None:
    kept = Output()
    part = PATTERN[: 3 * 1024 * 1024 + 1]
    for _ in range(100):  # 300 MiB
        kept.stdout(part)
        kept.stderr(part[:7])
        assert len(kept._kept[0].kept) <= KEPT_BYTES
        assert len(kept._kept[1].kept) <= KEPT_BYTES
    assert kept.cut() == (100 * len(part) - KEPT_BYTES, 0)


def test_exec_stream_keeps_nothing() -> None:
    out_read, out_write = os.pipe()
    try:
        output = Output(out_write, out_write)
        output.stdout(b"x")
        assert output.kept() == (b"", b"")
        assert output.cut() == (0, 0)
        assert os.read(out_read, 10) == b"x"
    finally:
        os.close(out_read)
        os.close(out_write)


def test_read_from_passes_a_process_s_pipes_on_and_closes_them() -> None:
    script = "head -c 300000 /dev/zero; printf e >&2; exit 4"
    process = subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    parts: list[bytes] = []
    output = Output()
    output.stdout = parts.append  # type: ignore[method-assign,assignment]
    assert output.read_from(process, 30) == 4
    assert b"".join(parts) == bytes(300000)
    assert len(parts) > 1, "it waited for the whole output"
    assert output.kept() == (b"", b"e")
    assert process.stdout is not None
    assert process.stdout.closed
    assert process.stderr is not None
    assert process.stderr.closed


def test_read_from_raises_at_its_timeout_and_leaves_the_process_to_the_caller() -> None:
    process = subprocess.Popen(["sleep", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            Output().read_from(process, 0.3)
        assert time.monotonic() - started < 5
        assert process.poll() is None
    finally:
        process.kill()
        process.wait()
