"""The container lane on the real engines: dockerd and podman, with simulated GPUs via CDI.

`make test` installs and starts both engines (scripts/engines.sh); a machine without them
fails here with the reason, never skips. Every test runs in one xdist group: the engines
read one registered CDI spec, so one simulated host serves them all.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.observe import assert_all_gpus_grantable, uuids, visible_gpu_uuids
from drivers.container import KEEPALIVE_PATH, LIVENESS_TIMEOUT_S, SESSION_LABEL, ContainerDriver
from drivers.container.keepalive import KEEPALIVE_OPEN_TIMEOUT_S
from drivers.docker import DockerDriver
from drivers.podman import PodmanDriver
from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.errors import GpusExhausted, SandboxStartError, UnknownGpuDevice, UnknownImage
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec
from gpuhost.wait import wait_for, wait_until
from tests.breakers import containers
from tests.catalogue import (
    DRI_LAYOUT,
    MIG_LAYOUT,
    ROOT,
    golden_ids,
    planted_name,
    run_catalogue,
    what_failed,
    without_the_busybox_key_case,
)
from tests.other_user import OTHER_USER, setpriv

pytestmark = pytest.mark.xdist_group("engines")
CDI_DIR = Path("/var/run/cdi")
ENGINES: tuple[type[ContainerDriver], ...] = (DockerDriver, PodmanDriver)


@pytest.fixture(scope="module")
def engine_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuHost]:
    """An 8-GPU simulated host registered with both engines, which must be running.

    Two of its GPUs are in MIG mode, and AMD and Intel GPUs are beside them.
    """
    root = tmp_path_factory.mktemp("engines") / "sim"
    sim = simulated.setup(root, 8, cdi_dir=CDI_DIR, mig=MIG_LAYOUT, dri=DRI_LAYOUT)
    try:
        host = GpuHost.open(HostConfig(sim.root))
        for engine in ENGINES:
            availability = engine(host, "probe").probe()
            assert availability.ok, f"{engine.name} cannot run: {availability.reason}"
        yield host
    finally:
        simulated.teardown(sim.root)


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_catalogue_passes_on_the_real_engine(
    pytester: pytest.Pytester, tmp_path: Path, engine_host: GpuHost, engine: str
) -> None:
    result, _ = run_catalogue(pytester, tmp_path, engine, sim_root=engine_host.config.sim_root)
    verdicts = without_the_busybox_key_case(result, engine)
    required = golden_ids()
    assert set(verdicts) | {"SANDBOX-PEER-01"} >= required
    assert {req for req in required if verdicts.get(req, "passed") != "passed"} == set(), (
        f"{what_failed(result, engine)}\nverdicts: {verdicts}"
    )


@pytest.mark.parametrize("broken", containers.ALL, ids=[cls.__name__ for cls in containers.ALL])
def test_catalogue_fails_the_broken_container_driver(
    pytester: pytest.Pytester,
    tmp_path: Path,
    engine_host: GpuHost,
    broken: type[containers.BrokenContainerDriver],
) -> None:
    name = planted_name(broken)
    result, _ = run_catalogue(
        pytester,
        tmp_path,
        name,
        8,
        f"--requirement={broken.BREAKS}",
        sim_root=engine_host.config.sim_root,
    )
    verdict = result["matrix"][broken.BREAKS][name]
    caught = [test for test in result["tests"] if test["outcome"] == "failed"]
    explained = f"{broken.__name__} ({broken.__doc__}) breaks {broken.BREAKS}: {result['tests']}"
    assert verdict == "failed", explained
    assert caught, explained


def test_no_driver_hands_out_a_gpu_another_driver_holds(engine_host: GpuHost) -> None:
    """Reference holds GPU 0 and podman GPU 1: a docker default request gets neither."""
    session = f"cross-{time.time_ns()}"
    reference = ReferenceDriver(engine_host, session)
    podman = PodmanDriver(engine_host, session)
    docker = DockerDriver(engine_host, session)
    gpu0, gpu1 = engine_host.gpus[:2]
    try:
        first = reference.create(SandboxSpec.with_gpus(driver="reference", device_ids=["0"]))
        second = podman.create(
            SandboxSpec.with_gpus(driver="podman", device_ids=[podman.device_ids(gpu1)[0]])
        )
        third = docker.create(SandboxSpec.with_gpus())
        assert (uuids(first), uuids(second)) == ([gpu0.uuid], [gpu1.uuid])
        assert uuids(third) == [engine_host.gpus[2].uuid], (
            f"reference holds {gpu0.uuid} and podman {gpu1.uuid}; docker got {uuids(third)}"
        )
        assert visible_gpu_uuids(third) == uuids(third)
    finally:
        for driver in (reference, podman, docker):
            driver.reap(session)


def _stopped_outside_the_registry_lock(run: subprocess.Popen[str], registry: Path) -> None:
    """Keep ``run`` stopped where it does not hold the lease registry's lock.

    What this test judges is the reap of a stopped creator's containers; a creator stopped
    inside a registry update holds the registry's flock, and every other user waits for it
    (a process of the host that stops another mid-update stops the registry with it).
    """
    fd = os.open(registry, os.O_RDONLY)
    try:
        for _ in range(100):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                run.send_signal(signal.SIGCONT)
                time.sleep(0.01)
                run.send_signal(signal.SIGSTOP)
                time.sleep(0.01)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        pytest.fail("the stopped run held the lease registry's lock at each of 100 tries")
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "how", [signal.SIGSTOP, signal.SIGINT, signal.SIGKILL], ids=["SIGSTOP", "SIGINT", "SIGKILL"]
)
def test_interrupted_run_then_reap_leaves_no_container(
    engine_host: GpuHost, how: signal.Signals
) -> None:
    """Interrupt a catalogue run while it holds containers; `--reap` leaves none behind.

    SIGSTOP leaves the creator alive, so its containers stay until `--reap` removes them;
    after SIGINT the run cleans up itself and after SIGKILL its containers exit with it.
    """
    run = subprocess.Popen(
        [
            sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--rootdir={ROOT}",
            "-c", str(ROOT / "pytest.ini"), "-p", "no:cacheprovider", "--driver=docker,podman",
            f"--sim-root={engine_host.config.sim_root}", "--requirement=GPU-RELEASE-01",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )  # fmt: skip
    try:
        session = _session_of(run)
        drivers = [engine(engine_host, session) for engine in ENGINES]
        wait_until(
            lambda: _any_container(drivers, session),
            timeout_s=60,
            what=f"the run's first container (session {session})",
            retry_on=(LookupError,),
        )
        run.send_signal(how)
        if how == signal.SIGSTOP:
            _stopped_outside_the_registry_lock(run, engine_host.leases.directory)
        else:
            run.wait(60)
        reap = subprocess.run(
            [
                sys.executable, "-m", "pytest", f"--rootdir={ROOT}", "-c",
                str(ROOT / "pytest.ini"), "--driver=docker,podman",
                f"--sim-root={engine_host.config.sim_root}", f"--reap={session}",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
        )  # fmt: skip
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        assert run.stdout is not None
        run.stdout.close()
    assert reap.returncode == 0, reap.stdout + reap.stderr
    if how == signal.SIGSTOP:
        removed = sum(int(n) for n in re.findall(r"removed (\d+) sandbox", reap.stdout))
        assert removed > 0, f"the stopped run held containers; --reap removed none: {reap.stdout}"
    assert [driver.sandboxes(session) for driver in drivers] == [[], []]
    for engine in ENGINES:
        listing = subprocess.run(
            engine(engine_host, session).cli_argv(
                "ps", "--all", "--quiet", f"--filter=label={SESSION_LABEL}={session}"
            ),
            capture_output=True,
            text=True,
            check=True,
        )
        assert listing.stdout.strip() == "", f"{engine.name} still lists {listing.stdout}"
    assert [lease for lease in engine_host.leases.leases() if lease.session_id == session] == []


def _session_of(run: subprocess.Popen[str]) -> str:
    assert run.stdout is not None
    for line in run.stdout:
        found = re.search(r"gpu-sandbox session: (\w+)", line)
        if found:
            return found.group(1)
    raise AssertionError(f"the run printed no session id (exit {run.wait()})")


def _any_container(drivers: list[ContainerDriver], session: str) -> None:
    if not any(driver.sandboxes(session) for driver in drivers):
        raise LookupError("no container yet")


def test_docker_without_cdi_fails_probe_saying_how_to_enable_it(
    tmp_path: Path, engine_host: GpuHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second, real dockerd started without CDI: the probe names the daemon.json setting."""
    # Under /run, not the deep pytest tmp_path: a unix socket's path must stay short.
    state = Path(tempfile.mkdtemp(prefix="gpu-sandbox-nocdi-", dir="/run"))
    socket = state / "docker.sock"
    config = {
        "hosts": [f"unix://{socket}"],
        "data-root": str(state / "data"),
        "exec-root": str(state / "exec"),
        "pidfile": str(state / "docker.pid"),
        "storage-driver": "vfs",
        "iptables": False,
        "ip6tables": False,
        "bridge": "none",
        "features": {"cdi": False},  # newer dockerd enable CDI by default
    }
    (state / "daemon.json").write_text(json.dumps(config))
    with (state / "dockerd.log").open("w") as log:
        daemon = subprocess.Popen(
            ["dockerd", f"--config-file={state / 'daemon.json'}"], stdout=log, stderr=log
        )
    try:
        monkeypatch.setenv("DOCKER_HOST", f"unix://{socket}")
        driver = DockerDriver(engine_host, "nocdi")
        wait_until(
            driver.ping,
            retry_on=DockerDriver.engine_errors(),
            timeout_s=60,
            what=f"the dockerd without CDI at {socket}",
        )
        availability = driver.probe()
    finally:
        daemon.terminate()
        try:
            daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(state, ignore_errors=True)
    assert not availability.ok
    assert '"features": {"cdi": true}' in availability.reason, availability.reason


