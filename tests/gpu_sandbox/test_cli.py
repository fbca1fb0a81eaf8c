"""``gpu-sandbox`` as a person runs it: the installed command, in a subprocess, on a simulated host.

Every mapping rule and every error of the GPU flags, on the reference driver and on docker
and podman where they answer (``make test`` starts them; elsewhere they are skipped with the
reason); the command's exit code and output passing through as it is written; SIGINT and
SIGTERM during ``run`` leaving no sandbox and no lease; ``spec``, ``gpus`` and ``reap``.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import pytest

from conformance.observe import parse_list
from drivers import REGISTRY, get_driver_class
from drivers.base import Driver
from gpu_sandbox.flags import GpuFlags, spec_dict
from gpuhost import simulated
from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost, HostConfig
from gpuhost.leases import Holder
from gpuhost.spec import SandboxSpec

ROOT = Path(__file__).parents[2]
GPU_SANDBOX = Path(sys.executable).parent / "gpu-sandbox"
CDI_DIR = Path("/var/run/cdi")
CLI_TIMEOUT_S = 120.0
"""An engine driver's create and close take seconds; a minute or two means something hangs."""
OUTPUT_TIMEOUT_S = 60.0
"""How long the first line of a running command may take to come through."""
DRIVERS = ("reference", "docker", "podman")
ENGINE_GROUP = pytest.mark.xdist_group("engines")
"""Tests that use an engine run in tests/drivers/test_engines.py's group, one of which stops
dockerd. (Under xdist each worker has a simulated host of its own: no other grouping is
needed.)"""


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[simulated.SimulatedHost]:
    """Four GPUs, the first in MIG mode with two instances; registered with the engines."""
    registry = CDI_DIR if os.access(CDI_DIR.parent, os.W_OK) else None
    root = tmp_path_factory.mktemp("cli") / "sim"
    mig = simulated.parse_mig_layout("0:2x1g.10gb")
    host = simulated.setup(root, 4, registry, mig, owner=Holder.process(os.getpid()))
    yield host
    simulated.teardown(host.root)


@pytest.fixture(
    params=[
        pytest.param(name, marks=[ENGINE_GROUP] if name != "reference" else []) for name in DRIVERS
    ]
)
def cli_driver(request: pytest.FixtureRequest, sim: simulated.SimulatedHost) -> Iterator[Driver]:
    """The driver, with a session of this test's own; skipped where it cannot run."""
    session = f"cli-test-{uuid.uuid4().hex[:8]}"
    instance = get_driver_class(request.param)(GpuHost.open(HostConfig(sim.root)), session)
    availability = instance.probe()
    if not availability.ok:
        pytest.skip(f"{request.param}: {availability.reason}")
    yield instance
    instance.reap(session)


def gpu_sandbox(*args: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(GPU_SANDBOX), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
        env=_env(**env),
    )


def _env(**extra: str) -> dict[str, str]:
    # tests.fake_drivers must be importable by the command, as an out-of-tree driver would be.
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def run(driver: Driver, *args: str) -> subprocess.CompletedProcess[str]:
    return gpu_sandbox("run", *_options(driver), *args)


def _options(driver: Driver) -> list[str]:
    return [
        f"--driver={driver.name}",
        f"--session={driver.session_id}",
        f"--sim-root={driver.host.config.sim_root}",
    ]


def seen(stdout: str) -> set[str]:
    """The UUIDs ``nvidia-smi -L`` listed: GPUs, and MIG instances under them."""
    listed = parse_list(stdout)
    return {gpu.uuid for gpu in listed} | {mig.uuid for gpu in listed for mig in gpu.mig_devices}


def expected(*devices: GpuDevice) -> set[str]:
    """What ``nvidia-smi -L`` lists for these devices: a MIG instance comes with its GPU."""
    return {uuid for device in devices for uuid in (device.uuid, device.parent_uuid) if uuid}


def assert_nothing_left(driver: Driver) -> None:
    """No sandbox of the session, and no lease of it in the registry's file.

    The file as it is, not ``LeaseRegistry.leases()``, which would reclaim the leases of
    dead holders and so hide a sandbox that was never closed but died with the command.
    """
    __tracebackhide__ = True
    session = driver.session_id
    assert driver.sandboxes(session) == [], f"sandboxes of {session} left"
    registry = driver.host.leases.path
    text = (registry.read_text() if registry.exists() else "") or '{"leases": []}'
    recorded, _ = json.JSONDecoder().raw_decode(text)
    left = [lease for lease in recorded["leases"] if lease["session_id"] == session]
    assert left == [], f"leases of {session} left in the registry"


