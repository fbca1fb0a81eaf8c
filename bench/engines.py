"""``python -m bench.engines`` (``make bench-engines``): the container lane's speed, side by side.

1. Sandbox lifecycle per engine: the driver's create (default GPU request) + exec
   ``nvidia-smi -L`` + close, against the engine's own
   ``<cli> run --rm --network=none --device nvidia.com/gpu=0 <image> nvidia-smi -L``,
   interleaved run by run so both see the same machine load. Target: at most 1.25x.
2. The whole catalogue's wall time per driver (reference, docker, podman), serially and
   with pytest-xdist ``-n 2``, counting runs that did not pass (a flaky result is any such
   run).

Needs both engines answering (``make engines``). Runs on a simulated 8-GPU host of its own,
registered with the engines for the duration (``make conformance`` registers its own again).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from bench.lane import time_lane
from bench.measure import interleaved_medians, sandbox_lifecycle
from drivers.container import ContainerDriver
from drivers.docker import DockerDriver
from drivers.podman import PodmanDriver
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.leases import Holder

CDI_DIR = Path("/var/run/cdi")


def bench_lifecycle(driver: ContainerDriver, iterations: int) -> tuple[float, float]:
    device = driver.device_ids(driver.inventory()[0])[0]
    raw = driver.oracle_argv([device], None, ["nvidia-smi", "-L"])

    def bare() -> None:
        subprocess.run(raw, check=True, capture_output=True)

    # The warm-up loads the image into the page cache and opens the clients' connections.
    return interleaved_medians(lambda: sandbox_lifecycle(driver), bare, iterations, warm_up=3)


def bench_catalogue(
    sim_root: Path, drivers: str, runs: int, *extra: str
) -> tuple[list[float], int]:
    """Wall times of ``runs`` catalogue runs, and how many of them did not pass."""
    times, failed = [], 0
    for _ in range(runs):
        run = time_lane(f"--driver={drivers}", f"--sim-root={sim_root}", *extra)
        times.append(run.seconds)
        if run.returncode != 0:
            failed += 1
            print(f"   a run did not pass (exit {run.returncode}):\n{run.output[-2000:]}")
    return times, failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__)
    parser.add_argument("--iterations", type=int, default=30, help="lifecycles to time")
    parser.add_argument("--runs", type=int, default=3, help="serial catalogue runs per driver")
    parser.add_argument("--xdist-runs", type=int, default=5, help="-n 2 runs per driver")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="gpu-bench-engines-") as tmp:
        owner = Holder.process(os.getpid())
        sim = simulated.setup(Path(tmp) / "sim", 8, cdi_dir=CDI_DIR, owner=owner)
        try:
            host = GpuHost.open(HostConfig(sim_root=sim.root))
            print(f"host: {host.describe()}")
            print(f"\n1. sandbox lifecycle, median of {args.iterations} (interleaved)")
            for engine in (DockerDriver, PodmanDriver):
                driver = engine(host, f"bench-{uuid.uuid4().hex[:8]}")
                availability = driver.probe()
                if not availability.ok:
                    sys.exit(f"{engine.name} cannot run: {availability.reason}")
                ours, bare = bench_lifecycle(driver, args.iterations)
                print(f"   {engine.name} ({driver.version()})")
                raw = f"{driver.cli} run --rm --device ... nvidia-smi -L"
                print(
                    f"     {'driver create + exec nvidia-smi -L + close':<44}{ours * 1000:8.1f} ms"
                )
                print(f"     {raw:<44}{bare * 1000:8.1f} ms")
                print(f"     ratio {ours / bare:.2f}x  (target <= 1.25x)")

            if args.runs == 0 and args.xdist_runs == 0:
                return 0
            print("\n2. the whole catalogue (pytest conformance --driver=X), wall time")
            for name in ("reference", "docker", "podman"):
                for label, runs, extra in (
                    ("serial", args.runs, ()),
                    ("-n 2", args.xdist_runs, ("-n", "2")),
                ):
                    if runs == 0:
                        continue
                    times, failed = bench_catalogue(sim.root, name, runs, *extra)
                    listed = ", ".join(f"{t:.1f}" for t in times)
                    print(
                        f"   {name:<10}{label:<8}median {statistics.median(times):6.1f} s  "
                        f"({runs} runs: {listed})  not passed: {failed}"
                    )
        finally:
            simulated.teardown(sim.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
