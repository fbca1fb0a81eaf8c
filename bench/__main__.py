"""``python -m bench`` (``make bench``): the reference lane's speed, side by side.

1. Sandbox lifecycle: the reference driver's create + exec ``nvidia-smi -L`` + close, against
   a bare ``bwrap <the same mounts> true``, interleaved run by run so that both see the same
   machine load. Target: at most 3x.
2. The full reference lane (``pytest conformance --driver=reference``): wall time. Target:
   at most 20 s on 2 cores.
3. The lease registry: grant + release per second with 8 processes contending, and double
   grants (a GPU held by two processes at once). Target: at least 2,000/s and zero, where
   registries live by default (/run, a tmpfs); the rate on disk is reported beside it.
4. The same on a MIG host (8 GPUs of 7 instances each, 56 in all, and 2 whole GPUs): every
   other grant an exclusive MIG instance, the others a shared whole GPU, where a grant
   weighs instances against their GPUs and shared leases against their limit. Target: at
   least 2,000/s.
5. A fleet report's merge (``gpu-sandbox report merge``) of 200 hosts' reports, copies of
   the lane's renamed, beside a merge of one: time and peak memory, medians
   (``bench/fleet.py``). Target: at most 10 s.

Runs on a simulated GPU host of its own, in a temporary directory.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from bench.fleet import print_fleet
from bench.lane import time_lane
from drivers.base import Driver
from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.errors import GpusExhausted
from gpuhost.host import GpuHost, HostConfig
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--iterations", type=int, default=100, help="lifecycles to time")
    parser.add_argument("--lane-runs", type=int, default=3, help="full reference lane runs")
    parser.add_argument("--registry-seconds", type=float, default=3.0)
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--fleet-hosts", type=int, default=200, help="reports merged in 5")
    parser.add_argument("--fleet-runs", type=int, default=5, help="merges timed of each size")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        sim = simulated.setup(Path(tmp) / "sim", 8)
        host = GpuHost.open(HostConfig(sim_root=sim.root))
        print(f"host: {host.describe()}; {os.cpu_count()} CPUs")

        ours, bare = bench_lifecycle(host, args.iterations)
        print(f"\n1. sandbox lifecycle, median of {args.iterations} (interleaved)")
        print(f"   reference create + exec nvidia-smi -L + close  {ours * 1000:8.2f} ms")
        print(f"   bare bwrap <same mounts> true                  {bare * 1000:8.2f} ms")
        print(f"   ratio {ours / bare:.2f}x  (target <= 3x)")

        report = Path(tmp) / "reference-lane.json"
        lane = bench_lane(sim.root, args.lane_runs, report)
        print(f"\n2. full reference lane (pytest conformance --driver=reference), {len(lane)} runs")
        runs = ", ".join(f"{t:.2f}" for t in lane)
        print(f"   median {statistics.median(lane):.2f} s  runs {runs}  (target <= 20 s)")

        print(
            f"\n3. lease registry, {args.processes} processes contending for 8 GPUs, "
            f"{args.registry_seconds:g} s each"
        )
        with tempfile.TemporaryDirectory(prefix="gpu-bench-", dir=_run_dir()) as run:
            places = [("default place", Path(run)), ("on disk", Path(tmp) / "leases-on-disk")]
            for label, registry_dir in places:
                rate, _, _, exhausted = bench_registry(
                    sim.root, registry_dir, args.processes, args.registry_seconds, check=False
                )
                where = f"{label}: {registry_dir} ({_filesystem(registry_dir)})"
                target = "  (target >= 2,000/s)" if label == "default place" else ""
                print(f"   {rate:,.0f} grant+release/s, {where}; exhausted {exhausted}{target}")
            _, grants, double, _ = bench_registry(
                sim.root, Path(run), args.processes, args.registry_seconds, check=True
            )
        print(
            f"   then with an O_EXCL marker per held GPU: {double} double grants in "
            f"{grants:,} grants  (target 0)"
        )

        # 8 GPUs in MIG mode (56 instances, as an 8 x H100 host in 7 x 1g.10gb) beside 2
        # whole GPUs, so that every other grant can be a shared one.
        layout = simulated.parse_mig_layout(",".join(f"{gpu}:7x1g.10gb" for gpu in range(8)))
        mig = simulated.setup(Path(tmp) / "mig", 10, mig=layout)
        print(
            f"\n4. the same on a MIG host, {len(mig.mig_devices)} MIG instances and "
            f"{sum(not gpu.mig_enabled for gpu in mig.gpus)} whole GPUs: every other grant an "
            "exclusive MIG instance, the others a shared whole GPU"
        )
        with tempfile.TemporaryDirectory(prefix="gpu-bench-", dir=_run_dir()) as run:
            rate, grants, _, exhausted = bench_registry(
                mig.root, Path(run), args.processes, args.registry_seconds, False, mixed=True
            )
        print(f"   {rate:,.0f} grant+release/s; exhausted {exhausted}  (target >= 2,000/s)")

        print(f"\n5. gpu-sandbox report merge: {args.fleet_hosts} hosts' reports beside one")
        print_fleet(report, args.fleet_hosts, args.fleet_runs)
    return 0


def _run_dir() -> str | None:
    """Where hosts keep their lease registries by default: /run, a tmpfs (when writable)."""
    run = Path("/run")
    return str(run) if os.access(run, os.W_OK) else None


def _filesystem(path: Path) -> str:
    """The type of the file system ``path`` is on, from /proc/mounts."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount_point, fs_type, *_ = line.split()
        if str(path).startswith(mount_point) and len(mount_point) > len(best):
            best, kind = mount_point, fs_type
    return kind


if __name__ == "__main__":
    sys.exit(main())