def assert_refused(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Exit 2, one line on stderr naming the flag and value, nothing on stdout."""
    __tracebackhide__ = True
    assert result.returncode == 2, result
    line = result.stderr.strip()
    assert line.startswith("gpu-sandbox"), result.stderr
    assert "\n" not in line, f"more than one line: {result.stderr!r}"
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"


# -- run: the mapping rules ------------------------------------------------------------------


def _rules() -> list[Any]:
    """(flags, devices expected) for each rule, from the driver's own inventory and IDs."""

    def first_free(d: Driver) -> tuple[list[str], list[GpuDevice]]:
        return ["--gpu"], [d.inventory()[0]]

    def count(d: Driver) -> tuple[list[str], list[GpuDevice]]:
        return ["--gpu-count=2"], list(d.inventory()[:2])

    def one_device(d: Driver) -> tuple[list[str], list[GpuDevice]]:
        gpu = d.inventory()[2]
        return [f"--gpu-device={d.device_ids(gpu)[0]}"], [gpu]

    def two_devices_mixed_forms(d: Driver) -> tuple[list[str], list[GpuDevice]]:
        first, second = d.inventory()[0], d.inventory()[2]
        ids = [d.device_ids(first)[-1], d.device_ids(second)[0]]
        return [f"--gpu-device={device_id}" for device_id in ids], [first, second]

    def count_and_devices(d: Driver) -> tuple[list[str], list[GpuDevice]]:
        gpus = list(d.inventory()[1:3])
        return ["--gpu-count=2", *(f"--gpu-device={d.device_ids(g)[0]}" for g in gpus)], gpus

    def a_mig_instance(d: Driver) -> tuple[list[str], list[GpuDevice]]:
        mig = d.host.mig_devices[1]
        return [f"--gpu-device={d.device_ids(mig)[0]}"], [mig]

    def block_with_ids(d: Driver) -> tuple[list[str], list[GpuDevice]]:
        gpu = d.inventory()[1]
        block = json.dumps({"gpu_device_ids": [d.device_ids(gpu)[-1]]})
        return ["--gpu", f"--driver-config-json={block}"], [gpu]

    def block_with_a_profile(d: Driver) -> tuple[list[str], list[GpuDevice]]:
        return [
            "--gpu-count=2",
            '--driver-config-json={"mig_profile": "1g.10gb"}',
        ], list(d.host.mig_devices)

    rules: list[Callable[[Driver], tuple[list[str], list[GpuDevice]]]] = [
        first_free, count, one_device, two_devices_mixed_forms, count_and_devices,
        a_mig_instance, block_with_ids, block_with_a_profile,
    ]  # fmt: skip
    return [pytest.param(rule, id=rule.__name__.replace("_", "-")) for rule in rules]


@pytest.mark.parametrize("rule", _rules())
def test_run_gives_what_each_rule_asks(
    cli_driver: Driver, rule: Callable[[Driver], tuple[list[str], list[GpuDevice]]]
) -> None:
    flags, devices = rule(cli_driver)
    result = run(cli_driver, *flags, "--", "nvidia-smi", "-L")
    assert result.returncode == 0, result
    assert seen(result.stdout) == expected(*devices), result.stdout
    assert_nothing_left(cli_driver)


def test_run_without_a_gpu_flag_gives_no_gpu(cli_driver: Driver) -> None:
    result = run(cli_driver, "--", "sh", "-c", "ls /dev | grep -c '^nvidia[0-9]' || true")
    assert (result.returncode, result.stdout) == (0, "0\n"), result


def test_run_block_from_a_file_and_the_environment(cli_driver: Driver, tmp_path: Path) -> None:
    gpu = cli_driver.inventory()[1]
    block = tmp_path / "block.json"
    block.write_text(json.dumps({"gpu_device_ids": [cli_driver.device_ids(gpu)[0]]}))
    result = run(
        cli_driver, "--gpu", f"--driver-config-json=@{block}", "--env=GREETING=hello world",
        "--", "sh", "-c", 'echo "$GREETING"; nvidia-smi -L',
    )  # fmt: skip
    assert result.returncode == 0, result
    greeting, listing = result.stdout.split("\n", 1)
    assert greeting == "hello world"
    assert seen(listing) == expected(gpu)


def test_run_takes_a_whole_request_in_seed_003s_shape(cli_driver: Driver, tmp_path: Path) -> None:
    """An envelope with a block for every driver: each driver gets its own GPU from it."""
    first, last = cli_driver.inventory()[0], cli_driver.inventory()[-1]
    config = {name: {"gpu_device_ids": ["not-this-drivers-id"]} for name in ("vm", "x")}
    config[cli_driver.name] = {"gpu_device_ids": [cli_driver.device_ids(last)[0]]}
    request = {
        "resource_requirements": {"gpu": {"count": 1}},
        "template": {"env": {"GREETING": "hi"}, "driver_config": config},
    }
    path = tmp_path / "request.json"
    path.write_text(json.dumps(request))
    result = run(
        cli_driver, f"--request={path}", "--", "sh", "-c", 'echo "$GREETING"; nvidia-smi -L'
    )
    assert result.returncode == 0, result
    greeting, listing = result.stdout.split("\n", 1)
    assert (greeting, seen(listing)) == ("hi", expected(last)), first
    assert_nothing_left(cli_driver)


def test_run_reads_the_request_from_stdin(cli_driver: Driver) -> None:
    result = subprocess.run(
        [str(GPU_SANDBOX), "run", *_options(cli_driver), "--request=-", "--", "nvidia-smi", "-L"],
        input=json.dumps({"resource_requirements": {"gpu": {"count": 2}}}),
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False, env=_env(),
    )  # fmt: skip
    assert result.returncode == 0, result
    assert len(parse_list(result.stdout)) == 2, result.stdout


def test_run_without_a_command_runs_nvidia_smi(cli_driver: Driver) -> None:
    result = run(cli_driver, "--gpu")
    assert result.returncode == 0, result
    assert seen(result.stdout) == expected(cli_driver.inventory()[0])


# -- run: the command's exit code and output -------------------------------------------------


@pytest.mark.parametrize("code", [0, 1, 7, 42])
def test_run_exits_with_the_commands_exit_code(cli_driver: Driver, code: int) -> None:
    result = run(cli_driver, "--gpu", "--", "sh", "-c", f"echo out; echo err >&2; exit {code}")
    assert (result.returncode, result.stdout, result.stderr) == (code, "out\n", "err\n")
    assert_nothing_left(cli_driver)


def test_run_on_a_driver_that_writes_output_at_the_end(sim: simulated.SimulatedHost) -> None:
    """The contract's default ``exec_stream``, with no --timeout: all of it comes through."""
    result = gpu_sandbox(
        "run", "--driver=tests.fake_drivers:OutputAtTheEnd", f"--sim-root={sim.root}", "--gpu",
        "--", "sh", "-c", "echo out; echo err >&2; exit 4",
    )  # fmt: skip
    assert (result.returncode, result.stdout, result.stderr) == (4, "out\n", "err\n")


def test_run_passes_output_through_as_it_is_written(cli_driver: Driver) -> None:
    """A line written before a long pause arrives before the pause ends, on each stream."""
    script = "echo first; echo first-err >&2; sleep 600; echo never"
    with _started(cli_driver, "--gpu", "--", "sh", "-c", script) as process:
        assert _line(process, process.stdout) == "first\n"
        assert _line(process, process.stderr) == "first-err\n"
        process.terminate()


@pytest.mark.parametrize(
    ("signum", "to_group"),
    [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGHUP, False)],
    ids=["SIGINT-to-the-group-as-ctrl-c", "SIGTERM", "SIGHUP"],
)
def test_a_signal_during_run_leaves_no_sandbox_and_no_lease(
    cli_driver: Driver, signum: signal.Signals, to_group: bool
) -> None:
    with _started(
        cli_driver, "--gpu-count=2", "--", "sh", "-c", "echo started; sleep 60"
    ) as process:
        assert _line(process, process.stdout) == "started\n"
        session = cli_driver.session_id
        assert len(cli_driver.sandboxes(session)) == 1
        held = [lease for lease in cli_driver.host.leases.leases() if lease.session_id == session]
        assert len(held) == 2
        if to_group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        assert process.wait(CLI_TIMEOUT_S) == 128 + signum
        assert process.stderr is not None
        assert f"{signum.name}: stopped; nothing of this run is left" in process.stderr.read()
    assert_nothing_left(cli_driver)


