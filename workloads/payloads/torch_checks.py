"""PyTorch workloads: matmul against NumPy, device memory and copy bandwidth, multi-GPU.

``python torch_checks.py matmul [--size N] [--seed S] [--reps R] [--cpu]``
    fp32 and bf16 matmul of the same seeded random inputs, each checked against the float64
    NumPy product of those inputs (as rounded to the type): relative error in the Frobenius
    norm at most 1e-4 for fp32 (TF32 off: TF32 would miss it) and 1e-2 for bf16, over the
    first rows of the product. Reports TFLOP/s (median of the repetitions, 2n^3 flops).
``python torch_checks.py memory [--share F] [--copy-mib M] [--reps R] [--cpu]``
    Allocates the share F (default 0.5) of the device's memory and checks it holds a
    pattern, then times device-to-device copies; GB/s counts bytes read plus bytes written,
    as CUDA's bandwidthTest does. Each copy must equal its source.
``python torch_checks.py multi-gpu --world N [--cpu]``
    A copy from each GPU to the next (peer copy), checked exactly, then an NCCL all-reduce
    with one process per GPU, checked exactly (small integers in float32 sum exactly).

``--cpu`` runs the same numerics on the CPU (gloo instead of NCCL; a nominal 512 MiB
"device" for memory) so that the suite's own tests can run without a GPU.

Prints one JSON line on stdout ({"workload", "ok", "mode", "metrics", "detail"}) and exits
0 when ok, 1 when not. Standalone: the harness sends it as ``python -c <source> ARGS``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy
import torch

Check = tuple[bool, dict[str, Any], str]
TOLERANCES = {"float32": 1e-4, "bfloat16": 1e-2}
CHECKED_ROWS = 256
"""Rows of the product checked against float64 NumPy: the whole product would cost the CPU
more than the GPU's matmul by orders of magnitude."""
CPU_DEVICE_BYTES = 512 << 20
PATTERN = 0xA5
CHECK_CHUNK_BYTES = 256 << 20
"""The pattern is compared a chunk at a time: a comparison of the whole block would need a
second block as large for its result, which half of the device's memory leaves no room for
(seen on an H100: 39.6 GiB allocated, then out of memory)."""


def device(args: argparse.Namespace, index: int = 0) -> torch.device:
    return torch.device("cpu" if args.cpu else f"cuda:{index}")


def timed(action: Callable[[], object], *devices: torch.device) -> float:
    """Seconds ``action`` takes, waiting for the work it queued on ``devices`` to finish."""
    cuda = [dev for dev in devices if dev.type == "cuda"]
    for dev in cuda:
        torch.cuda.synchronize(dev)
    start = time.perf_counter()
    action()
    for dev in cuda:
        torch.cuda.synchronize(dev)
    return time.perf_counter() - start


