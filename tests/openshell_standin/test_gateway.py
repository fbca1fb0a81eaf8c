"""OpenShell's real CLI (v0.0.111) against the stand-in gateway, on a simulated GPU host.

Every command here is the ``openshell`` binary NVIDIA ships (scripts/openshell.sh install),
talking gRPC over mutual TLS to ``python -m openshell_standin``, whose sandboxes are the
reference driver's. The tests skip, saying what they needed, where the CLI, its generated
code or bubblewrap is missing.
"""

from __future__ import annotations

import json
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.procfs import EXEC_MARKER_ENV, exec_marker, kill_marked, marked_processes
from gpuhost.wait import wait_for
from openshell_standin.client import RunningGateway, running
from openshell_standin.stubs import LAUNCHER, StubsMissing, cli_missing, load_api
from tests.catalogue import ROOT

GPUS = 8
RECORDED = ROOT / "tests" / "data" / "openshell"


def needs() -> str:
    """What these tests need and this machine lacks, or ""."""
    missing = cli_missing()
    if missing:
        return missing
    try:
        load_api()
    except StubsMissing as exc:
        return str(exc)
    return ""


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[simulated.SimulatedHost]:
    if needs():
        pytest.skip(needs())
    host = simulated.setup(tmp_path_factory.mktemp("openshell") / "sim", GPUS)
    probe = ReferenceDriver(GpuHost.open(HostConfig(sim_root=host.root)), "probe").probe()
    if not probe.ok:
        simulated.teardown(host.root)
        pytest.skip(f"reference driver: {probe.reason}")
    yield host
    simulated.teardown(host.root)


@pytest.fixture(scope="module")
def gateway(
    sim: simulated.SimulatedHost, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningGateway]:
    with running(tmp_path_factory.mktemp("gateway") / "state", sim.root) as gw:
        yield gw


@pytest.fixture
def name(gateway: RunningGateway) -> Iterator[str]:
    """A fresh sandbox name, deleted after the test whatever it left."""
    sandbox = f"t-{uuid.uuid4().hex[:8]}"
    yield sandbox
    gateway.cli("sandbox", "delete", sandbox)


def said(result: subprocess.CompletedProcess[str]) -> str:
    """The CLI's stderr on one line: its error frame (miette's) wraps long messages."""
    frame = "\N{BOX DRAWINGS LIGHT VERTICAL}\N{BOX DRAWINGS LIGHT VERTICAL AND RIGHT}"
    frame += "\N{BOX DRAWINGS LIGHT ARC UP AND RIGHT}\N{BOX DRAWINGS LIGHT HORIZONTAL}"
    frame += "\N{BLACK RIGHT-POINTING POINTER}\N{MULTIPLICATION SIGN} "
    return " ".join(line.strip().lstrip(frame) for line in result.stderr.splitlines())


def ok(result: subprocess.CompletedProcess[str]) -> str:
    __tracebackhide__ = True
    assert result.returncode == 0, f"exit {result.returncode}: {result.stdout}{result.stderr}"
    return result.stdout


def create(gateway: RunningGateway, name: str, *flags: str) -> str:
    return ok(gateway.cli("sandbox", "create", "--name", name, *flags, "--detach", "--",
                          "sleep", "infinity"))  # fmt: skip


def gpus_in(gateway: RunningGateway, name: str) -> list[str]:
    out = ok(gateway.cli("sandbox", "exec", "--name", name, "--no-tty", "--", "nvidia-smi", "-L"))
    return [line.split("UUID: ")[1].rstrip(")") for line in out.splitlines()]


def test_the_installed_cli_is_the_recorded_one() -> None:
    if cli_missing():
        pytest.skip(cli_missing())
    env = {"PATH": "/usr/bin:/bin"}  # the help shows OPENSHELL_* values: none here
    for path in sorted(RECORDED.iterdir()):
        args = ["--version"] if path.name == "version" else ["sandbox", path.stem[8:], "--help"]
        shown = subprocess.run([str(LAUNCHER), *args], capture_output=True, text=True, env=env)
        assert shown.stdout == path.read_text(), path.name


