"""External drivers (``--driver=exec:PATH``): the manifest, its templates, the adapter.

The adapter is tried on a driver made of ``sh`` commands (its "sandboxes" are files, its
exec runs on this host), and on the podman CLI itself (examples/drivers/podman-cli.yaml),
whose catalogue run is a lane test: it needs podman answering (`make engines`).
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from drivers import UnknownDriver, get_driver_class
from drivers.external import driver_class
from drivers.external.manifest import ManifestError, parse
from drivers.external.process import ExternalDriverError, OperationTimedOut, run_operation
from drivers.external.schema import SCHEMA
from drivers.external.templates import CreateRequest, render_create
from drivers.external.validate import main as validate
from gpuhost import simulated
from gpuhost.errors import ExecTimeout, SandboxExecError, SandboxStartError, UnknownGpuDevice
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import GpuRequest, SandboxSpec, select
from tests.catalogue import DRI_LAYOUT, MIG_LAYOUT, ROOT, golden_ids, run_catalogue, what_failed

PODMAN_CLI = ROOT / "examples" / "drivers" / "podman-cli.yaml"
EXAMPLE_JSONL = ROOT / "examples" / "drivers" / "jsonl-jail.yaml"
PODMAN_CLI_FAILS = {"GPU-RECLAIM-01", "GPU-RECLAIM-02", "GPU-SHARED-01", "GPU-SHARED-02"}
"""What the podman CLI fails with the adapter leasing its GPUs (docs/external-drivers.md):
a `podman run -d` container outlives the process that created it, with its GPUs (and a
container whose conmon was killed stays "running" in podman's records, with its GPUs)."""
PODMAN_CLI_PARTIAL = {"SANDBOX-PEER-01"}
"""What it passes with a case not tried: the kernel keyring's needs python3 in the sandbox,
which its busybox image lacks (conformance/test_peers.py)."""


def sh_manifest(state: Path, **changes: Any) -> dict[str, Any]:
    """A driver of sh commands: a sandbox is a file under ``state``; exec runs on this host."""
    d = f"{state}/{{session_id}}"
    manifest: dict[str, Any] = {
        "apiVersion": "gpu-sandbox.dev/v1alpha1",
        "kind": "Driver",
        "name": "sh-files",
        "mode": "templates",
        "allocation": "host-registry",
        "sandboxId": "adapter",
        "capabilities": {
            "maxGpusPerSandbox": 2,
            "exactIds": True,
            "idForms": ["index", "uuid"],
            "shared": True,
        },
        "driverConfig": {"label": {"type": "string", "fragment": ["--label={value}"]}},
        "timeouts": {"create": 5, "close": 5, "list": 5, "reap": 5},
        "templates": {
            "create": [
                "sh", "-c", f'mkdir -p {d} && echo "$@" > {d}/{{sandbox_id}}', "create",
                "{@count}", "{@device}", "{@shared}", "{@image}", "{@env}", "{@config}",
            ],
            "exec": ["env", "{@env}"],
            "close": ["rm", "-f", f"{d}/{{sandbox_id}}"],
            "list": ["sh", "-c", f"ls {d} 2>/dev/null || true"],
            "reap": ["rm", "-rf", d],
            "version": ["echo", "sh-files 1.0"],
        },
        "fragments": {
            "count": ["--count={count}"],
            "device": ["--device={device_id}"],
            "shared": ["--shared"],
            "image": ["--image={image}"],
            "env": ["{env_key}={env_value}"],
        },
        "exec": {"driverErrorCodes": [125]},
    }  # fmt: skip
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        target = manifest
        for key in parents:
            target = target[key]
        target[last] = value
    return manifest


def write(path: Path, manifest: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture
def host(tmp_path: Path) -> Iterator[GpuHost]:
    sim = simulated.setup(tmp_path / "sim", 4)
    yield GpuHost.open(HostConfig(sim.root))
    simulated.teardown(sim.root)


# -- the manifest --------------------------------------------------------------------------


def test_the_published_schema_is_the_one_the_adapter_validates_with() -> None:
    published = json.loads((ROOT / "docs" / "external-driver.schema.json").read_text())
    assert published == SCHEMA, (
        "run: python -m drivers.external.schema > docs/external-driver.schema.json"
    )


@pytest.mark.parametrize(
    ("changes", "key", "value"),
    [
        ({"allocaton": "driver"}, "allocaton", "driver"),
        ({"capabilities__maxGpus": 2}, "capabilities.maxGpus", 2),
        ({"templates__craete": ["true"]}, "templates.craete", ["true"]),
        ({"allocation": "lease"}, "allocation", "lease"),
        ({"capabilities__idForms": ["index", "serial"]}, "capabilities.idForms[1]", "serial"),
        ({"capabilities__maxGpusPerSandbox": 0}, "capabilities.maxGpusPerSandbox", 0),
        ({"timeouts__create": -1}, "timeouts.create", -1),
        ({"templates__exec": "env"}, "templates.exec", "env"),
        ({"apiVersion": "gpu-sandbox.dev/v1"}, "apiVersion", "gpu-sandbox.dev/v1"),
        ({"kind": "Drvier"}, "kind", "Drvier"),
        ({"templates__close": ["rm", "{sandbox}"]}, "templates.close[1]", "{sandbox}"),
        ({"templates__exec": ["env", "{@device}"]}, "templates.exec[1]", "{@device}"),
    ],
    ids=[
        "unknown-key", "unknown-nested-key", "unknown-operation", "bad-allocation",
        "bad-id-form", "zero-gpus", "negative-timeout", "shell-string", "wrong-apiVersion",
        "wrong-kind", "unknown-variable", "splice-out-of-place",
    ],
)  # fmt: skip
def test_a_bad_manifest_is_refused_naming_the_key_and_value_and_nothing_is_created(
    tmp_path: Path, changes: dict[str, Any], key: str, value: object
) -> None:
    state = tmp_path / "sandboxes"
    path = write(tmp_path / "driver.yaml", sh_manifest(state, **changes))
    with pytest.raises(ManifestError) as refused:
        driver_class(path)
    assert (refused.value.key, refused.value.value) == (key, value), refused.value
    assert key in str(refused.value)
    assert repr(value)[:20] in str(refused.value)
    with pytest.raises(UnknownDriver, match=key.replace("[", r"\[").replace(".", r"\.")):
        get_driver_class(f"exec:{path}")
    assert not state.exists(), "a refused manifest created something"


def test_a_bad_manifest_is_a_usage_error_of_the_catalogue(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    path = write(tmp_path / "driver.yaml", sh_manifest(tmp_path, allocaton="driver"))
    run = pytester.runpytest_subprocess(
        str(ROOT / "conformance"), f"--rootdir={ROOT}", "-c", str(ROOT / "pytest.ini"),
        "-p", "no:cacheprovider", f"--driver=exec:{path}", timeout=120,
    )  # fmt: skip
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    assert "allocaton" in run.stderr.str()


def test_the_example_manifests_are_valid() -> None:
    for path in sorted((ROOT / "examples" / "drivers").glob("*.yaml")):
        assert driver_class(path).manifest.name


# -- the templates -------------------------------------------------------------------------


def test_fragments_are_emitted_only_for_the_fields_the_request_sets(tmp_path: Path) -> None:
    manifest = parse(sh_manifest(tmp_path))
    values = {"session_id": "s1", "sandbox_id": "x1", "driver": "sh-files", "cdi_kind": "k"}

    def create(request: CreateRequest) -> list[str]:
        return render_create(manifest, request, values)[4:]

    assert create(CreateRequest("")) == []
    assert create(CreateRequest("img")) == ["--image=img"]  # the request's, --image's or default
    assert create(CreateRequest("", count=1, devices=(("0", "GPU-a"),))) == [
        "--count=1", "--device=0",
    ]  # fmt: skip
    assert create(
        CreateRequest("", count=2, devices=(("0", "GPU-a"), ("2", "GPU-c")), shared=True)
    ) == ["--count=2", "--device=0", "--device=2", "--shared"]
    assert create(CreateRequest("my image", env={"A": "b c", "E": ""}, config={"label": "L"})) == [
        "--image=my image",
        "A=b c",
        "E=",
        "--label=L",
    ]


def test_a_variable_is_never_split_or_read_by_a_shell(tmp_path: Path) -> None:
    manifest = parse(sh_manifest(tmp_path))
    values = {"session_id": "s", "sandbox_id": "x", "driver": "d", "cdi_kind": "k"}
    hostile = "$(touch pwned); `id` 'q' {sandbox_id}"
    argv = render_create(manifest, CreateRequest(hostile), values)
    assert argv[-1] == f"--image={hostile}"


# -- the adapter on a driver of sh commands -------------------------------------------------


def test_a_templates_driver_creates_execs_lists_and_reaps(tmp_path: Path, host: GpuHost) -> None:
    cls = driver_class(write(tmp_path / "driver.yaml", sh_manifest(tmp_path / "sb")))
    driver = cls(host, "session-a")
    spec = SandboxSpec.with_gpus(driver="sh-files", device_ids=["1"])
    with driver.create(spec) as sandbox:
        assert [gpu.index for gpu in sandbox.gpus] == [1]
        argv = (tmp_path / "sb" / "session-a" / sandbox.id).read_text().split()
        assert argv == ["--count=1", "--device=1"], "create was not handed the leased GPU"
        result = sandbox.exec(["sh", "-c", "printf o; printf e >&2; exit 42"])
        assert (result.returncode, result.stdout, result.stderr) == (42, "o", "e")
        assert driver.sandboxes("session-a") == [sandbox.id]
        with pytest.raises(SandboxExecError, match="driverErrorCodes"):
            sandbox.exec(["sh", "-c", "exit 125"])
        default = driver.create(SandboxSpec.with_gpus())
        assert [gpu.index for gpu in default.gpus] == [0]
    assert driver.sandboxes("session-a") == [default.id]
    assert driver.reap("session-a") == [default.id]
    assert driver.sandboxes("session-a") == []
    assert host.leases.leases() == []
    assert driver.version() == "sh-files 1.0"


def test_an_operation_past_its_timeout_is_killed_with_its_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    script = f"trap '' TERM; sleep 300 & echo $! > {pidfile}; wait; wait"
    started = time.monotonic()
    with pytest.raises(OperationTimedOut, match="timeout"):
        run_operation(["sh", "-c", script], 0.5, "create")
    assert time.monotonic() - started < 10
    child = int(pidfile.read_text())
    assert _gone(child), "the group outlived its timeout"


def test_a_create_past_its_timeout_fails_typed_and_leaves_no_lease(
    tmp_path: Path, host: GpuHost
) -> None:
    manifest = sh_manifest(tmp_path / "sb", timeouts__create=0.5)
    manifest["templates"]["create"] = ["sh", "-c", "sleep 30", "create", "{@device}"]
    driver = driver_class(write(tmp_path / "driver.yaml", manifest))(host, "session-t")
    with pytest.raises(SandboxStartError, match="timeout"):
        driver.create(SandboxSpec.with_gpus())
    assert host.leases.leases() == []


def test_an_exec_past_its_timeout_kills_what_it_started_even_in_a_new_session(
    tmp_path: Path, host: GpuHost
) -> None:
    driver = driver_class(write(tmp_path / "driver.yaml", sh_manifest(tmp_path / "sb")))
    pidfile = tmp_path / "pid"
    with driver(host, "session-e").create(SandboxSpec()) as sandbox, pytest.raises(ExecTimeout):
        sandbox.exec(["sh", "-c", f"setsid sleep 300 & echo $! > {pidfile}; wait"], 1)
    child = int(pidfile.read_text())
    assert _gone(child), "what the command started outlived its timeout"


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` has ended (or is a zombie) within ``within_s``: SIGKILL is not instant."""
    deadline = time.monotonic() + within_s
    while Path(f"/proc/{pid}").exists() and not _zombie(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


# -- the validate command ----------------------------------------------------------------


def test_validate_renders_every_template_for_the_sample_requests(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert validate([str(PODMAN_CLI)]) == 0
    out = capsys.readouterr().out
    for what in ("no GPU", "default", "count 2", "exact IDs", "shared", "env and image"):
        assert f"create, {what}" in out
    assert "--device=nvidia.com/gpu=0 --device=nvidia.com/gpu=1" in out
    assert "'--env=GREETING=hello world'" in out
    for op in ("pid:", "close:", "kill:", "list:", "reap:", "exec of"):
        assert op in out


def test_validate_refuses_a_misspelt_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = copy.deepcopy(yaml.safe_load(PODMAN_CLI.read_text()))
    manifest["templates"]["lsit"] = manifest["templates"].pop("list")
    assert validate([str(write(tmp_path / "bad.yaml", manifest))]) == 2
    assert "templates.lsit" in capsys.readouterr().err


def test_validate_probe_comes_back_with_exit_42_and_both_streams(
    tmp_path: Path, host: GpuHost, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "driver.yaml", sh_manifest(tmp_path / "sb"))
    code = validate([str(path), "--probe", f"--sim-root={host.config.sim_root}"])
    assert code == 0, capsys.readouterr()
    assert "probe: passed" in capsys.readouterr().out


def test_validate_probe_fails_a_driver_that_merges_stderr_into_stdout(
    tmp_path: Path, host: GpuHost, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = sh_manifest(tmp_path / "sb")
    manifest["templates"]["exec"] = ["sh", "-c", 'exec "$@" 2>&1', "exec"]
    path = write(tmp_path / "driver.yaml", manifest)
    assert validate([str(path), "--probe", f"--sim-root={host.config.sim_root}"]) == 1
    assert "not (42, 'o', 'e')" in capsys.readouterr().out


# -- the podman CLI, judged by the catalogue -------------------------------------------------


def _podman_answers() -> str:
    try:
        done = subprocess.run(
            ["podman", "--url=unix:///run/podman/podman.sock", "version"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if done.returncode == 0 else done.stderr.strip()


@pytest.mark.xdist_group("engines")
def test_the_podman_cli_fails_the_catalogue_exactly_where_its_containers_outlive_their_creator(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    missing = _podman_answers()
    if missing:
        pytest.skip(f"needs podman answering at /run/podman/podman.sock (make engines): {missing}")
    sim = simulated.setup(
        tmp_path / "sim", 8, cdi_dir=Path("/var/run/cdi"), mig=MIG_LAYOUT, dri=DRI_LAYOUT
    )
    try:
        name = f"exec:{PODMAN_CLI}"
        result, _ = run_catalogue(pytester, tmp_path, name, sim_root=sim.root)
    finally:
        simulated.teardown(sim.root)
    verdicts = {req: cells[name] for req, cells in result["matrix"].items()}
    failed = {req for req in golden_ids() if verdicts[req] == "failed"}
    assert failed == PODMAN_CLI_FAILS, what_failed(result, name)
    assert {req for req in golden_ids() if verdicts[req] == "partial"} == PODMAN_CLI_PARTIAL
    rest = golden_ids() - failed - PODMAN_CLI_PARTIAL
    assert {verdicts[req] for req in rest} <= {"passed", "not applicable"}, (
        f"{what_failed(result, name)}\nverdicts: {verdicts}"
    )


def test_two_manifests_are_two_drivers_side_by_side(tmp_path: Path, host: GpuHost) -> None:
    """Each exec:PATH is its own driver: its own name, block, sandboxes and leases."""
    one = get_driver_class(f"exec:{write(tmp_path / 'a.yaml', sh_manifest(tmp_path / 'a'))}")
    other = sh_manifest(tmp_path / "b", name="sh-other")
    two = get_driver_class(f"exec:{write(tmp_path / 'b.yaml', other)}")
    assert (one.name, two.name) == ("sh-files", "sh-other")
    first, second = one(host, "side"), two(host, "side")
    a = first.create(SandboxSpec.with_gpus())
    b = second.create(SandboxSpec.with_gpus())
    assert (first.sandboxes("side"), second.sandboxes("side")) == ([a.id], [b.id])
    assert a.gpus != b.gpus, "two external drivers were given one GPU"
    assert second.reap("side") == [b.id]
    assert first.sandboxes("side") == [a.id]
    a.close()


def test_allocation_driver_hands_the_request_on_as_given_and_leases_nothing(
    tmp_path: Path, host: GpuHost
) -> None:
    manifest = sh_manifest(tmp_path / "sb", allocation="driver")
    manifest["fragments"]["gpu"] = ["--gpus={count}"]
    manifest["templates"]["create"].insert(4, "{@gpu}")
    driver = driver_class(write(tmp_path / "driver.yaml", manifest))(host, "session-d")
    gpu1 = host.gpus[1]

    def created(spec: SandboxSpec) -> list[str]:
        with driver.create(spec) as sandbox:
            assert host.leases.leases() == [], "allocation: driver leased a GPU"
            return (tmp_path / "sb" / "session-d" / sandbox.id).read_text().split()

    assert created(SandboxSpec.with_gpus()) == ["--gpus=1"]
    assert created(SandboxSpec.with_gpus(2)) == ["--gpus=2", "--count=2"]
    exact = SandboxSpec.with_gpus(driver="sh-files", device_ids=[gpu1.uuid])
    assert created(exact) == ["--count=1", f"--device={gpu1.uuid}"]  # a count: one ID


def test_a_fresh_process_is_told_to_build_the_same_external_driver(
    tmp_path: Path, host: GpuHost
) -> None:
    """conformance.hold names a driver by module:qualname: for exec:PATH, exec:PATH itself."""
    from conformance.hold import _name

    path = write(tmp_path / "driver.yaml", sh_manifest(tmp_path / "sb"))
    driver = driver_class(path)(host, "session-h")
    assert _name(driver) == f"exec:{path.resolve()}"
    assert get_driver_class(_name(driver)) is type(driver)


def test_a_declared_inventory_is_what_the_adapter_offers_and_names(
    tmp_path: Path, host: GpuHost
) -> None:
    """templates.inventory, where declared, replaces the host's GPUs and the idForms."""
    gpu2, gpu3 = host.gpus[2], host.gpus[3]
    manifest = sh_manifest(tmp_path / "sb")
    lines = f"{gpu2.uuid} two\\n\\n{gpu3.uuid}\\n"
    manifest["templates"]["inventory"] = ["sh", "-c", f"printf '{lines}'"]
    driver = driver_class(write(tmp_path / "driver.yaml", manifest))(host, "session-i")
    assert driver.inventory() == (gpu2, gpu3)
    assert (driver.device_ids(gpu2), driver.device_ids(gpu3)) == (("two",), (gpu3.uuid,))
    with driver.create(SandboxSpec.with_gpus(2)) as sandbox:
        argv = (tmp_path / "sb" / "session-i" / sandbox.id).read_text().split()
        assert argv == ["--count=2", "--device=two", f"--device={gpu3.uuid}"]
    with pytest.raises(UnknownGpuDevice):
        driver.create(SandboxSpec.with_gpus(driver="sh-files", device_ids=["0"]))
    exact = SandboxSpec.with_gpus(driver="sh-files", device_ids=["two"])
    with driver.create(exact) as sandbox:
        assert sandbox.gpus == (gpu2,)
    manifest["templates"]["inventory"] = ["echo", "GPU-not-on-this-host"]
    lying = driver_class(write(tmp_path / "lying.yaml", manifest))(host, "session-i")
    with pytest.raises(ExternalDriverError, match="GPU-not-on-this-host"):
        lying.inventory()


def test_request_on_stdin_hands_create_the_request_as_json(tmp_path: Path, host: GpuHost) -> None:
    manifest = sh_manifest(tmp_path / "sb", requestOnStdin=True)
    d = f"{tmp_path / 'sb'}/{{session_id}}"
    manifest["templates"]["create"] = ["sh", "-c", f"mkdir -p {d} && cat > {d}/{{sandbox_id}}"]
    driver = driver_class(write(tmp_path / "driver.yaml", manifest))(host, "session-j")
    gpu1 = host.gpus[1]
    spec = SandboxSpec.with_gpus(driver="sh-files", device_ids=[gpu1.uuid], image="img")
    with driver.create(spec) as sandbox:
        sent = json.loads((tmp_path / "sb" / "session-j" / sandbox.id).read_text())
    assert sent == {
        "session_id": "session-j", "sandbox_id": sandbox.id, "driver": "sh-files",
        "request": spec.to_dict(), "gpus": [{"uuid": gpu1.uuid, "id": "1"}],
    }  # fmt: skip
    with pytest.raises(ManifestError, match="requestOnStdin"):
        parse({**yaml.safe_load(EXAMPLE_JSONL.read_text()), "requestOnStdin": True})


def test_a_drivers_request_as_a_spec_again_is_what_select_picked_and_only_that() -> None:
    gpu = GpuRequest(2, "shared")
    block = {"gpu_device_ids": ["1", "2"], "mig_profile": None}
    spec = SandboxSpec(
        image="img", env={"A": "b"}, gpu=gpu, driver_config={"sh-files": block, "other": {"x": 1}}
    )
    request = select(spec, "sh-files")
    again = request.to_spec()
    assert again.to_dict() == {
        "resource_requirements": {"gpu": {"count": 2, "sharing": "shared"}},
        "template": {"image": "img", "env": {"A": "b"}, "driver_config": {"sh-files": block}},
    }
    assert select(again, "sh-files") == request
    assert select(SandboxSpec(image="img"), "sh-files").to_spec() == SandboxSpec(image="img")