@pytest.mark.parametrize("engine", ENGINES, ids=[engine.name for engine in ENGINES])
def test_bad_image_and_unknown_cdi_name_are_typed_errors_leaving_nothing(
    engine_host: GpuHost, engine: type[ContainerDriver]
) -> None:
    driver = engine(engine_host, f"bad-{time.time_ns()}")
    gpu_spec = SandboxSpec.with_gpus(2, image="gpu-sandbox-no-such-image:1")
    with pytest.raises(UnknownImage) as bad_image:
        driver.create(gpu_spec)
    assert (bad_image.value.field, bad_image.value.value) == ("image", gpu_spec.image)
    assert "gpu-sandbox-no-such-image:1" in str(bad_image.value)
    name = "nvidia.com/gpu=GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(UnknownGpuDevice) as unknown:
        driver.create(SandboxSpec.with_gpus(driver=engine.name, device_ids=[name]))
    assert unknown.value.value == name
    assert name in str(unknown.value)
    assert driver.sandboxes(driver.session_id) == []
    assert list(driver.keepalive_dir().glob(f"{driver.session_id}.*")) == []
    assert_all_gpus_grantable(driver, after="refusing a bad image and an unknown CDI name")


@pytest.mark.parametrize("engine", ENGINES, ids=[engine.name for engine in ENGINES])
def test_a_command_cannot_hold_its_containers_keepalive_open(
    engine_host: GpuHost, engine: type[ContainerDriver]
) -> None:
    """Before: ``exec 5>`` on its FIFO (mounted read-only) worked, and kept it alive for good.

    Past its creator's death, GPUs and all, until a reap.
    """
    driver = engine(engine_host, f"fifo-{time.time_ns()}")
    with driver.create(SandboxSpec()) as sandbox:
        tried = sandbox.exec(["sh", "-c", f"exec 5>{KEEPALIVE_PATH} && echo opened"])
        assert (tried.returncode, tried.stdout) != (0, "opened\n"), tried
        assert "Permission denied" in tried.stderr, tried
        # Reading it stays harmless and possible: the first process does.
        assert sandbox.exec(["test", "-r", KEEPALIVE_PATH]).returncode == 0