def test_run_timeout_kills_the_command_and_closes(cli_driver: Driver) -> None:
    result = run(cli_driver, "--gpu", "--timeout=2", "--", "sleep", "60")
    assert result.returncode == 124, result
    assert "ran past its timeout of 2 s" in result.stderr
    assert_nothing_left(cli_driver)


@pytest.mark.parametrize("timeout", ["nan", "inf", "-1", "0", "1_0", "٣", "1e3", "9" * 5000])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(
    cli_driver: Driver, timeout: str
) -> None:
    """Before: a float, so ``nan``, ``inf``, ``1_0`` and Arabic-Indic digits all ran."""
    result = run(cli_driver, "--gpu", f"--timeout={timeout}", "--", "true")
    assert_refused(result, "argument --timeout: invalid value: ", "(seconds in ASCII digits")
    assert_nothing_left(cli_driver)


class _started:
    """``gpu-sandbox run`` in a session of its own (a terminal's Ctrl-C goes to its group)."""

    def __init__(self, driver: Driver, *args: str) -> None:
        self.process = subprocess.Popen(
            [str(GPU_SANDBOX), "run", *_options(driver), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=_env(),
        )

    def __enter__(self) -> subprocess.Popen[str]:
        return self.process

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(CLI_TIMEOUT_S)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


def _line(process: subprocess.Popen[str], stream: IO[str] | None) -> str:
    """The next line of one of the command's streams; what it said so far if none comes."""
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], OUTPUT_TIMEOUT_S)
    if not ready:
        process.kill()
        out, err = process.communicate(timeout=CLI_TIMEOUT_S)
        pytest.fail(f"no output within {OUTPUT_TIMEOUT_S:g} s; stdout {out!r}, stderr {err!r}")
    return stream.readline()


# -- every error: exit 2, one line naming the flag and the value, nothing created -----------


