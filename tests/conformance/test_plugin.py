"""The plugin's driver selection: unknown names, unavailable drivers, skips with reasons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

from gpuhost import simulated

ROOT = Path(__file__).parents[2]


def run(
    pytester: pytest.Pytester, *args: str, tests: str = "test_visibility.py"
) -> pytest.RunResult:
    return pytester.runpytest_subprocess(
        str(ROOT / "conformance" / tests),
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
    host = simulated.setup(tmp_path / "sim", 2)
    result = run(
        pytester, "--driver=tests.fake_drivers:UnavailableDriver", f"--sim-root={host.root}"
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*was named in --driver but cannot run: needed the frobnicator service (found:*",
            "*= verdict =*",
            "tests.fake_drivers:UnavailableDriver: NOT RUN — needed the frobnicator service*",
        ]
    )
    assert result.parseoutcomes().get("passed", 0) == 0


def test_default_driver_that_cannot_run_is_skipped_and_the_run_fails(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No --sim-root and no GPU on this machine: the reference driver finds nothing to hand out,
    # and no cluster answers (the local one may be up: its kubeconfig is not the one used).
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    result = run(pytester, f"--gpu-state-dir={tmp_path}")
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) > 0
    assert outcomes.get("passed", 0) == 0
    result.stdout.fnmatch_lines(
        ["*= skipped, by reason =*", "*  reference: needed NVIDIA GPUs (found none*"]
    )
    # ...and a run in which no driver could run checked nothing: it does not pass.
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ["FAIL: no driver could run here*", "reference: NOT RUN — needed NVIDIA GPUs (found none*"]
    )


def test_report_header_says_the_gpus_are_simulated(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    host = simulated.setup(tmp_path / "sim", 2)
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
    from drivers.reference import ReferenceDriver
    from gpuhost.host import GpuHost, HostConfig
    from gpuhost.spec import SandboxSpec

    host = simulated.setup(tmp_path / "sim", 2)
    driver = ReferenceDriver(GpuHost.open(HostConfig(sim_root=host.root)), "left-behind")
    sandbox = driver.create(SandboxSpec.with_gpus(2))
    assert driver.sandboxes("left-behind") == [sandbox.id]
    result = run(pytester, f"--sim-root={host.root}", "--reap=left-behind")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["reference: removed 1 sandbox(es) of session left-behind"])
    assert driver.sandboxes("left-behind") == []
    assert driver.host.leases.leases() == []
    sandbox.close()


def test_reports_carry_requirement_driver_and_gpus(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = simulated.setup(tmp_path / "sim", 2)
    out = tmp_path / "reports"
    step_summary = tmp_path / "step-summary.md"
    step_summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(step_summary))
    result = run(
        pytester,
        "--driver=reference",
        f"--sim-root={host.root}",
        "-k",
        "no_gpu_request or default_request",
        f"--junitxml={out / 'conformance.xml'}",
        f"--conformance-json={out / 'conformance.json'}",
        f"--conformance-html={out / 'conformance.html'}",
        f"--conformance-markdown={out / 'conformance.md'}",
    )
    assert result.ret == pytest.ExitCode.OK
    expected = {"driver": "reference", "gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": "2"}
    cases = ElementTree.parse(out / "conformance.xml").getroot().iter("testcase")
    properties = [{p.get("name"): p.get("value") for p in case.iter("property")} for case in cases]
    assert len(properties) == 2
    for props in properties:
        assert props == {
            **expected,
            "requirement": props["requirement"],
            "level": "mandatory",
            "simulated": "true",
        }
    assert {props["requirement"] for props in properties} == {"GPU-NONE-01", "GPU-DEFAULT-01"}
    document = json.loads((out / "conformance.json").read_text())
    for test in document["tests"]:
        assert test["gpu_count"] == 2
        assert test["simulated"] is True
        assert test["gpu_model"] == expected["gpu_model"]
    assert document["drivers"]["reference"]["version"].startswith("bubblewrap ")
    assert document["verdicts"]["reference"]["status"] == "PASS"
    markdown = (out / "conformance.md").read_text()
    assert step_summary.read_text() == "earlier step\n" + markdown
    assert "| GPU-NONE-01 | ✅ pass |" in markdown
    assert 'class="cell passed"' in (out / "conformance.html").read_text()


def test_a_failed_optional_requirement_is_reported_and_does_not_gate(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    # A profile in which GPU-DEFAULT-02, which this planted driver breaks, is optional.
    pytester.makepyfile(
        optional_profile="""
        import dataclasses

        NAME = "tests.breakers.selection:RoundRobin"

        def pytest_configure(config):
            from conformance import requirements

            golden = requirements.load()
            entries = tuple(
                dataclasses.replace(
                    entry,
                    drivers=(*entry.drivers, NAME),
                    optional=(NAME,) if entry.id == "GPU-DEFAULT-02" else (),
                )
                for entry in golden.requirements
            )
            profile = requirements.GoldenList((*golden.drivers, NAME), entries)
            requirements.load = lambda: profile
        """
    )
    host = simulated.setup(tmp_path / "sim", 2)
    result = run(
        pytester,
        "-p",
        "optional_profile",
        "--driver=tests.breakers.selection:RoundRobin",
        f"--sim-root={host.root}",
        "-k",
        "default_request or own_block",
        tests="test_selection.py",
    )
    assert result.parseoutcomes().get("failed", 0) > 0
    result.stdout.fnmatch_lines(
        [
            "tests.breakers.selection:RoundRobin: PASS (1/1 mandatory passed; * not run (no test "
            "selected): GPU-NONE-01, GPU-DEFAULT-01, GPU-COUNT-01, GPU-ISOLATION-01 and * more; "
            "1 optional failed)"
        ]
    )
    assert result.ret == pytest.ExitCode.OK


def test_driver_repeated_or_comma_separated_runs_each_driver_once(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    host = simulated.setup(tmp_path / "sim", 2)
    report = tmp_path / "conformance.json"
    other = "tests.fake_drivers:OutputAtTheEnd"
    result = run(
        pytester,
        "--driver=reference",
        f"--driver={other},reference",
        f"--sim-root={host.root}",
        "-k",
        "no_gpu_request",
        f"--conformance-json={report}",
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert list(json.loads(report.read_text())["drivers"]) == ["reference", other]
    result.assert_outcomes(passed=2)


def test_a_hanging_driver_fails_its_requirement_by_name_and_the_report_is_written(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """The per-test bound (pytest-timeout, signal) interrupts the test, not the run."""
    host = simulated.setup(tmp_path / "sim", 2)
    report = tmp_path / "conformance.json"
    result = run(
        pytester,
        "--driver=tests.fake_drivers:HangsInExec",
        f"--sim-root={host.root}",
        "--requirement=GPU-NONE-01,GPU-EXHAUST-02",
        "--timeout=3",
        f"--conformance-json={report}",
        tests="",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    matrix = json.loads(report.read_text())["matrix"]
    name = "tests.fake_drivers:HangsInExec"
    assert matrix["GPU-NONE-01"][name] == "failed"  # it hung in nvidia-smi, and was stopped
    # And the run went on (partial: a host without MIG or other vendors has no pool to ask).
    assert matrix["GPU-EXHAUST-02"][name] in ("passed", "partial")
    result.stdout.fnmatch_lines([f"{name}: FAIL — GPU-NONE-01 failed: *Timeout*"])


def test_a_run_waiting_for_its_turn_says_so_on_a_line_of_its_own(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Not captured, and not appended to the progress dots of ``-q`` on the terminal."""
    host = simulated.setup(tmp_path / "sim", 2)
    for verbosity in ("-q", "-v"):
        argv = [
            sys.executable, "-m", "pytest", str(ROOT / "conformance" / "test_validation.py"),
            f"--rootdir={ROOT}", "-c", str(ROOT / "pytest.ini"), "-p", "no:cacheprovider",
            "--driver=tests.fake_drivers:WaitsForItsTurn", f"--sim-root={host.root}", verbosity,
        ]  # fmt: skip
        # One stream, as on a terminal.
        done = subprocess.run(
            argv, cwd=pytester.path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:]
        said = [line for line in done.stdout.splitlines() if "waiting for another" in line]
        assert said == ["waiting for another conformance run (held by a test)"], (verbosity, said)


