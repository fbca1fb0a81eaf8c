"""Running the conformance catalogue from a self-test: in a subprocess, on a simulated host.

``run_catalogue`` runs it against one driver and returns its JSON report;
``assert_fails_its_requirement`` checks that a planted broken driver (``tests/breakers/``)
fails the requirement it breaks, and the run with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuhost import simulated
from workloads.manifest import REQUIREMENT_PREFIX

ROOT = Path(__file__).parent.parent
MIG_LAYOUT = simulated.parse_mig_layout("0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb")
DRI_LAYOUT = simulated.parse_dri_layout("intel:1,amd:2")
MESSAGE_SHOWN = 600
"""Of each failed test's message in ``what_failed``: its reason, not its whole traceback."""


def golden_ids() -> set[str]:
    """The conformance catalogue's requirements (the workload lane's need a real GPU)."""
    text = (ROOT / "conformance" / "REQUIREMENTS.yaml").read_text()
    ids = {str(entry["id"]) for entry in yaml.safe_load(text)["requirements"]}
    return {i for i in ids if not i.startswith(REQUIREMENT_PREFIX)}


BUSYBOX_KEY_CASE = "needs python3 in the sandbox to add a kernel key (found none)"


def without_the_busybox_key_case(result: dict[str, Any], driver: str) -> dict[str, str]:
    """The run's verdicts for ``driver``, SANDBOX-PEER-01 taken out once shown partial.

    The lanes' busybox image has no program that adds a kernel key: that case is left out,
    named, and the requirement is partial, never passed.
    """
    verdicts = {req: cells[driver] for req, cells in result["matrix"].items()}
    assert verdicts.pop("SANDBOX-PEER-01") == "partial"
    skipped = [t["message"] for t in result["tests"] if t["requirement"] == "SANDBOX-PEER-01"
               and t["outcome"] == "skipped"]  # fmt: skip
    assert skipped == [BUSYBOX_KEY_CASE]
    return verdicts


def partial_by_what_it_dropped(
    verdicts: dict[str, str], result: dict[str, Any], requirement: str
) -> None:
    """``requirement``'s cell, popped from ``verdicts``, is partial only for cases dropped by name.

    Every test of it passed; at least one left a case out, naming it (a way of ending the host
    cannot see on this lane), and none was skipped.
    """
    assert verdicts.pop(requirement) == "partial"
    tests = [t for t in result["tests"] if t["requirement"] == requirement]
    assert tests, f"no test of {requirement} ran"
    assert all(t["outcome"] == "passed" for t in tests), tests
    assert any(t.get("dropped") for t in tests), tests


def what_failed(result: dict[str, Any], driver: str) -> str:
    """Each test of ``driver`` that failed or erred, by requirement, with its message.

    The message of an assertion on a catalogue run's verdicts: a CI log keeps only part of a
    failure's output, and the verdicts alone do not say why.
    """
    return "\n".join(
        f"{test['requirement']} {test['nodeid'].rpartition('::')[2]} {test['outcome']}: "
        f"{test['message'][:MESSAGE_SHOWN]}"
        for test in result["tests"]
        if test["driver"] == driver and test["outcome"] in ("failed", "error")
    )


def planted_name(broken: type) -> str:
    """A planted broken driver's ``--driver`` import path: ``tests.breakers.mig:MigAllCaps``."""
    return f"{broken.__module__}:{broken.__qualname__}"


def run_catalogue(
    pytester: pytest.Pytester,
    tmp_path: Path,
    driver: str,
    gpus: int = 8,
    *args: str,
    sim_root: Path | None = None,
    full: bool = True,
) -> tuple[dict[str, Any], pytest.RunResult]:
    """Run the conformance catalogue against ``driver``; ``args`` go to pytest.

    The host is a fresh simulated one of ``gpus`` GPUs, unless ``sim_root`` names one;
    ``full``: two of them in MIG mode, and AMD and Intel GPUs beside them.
    """
    if sim_root is None:
        mig, dri = (MIG_LAYOUT, DRI_LAYOUT) if full else (None, None)
        sim_root = simulated.setup(tmp_path / "sim", gpus, mig=mig, dri=dri).root
    root = sim_root
    report = tmp_path / "conformance.json"
    run = pytester.runpytest_subprocess(
        str(ROOT / "conformance"),
        f"--rootdir={ROOT}",
        "-c",
        str(ROOT / "pytest.ini"),
        "-p",
        "no:cacheprovider",
        f"--driver={driver}",
        f"--sim-root={root}",
        "--reclaim-timeout=2",
        f"--conformance-json={report}",
        *args,
        timeout=600,
    )
    assert report.exists(), "the catalogue run wrote no report"
    result: dict[str, Any] = json.loads(report.read_text())
    return result, run


def assert_fails_its_requirement(
    pytester: pytest.Pytester, tmp_path: Path, broken: type, gpus: int, *args: str
) -> None:
    """The catalogue run on ``broken`` (one ``BREAKS`` requirement) fails it, and the run."""
    __tracebackhide__ = True
    name = planted_name(broken)
    requirement: str = broken.BREAKS  # type: ignore[attr-defined]
    result, run = run_catalogue(
        pytester, tmp_path, name, gpus, *args, f"--requirement={requirement}", full=False
    )
    explained = f"{broken.__name__} ({broken.__doc__}) breaks {requirement}: {result['tests']}"
    assert result["matrix"][requirement][name] == "failed", explained
    assert [test for test in result["tests"] if test["outcome"] == "failed"], explained
    run.stdout.fnmatch_lines([f"{name}: FAIL — *{requirement}*"])