def _errors() -> list[Any]:
    """(flags from the driver's IDs a and b, fragments the one line must hold)."""
    ids_field = "template.driver_config.{name}.gpu_device_ids"
    cases: list[tuple[str, Callable[[str, str], list[str]], list[str]]] = [
        ("count-0", lambda a, b: ["--gpu-count=0"],
         ["--gpu-count=0: gpu count must be greater than 0, got 0", "InvalidGpuCount"]),
        ("count-negative", lambda a, b: ["--gpu-count=-1"],
         ["--gpu-count=-1: gpu count must be greater than 0, got -1"]),
        ("duplicate-device", lambda a, b: [f"--gpu-device={a}", f"--gpu-device={a}"],
         ["--gpu-device={a}: ", f"{ids_field} contains duplicate device ID '{{a}}'",
          "DuplicateGpuDevice"]),
        ("count-disagrees", lambda a, b: ["--gpu-count=3", f"--gpu-device={a}",
                                          f"--gpu-device={b}"],
         ["--gpu-count=3 --gpu-device={a} --gpu-device={b}: ",
          f"gpu count (3) must match {ids_field} length (2)", "GpuCountMismatch"]),
        ("unknown-device", lambda a, b: ["--gpu-device=GPU-nonexistent"],
         ["--gpu-device=GPU-nonexistent: ", "names an unknown device 'GPU-nonexistent'",
          "UnknownGpuDevice"]),
        ("count-over-the-maximum", lambda a, b: ["--gpu-count=99"],
         ["--gpu-count=99: gpu count (99) exceeds the {name} driver's maximum",
          "UnsupportedGpuRequest"]),
        ("block-not-json", lambda a, b: ["--gpu", "--driver-config-json={nope"],
         ["--driver-config-json='{nope': --driver-config-json is not valid JSON"]),
        ("block-not-an-object", lambda a, b: ["--gpu", "--driver-config-json=[]"],
         ["--driver-config-json='[]': template.driver_config.{name} must be an object",
          "got a list"]),
        ("block-unknown-key", lambda a, b: ["--gpu", '--driver-config-json={"bogus": 1}'],
         ["""--driver-config-json='{"bogus": 1}': """,
          "template.driver_config.{name} has an unknown key 'bogus'"]),
        ("block-ids-without-a-gpu-request",
         lambda a, b: [f'--driver-config-json={{"gpu_device_ids": ["{a}"]}}'],
         ["--driver-config-json=", f"{ids_field} requires a gpu request",
          "GpuDevicesWithoutRequest"]),
        ("ids-from-both", lambda a, b: [f"--gpu-device={a}",
                                        f'--driver-config-json={{"gpu_device_ids": ["{b}"]}}'],
         ["--gpu-device={a} --driver-config-json=", "device IDs come from both --gpu-device"]),
        ("env-not-key-value", lambda a, b: ["--gpu", "--env=NOVALUE"],
         ["--env=NOVALUE: env entries are KEY=VALUE, got 'NOVALUE'"]),
        ("block-file-missing", lambda a, b: ["--gpu", "--driver-config-json=@/nonexistent.json"],
         ["--driver-config-json=@/nonexistent.json: cannot read /nonexistent.json"]),
        ("count-not-a-number", lambda a, b: ["--gpu-count=two"],
         ["argument --gpu-count: invalid int value: 'two'"]),
    ]  # fmt: skip
    return [pytest.param(flags, fragments, id=name) for name, flags, fragments in cases]


def _fragments(fragments: list[str], driver: Driver, a: str, b: str) -> list[str]:
    return [f.replace("{name}", driver.name).replace("{a}", a).replace("{b}", b) for f in fragments]


@pytest.mark.parametrize(("flags", "fragments"), _errors())
def test_each_error_exits_2_naming_the_flag_and_creates_nothing(
    cli_driver: Driver, flags: Callable[[str, str], list[str]], fragments: list[str]
) -> None:
    a, b = (cli_driver.device_ids(gpu)[0] for gpu in cli_driver.inventory()[:2])
    result = run(cli_driver, *flags(a, b), "--", "sh", "-c", "echo ran")
    assert_refused(result, *_fragments(fragments, cli_driver, a, b))
    assert result.stdout == ""
    assert_nothing_left(cli_driver)


@pytest.mark.parametrize(("flags", "fragments"), _errors())
def test_spec_refuses_each_error_with_the_same_line(
    sim: simulated.SimulatedHost, flags: Callable[[str, str], list[str]], fragments: list[str]
) -> None:
    driver = get_driver_class("reference")(GpuHost.open(HostConfig(sim.root)), "spec")
    a, b = (driver.device_ids(gpu)[0] for gpu in driver.inventory()[:2])
    result = gpu_sandbox("spec", f"--sim-root={sim.root}", *flags(a, b))
    assert_refused(result, *_fragments(fragments, driver, a, b))


def test_exact_ids_on_a_driver_without_them_are_refused(sim: simulated.SimulatedHost) -> None:
    for command in ("run", "spec"):
        result = gpu_sandbox(
            command, "--driver=tests.fake_drivers:CountsOnlyDriver", f"--sim-root={sim.root}",
            "--gpu-device=0",
        )  # fmt: skip
        assert_refused(
            result,
            "--gpu-device=0: the counts-only driver does not support exact GPU device IDs",
            "UnsupportedGpuRequest at template.driver_config.counts-only.gpu_device_ids",
        )


