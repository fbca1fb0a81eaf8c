"""``python -m bench.exec_memory`` (``make bench-exec-memory``): what a loud payload costs.

A payload prints ``--bytes`` (1 GB by default) on stdout through ``exec``; each driver is
measured in a fresh process of its own, whose peak resident memory (``ru_maxrss``) is read
once its sandbox is up and again once the exec has returned: the difference is what the
output made the runner hold. Drivers: the reference driver, jsonl-jail (jail.py's jails
behind the jsonl protocol, the output crossing as base64 events) and a templates manifest
whose exec runs on this host (the adapter's own pipes).

Runs on a simulated 2-GPU host of its own, in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.external import sh_manifest
from drivers import get_driver_class
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec

ROOT = Path(__file__).parent.parent
SESSION = "bench-exec-memory"


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(name: str, sim_root: Path, size: int) -> dict[str, float]:
    """One driver's exec of ``size`` bytes of output, in this process."""
    driver = get_driver_class(name)(GpuHost.open(HostConfig(sim_root)), SESSION)
    try:
        with driver.create(SandboxSpec.with_gpus()) as sandbox:
            sandbox.exec(["true"]).check()
            before = peak_mib()
            start = time.perf_counter()
            result = sandbox.exec(["head", "-c", str(size), "/dev/zero"], timeout=600)
            seconds = time.perf_counter() - start
            after = peak_mib()
            kept = len(result.stdout)
            cut = getattr(result, "stdout_cut", 0)
            del result
    finally:
        driver.reap(SESSION)
    return {"before": before, "after": after, "seconds": seconds, "kept": kept, "cut": cut}


def drivers(tmp: Path) -> dict[str, str]:
    """The drivers measured, by label: their ``--driver`` names (a manifest written in ``tmp``)."""
    sh = tmp / "sh-bench.yaml"
    sh.write_text(yaml.safe_dump(sh_manifest(tmp / "sb")))
    return {
        "reference": "reference",
        "exec:jsonl-jail": f"exec:{ROOT / 'examples' / 'drivers' / 'jsonl-jail.yaml'}",
        "exec:sh (templates)": f"exec:{sh}",
    }


def measure_apart(name: str, sim_root: Path, size: int) -> dict[str, float]:
    """``measure`` in a fresh process: its peak is this driver's alone."""
    one = [sys.executable, "-m", "bench.exec_memory", f"--bytes={size}", "--one", name]
    done = subprocess.run(
        [*one, str(sim_root)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {done.stderr.strip()[-2000:]}")
    measured: dict[str, float] = json.loads(done.stdout)
    return measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=10**9, help="the payload's output")
    parser.add_argument("--one", nargs=2, metavar=("DRIVER", "SIM_ROOT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], Path(args.one[1]), args.bytes)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        sim = simulated.setup(Path(tmp) / "sim", 2)
        try:
            print(f"exec of a payload printing {args.bytes:,} bytes on stdout; peak RSS, MiB")
            print(f"{'driver':22}{'before':>10}{'after':>10}{'held':>10}{'seconds':>10}  kept, cut")
            for label, name in drivers(Path(tmp)).items():
                try:
                    m = measure_apart(name, sim.root, args.bytes)
                except RuntimeError as exc:
                    print(f"{label:22}failed: {exc}")
                    continue
                held = m["after"] - m["before"]
                print(
                    f"{label:22}{m['before']:10.0f}{m['after']:10.0f}{held:10.0f}"
                    f"{m['seconds']:10.1f}  {m['kept']:,}, {m['cut']:,}"
                )
        finally:
            simulated.teardown(sim.root)


if __name__ == "__main__":
    main()
