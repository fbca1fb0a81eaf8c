"""The fleet workflow's merge step (.github/workflows/fleet.yml), run as the workflow runs it.

Its reports come from real runs of the catalogue (the reference driver, a few requirements)
on three simulated hosts of different shapes: 8 GPUs with MIG instances and DRI GPUs beside
them, one GPU, and AMD GPUs alone; each is laid out as the download-artifact step leaves it
(``fleet-reports/fleet-report-<sku>/conformance.json``), and the step's own script merges them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conformance.report import Results
from gpuhost import simulated

ROOT = Path(__file__).parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "fleet.yml"
REQUIREMENTS = "GPU-NONE-01,GPU-DEFAULT-01,GPU-VALIDATE-01,MIG-EXACT-01,DRI-ISOLATION-01"
SHAPES = {
    "h100x8": (8, "0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb", "intel:1,amd:2"),
    "one-gpu": (1, "", ""),
    "mi210": (0, "", "amd:2"),
}
NO_NVIDIA = "needed NVIDIA GPUs (found none through NVML or nvidia-smi"


def merge_step() -> str:
    jobs = yaml.safe_load(WORKFLOW.read_text())["jobs"]
    (step,) = [s for s in jobs["merge"]["steps"] if s.get("name") == "merge the hosts' reports"]
    assert step["env"] == {"SKUS": "${{ inputs.skus }}"}
    return str(step["run"])


def catalogue_run(
    pytester: pytest.Pytester, tmp_path: Path, sku: str, shape: tuple[int, str, str], *args: str
) -> None:
    """A run of the catalogue on a fresh simulated host, its report where the artifact goes."""
    count, mig, dri = shape
    host = simulated.setup(
        tmp_path / "sim" / sku,
        count,
        mig=simulated.parse_mig_layout(mig),
        dri=simulated.parse_dri_layout(dri),
    )
    report = tmp_path / "fleet-reports" / f"fleet-report-{sku}" / "conformance.json"
    report.parent.mkdir(parents=True)
    pytester.runpytest_subprocess(
        str(ROOT / "conformance"),
        f"--rootdir={ROOT}",
        "-c",
        str(ROOT / "pytest.ini"),
        "-p",
        "no:cacheprovider",
        f"--sim-root={host.root}",
        f"--requirement={REQUIREMENTS}",
        f"--conformance-json={report}",
        *args,
        timeout=300,
    )
    assert report.exists(), f"the run on {sku} wrote no report"
    simulated.teardown(host.root)


def run_merge_step(work: Path, skus: list[str]) -> subprocess.CompletedProcess[str]:
    (work / "fleet").mkdir(exist_ok=True)
    venv = work / ".venv"
    if not venv.exists():
        venv.symlink_to(Path(sys.executable).parent.parent)
    env = {**os.environ, "SKUS": json.dumps(skus)}
    env.pop("GITHUB_STEP_SUMMARY", None)
    return subprocess.run(
        ["bash", "-e", "-c", merge_step()],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_merge_step_judges_three_hosts_of_different_shapes_from_real_runs(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    for sku, shape in SHAPES.items():
        catalogue_run(pytester, tmp_path, sku, shape, "-k", "reference")
    done = run_merge_step(tmp_path, list(SHAPES))
    assert done.returncode == 0, done.stdout + done.stderr
    fleet: dict[str, Any] = json.loads((tmp_path / "fleet" / "conformance.json").read_text())
    names = [host["name"] for host in fleet["hosts"]]
    big, one, amd = names
    assert [host["gpus"] for host in fleet["hosts"]] == [
        "8 x NVIDIA H100 80GB HBM3 (nvidia; 2 in MIG mode: 8 x 1g.10gb, 3 x 2g.20gb; driver "
        "simulated), 1 x Intel Arc A770 (intel; driver simulated), 2 x AMD Instinct MI210 "
        "(amd; driver simulated) (SIMULATED)",
        "1 x NVIDIA H100 80GB HBM3 (nvidia; driver simulated) (SIMULATED)",
        "2 x AMD Instinct MI210 (amd; driver simulated) (SIMULATED)",
    ]
    for host in fleet["hosts"]:
        Results.checked(host["report"])  # each host's report whole, as its run wrote it
    reference = fleet["verdicts"]["reference"]
    assert reference["hosts"] == {big: "PASS", one: "PASS", amd: "NOT RUN"}
    assert reference["status"] == "PASS"
    assert reference["line"].startswith(
        "reference: PASS (passed on every host it ran on, 2 of 3; not run on 1, not counted: "
        f"{amd} ({NO_NVIDIA}"
    )
    matrix = fleet["matrix"]
    assert matrix["GPU-NONE-01"]["reference"] == {
        "status": "passed",
        "hosts": {big: "passed", one: "passed", amd: "not run"},
    }
    # MIG and DRI requirements pass on the host that has them; the one-GPU host skips them.
    for req in ("MIG-EXACT-01", "DRI-ISOLATION-01"):
        assert matrix[req]["reference"] == {
            "status": "partial",
            "hosts": {big: "passed", one: "skipped", amd: "not run"},
        }
    assert matrix["GPU-COUNT-01"]["reference"]["status"] == "not run"
    assert f"reference on {amd}: NOT RUN — {NO_NVIDIA}" in done.stdout
    assert reference["line"] in done.stdout.splitlines()
    for name in ("conformance.xml", "conformance.html", "conformance.md"):
        assert (tmp_path / "fleet" / name).stat().st_size > 0

    # The same AMD host with the driver named (--driver): it could not run there, so the
    # fleet's gate fails, naming the host.
    catalogue_run(pytester, tmp_path, "mi210-named", SHAPES["mi210"], "--driver=reference")
    done = run_merge_step(tmp_path, ["h100x8", "one-gpu", "mi210-named"])
    assert done.returncode == 1, done.stdout + done.stderr
    failed = json.loads((tmp_path / "fleet" / "conformance.json").read_text())["verdicts"]
    named = failed["reference"]["line"]
    assert named.startswith("reference: FAIL — named but could not run on 1: ")
    assert NO_NVIDIA in named

    # A runner that sent no report fails the gate by its sku, whatever the others said.
    done = run_merge_step(tmp_path, ["h100x8", "one-gpu", "mi210", "l4"])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "::error::the runner of l4 sent no report: it is not counted as a pass" in done.stdout

    # The same host's report twice is refused by name, and nothing is written.
    report = tmp_path / "fleet-reports" / "fleet-report-one-gpu" / "conformance.json"
    again = tmp_path / "fleet-reports" / "fleet-report-again" / "conformance.json"
    again.parent.mkdir()
    again.write_bytes(report.read_bytes())
    out = tmp_path / "refused"
    cli = Path(sys.executable).parent / "gpu-sandbox"
    done = subprocess.run(
        [str(cli), "report", "merge", "--out", str(out), str(report), str(again)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert f"refused: {again}: the same host as {report}" in done.stderr
    assert not out.exists()
