"""``python -m bench.profile`` (``make bench-profile``): where each lane's wall time goes.

For each lane (``--lanes``; default, every built-in driver), on the gate's simulated host
layout: the wall time (median of ``--runs``), the CPU time of the suite and of what it ran
(its sandboxes, QEMU), the CPU time of the engine's own daemons (dockerd, containerd and its
shims, podman's service and conmon, the cluster's kubelet, API server and etcd), and the
idle share: the part of the wall time in which the whole machine was less than a tenth of a
core busy. Then the ten slowest tests of the last run, each with its own idle share: a slow
test on an idle machine waits on a clock or a poll, one on a busy machine on work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.lane import ROOT
from bench.timeline import TIMELINE_ENV

LANES = ("reference", "docker", "podman", "kubernetes", "vm")
SIM = ("--sim-gpus=8", "--sim-mig=0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb", "--sim-dri=intel:1,amd:2")
ENGINE_DAEMONS = (
    "dockerd", "containerd", "containerd-shim", "podman", "conmon", "kubelet",
    "kube-apiserver", "etcd", "kube-scheduler", "kube-controller", "coredns",
)  # fmt: skip
"""Process names (as /proc/<pid>/comm has them, 15 characters) of the engines' own daemons."""
IDLE_BUSY_CORES = 0.1
SAMPLE_S = 0.1
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Samples:
    """The machine's busy cores and the engines' CPU time, sampled while a lane runs."""

    busy: list[tuple[float, float, float]] = field(default_factory=list)
    """(from, to, busy cores) per interval."""
    engine_ticks: dict[int, tuple[int, int]] = field(default_factory=dict)
    """pid → (CPU ticks when first seen, when last seen) of each engine daemon."""

    def idle_s(self, start: float, end: float) -> float:
        return sum(
            max(0.0, min(to, end) - max(since, start))
            for since, to, cores in self.busy
            if cores < IDLE_BUSY_CORES
        )

    def engine_cpu_s(self) -> float:
        return sum(last - first for first, last in self.engine_ticks.values()) / TICKS


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def _engine_daemons() -> dict[int, int]:
    """Pid → CPU ticks (user + system) of each engine daemon running now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        if name.startswith(ENGINE_DAEMONS):
            rest = raw[raw.rindex(")") + 2 :].split()
            found[int(entry.name)] = int(rest[11]) + int(rest[12])
    return found


def sample_machine(samples: Samples, stop: threading.Event) -> None:
    cores = os.cpu_count() or 1
    before, then = _cpu_ticks(), time.time()
    for pid, ticks in _engine_daemons().items():
        samples.engine_ticks[pid] = (ticks, ticks)
    while not stop.wait(SAMPLE_S):
        now_ticks, now = _cpu_ticks(), time.time()
        total = now_ticks[1] - before[1]
        busy = (now_ticks[0] - before[0]) / total * cores if total else 0.0
        samples.busy.append((then, now, busy))
        before, then = now_ticks, now
        for pid, ticks in _engine_daemons().items():
            first = samples.engine_ticks.get(pid, (0, 0))[0]  # one that started meanwhile: all
            samples.engine_ticks[pid] = (first, ticks)


@dataclass(frozen=True)
class LaneProfile:
    lane: str
    wall_s: float
    suite_cpu_s: float
    engine_cpu_s: float
    idle_share: float
    verdict: str
    slowest: list[tuple[float, float, str]]
    """(seconds, idle share, node id) of the slowest tests."""


def profile_lane(lane: str, extra: list[str]) -> LaneProfile:
    with tempfile.TemporaryDirectory(prefix="gpu-profile-") as scratch:
        timeline = Path(scratch) / "timeline.jsonl"
        argv = [
            sys.executable, "-m", "pytest", "conformance", "workloads", "-q",
            "-p", "no:cacheprovider", "-p", "bench.timeline", f"--driver={lane}", *SIM, *extra,
        ]  # fmt: skip
        env = {**os.environ, TIMELINE_ENV: str(timeline)}
        samples, stop = Samples(), threading.Event()
        sampler = threading.Thread(target=sample_machine, args=(samples, stop), daemon=True)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        sampler.start()
        start = time.time()
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        end = time.time()
        stop.set()
        sampler.join()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        tests = [json.loads(line) for line in timeline.read_text().splitlines()]
    suite = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    slowest = sorted(tests, key=lambda t: t["end"] - t["start"], reverse=True)[:10]
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(f"{lane}: ")]
    return LaneProfile(
        lane=lane,
        wall_s=end - start,
        suite_cpu_s=suite,
        engine_cpu_s=samples.engine_cpu_s(),
        idle_share=samples.idle_s(start, end) / (end - start),
        verdict=verdicts[-1] if verdicts else done.stdout[-400:],
        slowest=[
            (
                t["end"] - t["start"],
                samples.idle_s(t["start"], t["end"]) / max(t["end"] - t["start"], 1e-9),
                t["nodeid"],
            )
            for t in slowest
        ],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__)
    parser.add_argument("--lanes", default=",".join(LANES), help="comma-separated drivers")
    parser.add_argument("--runs", type=int, default=3, help="runs per lane (median wall time)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest after --")
    args = parser.parse_args(argv)
    print(f"machine: {os.cpu_count()} cores; idle: under {IDLE_BUSY_CORES:g} core busy")
    print(f"{'lane':<12}{'wall s':>9}{'suite CPU s':>13}{'engine CPU s':>14}{'idle':>7}")
    for lane in filter(None, args.lanes.split(",")):
        runs = [profile_lane(lane, args.pytest_args) for _ in range(args.runs)]
        median = statistics.median(run.wall_s for run in runs)
        last = runs[-1]
        print(
            f"{lane:<12}{median:>9.1f}{last.suite_cpu_s:>13.1f}{last.engine_cpu_s:>14.1f}"
            f"{last.idle_share:>7.0%}   (walls: {', '.join(f'{r.wall_s:.1f}' for r in runs)})"
        )
        print(f"    {last.verdict}")
        for seconds, idle, nodeid in last.slowest:
            print(f"    {seconds:6.1f} s  idle {idle:4.0%}  {nodeid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