def test_create_takes_the_default_a_count_or_exact_cdi_devices(
    gateway: RunningGateway, sim: simulated.SimulatedHost
) -> None:
    names = [f"c-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    try:
        create(gateway, names[0], "--gpu")
        create(gateway, names[1], "--gpu", "2")
        one, two = gpus_in(gateway, names[0]), gpus_in(gateway, names[1])
        assert (len(one), len(two), len(set(one + two))) == (1, 2, 3)
        free = [gpu for gpu in sim.gpus if gpu.uuid not in one + two][-2:]
        config = {"docker": {"cdi_devices": [gpu.cdi_names[1] for gpu in free]}}
        create(gateway, names[2], "--gpu=2", "--driver-config-json", json.dumps(config))
        assert sorted(gpus_in(gateway, names[2])) == sorted(gpu.uuid for gpu in free)
    finally:
        gateway.cli("sandbox", "delete", *names)


def test_only_the_active_drivers_block_and_known_cdi_names_count(
    gateway: RunningGateway, name: str
) -> None:
    vm_only = json.dumps({"vm": {"gpu_device_ids": ["0000:2d:00.0"]}})
    create(gateway, name, "--gpu", "--driver-config-json", vm_only)  # a default GPU
    assert len(gpus_in(gateway, name)) == 1
    unknown = json.dumps({"docker": {"cdi_devices": ["nvidia.com/gpu=99"]}})
    result = gateway.cli(
        "sandbox", "create", "--name", "u1", "--gpu", "--driver-config-json", unknown
    )
    assert result.returncode == 1
    assert "unresolvable CDI devices nvidia.com/gpu=99" in said(result)
    mismatch = json.dumps({"docker": {"cdi_devices": ["a=0", "a=1"]}})
    result = gateway.cli(
        "sandbox", "create", "--name", "u2", "--gpu", "--driver-config-json", mismatch
    )
    assert "gpu count (1) must match driver_config.cdi_devices length (2)" in said(result)


def test_exec_passes_env_output_and_exit_codes(gateway: RunningGateway, name: str) -> None:
    create(gateway, name, "--env", "FROM_CREATE=c")
    run = ("sandbox", "exec", "--name", name, "--no-tty")
    result = gateway.cli(*run, "--env", "FROM_EXEC=e", "--", "sh", "-c",
                         'echo "$FROM_CREATE $FROM_EXEC"; echo err >&2; exit 3')  # fmt: skip
    assert (result.returncode, result.stdout, result.stderr) == (3, "c e\n", "err\n")
    killed = gateway.cli(*run, "--", "sh", "-c", "kill -KILL $$")
    assert killed.returncode == 1  # no exit code: the supervisor's 1
    late = gateway.cli(*run, "--timeout", "1", "--", "sh", "-c", "echo $$ > /tmp/pid; sleep 60")
    assert late.returncode == 124
    # Gone, or a zombie its new parent (the sandbox's pid 1) has yet to reap.
    alive = 'p=$(cat /tmp/pid); test -e /proc/$p && ! grep -q "^State:.Z" /proc/$p/status'
    gone = gateway.cli(*run, "--", "sh", "-c", alive)
    assert gone.returncode != 0, "the command outlived its timeout"


def test_exec_words_stay_words_and_env_values_stay_on_one_line(
    gateway: RunningGateway, name: str
) -> None:
    create(gateway, name)
    words = ["--gpu", "a;b", "$(id)", "`id`", "it's", "x\ny", ""]
    shown = gateway.cli(
        "sandbox", "exec", "--name", name, "--no-tty", "--", "printf", "%s|", *words
    )
    assert ok(shown) == "".join(f"{word}|" for word in words)
    for flag in ("exec", "create"):
        args = ["--name", name] if flag == "exec" else ["--name", "e1"]
        result = gateway.cli("sandbox", flag, *args, "--env", "V=$(id)\n", "--", "true")
        assert result.returncode == 1
        assert "value for 'V' contains newline or carriage return characters" in said(result)


def test_list_selects_by_labels(gateway: RunningGateway) -> None:
    run = uuid.uuid4().hex[:8]
    names = [f"l-{run}-a", f"l-{run}-b"]
    try:
        create(gateway, names[0], "--label", f"run={run}", "--label", "role=a")
        create(gateway, names[1], "--label", f"run={run}", "--label", "role=b")
        listed = ("sandbox", "list", "--names", "--limit", "1000", "--selector")
        assert ok(gateway.cli(*listed, f"run={run}")).split() == names
        assert ok(gateway.cli(*listed, f"run={run},role=b")).split() == names[1:]
        assert ok(gateway.cli(*listed, "run=none")) == ""
        bad = gateway.cli(*listed, "run")
        assert bad.returncode == 1
        assert "invalid label selector: expected 'key=value', got 'run'" in said(bad)
    finally:
        gateway.cli("sandbox", "delete", *names)


def test_list_of_a_gateway_that_is_gone_fails(gateway: RunningGateway) -> None:
    env = {"OPENSHELL_GATEWAY_ENDPOINT": "https://127.0.0.1:9"}
    result = gateway.cli("sandbox", "list", "--names", env=env)
    assert (result.returncode, result.stdout) == (1, "")
    assert "Connection refused" in said(result)
    # The seeds' manifest read the table through a pipe: sed's status, and no names.
    script = f"{LAUNCHER} sandbox list | tr -s ' ' '\\n' | sed -n 's/^t-//p'"
    piped = subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                           env=gateway.cli_env(env))  # fmt: skip
    assert (piped.returncode, piped.stdout) == (0, "")


