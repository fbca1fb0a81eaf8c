"""External drivers of ``mode: jsonl``: the protocol, its schema, the adapter's bounds.

The adapter is tried on examples/drivers/jsonl_jail.py (bubblewrap jails behind one process)
and on small drivers written here that misbehave on purpose (a hung exec, a hung create, a
process that dies). Every message exchanged is traced (``GPU_SANDBOX_JSONL_TRACE``) and held
to docs/external-protocol.schema.json, in both directions, also over whole catalogue runs.
"""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from drivers.external import driver_class
from drivers.external.connection import TRACE_ENV
from drivers.external.manifest import ManifestError, parse
from drivers.external.protocol import SCHEMA, validator
from gpuhost import simulated
from gpuhost.errors import (
    ExecTimeout,
    GpusExhausted,
    SandboxExecError,
    SandboxStartError,
    UnknownGpuDevice,
    UnsupportedGpuRequest,
)
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec
from tests.catalogue import ROOT, golden_ids, run_catalogue, what_failed
from tests.conformance.test_example_driver import (
    PEERS_AND_PRIVILEGES,
    assert_impostor_is_no_sandbox,
    assert_sandboxes_of_users_of_their_own,
    gate_layout,
)

EXAMPLE = ROOT / "examples" / "drivers" / "jsonl-jail.yaml"
NAME = "jsonl-jail"


def assert_every_message_in_the_protocol(trace: Path) -> int:
    """Each traced message valid for its direction; how many there were."""
    __tracebackhide__ = True
    to_driver, from_driver = validator("toDriver"), validator("fromDriver")
    lines = trace.read_text().splitlines()
    assert lines, "no message was traced"
    ops = set()
    for line in lines:
        entry = json.loads(line)
        check = to_driver if entry["to"] == "driver" else from_driver
        errors = [error.message for error in check.iter_errors(entry["message"])]
        assert not errors, f"a message to the {entry['to']} outside the protocol: {entry} {errors}"
        ops.add(entry["message"].get("op", entry["message"].get("event")))
    return len(lines)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[GpuHost]:
    sim = simulated.setup(tmp_path / "sim", 4)
    yield GpuHost.open(HostConfig(sim.root))
    simulated.teardown(sim.root)


@pytest.fixture
def trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    return path


# -- the schema and the manifest -------------------------------------------------------------


def test_the_published_protocol_schema_is_the_one_the_adapter_validates_with() -> None:
    import jsonschema

    published = json.loads((ROOT / "docs" / "external-protocol.schema.json").read_text())
    assert published == SCHEMA, (
        "run: python -m drivers.external.protocol > docs/external-protocol.schema.json"
    )
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


def test_the_pages_examples_are_messages_of_the_protocol() -> None:
    """Each JSON line of docs/external-protocol.md's examples is valid, as sent."""
    page = (ROOT / "docs" / "external-protocol.md").read_text()
    blocks = [b for b in page.split("```json\n")[1:]]
    checked = 0
    for block in blocks:
        text = block.split("```", 1)[0].replace("…", "")
        for message in _json_values(text):
            errors = list(validator().iter_errors(message))
            assert not errors, f"the page's {message} is outside the schema: {errors[0].message}"
            checked += 1
    assert checked >= 20


def _json_values(text: str) -> Iterator[Any]:
    decoder = json.JSONDecoder()
    at = 0
    while at < len(text):
        if text[at].isspace():
            at += 1
            continue
        value, at = decoder.raw_decode(text, at)
        yield value


def jsonl_manifest(**changes: Any) -> dict[str, Any]:
    manifest: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    manifest.update(changes)
    return manifest


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"command": None}, "command"),
        ({"templates": {"create": ["true"]}}, "templates"),
        ({"allocation": "host-registry"}, "allocation"),
        ({"timeouts": {"ready": 5}}, "timeouts"),
        ({"command": ["{pyhton}", "x.py"]}, "command[0]"),
    ],
    ids=["no-command", "templates-in-jsonl", "host-registry", "templates-timeout", "bad-variable"],
)
def test_a_bad_jsonl_manifest_is_refused_naming_the_key(changes: dict[str, Any], key: str) -> None:
    manifest = jsonl_manifest(**changes)
    manifest = {k: v for k, v in manifest.items() if v is not None}
    with pytest.raises(ManifestError) as refused:
        parse(manifest)
    assert key in f"{refused.value.key} {refused.value}", refused.value


