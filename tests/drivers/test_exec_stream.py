"""``Sandbox.exec_stream``: the command's output to file descriptors, as it is written.

The reference driver's here, in this process; docker's and podman's through ``gpu-sandbox
run`` in tests/gpu_sandbox/test_cli.py. The contract's default (output written once the
command ends) is checked on a reference sandbox too, called as the base class has it.
"""

from __future__ import annotations

import os
import select
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from drivers.base import Sandbox
from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.errors import ExecTimeout
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec

PAUSE_S = 3.0
"""Between two lines of the command: the first must arrive well before the second."""


@pytest.fixture
def sandbox(sim_host: simulated.SimulatedHost) -> Iterator[Sandbox]:
    session = f"exec-stream-{uuid.uuid4().hex[:8]}"
    driver = ReferenceDriver(GpuHost.open(HostConfig(sim_root=sim_host.root)), session)
    if not driver.probe().ok:
        pytest.skip(driver.probe().reason)
    with driver.create(SandboxSpec.with_gpus()) as created:
        yield created
    driver.reap(session)


def test_output_arrives_as_it_is_written(sandbox: Sandbox) -> None:
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    script = f"echo first; echo oops >&2; sleep {PAUSE_S}; echo second; exit 3"
    returned: list[int] = []
    running = threading.Thread(
        target=lambda: returned.append(
            sandbox.exec_stream(["sh", "-c", script], out_write, err_write)
        )
    )
    started = time.monotonic()
    running.start()
    try:
        assert _read_line(out_read) == b"first\n"
        assert _read_line(err_read) == b"oops\n"
        assert time.monotonic() - started < PAUSE_S, "the first line waited for the pause"
        assert running.is_alive()
        assert _read_line(out_read) == b"second\n"
    finally:
        running.join(60)
        for fd in (out_read, out_write, err_read, err_write):
            os.close(fd)
    assert returned == [3]


def test_output_passes_as_bytes(sandbox: Sandbox, tmp_path: Path) -> None:
    """Not decoded: bytes that are not UTF-8 come through as they are."""
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    err = os.open(tmp_path / "err", os.O_RDWR | os.O_CREAT)
    try:
        code = sandbox.exec_stream(["sh", "-c", r"printf '\377\000x'; printf 'e' >&2"], out, err)
        assert code == 0
        assert (os.pread(out, 16, 0), os.pread(err, 16, 0)) == (b"\xff\x00x", b"e")
    finally:
        os.close(out)
        os.close(err)


def test_a_timeout_kills_the_command(sandbox: Sandbox) -> None:
    with open(os.devnull, "wb") as null, pytest.raises(ExecTimeout):
        sandbox.exec_stream(["sleep", "60"], null.fileno(), null.fileno(), timeout=1)
    assert sandbox.exec(["true"]).returncode == 0


def test_the_contracts_default_writes_the_output_at_the_end(
    sandbox: Sandbox, tmp_path: Path
) -> None:
    out = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    err = os.open(tmp_path / "err", os.O_RDWR | os.O_CREAT)
    try:
        code = Sandbox.exec_stream(
            sandbox, ["sh", "-c", "echo out; echo err >&2; exit 5"], out, err
        )
        assert (code, os.pread(out, 16, 0), os.pread(err, 16, 0)) == (5, b"out\n", b"err\n")
    finally:
        os.close(out)
        os.close(err)


def _read_line(fd: int, timeout: float = 60.0) -> bytes:
    line = b""
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no line within {timeout:g} s (got {line!r})"
        chunk = os.read(fd, 1)
        assert chunk, f"end of output (got {line!r})"
        line += chunk
    return line