LEAKY_TESTS = """
import os

import pytest

from gpuhost.leases import Holder, LeaseOwner
from gpuhost.spec import SandboxSpec


@pytest.mark.requirement("SANDBOX-REAP-01")
def test_1_fails_before_it_closes_what_it_made(driver):
    other = type(driver)(driver.host, "another-session", driver.image)
    driver.create(SandboxSpec.with_gpus())
    other.create(SandboxSpec.with_gpus())
    raise AssertionError("failed on purpose, two sandboxes open")


@pytest.mark.requirement("SANDBOX-REAP-01")
def test_2_keeps_a_lease(driver):
    owner = LeaseOwner("gpu-lease", "kept", driver.session_id, Holder.process(os.getpid()))
    driver.host.leases.acquire(driver.inventory(), owner, count=1)


@pytest.mark.requirement("GPU-COUNT-01")
def test_3_takes_every_gpu(driver, sandboxes):
    sandboxes(SandboxSpec.with_gpus(len(driver.inventory())))
"""


def test_a_test_that_leaves_gpus_held_fails_itself_not_the_tests_after_it(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """What a test made is closed after it, however it ended; what it kept fails it alone."""
    pytester.makepyfile(test_leaky=LEAKY_TESTS)
    host = simulated.setup(tmp_path / "sim", 2)
    report = tmp_path / "conformance.json"
    result = run(
        pytester,
        "--driver=reference",
        f"--sim-root={host.root}",
        "--reclaim-timeout=1",
        f"--conformance-json={report}",
        tests=str(pytester.path / "test_leaky.py"),  # a path of its own, not the catalogue's
    )
    result.assert_outcomes(passed=2, failed=1, errors=1)
    outcomes = {
        (test["nodeid"].split("::")[-1], test["outcome"])
        for test in json.loads(report.read_text())["tests"]
    }
    assert outcomes == {
        ("test_1_fails_before_it_closes_what_it_made[reference]", "failed"),
        ("test_2_keeps_a_lease[reference]", "passed"),
        ("test_2_keeps_a_lease[reference]", "error"),  # at its teardown
        ("test_3_takes_every_gpu[reference]", "passed"),
    }
    result.stdout.fnmatch_lines(
        [
            "this test left behind, once its sandboxes were closed and session * "
            "reaped: sandboxes none; leases: sandbox kept of the gpu-lease driver, held by *"
        ]
    )


def test_require_complete_fails_a_gate_that_checked_less_than_it_asks(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """On one GPU, what needs two is not fully checked: a release run fails, naming it."""
    host = simulated.setup(tmp_path / "sim", 1)
    common = ("--driver=reference", f"--sim-root={host.root}")
    lenient = run(pytester, *common)
    assert lenient.ret == pytest.ExitCode.OK, lenient.stdout.str()
    lenient.stdout.fnmatch_lines(["reference: PASS (*not fully checked: *"])
    strict = run(pytester, *common, "--require-complete")
    assert strict.ret == pytest.ExitCode.TESTS_FAILED
    strict.stdout.fnmatch_lines(
        ["reference: FAIL — * not fully checked, and --require-complete asks it: needs 2 GPUs*"]
    )


def test_a_declaration_no_profile_accepts_fails_the_requirements_it_would_leave_out(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """exclusive=False does not make the exclusivity requirements not applicable: it fails them."""
    host = simulated.setup(tmp_path / "sim", 4)
    name = "tests.fake_drivers:NonExclusiveByDeclaration"
    report = tmp_path / "conformance.json"
    result = run(
        pytester,
        f"--driver={name}",
        f"--sim-root={host.root}",
        f"--conformance-json={report}",
        tests="test_exhaustion.py",
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            f"{name}: FAIL — GPU-* failed: Failed: the * driver shares GPUs "
            "(exclusive=False), which would leave this requirement out; no profile accepts the "
            "declaration exclusive=False*"
        ]
    )
    matrix = json.loads(report.read_text())["matrix"]
    assert matrix["GPU-CONCURRENT-01"][name] == "failed"
    assert "not applicable" not in {cells[name] for cells in matrix.values()}