def test_an_unknown_driver_is_refused(sim: simulated.SimulatedHost) -> None:
    for command in ("run", "spec"):
        result = gpu_sandbox(command, "--driver=dokcer", "--gpu", f"--sim-root={sim.root}")
        assert_refused(result, "--driver=dokcer: unknown driver 'dokcer'; known: reference")


def test_a_flag_after_the_command_needs_the_separator(sim: simulated.SimulatedHost) -> None:
    result = gpu_sandbox("run", f"--sim-root={sim.root}", "sh", "-c", "true")
    assert_refused(result, "unrecognized arguments: -c true (put -- before the command to run)")


# -- spec ----------------------------------------------------------------------------------


def test_spec_prints_the_mapping_and_the_drivers_verdict(cli_driver: Driver) -> None:
    gpus = cli_driver.inventory()[:2]
    ids = [cli_driver.device_ids(gpu)[0] for gpu in gpus]
    flags = [f"--gpu-device={device_id}" for device_id in ids]
    sim_root = f"--sim-root={cli_driver.host.config.sim_root}"
    text = gpu_sandbox("spec", f"--driver={cli_driver.name}", sim_root, *flags)
    assert text.returncode == 0, text
    made = spec_dict(GpuFlags(gpu_devices=tuple(ids)), cli_driver.name)
    spec_text, verdict = text.stdout.split("\n}\n")
    assert json.loads(spec_text + "}") == made
    field = f"template.driver_config.{cli_driver.name}.gpu_device_ids"
    assert f"{cli_driver.name}: valid: 2 GPUs by exact ID ({field}: {', '.join(ids)})" in verdict
    assert all(gpu.uuid in verdict for gpu in gpus), verdict

    report = json.loads(
        gpu_sandbox("spec", f"--driver={cli_driver.name}", sim_root, *flags, "--json").stdout
    )
    assert (report["spec"], report["valid"], report["plan"]["count"]) == (made, True, 2)
    assert [device["uuid"] for device in report["resolved"]] == [gpu.uuid for gpu in gpus]


def test_spec_json_names_the_typed_error(sim: simulated.SimulatedHost) -> None:
    result = gpu_sandbox(
        "spec", f"--sim-root={sim.root}", "--gpu-count=2", "--gpu-device=1", "--json"
    )
    assert result.returncode == 2
    report = json.loads(result.stdout)
    assert report["valid"] is False
    assert report["spec"] == {
        "resource_requirements": {"gpu": {"count": 2}},
        "template": {"driver_config": {"reference": {"gpu_device_ids": ["1"]}}},
    }
    assert report["received"]["driver_config"] == {"gpu_device_ids": ["1"]}
    assert report["error"] == {
        "type": "GpuCountMismatch",
        "field": "template.driver_config.reference.gpu_device_ids",
        "value": ["1"],
        "message": "gpu count (2) must match template.driver_config.reference.gpu_device_ids "
        "length (1): ['1']",
        "flag": "--gpu-count=2 --gpu-device=1",
    }


# -- gpus ----------------------------------------------------------------------------------


def test_gpus_lists_each_device_its_ids_and_who_holds_it(cli_driver: Driver) -> None:
    held = cli_driver.inventory()[1]
    sim_root = f"--sim-root={cli_driver.host.config.sim_root}"
    spec = SandboxSpec.with_gpus(
        driver=cli_driver.name, device_ids=[cli_driver.device_ids(held)[0]]
    )
    with cli_driver.create(spec) as sandbox:
        listing = json.loads(gpu_sandbox("gpus", sim_root, "--json").stdout)
        text = gpu_sandbox("gpus", sim_root).stdout
        leases = cli_driver.host.leases.leases()
    assert set(listing["drivers"]) == set(REGISTRY)
    rows = {row["uuid"]: row for row in listing["gpus"]}
    assert list(rows) == [device.uuid for device in cli_driver.host.devices]
    for device in cli_driver.host.devices:
        row = rows[device.uuid]
        assert (row["pci_bus_id"], row["ids"][cli_driver.name]) == (
            device.pci_bus_id,
            list(cli_driver.device_ids(device)),
        )
        assert row["held_by"] == [] or device == held, row
    (holding,) = rows[held.uuid]["held_by"]
    (lease,) = [lease for lease in leases if lease.gpu_uuid == held.uuid]
    assert holding["since"] == datetime.fromisoformat(holding["since"]).isoformat()
    assert {k: v for k, v in holding.items() if k != "since"} == {
        "driver": cli_driver.name,
        "sandbox": sandbox.id,
        "session": cli_driver.session_id,
        "holder": {"kind": lease.holder.kind, "ref": lease.holder.ref},
        "mode": "exclusive",
    }
    (line,) = [
        line for line in text.splitlines() if line.split()[:2] == [str(held.index), held.uuid]
    ]
    assert f"{cli_driver.name} sandbox {sandbox.id} session {cli_driver.session_id}" in line
    free = cli_driver.inventory()[0]
    assert re.search(rf"^{free.index} +{free.uuid} .* free$", text, re.MULTILINE), text


