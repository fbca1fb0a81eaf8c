"""Lanes side by side (``python -m conformance.lanes``): a run per driver, one run's reports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import pytest

from conformance.lanes import Lane, _report
from conformance.report import Results
from gpuhost.private import private_directory
from tests.conformance.test_report import all_passed, make_entry, make_results
from tests.other_user import PYTHON, setpriv

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


# -- where the runner writes and what it reads back ----------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may write, sticky, as /tmp is (tmp_path is root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="gpu-sandbox-lanes-test-"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base)


def other_users_lane_dir(shared: Path) -> tuple[Path, Path]:
    """A lane directory another user made first: its lane's log and report link to root's."""
    victim = shared / "root-owned"
    victim.write_text("root's own\n")
    planted = shared / "lanes"
    script = (
        f"import os; os.mkdir({str(planted)!r}); os.chmod({str(planted)!r}, 0o777); "
        f"os.symlink({str(victim)!r}, {str(planted / 'reference.log')!r}); "
        f"os.symlink({str(victim)!r}, {str(planted / 'reference.json')!r})"
    )
    subprocess.run([*setpriv(), PYTHON, "-c", script], check=True, timeout=30)
    return planted, victim


def test_a_lane_directory_another_user_made_is_refused_by_name(
    pytester: pytest.Pytester, tmp_path: Path, shared_dir: Path
) -> None:
    planted, victim = other_users_lane_dir(shared_dir)
    run, reports = lanes(
        pytester, tmp_path, "--lanes=reference", f"--lane-dir={planted}", "-k", "no_gpu_request"
    )
    assert run.ret == 2, run.stdout.str()  # the runner's usage error, as argparse's
    run.stderr.fnmatch_lines(
        [f"*--lane-dir: {planted}: is uid 65534's directory, not this user's*"]
    )
    assert victim.read_text() == "root's own\n"
    assert not (reports / "conformance.json").exists()


def test_the_lane_directory_is_made_private_and_its_links_never_followed(tmp_path: Path) -> None:
    directory = tmp_path / "lanes"
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    victim = tmp_path / "root-owned"
    victim.write_text("root's own\n")
    (directory / "reference.log").symlink_to(victim)
    lane = Lane("reference", directory, private_directory(directory))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    lane.start(["--version"], dict(os.environ), 1)
    assert lane.process is not None
    lane.process.wait(60)
    assert victim.read_text() == "root's own\n"
    assert not (directory / "reference.log").is_symlink()
    assert "pytest" in (directory / "reference.log").read_text()


def finished_lane(directory: Path, fd: int, name: str) -> Lane:
    lane = Lane(name, directory, fd)
    lane.process = subprocess.Popen(["true"])
    lane.process.wait()
    return lane


def test_a_forged_or_linked_report_fails_its_lane_by_name_and_is_not_merged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = tmp_path / "lanes"
    fd = private_directory(directory)
    reference = make_results(all_passed("reference"))
    (directory / "reference.json").write_text(json.dumps(reference.to_json()))
    # A report of another lane's driver, a document that is not one, a link.
    forged = make_results(all_passed("docker"), ("docker",))
    (directory / "vm.json").write_text(json.dumps(forged.to_json()))
    (directory / "docker.json").write_text('{"tests": [], "verdicts": {"docker": "PASS"}}')
    (directory / "podman.json").symlink_to(directory / "reference.json")
    parts = [finished_lane(directory, fd, name) for name in ("reference", "vm", "docker", "podman")]
    args = argparse.Namespace(
        conformance_json=tmp_path / "merged.json", conformance_html=None,
        conformance_markdown=None, junitxml=tmp_path / "merged.xml",
    )  # fmt: skip
    assert _report(parts, args) == 1
    said = capsys.readouterr().out
    assert "vm: FAILED: its report is refused, not merged: " in said
    assert "results of drivers not of this lane: docker" in said
    assert "docker: FAILED: its report is refused, not merged: " in said
    assert "podman: FAILED: its report is refused, not merged: " in said
    assert "Too many levels of symbolic links" in said
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert list(merged["drivers"]) == ["reference"]
