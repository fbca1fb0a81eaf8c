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
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench.fleet import print_fleet
from bench.measure import bench_lane, bench_lifecycle, bench_registry, filesystem, run_dir
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig


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
        with tempfile.TemporaryDirectory(prefix="gpu-bench-", dir=run_dir()) as run:
            places = [("default place", Path(run)), ("on disk", Path(tmp) / "leases-on-disk")]
            for label, registry_dir in places:
                rate, _, _, exhausted = bench_registry(
                    sim.root, registry_dir, args.processes, args.registry_seconds, check=False
                )
                where = f"{label}: {registry_dir} ({filesystem(registry_dir)})"
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
        with tempfile.TemporaryDirectory(prefix="gpu-bench-", dir=run_dir()) as run:
            rate, grants, _, exhausted = bench_registry(
                mig.root, Path(run), args.processes, args.registry_seconds, False, mixed=True
            )
        print(f"   {rate:,.0f} grant+release/s; exhausted {exhausted}  (target >= 2,000/s)")

        print(f"\n5. gpu-sandbox report merge: {args.fleet_hosts} hosts' reports beside one")
        print_fleet(report, args.fleet_hosts, args.fleet_runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
