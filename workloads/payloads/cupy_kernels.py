"""CuPy kernels against NumPy: an ElementwiseKernel, a RawKernel built by NVRTC, a reduction.

``python cupy_kernels.py [--cpu] [--elements N] [--seed S]``

Each kernel runs on the same seeded random input as its NumPy reference and must equal it
exactly: the inputs are chosen so that every result is exact in its type (integer-valued
float32 for the fused multiply-add, a single rounding for the vector add, int64 for the
reduction), so "equal" means equal, not "close". The RawKernel is CUDA C compiled by NVRTC
inside the sandbox. ``--cpu`` uses NumPy as the array module and the NumPy equivalent of
each kernel.

Prints one JSON line on stdout ({"workload", "ok", "mode", "metrics", "detail"}) and exits
0 when ok, 1 when not. Standalone: the harness sends it as ``python -c <source> ARGS``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy

VECTOR_ADD = r"""
extern "C" __global__ void vector_add(const float* a, const float* b, float* out, int n) {
    int i = blockDim.x * blockIdx.x + threadIdx.x;
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}
"""
THREADS_PER_BLOCK = 256
SAXPY_A = 3.0


def inputs(elements: int, seed: int) -> dict[str, numpy.ndarray[Any, Any]]:
    rng = numpy.random.default_rng(seed)
    return {
        "x": rng.integers(-1000, 1000, elements).astype(numpy.float32),
        "y": rng.integers(-1000, 1000, elements).astype(numpy.float32),
        "a": rng.standard_normal(elements, dtype=numpy.float32),
        "b": rng.standard_normal(elements, dtype=numpy.float32),
        "k": rng.integers(-(2**20), 2**20, elements, dtype=numpy.int64),
    }


def references(data: dict[str, numpy.ndarray[Any, Any]]) -> dict[str, Any]:
    return {
        "elementwise": numpy.float32(SAXPY_A) * data["x"] + data["y"],
        "raw_vector_add": data["a"] + data["b"],
        "reduction": numpy.sum(data["k"] * data["k"]),
    }


def on_gpu(data: dict[str, numpy.ndarray[Any, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    import cupy

    dev = {name: cupy.asarray(array) for name, array in data.items()}
    saxpy = cupy.ElementwiseKernel(
        "float32 x, float32 y, float32 a", "float32 z", "z = a * x + y", "saxpy"
    )
    vector_add = cupy.RawKernel(VECTOR_ADD, "vector_add", backend="nvrtc")
    sum_of_squares = cupy.ReductionKernel(
        "int64 k", "int64 total", "k * k", "a + b", "total = a", "0", "sum_of_squares"
    )
    n = dev["a"].size
    added = cupy.empty_like(dev["a"])
    blocks = (n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK
    vector_add((blocks,), (THREADS_PER_BLOCK,), (dev["a"], dev["b"], added, numpy.int32(n)))
    results = {
        "elementwise": saxpy(dev["x"], dev["y"], numpy.float32(SAXPY_A)).get(),
        "raw_vector_add": added.get(),
        "reduction": sum_of_squares(dev["k"]).get(),
    }
    info = {"cupy": cupy.__version__, "nvrtc": list(cupy.cuda.nvrtc.getVersion())}
    return results, info


def on_cpu(data: dict[str, numpy.ndarray[Any, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    xp = numpy  # the array module CuPy would be; each kernel's NumPy equivalent
    results = {
        "elementwise": xp.float32(SAXPY_A) * data["x"] + data["y"],
        "raw_vector_add": xp.add(data["a"], data["b"]),
        "reduction": xp.sum(data["k"] * data["k"]),
    }
    return results, {"numpy": numpy.__version__}


def check(elements: int, seed: int, cpu: bool) -> tuple[bool, dict[str, Any], str]:
    data = inputs(elements, seed)
    expected = references(data)
    results, metrics = (on_cpu if cpu else on_gpu)(data)
    metrics.update(elements=elements, seed=seed)
    wrong = []
    for name, want in expected.items():
        got = numpy.asarray(results[name])
        equal = bool(got.shape == numpy.shape(want) and numpy.array_equal(got, want))
        metrics[f"{name}_equal"] = equal
        if not equal:
            mismatches = int(numpy.count_nonzero(got != want)) if got.shape == want.shape else -1
            wrong.append(f"{name} ({mismatches} elements differ)")
    if wrong:
        return False, metrics, "differs from NumPy: " + ", ".join(wrong)
    return True, metrics, "elementwise, raw (NVRTC) and reduction kernels equal NumPy"


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--cpu", action="store_true", help="NumPy as the array module")
    args = parser.parse_args(argv)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr: stdout carries one JSON line
    ok, metrics, detail = check(args.elements, args.seed, args.cpu)
    report = {"workload": "cupy-kernels", "ok": ok, "mode": "cpu" if args.cpu else "cuda"}
    out.write(json.dumps({**report, "metrics": metrics, "detail": detail}) + "\n")
    out.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
