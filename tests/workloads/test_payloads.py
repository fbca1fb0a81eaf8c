"""The payloads' CPU mode and the harness's judgement, without a GPU.

Every payload of the manifest runs here in ``--cpu`` mode on the bare host, through the
same argv (``python -c <source>``) and the same judgement as in a sandbox, so that payload
code, the JSON contract and the verdicts are exercised on machines with no GPU.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conformance.observe import parse_list
from drivers.base import ExecResult
from workloads.harness import ERROR, FAIL, PASS, judge, run_on_host
from workloads.manifest import MANIFEST, PAYLOADS, Workload, load_manifest

DISCOVERY = Path(__file__).parents[1] / "data" / "discovery"
WORKLOADS = {workload.name: workload for workload in load_manifest(MANIFEST)}
FAKE_UUIDS = (
    "GPU-11111111-2222-3333-4444-555555555555",
    "GPU-66666666-7777-8888-9999-000000000000",
)


def payload(name: str) -> ModuleType:
    """A payload script imported as a module, to test its functions one by one."""
    spec = importlib.util.spec_from_file_location(f"payload_{name}", PAYLOADS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPTS = {name: w for name, w in WORKLOADS.items() if w.payload is not None}


@pytest.mark.parametrize("workload", SCRIPTS.values(), ids=list(SCRIPTS))
def test_every_payload_ends_as_expected_in_cpu_mode(workload: Workload) -> None:
    outcome = run_on_host(workload, sys.executable, FAKE_UUIDS[: workload.gpus], cpu=True)
    assert outcome.verdict == workload.expect, outcome.explain()
    assert outcome.report is not None
    assert outcome.report["mode"] in {"cpu", "none"}


def test_the_control_is_reported_failed_with_its_reason() -> None:
    outcome = run_on_host(WORKLOADS["control-fails"], sys.executable)
    assert outcome.verdict == FAIL
    assert outcome.result.returncode == 1
    assert "expected fail, got fail" in outcome.explain()
    assert "by the closed form 500500" in outcome.explain()


def test_matmul_reports_its_throughput_and_errors_within_tolerance() -> None:
    outcome = run_on_host(WORKLOADS["torch-matmul"], sys.executable, FAKE_UUIDS[:1], cpu=True)
    metrics = outcome.metrics
    for dtype, tolerance in metrics["tolerances"].items():
        assert metrics[f"{dtype}_tflops"] > 0
        assert 0 <= metrics[f"{dtype}_rel_err"] <= tolerance


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("9f1c6a4e-0b7d-4c2e-8a51-3e6f0d2b7c90", "GPU-9f1c6a4e-0b7d-4c2e-8a51-3e6f0d2b7c90"),
        ("GPU-9F1C6A4E-0B7D-4C2E-8A51-3E6F0D2B7C90", "GPU-9f1c6a4e-0b7d-4c2e-8a51-3e6f0d2b7c90"),
        (bytes(range(16)), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"),
        ("MIG-5c3e0d5a-1b2c-4d5e-8f90-a1b2c3d4e5f6", "MIG-5c3e0d5a-1b2c-4d5e-8f90-a1b2c3d4e5f6"),
        (bytes(range(1, 17)) + b"luid", "GPU-01020304-0506-0708-090a-0b0c0d0e0f10"),
        (bytes(range(1, 6)), "GPU-01020304-0500-????-????-????????????"),
    ],
)
def test_device_uuids_take_nvidia_smi_form(raw: object, expected: str) -> None:
    assert payload("cuda_init").device_uuid(raw) == expected


@pytest.mark.parametrize(
    ("seen", "ok", "says"),
    [
        (list(FAKE_UUIDS), True, "exactly the 2 assigned"),
        ([FAKE_UUIDS[0]], False, "shows 1 devices"),
        ([FAKE_UUIDS[0], FAKE_UUIDS[0]], False, "one GPU twice"),
        ([FAKE_UUIDS[0], "GPU-ffffffff-0000-0000-0000-000000000000"], False, "not assigned"),
        (["GPU-11111111-2222-3333-44??-????????????", FAKE_UUIDS[1]], True, "exactly the 2"),
        (["GPU-11111111-2222-3333-45??-????????????", FAKE_UUIDS[1]], False, "not assigned"),
    ],
)
def test_cuda_must_show_exactly_the_assigned_gpus(seen: list[str], ok: bool, says: str) -> None:
    verdict, detail = payload("cuda_init").compare_devices(seen, FAKE_UUIDS)
    assert (verdict, says in detail) == (ok, True), detail


def test_cuda_shows_mig_instances_by_their_digits_alone() -> None:
    """CUDA gives a MIG instance's UUID bare (torch) or as bytes (CuPy), never ``MIG-``."""
    listed = parse_list((DISCOVERY / "nvidia-smi-L.mig-A100-7x1g.10gb.txt").read_text())
    instances = [mig.uuid for mig in listed[0].mig_devices]
    assigned = instances[2:4]
    cuda_init = payload("cuda_init")
    from_torch = [cuda_init.device_uuid(uuid.removeprefix("MIG-")) for uuid in assigned]
    from_cupy = [
        cuda_init.device_uuid(bytes.fromhex(uuid.removeprefix("MIG-").replace("-", "")))
        for uuid in assigned
    ]
    for seen in (from_torch, from_cupy, assigned):
        assert cuda_init.compare_devices(seen, assigned)[0], seen
    neighbour = [from_torch[0], cuda_init.device_uuid(instances[5].removeprefix("MIG-"))]
    verdict, detail = cuda_init.compare_devices(neighbour, assigned)
    assert not verdict
    assert instances[5].removeprefix("MIG-") in detail