def test_gpus_lists_the_ids_of_the_drivers_named(sim: simulated.SimulatedHost) -> None:
    """``--driver``, as ``run`` and ``spec`` take it: built-in names and import paths."""
    named = "reference,tests.fake_drivers:CountsOnlyDriver"
    result = gpu_sandbox("gpus", f"--sim-root={sim.root}", f"--driver={named}", "--json")
    assert result.returncode == 0, result
    listing = json.loads(result.stdout)
    assert list(listing["drivers"]) == ["reference", "tests.fake_drivers:CountsOnlyDriver"]
    text = gpu_sandbox("gpus", f"--sim-root={sim.root}", "--driver=reference").stdout
    assert "tests.fake_drivers:CountsOnlyDriver: counts only" not in text
    unknown = gpu_sandbox("gpus", f"--sim-root={sim.root}", "--driver=dokcer")
    assert unknown.returncode == 2, unknown
    assert "--driver=dokcer: unknown driver 'dokcer'; known: reference" in unknown.stderr


def test_gpus_and_spec_answer_without_the_engine(sim: simulated.SimulatedHost) -> None:
    """With docker not answering, its IDs come from the CDI specs on disk, and spec answers."""
    if not (sim.root / "cdi" / "registered").is_file():
        pytest.skip(f"the simulated host's CDI spec is not registered in {CDI_DIR} (not root)")
    gone = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}
    listing = json.loads(gpu_sandbox("gpus", f"--sim-root={sim.root}", "--json", **gone).stdout)
    gpu = sim.gpus[1]
    (row,) = [row for row in listing["gpus"] if row["uuid"] == gpu.uuid]
    assert row["ids"]["docker"] == list(gpu.cdi_names)
    report = gpu_sandbox(
        "spec", "--driver=docker", f"--sim-root={sim.root}", f"--gpu-device={gpu.cdi_names[0]}",
        "--json", **gone,
    )  # fmt: skip
    assert report.returncode == 0, report
    verdict = json.loads(report.stdout)
    assert (verdict["valid"], verdict["resolved"]) == (True, None)
    assert verdict["unresolved"].startswith("DockerException: "), verdict


def test_gpus_on_this_machine_names_every_discovery_source(tmp_path: Path) -> None:
    result = gpu_sandbox("gpus", f"--gpu-state-dir={tmp_path}", "--json")
    assert result.returncode == 0, result
    listing = json.loads(result.stdout)
    assert [source["source"] for source in listing["sources"]] == [
        "NVML",
        "nvidia-smi",
        "PCI bus (sysfs)",
    ]
    assert listing["simulated"] is False


# -- reap ----------------------------------------------------------------------------------