# -- the keepalive FIFO against another local user (uid 65534) ---------------------------------


@pytest.fixture
def shared_host(engine_host: GpuHost) -> Iterator[GpuHost]:
    """The engines' simulated GPUs, with a lease registry of their own every user can reach."""
    base = Path(tempfile.mkdtemp(prefix="gpu-sandbox-keepalive-"))
    base.chmod(0o755)
    registry = base / "leases"
    registry.mkdir()
    registry.chmod(0o1777)
    try:
        yield GpuHost.open(HostConfig(engine_host.config.sim_root, state_dir=registry))
    finally:
        shutil.rmtree(base)


def _as_other_user(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*setpriv(), "sh", "-c", script], capture_output=True, text=True, check=False, cwd="/"
    )


@pytest.fixture
def terminal() -> Iterator[str]:
    """A pseudo-terminal of root's, by its path: what a link could name."""
    master, slave = os.openpty()
    try:
        yield os.ttyname(slave)
    finally:
        os.close(master)
        os.close(slave)


PLANTED_KEEPALIVE_DIRS = {  # what uid 65534 makes first where the driver keeps its FIFOs
    "directory": "mkdir -m 777 {dir}",
    "link-to-its-directory": "mkdir -m 777 {dir}.its && ln -s {dir}.its {dir}",
    "fifo": "mkfifo -m 666 {dir}",
}


