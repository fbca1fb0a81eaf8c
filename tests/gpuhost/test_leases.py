"""The host-wide lease registry: selection, exact grants, release, reclaim, concurrency."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import multiprocessing
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuhost import liveness
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuBusy, GpusExhausted
from gpuhost.leases import (
    EXCLUSIVE,
    FORMAT_VERSION,
    SHARED,
    Holder,
    Lease,
    LeaseFileCorrupt,
    LeaseFileLocked,
    LeaseOwner,
    LeaseRegistry,
    lease_to_dict,
    liveness_check,
)
from gpuhost.liveness import boot_id, boot_time
from gpuhost.wait import wait_for
from tests.other_user import PYTHON, readable_copy, setpriv

ME = Holder.process(os.getpid())


def _gpu(index: int) -> GpuDevice:
    return GpuDevice(
        index=index,
        uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
        name="Test GPU",
        pci_bus_id=f"0000:{0x18 + index:02x}:00.0",
        memory_mib=1024,
        minor=index,
    )


INVENTORY = tuple(_gpu(i) for i in range(4))


def owner(sandbox_id: str, session_id: str = "session-1", holder: Holder = ME) -> LeaseOwner:
    return LeaseOwner(driver="test", sandbox_id=sandbox_id, session_id=session_id, holder=holder)


def uuids(gpus: tuple[GpuDevice, ...] | list[GpuDevice]) -> list[str]:
    return [gpu.uuid for gpu in gpus]


def held(registry: LeaseRegistry) -> dict[str, str]:
    """GPU UUID -> the sandbox holding it."""
    return {lease.gpu_uuid: lease.sandbox_id for lease in registry.leases()}


@pytest.fixture
def registry(tmp_path: Path) -> LeaseRegistry:
    return LeaseRegistry(tmp_path / "leases")


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child process to stand for a sandbox; killed and reaped at the end in any case."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _state(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2 :].split()[0]


# -- selection and grants -----------------------------------------------------------------


def test_lowest_free_first_in_the_given_order(registry: LeaseRegistry) -> None:
    assert registry.acquire(INVENTORY, owner("a"), count=1) == INVENTORY[:1]
    assert registry.acquire(INVENTORY, owner("b"), count=2) == INVENTORY[1:3]
    assert registry.release("a") == 1
    # The lowest free one again, not the next never-used one.
    assert registry.acquire(INVENTORY, owner("c"), count=2) == (INVENTORY[0], INVENTORY[3])
    assert held(registry) == {
        INVENTORY[0].uuid: "c",
        INVENTORY[1].uuid: "b",
        INVENTORY[2].uuid: "b",
        INVENTORY[3].uuid: "c",
    }


def test_selection_follows_the_inventory_order_given(registry: LeaseRegistry) -> None:
    reordered = (INVENTORY[2], INVENTORY[0], INVENTORY[3], INVENTORY[1])
    assert registry.acquire(reordered, owner("a"), count=3) == reordered[:3]


def test_lease_records_the_owner(registry: LeaseRegistry) -> None:
    before = time.time()
    registry.acquire(INVENTORY, owner("a", "s1"), count=2)
    leases = registry.leases()
    assert [lease.gpu_uuid for lease in leases] == uuids(INVENTORY[:2])
    for lease in leases:
        assert (lease.driver, lease.sandbox_id, lease.session_id) == ("test", "a", "s1")
        assert lease.holder == ME
        assert lease.mode == EXCLUSIVE
        assert before <= lease.acquired_at <= time.time()
        assert "sandbox a of the test driver" in lease.describe()


def test_count_zero_grants_nothing(registry: LeaseRegistry) -> None:
    assert registry.acquire(INVENTORY, owner("a"), count=0) == ()
    assert registry.leases() == []


def test_exact_grant(registry: LeaseRegistry) -> None:
    exact = (INVENTORY[3], INVENTORY[1])
    assert registry.acquire(INVENTORY, owner("a"), exact=exact) == exact
    assert held(registry) == {INVENTORY[3].uuid: "a", INVENTORY[1].uuid: "a"}
    # A count request then gets the lowest GPUs that are still free.
    assert registry.acquire(INVENTORY, owner("b"), count=2) == (INVENTORY[0], INVENTORY[2])


def test_busy_gpu_names_its_holder_and_takes_nothing(registry: LeaseRegistry) -> None:
    registry.acquire(INVENTORY, owner("holder-sandbox"), exact=[INVENTORY[2]])
    with pytest.raises(GpuBusy) as raised:
        registry.acquire(INVENTORY, owner("b"), exact=[INVENTORY[1], INVENTORY[2]])
    error = raised.value
    assert error.device == INVENTORY[2].describe()
    assert "sandbox holder-sandbox of the test driver" in error.holder
    assert str(ME) in error.holder
    assert INVENTORY[2].uuid in str(error)
    assert "holder-sandbox" in str(error)
    # Nothing of the refused request is held, not even the free GPU it named first.
    assert held(registry) == {INVENTORY[2].uuid: "holder-sandbox"}


def test_exhausted_reports_requested_available_total(registry: LeaseRegistry) -> None:
    registry.acquire(INVENTORY, owner("a"), count=1)
    with pytest.raises(GpusExhausted) as raised:
        registry.acquire(INVENTORY, owner("b"), count=4)
    assert (raised.value.requested, raised.value.available, raised.value.total) == (4, 3, 4)
    assert "requested 4 GPUs" in str(raised.value)
    assert "only 3 selectable of 4 devices" in str(raised.value)
    assert held(registry) == {INVENTORY[0].uuid: "a"}
    assert registry.free(INVENTORY) == INVENTORY[1:]


def test_more_than_exist_is_exhausted(registry: LeaseRegistry) -> None:
    with pytest.raises(GpusExhausted) as raised:
        registry.acquire(INVENTORY, owner("a"), count=5)
    assert (raised.value.requested, raised.value.available, raised.value.total) == (5, 4, 4)
    assert registry.leases() == []


# -- release ------------------------------------------------------------------------------


def test_release_is_idempotent_and_leaves_others_alone(registry: LeaseRegistry) -> None:
    registry.acquire(INVENTORY, owner("a"), count=2)
    registry.acquire(INVENTORY, owner("b"), count=1)
    assert registry.release("a") == 2
    assert registry.release("a") == 0
    assert registry.release("never-existed") == 0
    assert held(registry) == {INVENTORY[2].uuid: "b"}
    assert registry.free(INVENTORY) == (INVENTORY[0], INVENTORY[1], INVENTORY[3])


def test_release_session(registry: LeaseRegistry) -> None:
    registry.acquire(INVENTORY, owner("a", "s1"), count=1)
    registry.acquire(INVENTORY, owner("b", "s2"), count=1)
    registry.acquire(INVENTORY, owner("c", "s1"), count=2)
    gone = registry.release_session("s1")
    assert sorted(lease.sandbox_id for lease in gone) == ["a", "c", "c"]
    assert all(isinstance(lease, Lease) and lease.session_id == "s1" for lease in gone)
    assert held(registry) == {INVENTORY[1].uuid: "b"}
    assert registry.release_session("s1") == []


def test_set_holder_moves_only_that_sandboxs_leases(
    registry: LeaseRegistry, sleeper: subprocess.Popen[bytes]
) -> None:
    registry.acquire(INVENTORY, owner("a"), count=2)
    registry.acquire(INVENTORY, owner("b"), count=1)
    sandbox = Holder.process(sleeper.pid)
    registry.set_holder("a", sandbox)
    holders = {lease.gpu_uuid: lease.holder for lease in registry.leases()}
    assert holders == {
        INVENTORY[0].uuid: sandbox,
        INVENTORY[1].uuid: sandbox,
        INVENTORY[2].uuid: ME,
    }
    # The leases now live and die with the new holder.
    sleeper.kill()
    sleeper.wait()
    assert held(registry) == {INVENTORY[2].uuid: "b"}


def test_state_is_shared_between_registry_instances(tmp_path: Path) -> None:
    first = LeaseRegistry(tmp_path / "state")
    second = LeaseRegistry(tmp_path / "state")
    first.acquire(INVENTORY, owner("a"), count=3)
    assert second.acquire(INVENTORY, owner("b"), count=1) == INVENTORY[3:]
    with pytest.raises(GpusExhausted):
        first.acquire(INVENTORY, owner("c"), count=1)
    assert second.release("a") == 3
    assert held(first) == {INVENTORY[3].uuid: "b"}


def test_directory_is_created_on_first_use(tmp_path: Path) -> None:
    registry = LeaseRegistry(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists()
    assert registry.leases() == []
    registry.acquire(INVENTORY, owner("x"), count=1)
    stored = json.loads(registry.path.read_text())
    assert (stored["version"], stored["boot_id"]) == (FORMAT_VERSION, boot_id())
    assert [item["gpu_uuid"] for item in stored["leases"]] == [INVENTORY[0].uuid]


# -- reclaim ------------------------------------------------------------------------------


def test_dead_holder_is_reclaimed(
    registry: LeaseRegistry, sleeper: subprocess.Popen[bytes]
) -> None:
    registry.acquire(INVENTORY, owner("crashed", holder=Holder.process(sleeper.pid)), count=4)
    with pytest.raises(GpusExhausted):
        registry.acquire(INVENTORY, owner("b"), count=1)
    sleeper.kill()
    sleeper.wait()
    assert registry.acquire(INVENTORY, owner("b"), count=1) == INVENTORY[:1]
    assert held(registry) == {INVENTORY[0].uuid: "b"}


def test_zombie_holder_counts_as_dead(
    registry: LeaseRegistry, sleeper: subprocess.Popen[bytes]
) -> None:
    registry.acquire(INVENTORY, owner("crashed", holder=Holder.process(sleeper.pid)), count=4)
    os.kill(sleeper.pid, signal.SIGKILL)  # not reaped: it stays a zombie
    deadline = time.monotonic() + 5
    while _state(sleeper.pid) != "Z":
        assert time.monotonic() < deadline, "the killed child never became a zombie"
        time.sleep(0.001)
    assert registry.acquire(INVENTORY, owner("b"), count=4) == INVENTORY
    assert _state(sleeper.pid) == "Z"  # the registry did not need it reaped


def test_reused_pid_counts_as_dead(registry: LeaseRegistry) -> None:
    real = Holder.process(os.getpid())
    boot_id, pid, start = real.ref.split(":")
    assert pid == str(os.getpid())
    impostor = Holder("process", f"{boot_id}:{pid}:{int(start) + 1}")
    registry.acquire(INVENTORY, owner("old", holder=impostor), count=2)
    assert registry.leases() == []
    assert registry.acquire(INVENTORY, owner("b"), count=4) == INVENTORY


def test_holder_from_another_boot_counts_as_dead(registry: LeaseRegistry) -> None:
    _, pid, start = ME.ref.split(":")
    other_boot = Holder("process", f"00000000-0000-0000-0000-000000000000:{pid}:{start}")
    registry.acquire(INVENTORY, owner("old", holder=other_boot), count=1)
    assert registry.leases() == []


def test_live_holder_is_not_reclaimed(
    registry: LeaseRegistry, sleeper: subprocess.Popen[bytes]
) -> None:
    holder = Holder.process(sleeper.pid)
    assert str(holder).startswith(f"process {ME.ref.split(':')[0]}:{sleeper.pid}:")
    registry.acquire(INVENTORY, owner("alive", holder=holder), count=4)
    with pytest.raises(GpusExhausted):
        registry.acquire(INVENTORY, owner("b"), count=1)
    assert len(registry.leases()) == 4


def test_unknown_holder_kind_is_treated_as_alive(registry: LeaseRegistry) -> None:
    container = Holder("container", "no-such-container-anywhere")
    assert liveness_check("container") is None
    registry.acquire(INVENTORY, owner("c", holder=container), count=4)
    with pytest.raises(GpusExhausted) as raised:
        registry.acquire(INVENTORY, owner("b"), count=1)
    assert raised.value.available == 0
    assert {lease.holder for lease in registry.leases()} == {container}


def test_unknown_holder_kinds_are_looked_up_once_and_start_no_thread(
    registry: LeaseRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: 400 unknown kinds cost an entry-point scan and a thread each, every read."""
    from importlib import metadata

    kinds = [f"unknown-{i}" for i in range(400)]
    inventory = tuple(_gpu(i) for i in range(400))
    for kind, gpu in zip(kinds, inventory, strict=True):
        registry.acquire([gpu], owner(kind, holder=Holder(kind, "r")), count=1)
    looked_up: list[str] = []
    real = metadata.entry_points

    def entry_points(**selection: str) -> Any:
        looked_up.append(selection["name"])
        return real(**selection)

    monkeypatch.setattr(metadata, "entry_points", entry_points)
    monkeypatch.setattr(liveness, "ThreadPoolExecutor", None)  # any pool fails the read
    assert len(registry.leases()) == 400
    assert len(registry.leases()) == 400
    assert sorted(looked_up) == sorted(kinds)


