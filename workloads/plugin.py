"""The workload lane's options and fixtures, beside conformance.plugin (drivers, sandboxes).

Each workload of the manifest becomes one test per driver, carrying the workload's
requirement and GPU count as markers, so that conformance.plugin reports and skips it as it
does the conformance tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conformance import requirements
from drivers.base import Driver
from workloads.manifest import MANIFEST, Workload, load_manifest

LANE_MODULE = "workloads.test_workloads"
_manifest_key = pytest.StashKey[tuple[Workload, ...]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu-sandbox")
    group.addoption(
        "--workload-python",
        default=None,
        metavar="PATH",
        help="The Python that runs the payloads inside the sandboxes. Default: this "
        "interpreter for the reference driver (its sandboxes see the host's root), python3 "
        "from the image for the others.",
    )
    group.addoption(
        "--workload-manifest",
        type=Path,
        default=MANIFEST,
        metavar="PATH",
        help="The workloads to run (default: workloads/manifest.yaml).",
    )
    group.addoption(
        "--workload-cpu",
        action="store_true",
        help="Run each payload's CPU mode (NumPy and torch on the CPU) in the sandboxes, "
        "even on simulated GPUs: checks the exec path and the payloads' JSON, not CUDA.",
    )


def manifest(config: pytest.Config) -> tuple[Workload, ...]:
    """The manifest's workloads, loaded once; a bad manifest fails the collection."""
    if _manifest_key not in config.stash:
        config.stash[_manifest_key] = load_manifest(
            config.getoption("--workload-manifest"), set(requirements.load().by_id)
        )
    return config.stash[_manifest_key]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Only the lane's own tests: others may name a parameter "workload" too.
    if "workload" not in metafunc.fixturenames or metafunc.module.__name__ != LANE_MODULE:
        return
    params = []
    for workload in manifest(metafunc.config):
        marks = [pytest.mark.requirement(workload.requirement), pytest.mark.workload]
        if workload.gpus:
            marks.append(pytest.mark.gpus(workload.gpus))
        params.append(pytest.param(workload, marks=marks, id=workload.name))
    metafunc.parametrize("workload", params)


@pytest.fixture
def workload_python(pytestconfig: pytest.Config, driver: Driver) -> str:
    chosen: str | None = pytestconfig.getoption("--workload-python")
    if chosen:
        return chosen
    if not driver.capabilities.host_filesystem:
        return "python3"
    prefix = Path(sys.prefix).resolve()
    if not driver.sees(prefix) or not driver.sees(Path(sys.base_prefix).resolve()):
        pytest.skip(
            f"needed this Python ({sys.base_prefix}) readable by a root-run reference "
            f"sandbox's unprivileged user (found: a directory above it closed to others); "
            "run the suite from a venv of /usr/bin/python3 (make venv does), or name one "
            "with --workload-python"
        )
    return sys.executable


@pytest.fixture
def workload_cpu(pytestconfig: pytest.Config) -> bool:
    return bool(pytestconfig.getoption("--workload-cpu"))
