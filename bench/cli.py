"""``python -m bench.cli`` (``make bench-cli``): how fast ``gpu-sandbox spec`` starts.

Each command runs ``--runs`` times, the commands in turn run by run so that all see the same
machine load, and the medians are printed side by side with ``python -c pass``, the floor
(the interpreter and the venv's site). Target: ``gpu-sandbox spec`` under 300 ms. Then, from
``python -X importtime``: the engine clients each driver's ``spec`` imported (none is
needed to check a count) and its slowest imports.

Runs on a simulated 8-GPU host of its own, in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from drivers import REGISTRY
from gpuhost import simulated

GPU_SANDBOX = Path(sys.executable).parent / "gpu-sandbox"
ENGINE_CLIENTS = ("docker", "podman", "kubernetes", "requests", "urllib3")
TARGET_MS = 300.0


def medians(
    commands: dict[str, list[str]], runs: int, warm_up: int
) -> dict[str, tuple[float, float]]:
    """Median wall and CPU (user + system) seconds of each command, run in turn run by run.

    The CPU time is what the command itself costs; the wall time grows with the machine's
    load as well.
    """
    timed: dict[str, list[tuple[float, float]]] = {label: [] for label in commands}
    for index in range(warm_up + runs):
        for label, argv in commands.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run(argv, check=True, capture_output=True)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
            if index >= warm_up:
                timed[label].append((wall, cpu))
    return {
        label: (statistics.median(w for w, _ in times), statistics.median(c for _, c in times))
        for label, times in timed.items()
    }


def imports(argv: Sequence[str]) -> list[tuple[str, int, int, int]]:
    """(module, nesting level, own µs, cumulative µs) of each import, from -X importtime."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *argv], check=True, capture_output=True, text=True
    )
    found = []
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line or "self [us]" in line:
            continue
        own, cumulative, name = line.removeprefix("import time:").split("|")
        level = (len(name) - len(name.lstrip()) - 1) // 2
        found.append((name.strip(), level, int(own), int(cumulative)))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cli", description=__doc__)
    parser.add_argument("--runs", type=int, default=20, help="timed runs of each command")
    parser.add_argument("--warm-up", type=int, default=2, help="untimed runs first")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-cli-") as tmp:
        sim = simulated.setup(Path(tmp) / "sim", 8)
        host = f"--sim-root={sim.root}"
        spec = [str(GPU_SANDBOX), "spec", host]
        commands = {
            "python -c pass (the floor)": [sys.executable, "-c", "pass"],
            "gpu-sandbox --help": [str(GPU_SANDBOX), "--help"],
            **{
                f"gpu-sandbox spec --driver={name} --gpu-count=1": [
                    *spec, f"--driver={name}", "--gpu-count=1"
                ]
                for name in REGISTRY
            },
            "gpu-sandbox spec --gpu-device=0 --gpu-device=3": [
                *spec, "--gpu-device=0", "--gpu-device=3"
            ],
        }  # fmt: skip
        print(f"load average before: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
        timed = medians(commands, args.runs, args.warm_up)
        print(f"gpu-sandbox start-up, medians of {args.runs} runs each, interleaved")
        width = max(map(len, timed))
        print(f"  {'':<{width}}  {'wall':>9}  {'CPU':>9}")
        for label, (wall, cpu) in timed.items():
            print(f"  {label:<{width}}  {wall * 1000:6.1f} ms  {cpu * 1000:6.1f} ms")
        worst = max(w for label, (w, _) in timed.items() if label.startswith("gpu-sandbox spec"))
        floor = timed["python -c pass (the floor)"][0]
        print(
            f"  slowest spec: {worst * 1000:.1f} ms wall, {(worst - floor) * 1000:.1f} ms over "
            f"the floor  (target < {TARGET_MS:.0f} ms)"
        )
        print("\nimports of gpu-sandbox spec --gpu-count=1 (python -X importtime, one run)")
        for name in REGISTRY:
            found = imports([str(GPU_SANDBOX), *spec[1:], f"--driver={name}", "--gpu-count=1"])
            clients = sorted({module for module, *_ in found} & set(ENGINE_CLIENTS))
            total = sum(own for _, _, own, _ in found) / 1000
            top = sorted((item for item in found if item[1] == 0), key=lambda item: -item[3])
            slowest = ", ".join(
                f"{module} {cumulative / 1000:.0f}" for module, _, _, cumulative in top[:5]
            )
            engines = ", ".join(clients) or "none"
            print(f"  --driver={name}: {total:.0f} ms in all; engine clients: {engines}")
            print(f"    slowest at the top level (ms, with what they import): {slowest}")
    print(f"load average after: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
