"""Lanes side by side (``python -m conformance.lanes``): a run per driver, one run's reports."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest

from conformance.report import Results
from tests.conformance.test_report import all_passed, make_entry, make_results

ROOT = Path(__file__).parents[2]
SIM_RUNS = Path("/run/gpu-sandbox-runs")
pytestmark = pytest.mark.usefixtures("no_cluster")


def test_merged_results_keep_each_lanes_drivers_tests_levels_and_verdicts() -> None:
    reference = make_results(all_passed("reference"))
    tests = all_passed("vm")
    tests[0] = make_entry(tests[0]["requirement"], "vm", "failed", "GPU 3 in two sandboxes")
    vm = make_results(tests, ("vm",))
    vm = dataclasses.replace(vm, header={**vm.header, "session": "s2", "host": "another"})

    merged = Results.merged([reference, vm])

    assert list(merged.drivers) == ["reference", "vm"]
    assert merged.tests == reference.tests + vm.tests
    assert [v.line for v in merged.verdicts] == [
        *(v.line for v in reference.verdicts),
        *(v.line for v in vm.verdicts),
    ]
    assert merged.verdicts[1].status == "FAIL"
    for row, ref_row, vm_row in zip(
        merged.requirements, reference.requirements, vm.requirements, strict=True
    ):
        assert row["levels"] == {**ref_row["levels"], **vm_row["levels"]}
    assert merged.header["session"] == "s1, s2"
    assert merged.header["host"].endswith("each of the 2 lanes had a host like it of its own")
    assert Results.from_json(json.loads(json.dumps(merged.to_json()))).verdicts == merged.verdicts


def lanes(
    pytester: pytest.Pytester, tmp_path: Path, *args: str, tests: str = "test_visibility.py"
) -> tuple[pytest.RunResult, Path]:
    """``python -m conformance.lanes`` on part of the catalogue, each lane on a host of 2 GPUs."""
    reports = tmp_path / "reports"
    pytester.chdir()
    run = pytester.run(
        sys.executable, "-m", "conformance.lanes", *args,
        str(ROOT / "conformance" / tests), f"--rootdir={ROOT}", "-c", str(ROOT / "pytest.ini"),
        "-p", "no:cacheprovider", "--sim-gpus=2",
        f"--conformance-json={reports / 'conformance.json'}",
        f"--conformance-html={reports / 'conformance.html'}",
        f"--junitxml={reports / 'conformance.xml'}",
        timeout=300,
    )  # fmt: skip
    return run, reports


@pytest.fixture
def no_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cluster answers (the local one may be up: its kubeconfig is not the one used)."""
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def test_lanes_run_side_by_side_into_one_runs_reports(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    run, reports = lanes(
        pytester, tmp_path, "--lanes=reference,kubernetes", "--jobs=2", "-k", "no_gpu_request"
    )

    assert run.ret == 0, run.stdout.str()
    run.stdout.fnmatch_lines(["lanes: 2 lanes, 2 at a time, each on a simulated host of its own*"])
    run.stdout.fnmatch_lines_random(
        [
            "lanes: reference: PASS [[]1 passed, exit 0] in * s",
            "lanes: kubernetes: NOT RUN [[]1 skipped, exit 0] in * s",
        ]
    )
    run.stdout.fnmatch_lines(
        [
            "=== conformance by requirement ===",
            "GPU host: 2 x NVIDIA H100 80GB HBM3 (simulated GPUs under *); each of the 2 lanes*",
            "GPU-NONE-01 * passed * not run",
            "=== verdict ===",
            "reference: PASS*",
            "kubernetes: NOT RUN*",
        ]
    )
    document = json.loads((reports / "conformance.json").read_text())
    assert list(document["drivers"]) == ["reference", "kubernetes"]
    assert document["matrix"]["GPU-NONE-01"] == {"reference": "passed", "kubernetes": "not run"}
    assert (reports / "conformance.html").read_text().count("GPU-NONE-01") >= 1
    suites = ElementTree.parse(reports / "conformance.xml").getroot()
    assert [suite.get("name") for suite in suites] == [
        "conformance-reference",
        "conformance-kubernetes",
    ]
    for name in ("reference", "kubernetes"):
        assert (reports / "lanes" / f"{name}.log").read_text().count("gpu-sandbox session:") == 1
    # Each lane made a simulated host of its own, and removed it.
    sessions = document["session"].split(", ")
    assert len(set(sessions)) == 2
    assert not [session for session in sessions if (SIM_RUNS / f"run-{session}").exists()]


def test_a_run_whose_lanes_all_could_not_run_fails(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    run, _ = lanes(pytester, tmp_path, "--lanes=kubernetes", "-k", "no_gpu_request")
    assert run.ret == 1
    run.stdout.fnmatch_lines(
        [
            "FAIL: no driver could run here; every conformance test was skipped.",
            "kubernetes: NOT RUN*",
        ]
    )


def test_a_lane_that_fails_fails_the_run_with_its_failures_shown(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    # A bound no test can keep: the reference lane's test fails (pytest-timeout).
    run, reports = lanes(
        pytester, tmp_path, "--lanes=reference", "-k", "no_gpu_request", "--timeout=0.01"
    )
    assert run.ret == 1
    run.stdout.fnmatch_lines(
        [
            "lanes: reference: FAIL [[]1 error, exit 1] in * s",
            "--- reference (exit 1), from */lanes/reference.log",
            "ERROR *test_no_gpu_request*[[]reference]*",  # with its message where it fits
            "",
            "=== conformance by requirement ===",
        ]
    )
    run.stdout.fnmatch_lines(["=== verdict ===", "reference: FAIL — GPU-NONE-01 failed*Timeout*"])
    document = json.loads((reports / "conformance.json").read_text())
    assert document["verdicts"]["reference"]["status"] == "FAIL"


def test_a_usage_error_in_the_lanes_is_the_runs(pytester: pytest.Pytester, tmp_path: Path) -> None:
    run, _ = lanes(pytester, tmp_path, "--lanes=reference", "--reclaim-timeout=soon")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stdout.fnmatch_lines(
        ["lanes: reference: exit 4 without a report*", "*--reclaim-timeout*soon*"]
    )


def test_named_drivers_are_one_run(pytester: pytest.Pytester, tmp_path: Path) -> None:
    run, reports = lanes(pytester, tmp_path, "--driver=reference", "-k", "no_gpu_request")
    assert run.ret == 0
    assert "lanes:" not in run.stdout.str()
    run.stdout.fnmatch_lines(["*1 passed*"])
    assert not (reports / "lanes").exists()
    drivers = json.loads((reports / "conformance.json").read_text())["drivers"]
    assert list(drivers) == ["reference"]
    assert drivers["reference"]["explicit"]


def test_an_interrupt_stops_every_lane_which_tears_its_host_down(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    pytester.chdir()
    lane_dir = tmp_path / "lanes"
    runner = subprocess.Popen(
        [
            sys.executable, "-m", "conformance.lanes", "--lanes=reference",
            f"--lane-dir={lane_dir}", str(ROOT / "conformance" / "test_lifecycle.py"),
            f"--rootdir={ROOT}",
            "-c", str(ROOT / "pytest.ini"), "-p", "no:cacheprovider", "--sim-gpus=2",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log = lane_dir / "reference.log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "test_lifecycle.py " in log.read_text()):  # tests started
        assert runner.poll() is None, runner.communicate()[0]
        assert time.monotonic() < deadline, "no test started in 120 s"
        time.sleep(0.1)
    session = log.read_text().split("gpu-sandbox session: ")[1].split()[0]
    runner.send_signal(signal.SIGINT)
    out, _ = runner.communicate(timeout=300)
    assert runner.returncode == 130, out
    assert "lanes: interrupted: stopping reference" in out
    assert "KeyboardInterrupt" in log.read_text()
    assert not (SIM_RUNS / f"run-{session}").exists()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    assert str(lane_dir) not in ps.stdout, "a lane outlived its runner"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--lanes=reference,dokcer", "--sim-gpus=2"], "--lanes=reference,dokcer: built-in"),
        (["--lanes=reference", "--driver=reference"], "--lanes: lanes are runs of their own"),
        (["--jobs=0", "--sim-gpus=2"], "--jobs must be at least 1, not 0"),
    ],
)
def test_lanes_that_cannot_be_are_a_usage_error(args: list[str], says: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conformance.lanes", *args],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert says in done.stderr


@pytest.mark.parametrize(
    ("option", "says"),
    [
        (["--lane=dokcer"], "--lane=dokcer: one built-in driver (reference, "),
        (["--lane=docker", "--driver=reference"], "--lane=docker: one built-in driver"),
        (["--lanes-at-once=0"], "--lanes-at-once=0: at least 1"),
    ],
)
def test_a_lane_option_out_of_place_is_a_usage_error(
    pytester: pytest.Pytester, option: list[str], says: str
) -> None:
    run = pytester.runpytest_subprocess(
        str(ROOT / "conformance" / "test_visibility.py"), f"--rootdir={ROOT}",
        "-c", str(ROOT / "pytest.ini"), "-p", "no:cacheprovider", *option,
    )  # fmt: skip
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines([f"*{says}*"])
