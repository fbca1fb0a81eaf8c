"""What the benchmarks measure with, for ``python -m bench`` and each lane's bench.

Medians of two actions timed in turn, a sandbox's lifecycle, a lane's runs, and the lease
registry's grants under contention.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.lane import time_lane
from drivers.base import Driver
from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.errors import GpusExhausted
from gpuhost.host import GpuHost
from gpuhost.leases import EXCLUSIVE, SHARED, Holder, LeaseOwner, LeaseRegistry
from gpuhost.spec import SandboxSpec

MARKER_HOLD_S = 0.0005
"""How long a checking worker holds a GPU's marker: long enough for overlaps to show."""


def _timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def interleaved_medians(
    ours: Callable[[], object], theirs: Callable[[], object], iterations: int, warm_up: int
) -> tuple[float, float]:
    """Median seconds of each, timed run by run in turn so both see the same machine load."""
    for _ in range(warm_up):
        ours()
        theirs()
    timed: tuple[list[float], list[float]] = ([], [])
    for _ in range(iterations):
        timed[0].append(_timed(ours))
        timed[1].append(_timed(theirs))
    return statistics.median(timed[0]), statistics.median(timed[1])


def sandbox_lifecycle(driver: Driver) -> None:
    """Create a sandbox with the default GPU request, run nvidia-smi -L in it, close it."""
    with driver.create(SandboxSpec.with_gpus()) as sandbox:
        sandbox.exec(["nvidia-smi", "-L"]).check()


def bench_lifecycle(host: GpuHost, iterations: int) -> tuple[float, float]:
    driver = ReferenceDriver(host, f"bench-{uuid.uuid4().hex[:8]}")
    bare_argv = [*driver.bwrap_argv("bench", host.gpus[:1]), "true"]
    env = driver.sandbox_env({})

    def bare() -> None:
        subprocess.run(bare_argv, check=True, env=env)

    # The warm-up fills the page cache and starts the spawner thread.
    return interleaved_medians(lambda: sandbox_lifecycle(driver), bare, iterations, warm_up=5)


def bench_lane(sim_root: Path, runs: int, report: Path) -> list[float]:
    """The lane's times; its last run's report is left at ``report`` (for 5, the fleet)."""
    times = []
    for _ in range(runs):
        run = time_lane(
            "--driver=reference", f"--sim-root={sim_root}", f"--conformance-json={report}"
        )
        times.append(run.seconds)
        if run.returncode != 0:
            sys.exit(f"the reference lane failed:\n{run.output[-3000:]}")
    return times


def _contend(
    directory: str,
    registry_dir: str,
    seconds: float,
    check: bool,
    out: multiprocessing.Queue,  # type: ignore[type-arg]
    mixed: bool = False,
) -> None:
    """Grant and release for ``seconds``; count grants, exhaustions and double grants.

    With ``check``, while it holds a GPU a worker owns a marker file for it, created with
    O_EXCL: if the registry ever granted a GPU twice, the second holder finds it there.
    ``mixed``: every other grant is a MIG instance, the others a shared whole GPU.
    """
    host = simulated.load(Path(directory))
    registry = LeaseRegistry(Path(registry_dir))
    markers = Path(directory) / "bench-markers"
    holder = Holder.process(os.getpid())
    grants = exhausted = double = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sandbox_id = uuid.uuid4().hex
        owner = LeaseOwner("bench", sandbox_id, "bench", holder)
        pool, mode = host.gpus, EXCLUSIVE
        if mixed:
            shared = grants % 2 == 1
            pool = tuple(g for g in host.gpus if not g.mig_enabled) if shared else host.mig_devices
            mode = SHARED if shared else EXCLUSIVE
        try:
            (gpu,) = registry.acquire(pool, owner, count=1, mode=mode)
        except GpusExhausted:
            exhausted += 1
            continue
        if check:
            marker = markers / gpu.uuid
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                double += 1
            else:
                time.sleep(MARKER_HOLD_S)
                marker.unlink()
        registry.release(sandbox_id)
        grants += 1
    out.put((grants, exhausted, double))


def bench_registry(
    sim_root: Path,
    registry_dir: Path,
    processes: int,
    seconds: float,
    check: bool,
    mixed: bool = False,
) -> tuple[float, int, int, int]:
    (sim_root / "bench-markers").mkdir(exist_ok=True)
    queue: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    args = (str(sim_root), str(registry_dir), seconds, check, queue, mixed)
    workers = [multiprocessing.Process(target=_contend, args=args) for _ in range(processes)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    results = [queue.get() for _ in workers]
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - start
    grants, exhausted, double = (sum(column) for column in zip(*results, strict=True))
    return grants / elapsed, grants, double, exhausted


def run_dir() -> str | None:
    """Where hosts keep their lease registries by default: /run, a tmpfs (when writable)."""
    run = Path("/run")
    return str(run) if os.access(run, os.W_OK) else None


def filesystem(path: Path) -> str:
    """The type of the file system ``path`` is on, from /proc/mounts."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount_point, fs_type, *_ = line.split()
        if str(path).startswith(mount_point) and len(mount_point) > len(best):
            best, kind = mount_point, fs_type
    return kind
