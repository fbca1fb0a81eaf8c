"""A fleet report's merge (``gpu-sandbox report merge``): 200 hosts' reports beside one.

The reports are copies of one real run's (``python -m bench`` passes the report of its
reference lane), each renamed to a host of its own (hostname and ``host_id``) as 200 runners
would send them. Each merge is the command itself in a fresh process, the two sizes in turn
run by run so that both see the same machine load; wall and CPU time (user and system, which
a shared machine's load changes less) and peak memory (the process's own maximum resident
set, from ``wait4``) are medians. Target: 200 hosts in seconds (at most 10 s
on 2 cores).

    python -m bench.fleet --report reports/conformance.json [--hosts 200] [--runs 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPU_SANDBOX = Path(sys.executable).parent / "gpu-sandbox"
TARGET_S = 10.0


def renamed_copies(report: Path, directory: Path, hosts: int) -> list[Path]:
    """``hosts`` copies of ``report``, each a host of its own: its hostname and host_id."""
    document = json.loads(report.read_text())
    hostname, host_id = str(document["hostname"]), str(document["host_id"])
    paths = []
    for index in range(hosts):
        document["hostname"] = f"{hostname}-{index:03d}"
        document["host_id"] = hashlib.sha256(f"{host_id} {index}".encode()).hexdigest()[:32]
        path = directory / f"host-{index:03d}.json"
        path.write_text(json.dumps(document))
        paths.append(path)
    return paths


def merge_once(reports: list[Path], out: Path) -> tuple[float, float, int]:
    """Wall and CPU seconds and peak resident KiB of one ``gpu-sandbox report merge``."""
    argv = [str(GPU_SANDBOX), "report", "merge", "--out", str(out), *map(str, reports)]
    with tempfile.TemporaryFile() as stderr:
        start = time.perf_counter()
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(process.pid, 0)  # this process's own peak, not its siblings'
        seconds = time.perf_counter() - start
        process.returncode = code = os.waitstatus_to_exitcode(status)
        if code not in (0, 1):  # 1: the fleet's gate failed, a verdict all the same
            stderr.seek(0)
            sys.exit(f"the merge failed ({code}): {stderr.read().decode()[-2000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss


def bench_fleet(report: Path, hosts: int, runs: int) -> dict[int, tuple[float, float, float]]:
    """Median (wall s, CPU s, peak MiB) of a merge of one report and of ``hosts`` reports."""
    with tempfile.TemporaryDirectory(prefix="gpu-bench-fleet-") as tmp:
        copies = renamed_copies(report, Path(tmp), hosts)
        sizes = {1: copies[:1], hosts: copies}
        timed: dict[int, list[tuple[float, float, int]]] = {size: [] for size in sizes}
        for index in range(runs + 1):  # the first round warms the page cache
            for size, paths in sizes.items():
                measured = merge_once(paths, Path(tmp) / f"out-{size}")
                if index:
                    timed[size].append(measured)
    return {
        size: (
            statistics.median(wall for wall, _, _ in measured),
            statistics.median(cpu for _, cpu, _ in measured),
            statistics.median(kib for _, _, kib in measured) / 1024,
        )
        for size, measured in timed.items()
    }


def print_fleet(report: Path, hosts: int, runs: int) -> None:
    size = report.stat().st_size / 1024
    print(
        f"   copies of one real run's report ({size:,.0f} KiB), each renamed a host of its own; "
        f"medians of {runs}, interleaved"
    )
    results = bench_fleet(report, hosts, runs)
    for count, (wall, cpu, mib) in results.items():
        label = f"merge of {count} host{'s' if count > 1 else ''}"
        target = f"  (target <= {TARGET_S:g} s)" if count == hosts else ""
        print(f"   {label:<22}{wall:8.2f} s wall {cpu:8.2f} s CPU {mib:8.1f} MiB peak{target}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__)
    parser.add_argument("--report", type=Path, required=True, help="a run's --conformance-json")
    parser.add_argument("--hosts", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"fleet merge, {args.hosts} hosts beside one")
    print_fleet(args.report, args.hosts, args.runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
