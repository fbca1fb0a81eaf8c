"""``python -m bench.external`` (``make bench-external``): the external adapter's overhead.

Each driver makes the same lifecycle ``--runs`` times, the drivers in turn run by run so
that all see the same machine load: create (one GPU), exec (``true``), close. The median of
each operation is printed per driver, and the external drivers' beside the reference
driver's own: jsonl-jail (jail.py's jails behind the jsonl protocol) and a templates
manifest of ``sh`` commands (the adapter's floor: a process per operation, nothing else).

Runs on a simulated 4-GPU host of its own, in a temporary directory.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import yaml

from drivers import get_driver_class
from drivers.base import Driver
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec

ROOT = Path(__file__).parent.parent
OPERATIONS = ("create", "exec", "close")


def sh_manifest(state: Path) -> dict[str, object]:
    """The floor: a sandbox is a file; exec runs ``env`` on this host."""
    d = f"{state}/{{session_id}}"
    return {
        "apiVersion": "gpu-sandbox.dev/v1alpha1", "kind": "Driver", "name": "sh-bench",
        "mode": "templates", "allocation": "host-registry", "sandboxId": "adapter",
        "capabilities": {"maxGpusPerSandbox": 1, "exactIds": True, "idForms": ["uuid"]},
        "templates": {
            "create": ["sh", "-c", f"mkdir -p {d} && touch {d}/{{sandbox_id}}", "c", "{@device}"],
            "exec": ["env"],
            "close": ["rm", "-f", f"{d}/{{sandbox_id}}"],
            "list": ["sh", "-c", f"ls {d} 2>/dev/null || true"],
            "reap": ["rm", "-rf", d],
        },
        "fragments": {"device": ["{device_id}"]},
    }  # fmt: skip


def lifecycle(driver: Driver) -> dict[str, float]:
    """Seconds of each operation of one sandbox's life."""
    times = {}
    start = time.perf_counter()
    sandbox = driver.create(SandboxSpec.with_gpus())
    times["create"] = time.perf_counter() - start
    start = time.perf_counter()
    sandbox.exec(["true"]).check()
    times["exec"] = time.perf_counter() - start
    start = time.perf_counter()
    sandbox.close()
    times["close"] = time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warm-up", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sim = simulated.setup(Path(tmp) / "sim", 4)
        try:
            host = GpuHost.open(HostConfig(sim.root))
            sh = Path(tmp) / "sh-bench.yaml"
            sh.write_text(yaml.safe_dump(sh_manifest(Path(tmp) / "sb")))
            names = {
                "reference": "reference",
                "exec:jsonl-jail": f"exec:{ROOT / 'examples' / 'drivers' / 'jsonl-jail.yaml'}",
                "exec:sh (templates)": f"exec:{sh}",
            }
            drivers = {
                label: get_driver_class(n)(host, "bench-external") for label, n in names.items()
            }
            timed: dict[str, list[dict[str, float]]] = {label: [] for label in drivers}
            for index in range(args.warm_up + args.runs):
                for label, driver in drivers.items():
                    times = lifecycle(driver)
                    if index >= args.warm_up:
                        timed[label].append(times)
            for driver in drivers.values():
                driver.reap("bench-external")
        finally:
            simulated.teardown(sim.root)
    medians = {
        label: {op: statistics.median(t[op] for t in runs) * 1000 for op in OPERATIONS}
        for label, runs in timed.items()
    }
    reference = medians["reference"]
    print(f"median ms of {args.runs} runs (after {args.warm_up} warm-up), simulated 4-GPU host")
    print(f"{'driver':22}" + "".join(f"{op:>18}" for op in OPERATIONS))
    for label, ms in medians.items():
        cells = "".join(
            f"{ms[op]:9.1f} ({ms[op] - reference[op]:+6.1f})" if label != "reference"
            else f"{ms[op]:18.1f}" for op in OPERATIONS
        )  # fmt: skip
        print(f"{label:22}{cells}")
    print("(in brackets: the difference from the reference driver's own median)")


if __name__ == "__main__":
    main()