def test_a_templates_manifest_may_not_name_a_command() -> None:
    from tests.drivers.test_external_driver import sh_manifest

    with pytest.raises(ManifestError, match="command"):
        parse(sh_manifest(Path("/nonexistent"), command=["x"]))


# -- the example driver, through the adapter ---------------------------------------------------


def test_the_example_creates_execs_refuses_lists_and_reaps(host: GpuHost, trace: Path) -> None:
    driver = driver_class(EXAMPLE)(host, "jsonl-a")
    assert driver.probe().ok, driver.probe().reason
    assert driver.version().startswith("1.0 (bubblewrap")
    with driver.create(SandboxSpec.with_gpus(2)) as sandbox:
        assert len(sandbox.gpus) == 2
        assert driver.sandboxes("jsonl-a") == [sandbox.id]
        result = sandbox.exec(["sh", "-c", "printf 'o\\r\\n\\0'; printf e >&2; exit 130"])
        assert (result.returncode, result.stdout, result.stderr) == (130, "o\r\n\0", "e")
        assert sandbox.exec(["sh", "-c", "kill -9 $$"]).returncode == 128 + 9
        with pytest.raises(ExecTimeout):
            sandbox.exec(["sleep", "5"], timeout=0.3)
        with pytest.raises(GpusExhausted):
            driver.create(SandboxSpec.with_gpus(3))
    with pytest.raises(UnknownGpuDevice) as refused:
        driver.create(SandboxSpec.with_gpus(driver=NAME, device_ids=["no-such-gpu-0"]))
    assert refused.value.field == f"template.driver_config.{NAME}.gpu_device_ids"
    with pytest.raises(UnsupportedGpuRequest):
        driver.create(SandboxSpec.with_gpus(9))
    left = driver.create(SandboxSpec())
    assert driver.reap("jsonl-a") == [left.id]
    assert driver.sandboxes("jsonl-a") == []
    assert host.leases.leases() == []
    assert assert_every_message_in_the_protocol(trace) > 10


