"""The docker driver's exec keeps output that arrives in the same read as the upgrade headers.

dockerd answers an exec start with ``101 UPGRADED`` and then the output frames on the same
connection; under load both come in one read. A stand-in daemon on a unix socket sends them
in one write, so the case that loses output with docker-py's own stream reader
(docker/docker-py#3332) happens every time here.
"""

from __future__ import annotations

import functools
import json
import os
import select
import socket
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import pytest

from drivers.base import write_all
from drivers.docker import DockerDriver
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig

EXEC_ID = "e" * 64


STILL_RUNNING = threading.Event()
"""Cleared while a test keeps the stand-in's command running after its first output."""
STILL_RUNNING.set()


def frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


OUTPUT = frame(1, b"GPU-0\n") + frame(2, b"a warning\n") + frame(1, b"GPU-1\n")


def answer(request_line: str) -> bytes:
    """The stand-in daemon's reply to one request.

    The exec start is upgraded, its output in the same write; JSON for everything else.
    """
    method, path, _ = request_line.split(" ", 2)
    if path.endswith(f"/exec/{EXEC_ID}/start"):
        head = b"HTTP/1.1 101 UPGRADED\r\nContent-Type: application/vnd.docker.raw-stream\r\n"
        return head + b"Connection: Upgrade\r\nUpgrade: tcp\r\n\r\n" + OUTPUT
    if path.endswith("/exec"):
        body: object = {"Id": EXEC_ID}
    elif path.endswith(f"/exec/{EXEC_ID}/json"):
        body = {"ExitCode": 3, "Running": False}
    elif path.endswith("/version"):
        body = {"ApiVersion": "1.45", "Version": "26.1.5"}
    else:
        raise AssertionError(f"unexpected request {method} {path}")
    data = json.dumps(body).encode()
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )


def serve(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=converse, args=(conn,), daemon=True).start()


def converse(conn: socket.socket) -> None:
    with conn:
        while True:
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                request += chunk
            if not request:
                break
            head, _, body = request.partition(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            while len(body) < length:
                body += conn.recv(65536)
            reply = answer(head.split(b"\r\n")[0].decode())
            conn.sendall(reply)
            if b" 101 " in reply.split(b"\r\n")[0]:
                # The command goes on, silent, while a test holds it; then it ends, and the
                # daemon closes the upgraded connection.
                STILL_RUNNING.wait(timeout=30)
                break


@pytest.fixture
def daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    path = tmp_path / "docker.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    threading.Thread(target=serve, args=(listener,), daemon=True).start()
    url = f"unix://{path}"
    monkeypatch.setenv("DOCKER_HOST", url)
    yield url
    listener.close()


def driver(sim: simulated.SimulatedHost) -> DockerDriver:
    return DockerDriver(GpuHost.open(HostConfig(sim_root=sim.root)), "exec-test")


def test_docker_py_alone_loses_output_that_came_with_the_headers(daemon: str) -> None:
    """The stand-in reproduces the defect, so the next test is worth something."""
    api = docker.APIClient(base_url=daemon, version="1.45")
    stdout, stderr = api.exec_start(EXEC_ID, demux=True)
    assert (stdout, stderr) == (None, None)


def test_exec_keeps_output_that_came_with_the_headers(
    daemon: str, sim_host: simulated.SimulatedHost
) -> None:
    out: list[bytes] = []
    err: list[bytes] = []
    returncode = driver(sim_host).exec_in(
        "c" * 64, ["nvidia-smi", "-L"], {}, out.append, err.append
    )
    assert (b"".join(out), b"".join(err), returncode) == (
        b"GPU-0\nGPU-1\n",
        b"a warning\n",
        3,
    )


def test_exec_hands_on_what_came_with_the_headers_at_once(
    daemon: str, sim_host: simulated.SimulatedHost
) -> None:
    """A command's first output, come with the headers, is passed on before it writes more."""
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    STILL_RUNNING.clear()
    try:
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(
                driver(sim_host).exec_in, "c" * 64, ["nvidia-smi", "-L"], {},
                functools.partial(write_all, out_write), functools.partial(write_all, err_write),
            )  # fmt: skip
            ready, _, _ = select.select([out_read], [], [], 10)
            assert ready, "the output that came with the headers waits for the command's next"
            assert os.read(out_read, 65536).startswith(b"GPU-0\n")
            STILL_RUNNING.set()
            assert streaming.result(timeout=30) == 3
    finally:
        STILL_RUNNING.set()
        for fd in (out_read, out_write, err_read, err_write):
            os.close(fd)
