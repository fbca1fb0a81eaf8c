"""The plugin's driver selection: unknown names, unavailable drivers, skips with reasons."""

from __future__ import annotations

from pathlib import Path

import pytest

from drivers import simgpu

ROOT = Path(__file__).parent.parent


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        str(ROOT / "conformance" / "test_visibility.py"),
        f"--rootdir={ROOT}",
        "-c",
        str(ROOT / "pytest.ini"),
        "-p",
        "no:cacheprovider",
        *args,
        timeout=120,
    )


def test_unknown_driver_is_a_usage_error_listing_the_known(pytester: pytest.Pytester) -> None:
    result = run(pytester, "--driver=dokcer")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown driver 'dokcer'; known: reference*"])


def test_non_driver_import_path_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = run(pytester, "--driver=tests.fake_drivers:NotADriver")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*is not a drivers.base.Driver subclass*"])


def test_explicit_driver_that_cannot_run_fails_the_run(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    host = simgpu.setup(tmp_path / "sim", 2)
    result = run(
        pytester, "--driver=tests.fake_drivers:UnavailableDriver", f"--sim-root={host.root}"
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["*was named in --driver but cannot run: needed the frobnicator service (found:*"]
    )
    assert result.parseoutcomes().get("passed", 0) == 0


def test_default_driver_that_cannot_run_is_skipped_and_the_run_fails(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    # No --sim-root and no GPU on this machine: the reference driver finds nothing to hand out.
    result = run(pytester, f"--gpu-state-dir={tmp_path}")
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0
    assert outcomes.get("passed", 0) == 0
    result.stdout.fnmatch_lines(["*SKIPPED*reference: needed NVIDIA GPUs (found none*"])
    # ...and a run in which no driver could run checked nothing: it does not pass.
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["FAIL: no driver could run here*"])


def test_report_header_says_the_gpus_are_simulated(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    host = simgpu.setup(tmp_path / "sim", 2)
    result = run(pytester, f"--sim-root={host.root}", "-k", "no_gpu_request")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        [
            "gpu host: 2 x NVIDIA H100 80GB HBM3 (simulated GPUs under*",
            "*this run used SIMULATED GPUs*",
            "*conformance by requirement*",
            "GPU-NONE-01*passed*",
        ]
    )


def test_reap_option_removes_a_sessions_sandboxes(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    from drivers.host import GpuHost, HostConfig
    from drivers.reference import ReferenceDriver
    from drivers.spec import SandboxSpec

    host = simgpu.setup(tmp_path / "sim", 2)
    driver = ReferenceDriver(GpuHost.open(HostConfig(sim_root=host.root)), "left-behind")
    sandbox = driver.create(SandboxSpec.with_gpus(2))
    assert driver.sandboxes("left-behind") == [sandbox.id]
    result = run(pytester, f"--sim-root={host.root}", "--reap=left-behind")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["reference: removed 1 sandbox(es) of session left-behind"])
    assert driver.sandboxes("left-behind") == []
    assert driver.host.leases.leases() == []
    sandbox.close()