def test_a_registered_liveness_check_is_used(
    registry: LeaseRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = {"c-2"}
    monkeypatch.setitem(liveness._CHECKS, "container", lambda holder: holder.ref not in gone)
    registry.acquire(INVENTORY, owner("a", holder=Holder("container", "c-1")), count=1)
    registry.acquire(INVENTORY, owner("b", holder=Holder("container", "c-2")), count=1)
    assert held(registry) == {INVENTORY[0].uuid: "a"}
    assert registry.acquire(INVENTORY, owner("c"), count=1) == INVENTORY[1:2]


# -- the file -----------------------------------------------------------------------------


def _write(registry: LeaseRegistry, content: bytes, mtime: float | None = None) -> Path:
    registry.directory.mkdir(parents=True, exist_ok=True)
    path = registry.path
    path.write_bytes(content)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_a_file_cut_short_in_this_boot_stops_grants_with_the_reason(
    registry: LeaseRegistry,
) -> None:
    _write(registry, b'{"version": 2, "boot_id": "x", "leases": [{"gpu_')
    with pytest.raises(LeaseFileCorrupt, match="cannot be read"):
        registry.acquire(INVENTORY, owner("a"), count=1)


def test_a_file_cut_short_before_this_boot_holds_nothing(registry: LeaseRegistry) -> None:
    """A power loss mid-write must not block every grant after the reboot."""
    _write(registry, b'{"version": 2, "boot_id": "x", "leases": [{"gpu_', boot_time() - 60)
    assert registry.leases() == []
    assert registry.acquire(INVENTORY, owner("a"), count=4) == INVENTORY


def test_leases_of_an_earlier_boot_are_dead(registry: LeaseRegistry) -> None:
    registry.acquire(INVENTORY, owner("a", holder=Holder("container", "c-1")), count=2)
    path = registry.path
    stored = json.loads(path.read_text())
    path.write_text(json.dumps({**stored, "boot_id": "00000000-earlier-boot"}))
    assert registry.leases() == []


def test_a_version_1_file_is_read(registry: LeaseRegistry) -> None:
    lease = Lease(INVENTORY[1].uuid, "test", "old", "s", ME, EXCLUSIVE, 1.0)
    _write(registry, json.dumps({"version": 1, "leases": [lease_to_dict(lease)]}).encode())
    assert registry.leases() == [lease]
    registry.acquire(INVENTORY, owner("new"), count=1)
    assert json.loads(registry.path.read_text())["version"] == FORMAT_VERSION


def test_a_newer_version_is_refused_by_name(registry: LeaseRegistry) -> None:
    _write(registry, json.dumps({"version": 5, "boot_id": boot_id(), "leases": []}).encode())
    with pytest.raises(LeaseFileCorrupt, match="version 5, written by a newer client"):
        registry.leases()


def test_stale_bytes_after_valid_json_are_ignored(registry: LeaseRegistry) -> None:
    """A writer killed between pwrite and ftruncate leaves valid JSON, then stale bytes."""
    registry.acquire(INVENTORY, owner("a"), count=1)
    registry.acquire(INVENTORY, owner("b"), count=3)
    path = registry.path
    long = path.read_bytes()
    stored = json.loads(long)
    short = json.dumps({**stored, "leases": stored["leases"][:1]}).encode()
    assert len(short) < len(long)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, short, 0)  # ... and the writer dies before its ftruncate
    finally:
        os.close(fd)
    assert path.read_bytes() == short + long[len(short) :]

    assert held(registry) == {INVENTORY[0].uuid: "a"}
    assert LeaseRegistry(registry.directory).free(INVENTORY) == INVENTORY[1:]
    # The next write leaves a clean file again.
    registry.acquire(INVENTORY, owner("c"), count=1)
    assert [item["sandbox_id"] for item in json.loads(path.read_bytes())["leases"]] == ["a", "c"]


