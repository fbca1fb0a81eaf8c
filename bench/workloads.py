"""``python -m bench.workloads`` (``make bench-workloads``): workload throughput, sandbox vs bare.

Runs the matmul and copy payloads of workloads/manifest.yaml (``torch-matmul``,
``torch-memory``) inside a reference sandbox holding one GPU and on the bare host, run by
run interleaved so that both see the same machine load, and prints for each metric the
medians, the in-sandbox/bare ratio, and the sandbox's median as a share of the peak:
the best value observed on the bare host in this run, not a datasheet figure.

With NVIDIA GPUs the payloads run on CUDA, the bare runs limited to the sandbox's GPU.
Without, their CPU mode runs, inside a sandbox on a simulated host of its own, and the
output says so: the figures then measure what the sandbox costs CPU work, not a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path

from drivers.base import Sandbox
from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec
from workloads.harness import PASS, Outcome, run_in_sandbox, run_on_host
from workloads.manifest import Workload, load_manifest

METRICS = {
    "torch-matmul": {
        "float32_tflops": "fp32 matmul, TFLOP/s",
        "bfloat16_tflops": "bf16 matmul, TFLOP/s",
    },
    "torch-memory": {"d2d_gbps": "device-to-device copy, GB/s"},
}
Samples = dict[str, dict[str, list[float]]]
"""metric -> "bare" or "sandbox" -> one value per repetition."""


def measure(
    sandbox: Sandbox, workloads: list[Workload], reps: int, cpu: bool, env: Mapping[str, str]
) -> Samples:
    samples: Samples = {
        metric: {"bare": [], "sandbox": []} for w in workloads for metric in METRICS[w.name]
    }
    uuids = [gpu.uuid for gpu in sandbox.gpus]
    for rep in range(reps):
        for workload in workloads:
            # Alternate which goes first, so that neither always runs on a warmer machine.
            order = ("sandbox", "bare") if rep % 2 == 0 else ("bare", "sandbox")
            for where in order:
                if where == "sandbox":
                    outcome = run_in_sandbox(sandbox, workload, sys.executable, cpu)
                else:
                    outcome = run_on_host(workload, sys.executable, uuids, cpu, env)
                _check(outcome, where)
                for metric in METRICS[workload.name]:
                    samples[metric][where].append(float(outcome.metrics[metric]))
    return samples


def _check(outcome: Outcome, where: str) -> None:
    if outcome.verdict != PASS:
        sys.exit(f"the {where} run failed:\n{outcome.explain()}")


def _load() -> str:
    """The machine's load average: other work on the machine moves CPU-mode figures."""
    return "load average " + " ".join(f"{load:.1f}" for load in os.getloadavg())


def report(samples: Samples, labels: Mapping[str, str]) -> list[str]:
    lines = [f"{'metric':32} {'bare':>10} {'sandbox':>10} {'sandbox/bare':>13} {'% of peak':>10}"]
    for metric, runs in samples.items():
        bare, inside = statistics.median(runs["bare"]), statistics.median(runs["sandbox"])
        peak = max(runs["bare"])
        lines.append(
            f"{labels[metric]:32} {bare:10.4g} {inside:10.4g} {inside / bare:12.2f}x "
            f"{inside / peak:10.0%}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__)
    parser.add_argument("--reps", type=int, default=5, help="runs of each payload, each place")
    parser.add_argument("--cpu", action="store_true", help="the CPU mode even with GPUs here")
    parser.add_argument(
        "--timed", type=int, default=20, help="timed repetitions inside each payload run"
    )
    args = parser.parse_args(argv)
    workloads = [
        dataclasses.replace(w, args=(*w.args, "--reps", str(args.timed)))
        for w in load_manifest()
        if w.name in METRICS
    ]
    labels = {metric: label for names in METRICS.values() for metric, label in names.items()}

    with tempfile.TemporaryDirectory(prefix="gpu-bench-workloads-") as tmp:
        host = None if args.cpu else GpuHost.open(HostConfig())
        cpu = host is None or host.simulated is not None or not host.gpus
        if cpu:
            sim = simulated.setup(Path(tmp) / "sim", 1)
            host = GpuHost.open(HostConfig(sim_root=sim.root))
        assert host is not None
        session = f"bench-workloads-{uuid.uuid4().hex[:8]}"
        driver = ReferenceDriver(host, session)
        availability = driver.probe()
        if not availability.ok:
            sys.exit(f"the reference driver cannot run here: {availability.reason}")
        if cpu:
            print(
                "CPU MODE: no NVIDIA GPU on this machine, so the payloads' CPU mode ran "
                "(torch on the CPU, in a sandbox on a simulated GPU host). These figures "
                "measure what the sandbox costs CPU work; they say nothing of a GPU."
            )
        print(f"host: {host.describe()}; {os.cpu_count()} CPUs; {_load()}")
        try:
            with driver.create(SandboxSpec.with_gpus()) as sandbox:
                env = dict(driver.sandbox_env({}))
                if not cpu:
                    env["CUDA_VISIBLE_DEVICES"] = sandbox.gpus[0].uuid  # the same GPU, bare
                samples = measure(sandbox, workloads, args.reps, cpu, env)
        finally:
            driver.reap(session)
    print(
        f"payloads: {', '.join(w.describe() for w in workloads)}\n"
        f"{args.reps} runs of each, in the sandbox and bare, interleaved; each value is a run's "
        "median of its timed repetitions; the table shows the medians of the runs"
    )
    for line in report(samples, labels):
        print(f"  {line}")
    print(f"peak = the best value observed on the bare host in this run; at the end, {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
