"""A ``jsonl`` driver's exec output and its death: what the adapter holds, and how it fails.

A small driver written here answers an exec in the way a test writes into ``FAKE_HOW``: an
output chunk that is not base64 followed by 25 MiB more, a reply of another op, a line
nested past Python's recursion limit, or dying while a setsid child it started still holds
its stdout.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from drivers.external import driver_class, protocol
from drivers.external.connection import DriverProcessDied
from drivers.external.protocol import ProtocolError, validator
from drivers.sandbox import Sandbox
from gpuhost import simulated
from gpuhost.errors import ExecTimeout, SandboxExecError
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec
from tests.drivers.test_external_driver import _gone

FAKE = """
import base64, json, os, subprocess, sys, threading
lock = threading.Lock()
def send(m):
    line = (m if isinstance(m, str) else json.dumps(m)) + "\\n"
    with lock:
        sys.stdout.write(line); sys.stdout.flush()
def handle(r):
    i, op = r["id"], r["op"]
    if op == "hello":
        return send({"id": i, "op": op, "result": {"protocol": 1,
            "driver": {"name": "fake", "version": "0"},
            "capabilities": {"maxGpusPerSandbox": 1, "exactIds": False}}})
    if op == "create":
        return send({"id": i, "op": op, "result": {"sandbox_id": "s1", "gpus": []}})
    if op == "list":
        return send({"id": i, "op": op, "result": {"sandbox_ids": []}})
    if op == "reap":
        return send({"id": i, "op": op, "result": {"removed": []}})
    if op != "exec":
        return send({"id": i, "op": op, "result": {}})
    how, _, arg = open(os.environ["FAKE_HOW"]).read().partition(" ")
    out = {"id": i, "event": "output", "stream": "stdout", "data": "b2sK"}
    if how == "chunk":
        send({**out, **json.loads(arg)})
        for _ in range(400):  # 25 MiB more
            send({**out, "data": base64.b64encode(b"x" * 65536).decode()})
        open(os.environ["FAKE_LOG"], "w").write("sent")
    elif how == "reply":
        send({"id": i, **json.loads(arg)})
    elif how == "deep":
        send("[" * 100000 + "]" * 100000)
    elif how == "die":  # a child in a session of its own keeps our stdout open
        env = {} if arg == "env-cleared" else None
        child = subprocess.Popen(["/usr/bin/setsid", "/bin/sleep", "3600"], env=env)
        open(os.environ["FAKE_PID"], "w").write(str(child.pid))
        os._exit(3)
    send(out)
    send({"id": i, "op": "exec", "result": {"exit_code": 0}})
for line in sys.stdin:
    threading.Thread(target=handle, args=(json.loads(line),), daemon=True).start()
"""


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sandbox]:
    (tmp_path / "fake.py").write_text(textwrap.dedent(FAKE))
    manifest = {
        "apiVersion": "gpu-sandbox.dev/v1alpha1", "kind": "Driver", "name": "fake",
        "mode": "jsonl", "allocation": "driver", "command": ["{python}", "fake.py"],
        "capabilities": {"maxGpusPerSandbox": 1, "exactIds": False},
        "timeouts": {"hello": 10, "create": 10, "close": 10, "list": 10, "reap": 10},
        "passEnv": ["FAKE_HOW", "FAKE_LOG", "FAKE_PID"],
    }  # fmt: skip
    (tmp_path / "fake.yaml").write_text(yaml.safe_dump(manifest))
    for name in ("how", "log", "pid"):
        monkeypatch.setenv(f"FAKE_{name.upper()}", str(tmp_path / name))
    (tmp_path / "how").write_text("echo")
    sim = simulated.setup(tmp_path / "sim", 1)
    driver = driver_class(tmp_path / "fake.yaml")(GpuHost.open(HostConfig(sim.root)), "fake-o")
    created = driver.create(SandboxSpec())
    try:
        yield created
    finally:
        created._conn.terminate()  # type: ignore[attr-defined]
        simulated.teardown(sim.root)


def causes(error: BaseException) -> list[BaseException]:
    """``error`` and its causes, the first cause last."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    return chain


def answer(how: str) -> None:
    """How the driver answers the next exec."""
    Path(os.environ["FAKE_HOW"]).write_text(how)


