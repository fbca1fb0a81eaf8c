"""``python -m bench.lanes`` (``make bench-lanes``): one run against lanes side by side.

The five lanes in one pytest run, one after the other (``make conformance`` until
2026-11-27), against ``python -m conformance.lanes`` running them side by side. On the gate's
simulated layout, with the engines and the cluster up. Each round runs every
form once, in turn, so that a slow spell of a shared machine falls on each; printed per form:
the median wall time of ``--runs`` rounds, its ratio to the one run's, the idle share of its
last run (the whole machine under a tenth of a core busy) and each driver's verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.lane import ROOT
from bench.profile import IDLE_BUSY_CORES, SIM, Samples, sample_machine

ONE_RUN = "one run"


def run_form(form: str, extra: list[str]) -> tuple[float, float, dict[str, str]]:
    """(wall seconds, idle share, driver → verdict status) of one run of ``form``."""
    with tempfile.TemporaryDirectory(prefix="gpu-bench-lanes-") as scratch:
        report = Path(scratch) / "conformance.json"
        common = ["conformance", "workloads", "-p", "no:cacheprovider", *SIM, *extra]
        if form == ONE_RUN:
            argv = [sys.executable, "-m", "pytest", "-q", *common]
        else:
            jobs = form.removeprefix("lanes --jobs=")
            lane_dir = f"--lane-dir={scratch}/lanes"
            argv = [sys.executable, "-m", "conformance.lanes", f"--jobs={jobs}", lane_dir, *common]
        samples, stop = Samples(), threading.Event()
        sampler = threading.Thread(target=sample_machine, args=(samples, stop), daemon=True)
        sampler.start()
        start = time.time()
        subprocess.run(
            [*argv, f"--conformance-json={report}"],
            cwd=ROOT,
            capture_output=True,
            check=False,
        )
        end = time.time()
        stop.set()
        sampler.join()
        try:
            verdicts = json.loads(report.read_text())["verdicts"]
        except (OSError, ValueError):
            verdicts = {}
    statuses = {driver: str(verdict["status"]) for driver, verdict in verdicts.items()}
    return end - start, samples.idle_s(start, end) / (end - start), statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lanes", description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="rounds (median wall time)")
    parser.add_argument("--jobs", default="2,3", help="conformance.lanes --jobs to compare")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest after --")
    args = parser.parse_args(argv)
    forms = [ONE_RUN, *(f"lanes --jobs={jobs}" for jobs in args.jobs.split(",") if jobs)]
    walls: dict[str, list[float]] = {form: [] for form in forms}
    last: dict[str, tuple[float, dict[str, str]]] = {}
    print(f"machine: {os.cpu_count()} cores; idle: under {IDLE_BUSY_CORES:g} core busy")
    for round_ in range(1, args.runs + 1):
        for form in forms:
            wall, idle, verdicts = run_form(form, args.pytest_args)
            walls[form].append(wall)
            last[form] = (idle, verdicts)
            print(f"round {round_}: {form}: {wall:.1f} s", flush=True)
    baseline = statistics.median(walls[ONE_RUN])
    print(f"{'form':<16}{'median s':>10}{'ratio':>8}{'idle':>7}   walls; verdicts")
    for form in forms:
        median = statistics.median(walls[form])
        idle, verdicts = last[form]
        shown = ", ".join(f"{driver} {status}" for driver, status in verdicts.items())
        print(
            f"{form:<16}{median:>10.1f}{median / baseline:>8.2f}{idle:>7.0%}   "
            f"{', '.join(f'{wall:.1f}' for wall in walls[form])}; {shown or 'no report'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