def test_empty_file_is_no_leases(registry: LeaseRegistry) -> None:
    registry.directory.mkdir(parents=True)
    (registry.path).write_bytes(b"")
    assert registry.leases() == []
    assert registry.acquire(INVENTORY, owner("a"), count=4) == INVENTORY


def test_reclaim_is_written_back(registry: LeaseRegistry, sleeper: subprocess.Popen[bytes]) -> None:
    registry.acquire(INVENTORY, owner("crashed", holder=Holder.process(sleeper.pid)), count=2)
    sleeper.kill()
    sleeper.wait()
    assert registry.leases() == []
    path = registry.path
    assert json.loads(path.read_bytes()) == {
        "version": FORMAT_VERSION,
        "boot_id": boot_id(),
        "leases": [],
    }


# -- checks that ask an engine run outside the lock ----------------------------------------


def _lock_is_free(registry: LeaseRegistry) -> bool:
    fd = os.open(registry.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def test_an_engine_check_runs_outside_the_host_lock(
    registry: LeaseRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []

    def gone(holder: Holder) -> bool:
        seen.append(_lock_is_free(registry))
        return False

    monkeypatch.setitem(liveness._CHECKS, "container", gone)
    registry.acquire(INVENTORY, owner("c", holder=Holder("container", "c-1")), count=4)
    assert registry.acquire(INVENTORY, owner("b"), count=1) == INVENTORY[:1]
    assert seen
    assert all(seen), "the liveness check ran while the host lock was held"


def test_a_hung_engine_check_delays_no_other_grant(
    registry: LeaseRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that waits on a hung engine's verdict holds no lock: others go on."""
    release = threading.Event()

    def hung(holder: Holder) -> bool:
        release.wait(10)
        return True

    monkeypatch.setitem(liveness._CHECKS, "container", hung)
    registry.acquire(INVENTORY, owner("c", holder=Holder("container", "c-1")), count=3)
    refused: list[BaseException] = []

    def wait_for_two() -> None:
        try:
            registry.acquire(INVENTORY, owner("w"), count=2)
        except GpusExhausted as exc:
            refused.append(exc)

    waiting = threading.Thread(target=wait_for_two)
    waiting.start()
    try:
        time.sleep(0.2)  # the waiting request is now in the hung check
        start = time.monotonic()
        assert registry.acquire(INVENTORY, owner("d"), count=1) == INVENTORY[3:]
        assert registry.release("d") == 1
        assert time.monotonic() - start < 1
    finally:
        release.set()
        waiting.join()
    assert len(refused) == 1, "the judged holder is alive: the request for two is refused"


def test_a_fresh_process_finds_a_drivers_check_by_its_entry_point() -> None:
    """No import of the docker driver: the registry finds its check by entry point."""
    code = (
        "import sys\n"
        "from gpuhost.leases import liveness_check\n"
        "assert 'drivers.docker' not in sys.modules\n"
        "print(liveness_check('docker').__qualname__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ContainerDriver.holder_alive"


# -- concurrency --------------------------------------------------------------------------

GRANTS_PER_WORKER = 30
WORKERS = 8


def _log(log_dir: Path, gpu: GpuDevice, line: str) -> None:
    fd = os.open(log_dir / gpu.uuid, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _grant_loop(registry: LeaseRegistry, log_dir: Path, worker: int) -> None:
    """Take one GPU at a time, log start/end around holding it, and give it back."""
    pid = os.getpid()
    holder = Holder.process(pid)
    tag = f"{pid}/{worker}"
    granted = 0
    attempt = 0
    while granted < GRANTS_PER_WORKER:
        attempt += 1
        sandbox = f"w{worker}-{attempt}"
        try:
            (gpu,) = registry.acquire(INVENTORY, owner(sandbox, holder=holder), count=1)
        except GpusExhausted:
            time.sleep(0.0005)
            continue
        _log(log_dir, gpu, f"{tag} start\n")
        time.sleep(0.0002)
        _log(log_dir, gpu, f"{tag} end\n")
        assert registry.release(sandbox) == 1
        granted += 1


def _process_worker(registry: LeaseRegistry, log_dir: Path, worker: int) -> None:
    try:
        _grant_loop(registry, log_dir, worker)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _assert_never_shared(log_dir: Path) -> int:
    """Every GPU's log alternates start/end of one holder at a time; returns the grants."""
    grants = 0
    for path in sorted(log_dir.iterdir()):
        holding: str | None = None
        for number, line in enumerate(path.read_text().splitlines(), 1):
            who, event = line.split()
            if event == "start":
                assert holding is None, (
                    f"{path.name} line {number}: {who} got it while {holding} held it"
                )
                holding = who
                grants += 1
            else:
                assert holding == who, f"{path.name} line {number}: {who} ended {holding}'s hold"
                holding = None
        assert holding is None, f"{path.name}: {holding} never gave it back"
    return grants


def test_processes_never_share_a_gpu(tmp_path: Path) -> None:
    registry = LeaseRegistry(tmp_path / "state")
    assert registry.leases() == []  # the parent has the file open before forking
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_process_worker, args=(registry, log_dir, n)) for n in range(WORKERS)
    ]
    for process in workers:
        process.start()
    for process in workers:
        process.join(timeout=60)
    assert [process.exitcode for process in workers] == [0] * WORKERS
    assert _assert_never_shared(log_dir) == WORKERS * GRANTS_PER_WORKER
    assert registry.leases() == []


def test_threads_sharing_one_registry_never_share_a_gpu(tmp_path: Path) -> None:
    registry = LeaseRegistry(tmp_path / "state")
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    errors: list[BaseException] = []
    barrier = threading.Barrier(WORKERS)

    def run(worker: int) -> None:
        try:
            barrier.wait()
            _grant_loop(registry, log_dir, worker)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert _assert_never_shared(log_dir) == WORKERS * GRANTS_PER_WORKER
    assert registry.leases() == []


# -- MIG instances and their GPU; shared leases --------------------------------------------

GPU_IN_MIG_MODE = dataclasses.replace(_gpu(4), mig_enabled=True)
INSTANCES = tuple(
    dataclasses.replace(
        GPU_IN_MIG_MODE,
        uuid=f"MIG-{i:08d}-0000-0000-0000-000000000000",
        parent_uuid=GPU_IN_MIG_MODE.uuid,
        mig_index=i,
        profile="1g.10gb",
    )
    for i in range(3)
)


def test_a_leased_instance_makes_its_gpu_busy_and_not_its_siblings(
    registry: LeaseRegistry,
) -> None:
    registry.acquire(INSTANCES, owner("mig-0"), exact=[INSTANCES[0]])
    with pytest.raises(GpuBusy, match=r"held exclusively through MIG-00000000.* by sandbox mig-0"):
        registry.acquire(INVENTORY, owner("whole"), exact=[GPU_IN_MIG_MODE])
    assert registry.acquire(INSTANCES, owner("mig-1"), count=1) == INSTANCES[1:2]
    stored = json.loads((registry.path).read_text())["leases"]
    assert [item.get("parent_uuid") for item in stored] == [GPU_IN_MIG_MODE.uuid] * 2


def test_a_leased_gpu_makes_every_instance_of_it_busy(registry: LeaseRegistry) -> None:
    registry.acquire(INVENTORY, owner("whole"), exact=[GPU_IN_MIG_MODE])
    for instance in INSTANCES:
        with pytest.raises(GpuBusy, match="by sandbox whole"):
            registry.acquire(INSTANCES, owner("mig"), exact=[instance])
    with pytest.raises(GpusExhausted, match="3 held exclusively"):
        registry.acquire(INSTANCES, owner("mig"), count=1)


def test_shared_leases_fill_a_gpu_up_to_the_limit_then_the_next(registry: LeaseRegistry) -> None:
    got = [
        registry.acquire(INVENTORY, owner(f"s{n}"), count=1, mode=SHARED, share_limit=3)[0]
        for n in range(5)
    ]
    # The GPU already shared first, while it has room; then the lowest free one.
    assert got == [INVENTORY[0]] * 3 + [INVENTORY[1]] * 2
    stored = json.loads((registry.path).read_text())["leases"]
    assert {(item["mode"], item["share_limit"]) for item in stored} == {(SHARED, 3)}


def test_exclusive_and_shared_never_meet(registry: LeaseRegistry) -> None:
    registry.acquire(INVENTORY, owner("shared"), exact=[INVENTORY[0]], mode=SHARED)
    registry.acquire(INVENTORY, owner("alone"), exact=[INVENTORY[1]])
    with pytest.raises(GpuBusy, match=r"shared by sandbox shared .*\(shared\)"):
        registry.acquire(INVENTORY, owner("x"), exact=[INVENTORY[0]])
    with pytest.raises(GpuBusy, match="held exclusively by sandbox alone"):
        registry.acquire(INVENTORY, owner("y"), exact=[INVENTORY[1]], mode=SHARED)
    # An exclusive count skips the shared GPU; a shared one joins it.
    assert registry.acquire(INVENTORY, owner("e"), count=1) == INVENTORY[2:3]
    assert registry.acquire(INVENTORY, owner("s"), count=1, mode=SHARED) == INVENTORY[:1]


def test_the_strictest_share_limit_holds(registry: LeaseRegistry) -> None:
    registry.acquire(INVENTORY[:1], owner("a"), count=1, mode=SHARED, share_limit=2)
    registry.acquire(INVENTORY[:1], owner("b"), count=1, mode=SHARED, share_limit=8)
    with pytest.raises(
        GpusExhausted, match=r"requested 1 GPUs.*shared; 0 held exclusively, 1 shared"
    ):
        registry.acquire(INVENTORY[:1], owner("c"), count=1, mode=SHARED, share_limit=8)


def test_releasing_one_shared_holder_leaves_the_others(registry: LeaseRegistry) -> None:
    for name in ("a", "b", "c"):
        registry.acquire(INVENTORY, owner(name), exact=[INVENTORY[0]], mode=SHARED)
    assert registry.release("b") == 1
    assert sorted(held_by(registry, INVENTORY[0])) == ["a", "c"]
    with pytest.raises(GpuBusy):
        registry.acquire(INVENTORY, owner("x"), exact=[INVENTORY[0]])


def held_by(registry: LeaseRegistry, gpu: GpuDevice) -> list[str]:
    return [lease.sandbox_id for lease in registry.leases() if lease.gpu_uuid == gpu.uuid]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a /proc of its own, another user")
@pytest.mark.parametrize("client", ["python", "sh"])
def test_a_holder_hidden_by_hidepid_is_alive(client: str) -> None:
    """Under hidepid=invisible another user's live holder is alive, not gone (a second grant).

    The other user holds nothing: it looks at root's holder through hidepid.
    """
    holder = subprocess.Popen(["sleep", "60"])
    base = Path(tempfile.mkdtemp(prefix="gpu-hidepid-"))
    try:
        src = readable_copy(base)
        ref = f"{liveness.boot_id()}:{holder.pid}:{liveness.process_start_time(holder.pid)}"
        if client == "python":
            check = [PYTHON, "-c", f"from gpuhost.liveness import _process_alive, Holder; "
                     f"print(_process_alive(Holder('process', {ref!r})))"]  # fmt: skip
        else:
            script = src / "gpuhost" / "gpu-lease"
            functions = script.read_text().split("\nprocess_alive() {", 1)[1].split("\n}\n")[0]
            check = ["sh", "-c", f'boot=$(cat /proc/sys/kernel/random/boot_id)\n'
                     f"process_alive() {{{functions}\n}}\n"
                     f"process_alive {ref} && echo True || echo False"]  # fmt: skip
        seen = subprocess.run(
            ["unshare", "--mount", "--propagation=private", "sh", "-c",
             'mount -t proc -o hidepid=invisible proc /proc && exec "$@"', "sh",
             *setpriv(), "--", *check],
            capture_output=True, text=True, check=False, cwd=src,
            env={**os.environ, "PYTHONPATH": str(src)},
        )  # fmt: skip
        assert seen.stdout.strip() == "True", seen
    finally:
        holder.kill()
        holder.wait()
        shutil.rmtree(base)


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_an_engine_address_read_from_the_lease_file_is_never_connected_to(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forged holder names a socket of its writer's: the liveness check does not call it."""
    from drivers import get_driver_class
    from drivers.container import ContainerDriver

    cls = get_driver_class(engine)
    assert issubclass(cls, ContainerDriver)
    monkeypatch.setenv(cls.url_env, f"unix://{tmp_path / 'configured.sock'}")
    planted = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    planted.bind(str(tmp_path / "planted.sock"))
    planted.listen(1)
    planted.settimeout(0.5)
    for address in (f"unix://{tmp_path / 'planted.sock'}", "ssh://root@127.0.0.1"):
        assert cls.holder_alive(Holder(cls.holder_kind, f"{address} 0123456789ab")) is True
        with pytest.raises(TimeoutError):
            planted.accept()
    planted.close()


def test_a_lease_file_that_is_a_link_is_replaced_and_its_target_untouched(tmp_path: Path) -> None:
    """A user who can write the registry's directory must not make root open their file.

    The link is removed, never followed, and a file of the registry's user made in its place
    (tests/gpuhost/test_lease_users.py tries it as another user, with every client).
    """
    target = tmp_path / "target"
    target.write_text("{}")
    target.chmod(0o600)
    registry = LeaseRegistry(tmp_path / "leases")
    (tmp_path / "leases").mkdir()
    registry.path.symlink_to(target)
    registry.acquire(INVENTORY, owner("a"), count=1)
    assert stat.S_ISREG(registry.path.lstat().st_mode)
    assert [lease.sandbox_id for lease in LeaseRegistry(tmp_path / "leases").leases()] == ["a"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert target.read_text() == "{}"


def test_a_lease_file_of_two_names_is_refused_by_name(tmp_path: Path) -> None:
    """A lease file with a second name is not written through.

    Another user could make one of a file of root's under root's name where
    fs.protected_hardlinks is off: root would write its leases into that file.
    """
    registry = LeaseRegistry(tmp_path / "leases")
    registry.leases()
    registry.close()
    os.link(registry.path, tmp_path / "elsewhere")
    with pytest.raises(LeaseFileCorrupt, match=rf"{registry.path} has 2 names"):
        registry.acquire(INVENTORY, owner("a"), count=1)


def test_a_lock_held_too_long_fails_the_grant_naming_its_holder(tmp_path: Path) -> None:
    """Another process that keeps the lease file locked stops grants for a bound, not forever."""
    registry = LeaseRegistry(tmp_path / "leases", lock_timeout_s=0.5)
    registry.leases()  # the file exists
    holder = subprocess.Popen(["flock", str(tmp_path / "leases"), "sleep", "60"])
    try:
        wait_for(
            lambda: f" {holder.pid} " in Path("/proc/locks").read_text(),
            lambda held: held,
            timeout_s=10,
            what="flock(1) to take the lock",
        )
        started = time.monotonic()
        with pytest.raises(LeaseFileLocked, match=rf"over 0.5 s by pid {holder.pid} \(uid"):
            registry.acquire([_gpu(0)], owner("a"), count=1)
        assert time.monotonic() - started < 5
    finally:
        holder.kill()
        holder.wait()


def test_a_registry_let_go_leaves_no_file_open(tmp_path: Path) -> None:
    """Before: each registry kept its files open for the life of the process (EMFILE)."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(500):
        LeaseRegistry(tmp_path / "leases").acquire(INVENTORY, owner("a"), count=1)
        LeaseRegistry(tmp_path / "leases").release("a")
    assert len(os.listdir("/proc/self/fd")) <= before
