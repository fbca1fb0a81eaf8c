"""CUDA init: the framework sees exactly the sandbox's GPUs, by UUID, and runs a kernel on each.

``python cuda_init.py --framework torch|cupy --expect-uuids GPU-a,GPU-b [--cpu]``

Checks that CUDA is available, that the device count equals the number of GPUs assigned,
that every device's UUID is one of them (no device twice), and that a small kernel gives
the right answer on every device: ``nvidia-smi`` working is no proof that CUDA does.
``--cpu`` imports the framework (NumPy stands in for CuPy) and computes on the CPU; no
device is checked.

Prints one JSON line on stdout ({"workload", "ok", "mode", "metrics", "detail"}) and exits
0 when ok, 1 when not. Standalone: the harness sends it as ``python -c <source> ARGS``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

Check = tuple[bool, dict[str, Any], str]
KERNEL_ELEMENTS = 1024


def device_uuid(raw: object) -> str:
    """A CUDA device UUID in nvidia-smi's form, ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``.

    torch gives the bare 36-character form, CuPy the raw bytes; MIG instances keep their
    ``MIG-`` prefix. CuPy converts the 16-byte array as a C string, so its bytes stop at the
    first zero byte (and may run past the 16th): a short UUID gets that zero byte back and
    ``?`` for each digit it lost, which ``compare_devices`` lets match any digit.
    """
    if isinstance(raw, bytes | bytearray):
        known = bytes(raw[:16])
        text = known.hex() if len(known) == 16 else (known + b"\0").hex().ljust(32, "?")
        raw = f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
    text = str(raw).strip().lower()
    if text.startswith(("gpu-", "mig-")):
        return text[:3].upper() + text[3:]
    return f"GPU-{text}"


def compare_devices(seen: Sequence[str], assigned: Sequence[str]) -> tuple[bool, str]:
    """Whether the devices CUDA shows are exactly the GPUs assigned, compared by UUID.

    By the UUID's digits alone: CUDA gives a MIG instance's UUID without saying it is one,
    so ``GPU-x`` from CUDA is the instance nvidia-smi calls ``MIG-x``.
    """
    wanted = [_digits(uuid) for uuid in assigned]
    strangers = [
        uuid for uuid in seen if not any(fnmatch.fnmatchcase(w, _digits(uuid)) for w in wanted)
    ]
    if strangers:
        return False, f"CUDA shows {strangers}, not assigned to this sandbox ({list(assigned)})"
    if len(set(seen)) != len(seen):
        return False, f"CUDA shows one GPU twice: {list(seen)}"
    if len(seen) != len(assigned):
        return False, f"CUDA shows {len(seen)} devices {list(seen)}, {len(assigned)} assigned"
    return True, f"CUDA shows exactly the {len(seen)} assigned GPU(s)"


def _digits(uuid: str) -> str:
    return uuid.lower().removeprefix("gpu-").removeprefix("mig-")


def torch_devices(cpu: bool) -> tuple[list[str], list[bool], dict[str, Any]]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if cpu:
        total = torch.ones(KERNEL_ELEMENTS).mul(2).sum().item()
        return [], [total == 2 * KERNEL_ELEMENTS], info
    info["available"] = torch.cuda.is_available()
    if not info["available"]:
        return [], [], info
    seen, kernels = [], []
    for index in range(torch.cuda.device_count()):
        seen.append(device_uuid(torch.cuda.get_device_properties(index).uuid))
        ones = torch.ones(KERNEL_ELEMENTS, device=f"cuda:{index}")
        kernels.append(ones.mul(2).sum().item() == 2 * KERNEL_ELEMENTS)
    return seen, kernels, info


def cupy_devices(cpu: bool) -> tuple[list[str], list[bool], dict[str, Any]]:
    import numpy

    if cpu:
        total = (numpy.ones(KERNEL_ELEMENTS) * 2).sum()
        return [], [bool(total == 2 * KERNEL_ELEMENTS)], {"numpy": numpy.__version__}
    import cupy

    runtime = cupy.cuda.runtime
    info: dict[str, Any] = {"cupy": cupy.__version__, "cuda": runtime.runtimeGetVersion()}
    seen, kernels = [], []
    for index in range(runtime.getDeviceCount()):
        seen.append(device_uuid(runtime.getDeviceProperties(index)["uuid"]))
        with cupy.cuda.Device(index):
            kernels.append(int((cupy.ones(KERNEL_ELEMENTS) * 2).sum()) == 2 * KERNEL_ELEMENTS)
    info["available"] = bool(seen)
    return seen, kernels, info


FRAMEWORKS: dict[str, Callable[[bool], tuple[list[str], list[bool], dict[str, Any]]]] = {
    "torch": torch_devices,
    "cupy": cupy_devices,
}


def check(framework: str, assigned: Sequence[str], cpu: bool) -> Check:
    seen, kernels, metrics = FRAMEWORKS[framework](cpu)
    metrics.update(device_count=len(seen), uuids=seen, kernels_ok=kernels)
    if cpu:
        return all(kernels), metrics, "cpu mode: the framework ran on the CPU; no device checked"
    if not seen:
        return False, metrics, f"{framework} finds no CUDA device ({len(assigned)} assigned)"
    ok, detail = compare_devices(seen, assigned)
    if ok and not all(kernels):
        ok, detail = False, f"a kernel gave a wrong answer on device(s) {kernels}"
    return ok, metrics, detail


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--framework", choices=sorted(FRAMEWORKS), required=True)
    parser.add_argument("--expect-uuids", default="", help="the assigned GPUs, comma-separated")
    parser.add_argument("--cpu", action="store_true", help="compute on the CPU; check no device")
    args = parser.parse_args(argv)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr: stdout carries one JSON line
    assigned = [uuid for uuid in args.expect_uuids.split(",") if uuid]
    ok, metrics, detail = check(args.framework, assigned, args.cpu)
    mode = "cpu" if args.cpu else "cuda"
    report = {"workload": f"cuda-init-{args.framework}", "ok": ok, "mode": mode}
    out.write(json.dumps({**report, "metrics": metrics, "detail": detail}) + "\n")
    out.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