def test_delete_gives_the_gpus_back(gateway: RunningGateway, name: str) -> None:
    create(gateway, name, "--gpu", str(GPUS))
    more = gateway.cli("sandbox", "create", "--name", "x1", "--gpu", "--", "true")
    assert more.returncode == 1
    assert "not in a state required" in said(more)  # FailedPrecondition
    assert "GPU sandbox requested 1 GPUs, but only 0 selectable of 8" in said(more)
    ok(gateway.cli("sandbox", "delete", name))
    assert ok(gateway.cli("sandbox", "list", "--names", "--selector", "x=y")) == ""
    create(gateway, name, "--gpu", str(GPUS))
    missing = gateway.cli("sandbox", "delete", "nosuch")
    assert missing.returncode == 1
    assert "sandbox not found" in said(missing)


def test_the_gateway_refuses_names_over_19_characters(gateway: RunningGateway) -> None:
    for bad, message in [
        ("a" * 20, "name exceeds maximum length (20 > 19)"),
        ("Upper", "name must contain only lowercase alphanumeric characters or hyphens"),
    ]:
        result = gateway.cli("sandbox", "create", "--name", bad, "--detach", "--", "sleep", "1")
        assert result.returncode == 1
        assert message in said(result)
    assert ok(gateway.cli("sandbox", "list", "--names")).split().count("a" * 20) == 0


def test_the_cli_refuses_gpu_0_and_a_repeated_gpu(gateway: RunningGateway) -> None:
    zero = gateway.cli("sandbox", "create", "--name", "g0", "--gpu", "0")
    assert zero.returncode == 2
    assert "GPU count must be greater than 0" in said(zero)
    twice = gateway.cli("sandbox", "create", "--name", "g2", "--gpu", "--gpu", "2")
    assert twice.returncode == 2
    assert "cannot be used multiple times" in said(twice)
    for flag in ("--gpu-count", "--gpu-device"):  # the seeds' flags were never merged
        unknown = gateway.cli("sandbox", "create", "--name", "g3", flag, "1")
        assert unknown.returncode == 2
        assert f"unexpected argument '{flag}'" in said(unknown)


def test_a_sandbox_whose_main_process_exits_refuses_exec(
    gateway: RunningGateway, name: str
) -> None:
    # It exits once create has seen it Ready (a main that exits at once may beat the watch).
    ok(gateway.cli("sandbox", "create", "--name", name, "--detach", "--", "sleep", "1"))
    wait_for(
        lambda: ok(gateway.cli("sandbox", "list")),
        lambda table: "Error" in table,
        timeout_s=30,
        what=f"sandbox {name} to reach phase Error",
    )
    result = gateway.cli("sandbox", "exec", "--name", name, "--no-tty", "--", "true")
    assert result.returncode == 1
    assert f"sandbox '{name}' is not ready (phase: Error)" in said(result)


def test_a_name_after_exec_is_the_command(gateway: RunningGateway, name: str) -> None:
    create(gateway, name)  # saved as the last-used sandbox
    result = gateway.cli("sandbox", "exec", name, "--", "true")
    assert result.returncode == 127
    assert f"{name}: command not found" in said(result)


def test_only_the_runs_client_certificate_gets_in(gateway: RunningGateway, tmp_path: Path) -> None:
    elsewhere = {"XDG_CONFIG_HOME": str(tmp_path), "OPENSHELL_GATEWAY_INSECURE": "true"}
    result = gateway.cli("sandbox", "list", "--names", env=elsewhere)
    assert result.returncode == 1  # no client certificate: the handshake fails
    mtls = Path(gateway.env["XDG_CONFIG_HOME"], "openshell", "gateways",
                gateway.env["OPENSHELL_GATEWAY"], "mtls")  # fmt: skip
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in (mtls, *mtls.iterdir())}
    assert modes == {"mtls": 0o700, "ca.crt": 0o600, "tls.crt": 0o600, "tls.key": 0o600}
    assert stat.S_IMODE(gateway.state.stat().st_mode) == 0o700