def test_reap_removes_what_a_session_left(cli_driver: Driver) -> None:
    sandbox = cli_driver.create(SandboxSpec.with_gpus(2))
    assert cli_driver.sandboxes(cli_driver.session_id) == [sandbox.id]
    result = gpu_sandbox(
        "reap", cli_driver.session_id, f"--driver={cli_driver.name}",
        f"--sim-root={cli_driver.host.config.sim_root}",
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (
        0,
        f"{cli_driver.name}: removed 1 sandbox(es) of session {cli_driver.session_id}\n",
    )
    assert_nothing_left(cli_driver)
    sandbox.close()


@ENGINE_GROUP
def test_reap_with_no_driver_named_asks_every_registered_one(sim: simulated.SimulatedHost) -> None:
    result = gpu_sandbox("reap", "nothing-here", f"--sim-root={sim.root}")
    assert result.returncode == 0, result
    assert [line.split(":")[0] for line in result.stdout.splitlines()] == list(REGISTRY)
    assert_refused(gpu_sandbox("reap", "s", "--driver=dokcer"), "unknown driver 'dokcer'")


# -- start-up ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DRIVERS)
def test_spec_imports_no_engine_client(sim: simulated.SimulatedHost, name: str) -> None:
    """Engine clients cost most of the start-up: ``spec`` of a count needs none of them."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", str(GPU_SANDBOX), "spec", f"--driver={name}",
         "--gpu-count=2", f"--sim-root={sim.root}"],
        capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()}
    clients = {"docker", "podman", "requests", "kubernetes", "urllib3"}
    assert imported & clients == set()


# -- whole requests (--request) and the seeds' own -----------------------------------------

REQUESTS = ROOT / "tests" / "data" / "requests"


@pytest.mark.parametrize(
    "name",
    [
        "reference",
        "kubernetes",
        # Their exact IDs are resolved by asking the engine.
        pytest.param("docker", marks=ENGINE_GROUP),
        pytest.param("podman", marks=ENGINE_GROUP),
        "vm",
    ],
)
def test_seed_003s_request_reaches_each_driver_as_its_own_block(
    sim: simulated.SimulatedHost, name: str
) -> None:
    """Each driver is handed its block (or none); the IDs are then its own to resolve here."""
    result = gpu_sandbox(
        "spec", f"--driver={name}", f"--sim-root={sim.root}", "--json",
        f"--request={REQUESTS / 'seed-003-envelope.json'}",
    )  # fmt: skip
    report = json.loads(result.stdout)
    assert report["spec"] == json.loads((REQUESTS / "seed-003-envelope.json").read_text())
    own = report["spec"]["template"]["driver_config"].get(name, {})
    assert report["received"]["driver_config"] == own
    if not own:  # no block: the plain request of its count
        assert (result.returncode, report["plan"]["count"]) == (0, 1), result
    else:  # the seed's IDs name a real host's GPUs: this simulated host has none of them
        assert report["error"]["type"] == "UnknownGpuDevice", report
        assert report["error"]["field"] == f"template.driver_config.{name}.gpu_device_ids"


@pytest.mark.parametrize(
    ("file", "fragments"),
    [
        ("seed-001-driver-config.json",
         ["driver_config at the top level", "moved to template.driver_config",
          "(InvalidDriverConfig at driver_config)"]),
        ("seed-001-gpu-device-ids.json",
         ["resource_requirements.gpu.device_ids (['nvidia.com/gpu=0']) was replaced by "
          "template.driver_config.<driver>.gpu_device_ids"]),
        ("seed-003-docker-block.json", ["spec has an unknown key 'gpu_device_ids'"]),
    ],
)  # fmt: skip
def test_superseded_shapes_are_refused_saying_what_replaced_them(
    sim: simulated.SimulatedHost, file: str, fragments: list[str]
) -> None:
    for command in ("spec", "run"):
        result = gpu_sandbox(command, f"--sim-root={sim.root}", f"--request={REQUESTS / file}")
        assert_refused(result, *fragments)


def test_a_block_moved_into_a_request_says_what_replaced_its_key(
    sim: simulated.SimulatedHost, tmp_path: Path
) -> None:
    path = tmp_path / "request.json"
    block = {"device_ids": ["0"]}
    path.write_text(
        json.dumps(
            {
                "resource_requirements": {"gpu": {}},
                "template": {"driver_config": {"reference": block}},
            }
        )
    )
    result = gpu_sandbox("spec", f"--sim-root={sim.root}", f"--request={path}")
    assert_refused(
        result,
        "template.driver_config.reference.device_ids (['0']) was replaced by "
        "template.driver_config.reference.gpu_device_ids",
    )


@pytest.mark.parametrize("flag", ["--gpu", "--gpu-count=2", "--gpu-sharing=shared", "--env=A=1"])
def test_request_flags_are_refused_beside_a_whole_request(
    sim: simulated.SimulatedHost, tmp_path: Path, flag: str
) -> None:
    path = tmp_path / "request.json"
    path.write_text("{}")
    for command in ("spec", "run"):
        result = gpu_sandbox(command, f"--sim-root={sim.root}", f"--request={path}", flag)
        assert_refused(result, f"--request={path} is the whole request: {flag.split('=')[0]}")


def test_a_request_that_is_not_json_is_a_typed_refusal(
    sim: simulated.SimulatedHost, tmp_path: Path
) -> None:
    path = tmp_path / "request.json"
    path.write_text("{nope")
    assert_refused(
        gpu_sandbox("spec", f"--sim-root={sim.root}", f"--request={path}"),
        f"the request in {path} is not valid JSON", "(InvalidGpuRequest at spec)",
    )  # fmt: skip
    assert_refused(
        gpu_sandbox("spec", f"--sim-root={sim.root}", f"--request={tmp_path / 'missing'}"),
        "cannot read",
    )


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _odd_input() -> list[Any]:
    """(arguments, fragments of the one line): input that once ended in a traceback, exit 1."""
    deep = "[" * 50_000 + "]" * 50_000
    cases: list[tuple[str, list[str], list[str]]] = [
        ("count-arabic-indic-digit", ["--gpu-count=٣"],
         ["argument --gpu-count: invalid int value: '٣' (a count is written in ASCII digits"]),
        ("count-underscore", ["--gpu-count=1_0"], ["invalid int value: '1_0'"]),
        ("count-5000-digits", ["--gpu-count=" + "9" * 5000],
         ["invalid int value: '999", "… (5000 characters)"]),
        ("block-file-not-utf8", ["--gpu", "--driver-config-json=@{not_utf8}"],
         ["--driver-config-json=@{not_utf8}: cannot read {not_utf8}: it is not UTF-8 text "
          "(invalid start byte at byte 7)"]),
        ("request-not-utf8", ["--request={not_utf8}"],
         ["--request={not_utf8}: cannot read {not_utf8}: it is not UTF-8 text"]),
        ("block-duplicate-key",
         ["--gpu", '--driver-config-json={"gpu_device_ids": ["0"], "gpu_device_ids": []}'],
         ["--driver-config-json is not strict JSON: the key 'gpu_device_ids' is given twice",
          "(InvalidDriverConfig at template.driver_config.reference)"]),
        ("block-nan", ["--gpu", '--driver-config-json={"x": NaN}'],
         ["NaN is not a JSON number, in '{\"x\": NaN}'"]),
        ("block-5000-digits", ["--gpu", '--driver-config-json={"x": %s}' % ("9" * 5000)],
         ["an integer of 5000 digits (at most 4300)"]),
        ("block-deep", ["--gpu", f"--driver-config-json={deep}"],
         ["nests deeper than a request may (32 levels)"]),
        ("device-with-a-newline", ["--gpu-device=1\n"],
         ["--gpu-device='1\\n': ", "names an unknown device '1\\n'", "UnknownGpuDevice"]),
        ("image-padded", ["--gpu", "--image= busybox\n"],
         ["--image=' busybox\\n': template.image must be an image's name"]),
        ("vm-index-5000-digits", ["--driver=vm", "--gpu-device=" + "9" * 5000],
         ["GPU index '999", "… (5000 characters) out of range (have 4 GPUs)"]),
        ("vm-index-newline", ["--driver=vm", "--gpu-device=1\n"],
         ["invalid PCI BDF address: '1\\n'"]),
        ("vm-index-leading-zero", ["--driver=vm", "--gpu-device=01"],
         ["invalid PCI BDF address: '01'"]),
    ]  # fmt: skip
    return [pytest.param(args, fragments, id=name) for name, args, fragments in cases]


@pytest.mark.parametrize(("args", "fragments"), _odd_input())
def test_odd_input_is_one_line_and_exit_2(
    sim: simulated.SimulatedHost, tmp_path: Path, args: list[str], fragments: list[str]
) -> None:
    not_utf8 = tmp_path / "block.json"
    not_utf8.write_bytes(b'{"a": "\xff"}')
    args = [arg.replace("{not_utf8}", str(not_utf8)) for arg in args]
    result = gpu_sandbox("spec", f"--sim-root={sim.root}", *args)
    assert_refused(result, *(f.replace("{not_utf8}", str(not_utf8)) for f in fragments))
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("request_text", "fragments"),
    [
        pytest.param(
            '{"resource_requirements": {"gpu": {}}, "template": {"driver_config": '
            '{"reference": {"gpu_device_ids": ["3"]}}, "driver_config": {}}}',
            ["the key 'driver_config' is given twice in one object", "(InvalidGpuRequest at spec)"],
            id="duplicate-key",
        ),
        pytest.param(
            '{"template": {"env": {"A": "a\\u0000b"}}}',
            ["template.env.A must be a string without NUL", "got 'a\\x00b'", "at template.env.A"],
            id="env-nul",
        ),
        pytest.param(
            '{"template": {"env": {"A": "\\ud800"}}}',
            ["got '\\ud800'", "at template.env.A"],
            id="env-lone-surrogate",
        ),
        pytest.param(
            '{"template": {"image": "a\\u0000b"}}',
            ["got 'a\\x00b'", "(InvalidGpuRequest at template.image)"],
            id="image-nul",
        ),
        pytest.param(
            '{"resource_requirements": {"gpu": {"count": 1e400}}}',
            ["the number '1e400' is too large for a float"],
            id="float-overflow",
        ),
    ],
)
def test_a_request_json_can_read_only_one_way_is_refused(
    sim: simulated.SimulatedHost, request_text: str, fragments: list[str]
) -> None:
    """Each through stdin, and ``spec --json`` prints strict JSON even then."""
    result = subprocess.run(
        [str(GPU_SANDBOX), "spec", f"--sim-root={sim.root}", "--request=-", "--json"],
        input=request_text, capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        check=False, env=_env(),
    )  # fmt: skip
    assert_refused(result, *fragments)
    report = _strict(result.stdout)
    assert report["valid"] is False
    assert report["error"]["message"] in result.stderr


def test_gpu_sharing_and_the_envelope_from_the_command_line(sim: simulated.SimulatedHost) -> None:
    envelope = json.dumps({"vm": {"gpu_device_ids": ["7"]}, "reference": {"gpu_device_ids": ["1"]}})
    result = gpu_sandbox(
        "spec", f"--sim-root={sim.root}", "--json", "--gpu-sharing=shared", "--gpu",
        f"--driver-config-json={envelope}",
    )  # fmt: skip
    report = json.loads(result.stdout)
    assert result.returncode == 0, result
    assert report["spec"]["resource_requirements"] == {"gpu": {"sharing": "shared"}}
    assert report["received"]["driver_config"] == {"gpu_device_ids": ["1"]}
    assert (report["plan"]["sharing"], report["plan"]["device_ids"]) == ("shared", ["1"])
    assert_refused(
        gpu_sandbox("spec", f"--sim-root={sim.root}", "--gpu-sharing=sharde"),
        "--gpu-sharing=sharde: gpu sharing must be one of exclusive, shared, got 'sharde'",
    )


@pytest.mark.parametrize("session", ["../..", "a/b", "x b", "-rf", "a" * 64, "*", "a\nb"])
def test_session_ids_that_could_reach_a_path_or_a_glob_are_refused(
    sim: simulated.SimulatedHost, session: str
) -> None:
    """A session id goes into file names, globs, labels and QEMU's -name: a label value only."""
    assert_refused(
        gpu_sandbox("reap", f"--sim-root={sim.root}", "--", session), "invalid session id"
    )
    assert_refused(
        gpu_sandbox("run", f"--session={session}", f"--sim-root={sim.root}"), "invalid session id"
    )
