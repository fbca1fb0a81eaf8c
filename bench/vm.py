"""``python -m bench.vm`` (``make bench-vm``): the vm lane's speed and memory, side by side.

1. Sandbox lifecycle: the vm driver's create (default GPU request) + exec ``nvidia-smi -L``
   + close, against a bare ``qemu-system-x86_64`` boot of the same kernel and initramfs,
   with the same simulated GPU at the same address, whose init runs the same command and
   powers off. Interleaved run by run, so both see the same machine load. The driver is
   timed in both of its boot modes: resuming the saved template (the default on simulated
   hosts) and booting cold. Target: at most 1.2x.
2. Boot time: a cold boot to the guest agent, and a resume of the template, alone.
3. Memory: four VMs running at once, each QEMU's proportional set size (PSS, which shares
   out the pages VMs have in common) and resident set size. Target: four fit in 2 GiB.
4. The whole lane, ``pytest conformance --driver=vm`` on a simulated 8-GPU host (two GPUs
   in MIG mode, AMD and Intel GPUs beside them, as ``make conformance`` has): wall time.

Says which acceleration (KVM or TCG) the VMs ran under.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from bench.lane import time_lane
from bench.measure import interleaved_medians, sandbox_lifecycle
from drivers import vm
from drivers.vm import VmDriver
from drivers.vm.qemu import root_ports
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.simulated.pci_proxy import GpuFunction
from gpuhost.spec import SandboxSpec

BARE_TIMEOUT_S = 120.0
"""A bare boot that runs one command and powers off: seconds; minutes mean it hangs."""


def bare_boot(driver: VmDriver, lock_dir: Path) -> None:
    """Boot the guest image with GPU 0 at its address; its init runs nvidia-smi -L, powers off."""
    image = driver.guest_image()
    accel, _ = driver.acceleration()
    gpu = driver.inventory()[0]
    function = GpuFunction.claim(lock_dir, gpu.pci_bus_id)
    fd = function.qemu_socket.fileno()
    with tempfile.TemporaryDirectory(prefix="gpu-bench-vm-") as tmp:
        argv = driver.qemu_argv("bench", image, driver.initrd(image), accel, Path(tmp))
        argv = argv[argv.index("--") + 1 :]  # qemu itself, without setpriv
        argv[argv.index("-append") + 1] += " gpu_sandbox.oneshot=1"
        argv[argv.index("-serial") - 1] = f"file,id=console,path={tmp}/console.log"
        argv += root_ports([gpu.pci_bus_id])
        argv += ["-device", f"x-pci-proxy-dev,id=gpu0,fd={fd},bus=port0,addr=0x0"]
        try:
            done = subprocess.run(
                argv, pass_fds=function.fds(), capture_output=True, timeout=BARE_TIMEOUT_S
            )
        finally:
            function.handed_over()
        console = Path(tmp, "console.log").read_text(errors="replace")
    if done.returncode != 0 or f"(UUID: {gpu.uuid})" not in console:
        raise RuntimeError(f"the bare boot failed ({done.returncode}): {done.stderr!r} {console}")


def memory_of_four(driver: VmDriver) -> list[tuple[int, int]]:
    """(PSS, RSS) in KiB of each QEMU of four VMs running at once, each with a GPU."""
    with ExitStack() as stack:
        vms = [stack.enter_context(driver.create(SandboxSpec.with_gpus())) for _ in range(4)]
        for sandbox in vms:
            sandbox.exec(["nvidia-smi", "-L"]).check()
        return [_pss_rss(sandbox.pid) for sandbox in vms if isinstance(sandbox, vm.VmSandbox)]


def _pss_rss(pid: int) -> tuple[int, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value, *_ = line.split()
        fields[name.rstrip(":")] = int(value)
    return fields["Pss"], fields["Rss"]


def lane(runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        run = time_lane(
            "--driver=vm", "--sim-gpus=8", "--sim-mig=0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb",
            "--sim-dri=intel:1,amd:2",
        )  # fmt: skip
        times.append(run.seconds)
        print(f"   {run.seconds:6.1f} s  {run.verdict('vm')}")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vm", description=__doc__)
    parser.add_argument("--iterations", type=int, default=10, help="lifecycles to time")
    parser.add_argument("--lane-runs", type=int, default=1, help="whole vm lane runs")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="gpu-bench-vm-") as tmp:
        sim = simulated.setup(Path(tmp) / "sim", 8)
        try:
            host = GpuHost.open(HostConfig(sim_root=sim.root))
            session = f"bench-{uuid.uuid4().hex[:8]}"
            driver = VmDriver(host, session)
            availability = driver.probe()
            if not availability.ok:
                sys.exit(f"the vm driver cannot run: {availability.reason}")
            _, why = driver.acceleration()
            print(f"host: {host.describe()}")
            print(f"vm: {driver.version()} ({why}); load average {os.getloadavg()[0]:.1f}")
            try:
                report(driver, args, Path(tmp) / "locks")
            finally:
                driver.reap(session)
        finally:
            simulated.teardown(sim.root)
    if args.lane_runs:
        print("\n4. the whole vm lane (pytest conformance --driver=vm, 8 simulated GPUs)")
        times = lane(args.lane_runs)
        print(f"   median {statistics.median(times):.1f} s")
    return 0


def report(driver: VmDriver, args: argparse.Namespace, locks: Path) -> None:
    print(f"\n1. sandbox lifecycle, median of {args.iterations} (interleaved)")
    driver.template(driver.guest_image(), driver.acceleration()[0])  # made before timing
    for mode in (vm.SNAPSHOT, vm.COLD):
        os.environ[vm.BOOT_ENV] = mode
        ours, bare = interleaved_medians(
            lambda: sandbox_lifecycle(driver),
            lambda: bare_boot(driver, locks),
            args.iterations,
            warm_up=1,
        )
        label = f"driver create + exec nvidia-smi -L + close ({mode})"
        print(f"   {label:<58}{ours:7.2f} s")
        print(f"   {'bare qemu boot running nvidia-smi -L, poweroff':<58}{bare:7.2f} s")
        print(f"   ratio {ours / bare:.2f}x  (target <= 1.2x)")

    print("\n2. boot time, median of 5")
    for mode in (vm.COLD, vm.SNAPSHOT):
        os.environ[vm.BOOT_ENV] = mode
        times = []
        for _ in range(5):
            start = time.perf_counter()
            with driver.create(SandboxSpec.with_gpus()):
                times.append(time.perf_counter() - start)
        print(
            f"   {mode:<10} create, to the guest agent with its GPU: "
            f"{statistics.median(times):.2f} s"
        )
    os.environ.pop(vm.BOOT_ENV, None)

    print("\n3. memory, four VMs running at once (snapshot mode)")
    sizes = memory_of_four(driver)
    for pss, rss in sizes:
        print(f"   qemu: PSS {pss / 1024:6.1f} MiB, RSS {rss / 1024:6.1f} MiB")
    total = sum(pss for pss, _ in sizes) / 1024
    print(f"   four VMs: {total:.0f} MiB PSS (target: within 2048 MiB)")


if __name__ == "__main__":
    sys.exit(main())
