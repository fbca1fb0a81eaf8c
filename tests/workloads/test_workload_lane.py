"""The workload lane end to end, on a simulated host: skips, the CPU self-check, the control."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec
from workloads.harness import PASS, run_in_sandbox
from workloads.manifest import MANIFEST, load_manifest

ROOT = Path(__file__).parents[2]


def run_lane(
    pytester: pytest.Pytester, sim: simulated.SimulatedHost, *args: str
) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        str(ROOT / "workloads"),
        f"--rootdir={ROOT}",
        "-c",
        str(ROOT / "pytest.ini"),
        "-p",
        "no:cacheprovider",
        "--driver=reference",
        f"--sim-root={sim.root}",
        *args,
        timeout=300,
    )


def test_a_payload_runs_in_cpu_mode_inside_a_reference_sandbox(
    sim_host: simulated.SimulatedHost,
) -> None:
    driver = ReferenceDriver(GpuHost.open(HostConfig(sim_root=sim_host.root)), "payload-test")
    if not driver.probe().ok:
        pytest.skip(driver.probe().reason)
    (workload,) = (w for w in load_manifest(MANIFEST) if w.name == "cupy-kernels")
    try:
        with driver.create(SandboxSpec.with_gpus()) as sandbox:
            outcome = run_in_sandbox(sandbox, workload, sys.executable, cpu=True)
    finally:
        driver.reap("payload-test")
    assert outcome.verdict == PASS, outcome.explain()
    assert outcome.metrics["elements"] == 1 << 20


def test_on_simulated_gpus_the_gpu_workloads_skip_and_the_controls_run(
    pytester: pytest.Pytester, sim_host: simulated.SimulatedHost
) -> None:
    result = run_lane(pytester, sim_host)
    workloads = load_manifest(MANIFEST)
    controls = [w for w in workloads if not w.gpus]
    assert {w.expect for w in controls} == {"fail"}
    # The controls need no GPU: they run, and are seen to fail as they must.
    result.assert_outcomes(passed=len(controls), skipped=len(workloads) - len(controls))
    # The matrix (rows in the golden list's order) closes the output, after the skips.
    result.stdout.fnmatch_lines(
        [
            "*no CUDA device: the GPUs are simulated (8 x NVIDIA H100*simulated GPUs*",
            "WORKLOAD-CUDA-01*skipped*",
            "WORKLOAD-CONTROL-01*passed*",
        ]
    )


def test_the_cpu_self_check_runs_every_payload_through_the_sandbox(
    pytester: pytest.Pytester, sim_host: simulated.SimulatedHost
) -> None:
    result = run_lane(pytester, sim_host, "--workload-cpu")
    result.assert_outcomes(passed=len(load_manifest(MANIFEST)))


def test_a_control_expected_to_pass_fails_the_run(
    pytester: pytest.Pytester, sim_host: simulated.SimulatedHost, tmp_path: Path
) -> None:
    """The lane can fail: told the control should pass, it reports the control's failure."""
    document = yaml.safe_load(MANIFEST.read_text())
    control = next(w for w in document["workloads"] if w["name"] == "control-fails")
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(yaml.safe_dump({"workloads": [{**control, "expect": "pass"}]}))
    result = run_lane(pytester, sim_host, f"--workload-manifest={manifest}", "--workload-cpu")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*workload control-fails (control.py): expected pass, got fail",
            "*detail: sum of 1..1000 by loop is 499500, by the closed form 500500",
            "WORKLOAD-CONTROL-01*failed*",
        ]
    )


def test_a_bad_manifest_fails_the_collection_naming_field_and_value(
    pytester: pytest.Pytester, sim_host: simulated.SimulatedHost, tmp_path: Path
) -> None:
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text("workloads:\n  - {name: x, requirement: WORKLOAD-CUDA-01, gpus: 1}\n")
    result = run_lane(pytester, sim_host, f"--workload-manifest={manifest}")
    assert result.ret != pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*MissingField*workloads[[]0[]].expect: is required*"])