def test_a_failing_rank_ends_the_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    checks = payload("torch_checks")

    def rank(rank: int, world: int, rendezvous: str, cpu: bool) -> None:
        if rank == 1:
            raise SystemExit(3)
        time.sleep(600)  # rank 0 would wait for rank 1 forever

    monkeypatch.setattr(checks, "all_reduce_rank", rank)
    start = time.monotonic()
    assert checks.run_ranks(2, "unused", True) == [-9, 3]
    assert time.monotonic() - start < 30


def report(**changes: Any) -> str:
    fields = {"workload": "w", "ok": True, "mode": "cpu", "metrics": {}, "detail": "d", **changes}
    return json.dumps(fields) + "\n"


JUDGED = {
    "ok": (report(), 0, PASS, ""),
    "not ok": (report(ok=False), 1, FAIL, ""),
    "no JSON (a crash)": ("", 1, ERROR, "printed 0"),
    "two lines": (report() + report(), 0, ERROR, "printed 2"),
    "not JSON": ("hello\n", 0, ERROR, "not JSON"),
    "a field missing": (json.dumps({"ok": True}), 0, ERROR, "lacks 'workload'"),
    "ok but exit 1": (report(), 1, ERROR, "exited 1"),
    "ran on CUDA in a CPU run": (report(mode="cuda"), 0, ERROR, "mode 'cuda'"),
    "no python3 in the image": ("", 127, ERROR, "py was not found or could not run"),
}


@pytest.mark.parametrize(("stdout", "code", "verdict", "says"), JUDGED.values(), ids=list(JUDGED))
def test_a_payload_is_judged_by_its_json_line(
    stdout: str, code: int, verdict: str, says: str
) -> None:
    workload = WORKLOADS["control-fails"]
    outcome = judge(workload, ExecResult(("py",), code, stdout, "Traceback: boom"), cpu=True)
    assert outcome.verdict == verdict
    assert says in outcome.problem
    if verdict == ERROR:
        assert "Traceback: boom" in outcome.explain()


def test_a_command_is_judged_by_its_exit_status() -> None:
    command = Workload("c", "WORKLOAD-CONTROL-01", "fail", 0, command=("false",))
    assert judge(command, ExecResult(("false",), 1, "", "")).verdict == FAIL
    assert judge(command, ExecResult(("true",), 0, "", "")).verdict == PASS


def test_payloads_are_standalone_scripts() -> None:
    """Sent as ``python -c``, a payload can import nothing of this project."""
    for path in Path(PAYLOADS).glob("*.py"):
        source = path.read_text()
        assert "import drivers" not in source, path
        assert "from workloads" not in source, path
        assert len(source.encode()) < 128 * 1024, f"{path} is over one argument's limit"


def test_the_benchmark_reports_medians_ratio_and_share_of_the_bare_peak() -> None:
    from bench.workloads import report

    samples = {"m": {"bare": [1.0, 2.0, 4.0], "sandbox": [1.0, 1.0, 3.0]}}
    (header, row) = report(samples, {"m": "metric m"})
    assert header.split()[:3] == ["metric", "bare", "sandbox"]
    assert row.split() == ["metric", "m", "2", "1", "0.50x", "25%"]