def relative_error(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """||got - a@b|| / ||a@b|| over the first rows, against float64 NumPy."""
    rows = min(CHECKED_ROWS, a.shape[0])
    reference = a[:rows].double().cpu().numpy() @ b.double().cpu().numpy()
    diff = got[:rows].double().cpu().numpy() - reference
    return float(numpy.linalg.norm(diff) / numpy.linalg.norm(reference))


def time_matmul(a: torch.Tensor, b: torch.Tensor, reps: int) -> tuple[torch.Tensor, float]:
    """The product and the median seconds of ``reps`` timed matmuls, after a warm-up."""
    product = a @ b  # cuBLAS picks its kernel here
    times = [timed(lambda: torch.matmul(a, b, out=product), a.device) for _ in range(reps)]
    return product, statistics.median(times)


def matmul(args: argparse.Namespace) -> Check:
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = device(args)
    n = args.size or (768 if args.cpu else 8192)
    generator = torch.Generator().manual_seed(args.seed)
    a64 = torch.randn(n, n, generator=generator, dtype=torch.float64)
    b64 = torch.randn(n, n, generator=generator, dtype=torch.float64)
    metrics: dict[str, Any] = {"size": n, "seed": args.seed, "tolerances": TOLERANCES}
    failed = []
    for name, tolerance in TOLERANCES.items():
        dtype = getattr(torch, name)
        a, b = a64.to(dtype).to(dev), b64.to(dtype).to(dev)
        product, seconds = time_matmul(a, b, args.reps)
        error = relative_error(product, a, b)
        metrics[f"{name}_tflops"] = 2 * n**3 / seconds / 1e12
        metrics[f"{name}_rel_err"] = error
        if not error <= tolerance:
            failed.append(f"{name} relative error {error:.2e} > {tolerance:g}")
    if failed:
        return False, metrics, "; ".join(failed)
    return True, metrics, f"fp32 and bf16 {n}x{n} matmul within tolerance of float64 NumPy"


def memory(args: argparse.Namespace) -> Check:
    dev = device(args)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
    else:
        free = total = CPU_DEVICE_BYTES
    want = int(total * args.share)
    metrics: dict[str, Any] = {"total_bytes": total, "free_bytes": free, "share": args.share}
    if want > free:
        return False, metrics, f"{args.share:.0%} of {total} bytes wanted, {free} free"
    block = torch.empty(want, dtype=torch.uint8, device=dev).fill_(PATTERN)
    chunks = range(0, want, CHECK_CHUNK_BYTES)
    held = all(bool((block[i : i + CHECK_CHUNK_BYTES] == PATTERN).all()) for i in chunks)
    metrics["allocated_bytes"] = block.numel()
    del block
    copy_bytes = args.copy_mib << 20
    source = torch.randint(-(2**31), 2**31 - 1, (copy_bytes // 4,), dtype=torch.int32, device=dev)
    target = torch.empty_like(source)
    target.copy_(source)
    times = [timed(lambda: target.copy_(source), dev) for _ in range(args.reps)]
    copied = bool(torch.equal(target, source))
    metrics["copy_bytes"] = copy_bytes
    metrics["d2d_gbps"] = 2 * copy_bytes / statistics.median(times) / 1e9
    if not (held and copied):
        return False, metrics, f"allocation held its pattern: {held}; copy equal: {copied}"
    return True, metrics, f"allocated {want} bytes ({args.share:.0%}); copies equal"


def all_reduce_rank(rank: int, world: int, rendezvous: str, cpu: bool) -> None:
    """One rank of the all-reduce; raises (and so fails the parent) on a wrong sum."""
    import torch.distributed as dist

    backend = "gloo" if cpu else "nccl"
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world)
    try:
        dev = torch.device("cpu" if cpu else f"cuda:{rank}")
        base = torch.arange(1 << 20, device=dev, dtype=torch.float32).remainder(1024).add(1)
        tensor = base * (rank + 1)
        dist.all_reduce(tensor)
        expected = base * (world * (world + 1) // 2)
        if not torch.equal(tensor, expected):
            wrong = int((tensor != expected).sum())
            raise AssertionError(f"rank {rank}: {wrong} elements of the all-reduce are wrong")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, rendezvous: str, cpu: bool) -> list[int | None]:
    """Fork one process per rank; when one fails, kill the rest (they would wait forever)."""
    context = multiprocessing.get_context("fork")
    ranks = [
        context.Process(target=all_reduce_rank, args=(rank, world, rendezvous, cpu))
        for rank in range(world)
    ]
    for rank in ranks:
        rank.start()
    running = list(ranks)
    while running:
        multiprocessing.connection.wait([rank.sentinel for rank in running])
        running = [rank for rank in running if rank.exitcode is None]
        if any(rank.exitcode for rank in ranks):
            for rank in running:
                rank.kill()
    for rank in ranks:
        rank.join()
    return [rank.exitcode for rank in ranks]


def peer_copy(
    chunk: torch.Tensor, source: torch.device, target: torch.device
) -> tuple[float, bool]:
    """GB/s of a copy of ``chunk`` from ``source`` to ``target``, and whether it was exact."""
    on_source = chunk.to(source)
    seconds = timed(lambda: on_source.to(target, copy=True), source, target)
    copied = on_source.to(target, copy=True)
    return chunk.numel() * chunk.element_size() / seconds / 1e9, torch.equal(copied.cpu(), chunk)


def multi_gpu(args: argparse.Namespace) -> Check:
    # Every rank is on this machine: loopback is the one network they need, and the
    # sandbox may have no other.
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    metrics: dict[str, Any] = {"world": args.world, "backend": "gloo" if args.cpu else "nccl"}
    if args.world < 2:
        return False, metrics, f"multi-gpu needs at least 2 GPUs, got --world {args.world}"
    # The ranks are forked before this process touches CUDA (a forked child cannot use a
    # CUDA context its parent made), and forked because under `python -c` the spawn start
    # method has no module to import the rank's function from.
    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = f"file://{tmp}/rendezvous"
        start = time.perf_counter()
        exits = run_ranks(args.world, rendezvous, args.cpu)
        metrics["all_reduce_s"] = time.perf_counter() - start
    if any(exits):
        return False, metrics, f"all-reduce failed, rank exit codes {exits} (stderr has why)"
    chunk = torch.arange(1 << 24, dtype=torch.int32)
    for index in range(args.world):
        source, target = device(args, index), device(args, (index + 1) % args.world)
        if source.type == "cuda":
            metrics[f"peer_access_{index}"] = torch.cuda.can_device_access_peer(source, target)
        gbps, exact = peer_copy(chunk, source, target)
        if not exact:
            return False, metrics, f"the copy from {source} to {target} differs"
        metrics[f"peer_copy_{index}_gbps"] = gbps
    return True, metrics, f"all-reduce over {args.world} ranks and peer copies exact"


CHECKS: dict[str, Callable[[argparse.Namespace], Check]] = {
    "matmul": matmul,
    "memory": memory,
    "multi-gpu": multi_gpu,
}


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--cpu", action="store_true", help="compute on the CPU")
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions")
    parser.add_argument("--size", type=int, default=0, help="matmul: n (default 8192, 768 on CPU)")
    parser.add_argument("--share", type=float, default=0.5, help="memory: share to allocate")
    parser.add_argument("--copy-mib", type=int, default=0, help="memory: bytes per copy, MiB")
    parser.add_argument("--world", type=int, default=2, help="multi-gpu: ranks, one per GPU")
    args = parser.parse_args(argv)
    args.copy_mib = args.copy_mib or (64 if args.cpu else 1024)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr: stdout carries one JSON line
    ok, metrics, detail = CHECKS[args.check](args)
    report = {"workload": f"torch-{args.check}", "ok": ok, "mode": "cpu" if args.cpu else "cuda"}
    out.write(json.dumps({**report, "metrics": metrics, "detail": detail}) + "\n")
    out.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