def test_a_killed_sandbox_refuses_exec_and_its_gpus_come_back(host: GpuHost) -> None:
    driver = driver_class(EXAMPLE)(host, "jsonl-k")
    sandbox = driver.create(SandboxSpec.with_gpus(4))
    sandbox.kill()
    with pytest.raises(SandboxExecError):
        sandbox.exec(["true"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            driver.create(SandboxSpec.with_gpus(4)).close()
            break
        except GpusExhausted:
            time.sleep(0.1)
    else:
        pytest.fail("a killed sandbox's GPUs did not come back")
    sandbox.close()


def test_the_examples_jails_run_as_users_of_their_own_under_the_filter(host: GpuHost) -> None:
    assert_sandboxes_of_users_of_their_own(driver_class(EXAMPLE)(host, "jsonl-users"))


def test_another_users_bwrap_with_the_sessions_stamp_is_not_one_of_its_jails(
    host: GpuHost,
) -> None:
    driver = driver_class(EXAMPLE)(host, "jsonl-impostor")
    assert_impostor_is_no_sandbox(driver, "JAIL_SANDBOX", "jsonl-impostor")


# -- drivers that misbehave: the adapter's bounds ---------------------------------------------

FAKE = """
import base64, json, os, signal, subprocess, sys, threading, time
def how():
    try:
        return open(os.environ["FAKE_HOW"]).read().strip()
    except OSError:
        return ""
CAPS = {"maxGpusPerSandbox": 1, "exactIds": False}
def send(m):
    sys.stdout.write(json.dumps(m) + "\\n"); sys.stdout.flush()
def handle(r):
    op = r["op"]
    if op == "hello":
        return send({"id": r["id"], "op": op, "result": {"protocol": 1,
            "driver": {"name": "fake", "version": "0"}, "capabilities": CAPS}})
    if op == "create":
        if how() == "hang-create":
            time.sleep(3600)
        if how() == "die-at-create":
            os._exit(3)
        with open(os.environ["FAKE_LOG"], "a") as log:
            log.write(f"create {os.getpid()}\\n")
        return send({"id": r["id"], "op": op, "result": {"sandbox_id": "s1", "gpus": []}})
    if op == "exec":
        script = "trap '' TERM; sleep 3600 & echo $! > " + os.environ["FAKE_PID"] + "; wait"
        p = subprocess.Popen(["sh", "-c", script], start_new_session=True)
        send({"id": r["id"], "event": "started", "pid": p.pid})
        return  # never answered, and cancel is ignored
    if op == "reap":
        with open(os.environ["FAKE_LOG"], "a") as log:
            log.write(f"reap {r['session_id']} {os.getpid()}\\n")
        return send({"id": r["id"], "op": op, "result": {"removed": []}})
    if op == "list":
        return send({"id": r["id"], "op": op, "result": {"sandbox_ids": []}})
    if op in ("close", "shutdown"):
        return send({"id": r["id"], "op": op, "result": {}})
for line in sys.stdin:
    threading.Thread(target=handle, args=(json.loads(line),), daemon=True).start()
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> type:
    (tmp_path / "fake.py").write_text(textwrap.dedent(FAKE))
    manifest = {
        "apiVersion": "gpu-sandbox.dev/v1alpha1", "kind": "Driver", "name": "fake",
        "mode": "jsonl", "allocation": "driver", "command": ["{python}", "fake.py"],
        "capabilities": {"maxGpusPerSandbox": 1, "exactIds": False},
        "timeouts": {"create": 1, "hello": 10}, "passEnv": ["FAKE_LOG", "FAKE_PID", "FAKE_HOW"],
    }  # fmt: skip
    path = tmp_path / "fake.yaml"
    path.write_text(yaml.safe_dump(manifest))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log"))
    monkeypatch.setenv("FAKE_PID", str(tmp_path / "pid"))
    monkeypatch.setenv("FAKE_HOW", str(tmp_path / "how"))
    return driver_class(path)


def test_an_exec_whose_driver_ignores_timeout_and_cancel_is_ended_by_the_adapter(
    fake: type, host: GpuHost, tmp_path: Path
) -> None:
    from tests.drivers.test_external_driver import _gone

    sandbox = fake(host, "fake-e").create(SandboxSpec())
    started = time.monotonic()
    with pytest.raises(ExecTimeout, match="timeout"):
        sandbox.exec(["anything"], timeout=0.5)
    assert time.monotonic() - started < 10
    assert _gone(int((tmp_path / "pid").read_text())), "the command's process group outlived it"


def test_a_hung_create_times_out_and_the_driver_process_is_restarted(
    fake: type, host: GpuHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "how").write_text("hang-create")
    driver = fake(host, "fake-c")
    started = time.monotonic()
    with pytest.raises(SandboxStartError, match="timeout"):
        driver.create(SandboxSpec())
    assert time.monotonic() - started < 10
    (tmp_path / "how").write_text("")
    assert driver.create(SandboxSpec()).id == "s1", "no new driver process after the hung one"


def test_a_driver_process_that_dies_fails_what_is_in_flight_and_is_restarted_and_reaped(
    fake: type, host: GpuHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = fake(host, "fake-d")
    first = driver.create(SandboxSpec())
    (tmp_path / "how").write_text("die-at-create")
    with pytest.raises(SandboxStartError, match=r"driver process .* exited 3 while it was in"):
        driver.create(SandboxSpec())
    assert not first.running()
    (tmp_path / "how").write_text("")
    second = driver.create(SandboxSpec())
    log = (tmp_path / "log").read_text().split("\n")
    pids = [line.split()[-1] for line in log if line.startswith("create")]
    assert len(set(pids)) == 2, f"the second create was not made by a new process: {log}"
    assert f"reap fake-d {pids[-1]}" in log, f"the new process did not reap the dead one's: {log}"
    first.close()  # its process is gone: nothing to do
    second.close()


# -- the catalogue, on the example and its planted breakers (lane) ----------------------------


def _catalogue(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str
) -> tuple[dict[str, Any], pytest.RunResult, Path]:
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    result, run = run_catalogue(pytester, tmp_path, f"exec:{EXAMPLE}", 8, *args)
    return result, run, trace


def test_the_example_passes_the_whole_catalogue_every_message_in_the_protocol(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "--sim-gpus=8" in gate_layout()  # run_catalogue makes the gate's layout itself
    result, run, trace = _catalogue(pytester, tmp_path, monkeypatch)
    name = f"exec:{EXAMPLE}"
    assert result["verdicts"][name]["status"] == "PASS", (
        what_failed(result, name) or run.stdout.str()[-3000:]
    )
    assert run.ret == 0
    verdicts = {req: cells[name] for req, cells in result["matrix"].items()}
    assert {verdicts[req] for req in golden_ids()} <= {"passed", "not applicable"}, (
        f"{what_failed(result, name)}\nverdicts: {verdicts}"
    )
    assert assert_every_message_in_the_protocol(trace) > 1000


def test_the_example_passes_the_peer_and_privilege_requirements(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    name = f"exec:{EXAMPLE}"
    result, run = run_catalogue(pytester, tmp_path, name, 4, PEERS_AND_PRIVILEGES, full=False)
    verdicts = {req: result["matrix"][req][name] for req in ("SANDBOX-PEER-01", "SANDBOX-PRIV-01")}
    assert set(verdicts.values()) == {"passed"}, (verdicts, run.stdout.str()[-3000:])


@pytest.mark.parametrize(
    ("breaker", "requirement"),
    [("exit-codes", "SANDBOX-EXEC-01"), ("merged-streams", "SANDBOX-EXEC-01")],
)
def test_a_planted_broken_jsonl_driver_fails_the_requirement_it_breaks(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    breaker: str, requirement: str,
) -> None:  # fmt: skip
    monkeypatch.setenv("JSONL_JAIL_BREAK", breaker)
    result, run, _ = _catalogue(pytester, tmp_path, monkeypatch, f"--requirement={requirement}")
    name = f"exec:{EXAMPLE}"
    assert result["matrix"][requirement][name] == "failed", result["tests"]
    run.stdout.fnmatch_lines([f"{name}: FAIL — *{requirement}*"])


def test_a_driver_process_that_crashes_fails_the_tests_in_flight_and_the_run_goes_on(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JSONL_JAIL_BREAK", "crash-on-third-create")
    result, run, trace = _catalogue(pytester, tmp_path, monkeypatch)
    failed = [test for test in result["tests"] if test["outcome"] in ("failed", "error")]
    assert len(failed) == 1, [(t["name"], t["message"][:200]) for t in failed]
    assert "driver process" in failed[0]["message"], failed[0]
    assert "killed by signal 9" in failed[0]["message"], failed[0]
    passed = [test for test in result["tests"] if test["outcome"] == "passed"]
    assert len(passed) > 80, "the run did not go on after the driver process was restarted"
    hellos = [
        line for line in trace.read_text().splitlines() if '"op": "hello", "protocol"' in line
    ]
    assert len(hellos) >= 2
    assert run.ret != 0


def test_reap_from_the_command_line_works_for_a_jsonl_driver(
    pytester: pytest.Pytester, host: GpuHost
) -> None:
    driver = driver_class(EXAMPLE)(host, "jsonl-r")
    made = driver.create(SandboxSpec.with_gpus(1))
    run = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", f"--rootdir={ROOT}", "-c", str(ROOT / "pytest.ini"),
        "--reap=jsonl-r", f"--driver=exec:{EXAMPLE}", f"--sim-root={host.config.sim_root}",
        timeout=120,
    )  # fmt: skip
    assert run.ret == 0, run.stdout.str() + run.stderr.str()
    run.stdout.fnmatch_lines(["*removed 1 sandbox(es) of session jsonl-r*"])
    assert driver.sandboxes("jsonl-r") == []
    assert host.leases.leases() == []
    made.close()


def test_a_jsonl_driver_that_declares_inventory_is_asked_for_its_gpus(
    host: GpuHost, tmp_path: Path, trace: Path
) -> None:
    manifest = jsonl_manifest(
        inventory=True, command=["{python}", str(EXAMPLE.parent / "jsonl_jail.py")]
    )
    path = tmp_path / "jsonl-jail.yaml"
    path.write_text(yaml.safe_dump(manifest))
    driver = driver_class(path)(host, "jsonl-i")
    assert driver.inventory() == host.default_devices
    gpu = host.gpus[1]
    assert driver.device_ids(gpu)[:2] == (str(gpu.index), gpu.uuid)
    assert '"op": "inventory"' in trace.read_text()
    assert_every_message_in_the_protocol(trace)