@pytest.mark.parametrize(
    ("event", "field", "value"),
    [
        ({"data": "A"}, "data", "A"),
        ({"data": "b2sK="}, "data", "b2sK="),
        ({"data": "b2 sK"}, "data", "b2 sK"),
        ({"data": 7}, "data", 7),
        ({"stream": "stdin"}, "stream", "stdin"),
        ({"extra": True}, "extra", True),
    ],
    ids=["one-character", "bad-padding", "space", "not-a-string", "stream", "extra-field"],
)
def test_a_malformed_chunk_fails_its_exec_by_field_and_value_and_what_follows_is_dropped(
    sandbox: Sandbox, event: dict[str, Any], field: str, value: object
) -> None:
    answer(f"chunk {json.dumps(event)}")
    with pytest.raises(SandboxExecError) as failed:
        sandbox.exec(["anything"], timeout=30)
    cause = failed.value.__cause__
    assert isinstance(cause, ProtocolError), repr(failed.value)
    assert (cause.field, cause.value) == (field, value)
    assert f"{field} {value!r}" in str(failed.value), failed.value
    # The 25 MiB sent after it are read and dropped: nothing of that request is held.
    log = Path(os.environ["FAKE_LOG"])
    deadline = time.monotonic() + 30
    while not log.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.exists(), "the driver did not get its chunks out"
    conn = sandbox._conn  # type: ignore[attr-defined]
    time.sleep(0.5)
    assert conn._pending == {}, "a failed request is still in flight, its chunks queued"
    answer("echo")
    assert sandbox.exec(["next"]).stdout == "ok\n", "the next exec of the process failed"


@pytest.mark.parametrize(
    ("reply", "field"),
    [
        ({"op": "list", "result": {"sandbox_ids": []}}, "op"),
        ({"op": "exec", "result": {"exit_code": -1}}, "result.exit_code"),
        ({"op": "exec", "result": {"exit_code": 0}, "extra": 1}, ""),
    ],
    ids=["another-op", "negative-exit-code", "extra-field"],
)
def test_a_malformed_reply_fails_its_exec_with_a_typed_error(
    sandbox: Sandbox, reply: dict[str, Any], field: str
) -> None:
    answer(f"reply {json.dumps(reply)}")
    with pytest.raises(SandboxExecError, match="breaks the protocol") as failed:
        sandbox.exec(["anything"], timeout=30)
    cause = failed.value.__cause__
    assert isinstance(cause, ProtocolError), repr(failed.value)
    assert cause.field == field


def test_a_line_nested_too_deep_ends_the_driver_process_and_fails_what_is_in_flight(
    sandbox: Sandbox,
) -> None:
    answer("deep")
    started = time.monotonic()
    with pytest.raises(SandboxExecError) as failed:
        sandbox.exec(["anything"], timeout=30)
    assert time.monotonic() - started < 10, "it waited for the exec's timeout"
    died = causes(failed.value)[-1]
    assert isinstance(died, DriverProcessDied), causes(failed.value)
    assert "after a line that is not JSON: b'[[[[" in str(died)


@pytest.mark.parametrize("child", ["marked", "env-cleared"])
def test_a_driver_process_that_dies_fails_its_exec_at_once_and_leaves_nothing(
    sandbox: Sandbox, child: str
) -> None:
    """Even while a setsid child it started holds its stdout: found by its marker or its pipe."""
    answer(f"die {child}")
    started = time.monotonic()
    with pytest.raises(SandboxExecError) as failed:
        sandbox.exec(["anything"], timeout=30)
    assert time.monotonic() - started < 10, "it waited for the exec's timeout, not the process"
    assert not isinstance(failed.value, ExecTimeout)
    died = causes(failed.value)[-1]
    assert isinstance(died, DriverProcessDied), causes(failed.value)
    assert "exited 3 while it was in flight" in str(died)
    pid = int(Path(os.environ["FAKE_PID"]).read_text())
    assert _gone(pid, within_s=10), f"the driver's setsid child {pid} outlived it"


VALID = ["", "AAAA", "AA==", "AAA=", "b2sK", "AAAAAA=="]
SAMPLES = [
    *VALID, "A", "AA", "AAA", "AA=", "A===", "AAAA=", "AAAA====", "AA==AA==", "AAA==A==", "AA=A",
    "-_==", "AA\n==", "ÀÀ==", 7, None,
]  # fmt: skip


@pytest.mark.parametrize("data", SAMPLES, ids=repr)
def test_the_schema_and_the_adapters_check_agree_on_an_output_events_data(data: object) -> None:
    message = {"id": 1, "event": "output", "stream": "stdout", "data": data}
    valid = data in VALID
    assert (not list(validator("fromDriver").iter_errors(message))) is valid
    if valid:
        protocol.output_data(message)
        return
    with pytest.raises(ProtocolError) as refused:
        protocol.output_data(message)
    assert (refused.value.field, refused.value.value) == ("data", data)
