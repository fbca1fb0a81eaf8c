"""``python -m bench.kubernetes`` (``make bench-kubernetes``): the kubernetes lane, side by side.

1. Pod lifecycle: the kubernetes driver's create (default GPU request) + exec
   ``nvidia-smi -L`` + close, against ``kubectl run --rm -i`` of the same pod spec (the
   driver's own manifest, through ``--overrides``) running ``nvidia-smi -L``, which creates
   the pod, waits for it, streams its output and deletes it. Interleaved run by run, so both
   see the same machine load. Target: at most 1.2x.
2. The cluster's memory: the resident set size of each of its processes (etcd, the control
   plane, containerd, the kubelet, the device plugins), idle.
3. The whole lane, ``pytest conformance --driver=kubernetes``: wall time.

Needs the cluster answering (``make cluster``): its kubeconfig, and its kubectl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from bench.lane import time_lane
from bench.measure import interleaved_medians, sandbox_lifecycle
from drivers.kubernetes import DEFAULT_IMAGE, KubernetesDriver, pod_manifest
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig

CLUSTER_DIR = Path("/run/gpu-sandbox-cluster")
KUBECTL = CLUSTER_DIR / "bin" / "kubectl"


def kubectl_run(driver: KubernetesDriver, kubectl: Path) -> None:
    """``kubectl run --rm -i`` of the driver's pod spec, running ``nvidia-smi -L``."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    pod = pod_manifest(
        name=name,
        namespace=driver.namespace,
        labels={"gpu-sandbox.dev/bench": "kubectl"},
        image=DEFAULT_IMAGE,
        env={},
        resource=driver.resource,
        gpus=1,
    )
    pod["spec"]["containers"][0]["command"] = ["nvidia-smi", "-L"]
    pod["spec"]["containers"][0]["stdin"] = True
    pod["spec"]["containers"][0]["stdinOnce"] = True
    subprocess.run(
        [
            str(kubectl), f"--kubeconfig={driver.cluster.kubeconfig}", "run", name,
            f"--namespace={driver.namespace}", f"--image={DEFAULT_IMAGE}", "--restart=Never",
            "--rm", "-i", "--quiet", f"--overrides={json.dumps(pod)}",
        ],
        check=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def cluster_memory() -> dict[str, int]:
    """RSS in KiB of each process the cluster's set-up started, by its pid files."""
    found: dict[str, int] = {}
    for pidfile in sorted(CLUSTER_DIR.glob("**/*.pid")):
        try:
            pid = int(pidfile.read_text().split()[0])
            status = Path(f"/proc/{pid}/status").read_text()
        except (OSError, ValueError, IndexError):
            continue
        rss = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
        found[pidfile.stem] = int(rss.split()[1])
    return found


def lane(sim_root: Path) -> tuple[float, str]:
    run = time_lane("--driver=kubernetes", f"--sim-root={sim_root}")
    return run.seconds, run.verdict("kubernetes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kubernetes", description=__doc__)
    parser.add_argument("--iterations", type=int, default=10, help="lifecycles to time")
    parser.add_argument("--lane-runs", type=int, default=1, help="whole lane runs (0: none)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu-bench-k8s-") as tmp:
        sim = simulated.setup(Path(tmp) / "sim", 2)
        try:
            host = GpuHost.open(HostConfig(sim.root))
            driver = KubernetesDriver(host, f"bench-{uuid.uuid4().hex[:8]}")
            availability = driver.probe()
            if not availability.ok:
                sys.exit(f"the kubernetes driver cannot run: {availability.reason}")
            print(f"kubernetes: {driver.version()}; load average {os.getloadavg()[0]:.1f}")
            print(f"\n1. pod lifecycle, median of {args.iterations} (interleaved)")
            ours, theirs = interleaved_medians(
                lambda: sandbox_lifecycle(driver),
                lambda: kubectl_run(driver, KUBECTL),
                args.iterations,
                warm_up=2,
            )
            print(f"   {'driver: create + exec nvidia-smi -L + close':<52}{ours:7.2f} s")
            print(f"   {'kubectl run --rm -i (same pod spec) nvidia-smi -L':<52}{theirs:7.2f} s")
            print(f"   ratio {ours / theirs:.2f}x  (target <= 1.2x)")
            print("\n2. the cluster's memory, idle (RSS)")
            memory = cluster_memory()
            for name, kib in memory.items():
                print(f"   {name:<28}{kib / 1024:8.1f} MiB")
            print(f"   {'in all':<28}{sum(memory.values()) / 1024:8.1f} MiB")
            if args.lane_runs:
                print("\n3. the whole kubernetes lane (pytest conformance --driver=kubernetes)")
                times = []
                for _ in range(args.lane_runs):
                    took, verdict = lane(sim.root)
                    times.append(took)
                    print(f"   {took:6.1f} s  {verdict}")
                print(f"   median {statistics.median(times):.1f} s")
            driver.reap(driver.session_id)
        finally:
            simulated.teardown(sim.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