def test_the_launcher_says_how_to_install_the_cli(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "GPU_SANDBOX_OPENSHELL_CACHE": str(tmp_path)}
    result = subprocess.run([str(LAUNCHER), "--version"], capture_output=True, text=True, env=env)
    assert result.returncode == 127
    assert f"not installed in {tmp_path}/0.0.111: run scripts/openshell.sh install" in result.stderr


def test_the_command_lines_of_the_manifest_work(gateway: RunningGateway) -> None:
    """Every value in a `--flag=value` element of its own, as the v0.0.111 manifest renders."""
    sandbox = uuid.uuid4().hex[:12]  # the adapter's sandbox id: a DNS label of 12 bytes
    session = f"Run_{uuid.uuid4().hex[:8]}.x"  # any session id is a label value
    selector = f"--selector=gpu-sandbox.dev/session={session},gpu-sandbox.dev/driver=openshell"
    try:
        ok(gateway.cli(
            "sandbox", "create", f"--name={sandbox}", f"--label=gpu-sandbox.dev/session={session}",
            "--label=gpu-sandbox.dev/driver=openshell", "--gpu=2",
            "--from=gpu-sandbox-busybox:latest", "--env=GREETING=hello world", "--env=EMPTY=",
            "--no-tty", "--detach", "--", "sleep", "infinity",
        ))  # fmt: skip
        listed = gateway.cli("sandbox", "list", "--names", "--limit=1000", selector)
        assert ok(listed).split() == [sandbox]
        marker, needle = exec_marker()
        shown = gateway.cli(
            "sandbox", "exec", f"--name={sandbox}", "--no-tty", f"--env={EXEC_MARKER_ENV}={marker}",
            "--", "sh", "-c", f'echo "$GREETING|$EMPTY|${EXEC_MARKER_ENV}"',
        )  # fmt: skip
        assert ok(shown) == f"hello world||{marker}\n"
        # The adapter's exec timeout: the marker finds the command inside, from this host.
        marker, needle = exec_marker()
        late = subprocess.Popen(
            [str(LAUNCHER), "sandbox", "exec", f"--name={sandbox}", "--no-tty",
             f"--env={EXEC_MARKER_ENV}={marker}", "--", "sleep", "60"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=gateway.cli_env(),
        )  # fmt: skip
        wait_for(
            lambda: marked_processes(needle),
            bool,
            timeout_s=30,
            what="the command to run in the sandbox with its marker",
        )
        kill_marked(needle)
        late.communicate(timeout=30)
        assert late.returncode == 1  # killed by a signal: the supervisor's 1
        ok(gateway.cli("sandbox", "delete", sandbox))
        assert ok(gateway.cli("sandbox", "list", "--names", "--limit=1000", selector)) == ""
    finally:
        gateway.cli("sandbox", "delete", sandbox)


def test_a_login_shell_finds_the_gpu_tools_whatever_the_environment(
    gateway: RunningGateway, name: str
) -> None:
    # SANDBOX-ENV-01 sets HOME and PATH of its own; bash -l sets PATH afresh.
    create(gateway, name, "--gpu", "--env=HOME=/nonexistent", "--env=PATH=/spec/bin:/usr/bin:/bin")
    assert len(gpus_in(gateway, name)) == 1
    shown = gateway.cli("sandbox", "exec", f"--name={name}", "--no-tty", "--", "printenv", "HOME")
    assert ok(shown) == "/nonexistent\n"


def test_forking_a_sandboxs_processes_leaves_grpc_out_of_the_children(
    sim: simulated.SimulatedHost, tmp_path: Path
) -> None:
    """No process the gateway forks runs gRPC's fork handlers (GRPC_ENABLE_FORK_SUPPORT).

    They ran in each process forked from the server's threads: they logged into its stderr
    and, once, "epoll_wait error" into a command's.
    """
    log = tmp_path / "gateway.log"
    with running(tmp_path / "state", sim.root, log_path=log) as gw:
        name = f"f-{uuid.uuid4().hex[:8]}"
        try:
            create(gw, name, "--gpu")
            for _ in range(3):
                result = gw.cli("sandbox", "exec", "--name", name, "--no-tty", "--", "true")
                assert (result.returncode, result.stderr) == (0, "")
        finally:
            gw.cli("sandbox", "delete", name)
    assert "fork" not in log.read_text(), log.read_text()[:2000]