@pytest.mark.parametrize("planted", sorted(PLANTED_KEEPALIVE_DIRS))
@pytest.mark.parametrize("engine", ENGINES, ids=[engine.name for engine in ENGINES])
def test_a_keepalive_directory_another_user_made_first_is_replaced(
    shared_host: GpuHost, engine: type[ContainerDriver], planted: str
) -> None:
    """The FIFOs go in a directory of root's only, never one another user can swap them in.

    Before: the driver made its FIFOs in whatever directory stood at ``<registry>/keepalive``:
    uid 65534, who made it first, swapped each FIFO for a link, and the engine bound the
    link's target (root's terminal: a command in the sandbox read what was typed on it, and
    the container outlived its creator's ``kill -9``), and root chmod'ed it.
    """
    driver = engine(shared_host, f"planted-{time.time_ns()}")
    directory = driver.keepalive_dir()
    _as_other_user(PLANTED_KEEPALIVE_DIRS[planted].format(dir=directory)).check_returncode()
    with driver.create(SandboxSpec()) as sandbox:
        st = directory.lstat()
        assert (stat.S_ISDIR(st.st_mode), st.st_uid, stat.S_IMODE(st.st_mode)) == (
            True, os.geteuid(), 0o700,
        )  # fmt: skip
        fifo = directory / f"{driver.session_id}.{sandbox.id}"
        assert stat.S_ISFIFO(fifo.lstat().st_mode)
        tried = _as_other_user(f"rm -f {fifo}; ln -s /dev/null {fifo}")
        assert tried.returncode != 0, "uid 65534 could replace root's keepalive FIFO"
        assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert driver.sandboxes(driver.session_id) == []


@pytest.mark.parametrize("engine", ENGINES, ids=[engine.name for engine in ENGINES])
def test_a_keepalive_directory_of_another_user_root_cannot_empty_is_refused_by_name(
    shared_host: GpuHost, engine: type[ContainerDriver]
) -> None:
    """Never emptied (what is in it is another user's), never used: refused, nothing left."""
    driver = engine(shared_host, f"planted-{time.time_ns()}")
    directory = driver.keepalive_dir()
    _as_other_user(f"mkdir -m 777 {directory} && touch {directory}/x").check_returncode()
    with pytest.raises(SandboxStartError, match=rf"{directory} is a directory of uid {OTHER_USER}"):
        driver.create(SandboxSpec())
    assert sorted(os.listdir(directory)) == ["x"]
    assert driver.sandboxes(driver.session_id) == []
    assert shared_host.leases.leases() == []


@pytest.mark.parametrize("when", ["create_container", "start_created"])
@pytest.mark.parametrize("engine", ENGINES, ids=[engine.name for engine in ENGINES])
def test_a_keepalive_swapped_for_a_link_before_the_engine_binds_it_is_refused(
    shared_host: GpuHost,
    engine: type[ContainerDriver],
    when: str,
    terminal: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the engine binds must be the FIFO this process made, and it is sealed by its fd.

    The FIFO is swapped for a link to root's terminal just before the engine creates the
    container, or starts it (as a user who could write a directory above the registry
    could): refused, the container removed, the terminal neither bound for long nor
    chmod'ed. Before: the engine bound the terminal, the driver took it for the FIFO the
    container's shell had opened (it looked by path) and chmod'ed it 0400 through the link.
    """
    mode = stat.S_IMODE(os.stat(terminal).st_mode)
    driver = engine(shared_host, f"swapped-{time.time_ns()}")
    real = getattr(driver, when)

    def swapped(*args: object) -> object:
        for fifo in driver.keepalive_dir().iterdir():
            if stat.S_ISFIFO(fifo.lstat().st_mode):
                fifo.rename(fifo.with_name(f"{fifo.name}.moved"))
                fifo.symlink_to(terminal)
        return real(*args)

    monkeypatch.setattr(driver, when, swapped)
    started = time.monotonic()
    with pytest.raises(SandboxStartError, match="keepalive"):
        driver.create(SandboxSpec())
    assert time.monotonic() - started < KEEPALIVE_OPEN_TIMEOUT_S / 2  # refused, not timed out
    assert stat.S_IMODE(os.stat(terminal).st_mode) == mode
    wait_for(
        lambda: driver.sandboxes(driver.session_id), lambda left: not left, timeout_s=30,
        what="the refused container to be removed",
    )  # fmt: skip
    assert shared_host.leases.leases() == []


def _dockerd_pid() -> int:
    """The pid of the dockerd answering at the docker socket, from its pidfile."""
    for pidfile in (Path("/run/gpu-sandbox-engines/dockerd.run.pid"), Path("/var/run/docker.pid")):
        if pidfile.is_file():
            return int(pidfile.read_text().split()[0])
    pytest.fail("needed dockerd's pidfile (make engines writes /run/gpu-sandbox-engines/...)")


def test_a_hung_engine_delays_no_other_drivers_grants(engine_host: GpuHost) -> None:
    """A hung dockerd holds up no other driver's grants and releases.

    With dockerd SIGSTOPped while its containers hold GPUs, reference sandboxes still come
    and go within the exhaustion bound; only a request that needs docker's verdict waits,
    for the liveness check's own timeout at most, and is refused (never granted on a guess).
    """
    session = f"hung-{time.time_ns()}"
    docker = DockerDriver(engine_host, session)
    reference = ReferenceDriver(engine_host, session)
    held = docker.create(SandboxSpec.with_gpus(2))
    whole = len(reference.inventory())  # the GPUs not in MIG mode
    pid = _dockerd_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(3):
            start = time.monotonic()
            with reference.create(SandboxSpec.with_gpus(whole - 2)) as sandbox:
                assert not set(uuids(sandbox)) & set(uuids(held))
            took = time.monotonic() - start
            assert took < ReferenceDriver.exhaustion_grace_s, f"a grant took {took:.2f} s"
        start = time.monotonic()
        with pytest.raises(GpusExhausted):
            reference.create(SandboxSpec.with_gpus(whole - 1))
        waited = time.monotonic() - start
        assert waited < LIVENESS_TIMEOUT_S + 3, f"the refusal took {waited:.1f} s"
    finally:
        os.kill(pid, signal.SIGCONT)
        held.close()
        reference.reap(session)
        docker.reap(session)
