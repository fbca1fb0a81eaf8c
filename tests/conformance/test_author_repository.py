"""A driver author's repository with packages of its own named as the suite's, run by file.

The author's ``drivers/`` package holds their driver (the example jail, and a module it
imports relatively) and a ``workloads/`` package that must never be imported in the
suite's place. ``--driver=drivers/mine.py:MyDriver`` finds theirs; the catalogue, its other
processes and the workload plugin find the suite's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from drivers import UnknownDriver, driver_argument, get_driver_class
from tests.conformance.test_example_driver import EXAMPLE

MINE = '''"""The author's driver: the example jail, under a name their own module gives."""

from .jail import JailDriver
from .naming import NAME


class MyDriver(JailDriver):
    name = NAME
'''
SHADOW = "raise ImportError(\"the author's own {0} package, imported in the suite's place\")\n"
REQUIREMENTS = "GPU-DEFAULT-01,GPU-HOSTWIDE-01,SANDBOX-REAP-01,WORKLOAD-CUDA-01"
"""One in this process, one that creates from other processes, one that reaps from a fresh
process, and one of the workload plugin."""


def authors_repository(root: Path) -> Path:
    """``root`` made into the repository; returns the file that holds the driver."""
    for package in ("drivers", "workloads"):
        (root / package).mkdir()
        (root / package / "__init__.py").write_text(SHADOW.format(package))
    (root / "drivers" / "__init__.py").write_text('"""The author\'s drivers."""\n')
    (root / "drivers" / "naming.py").write_text('NAME = "authors-jail"\n')
    shutil.copy(EXAMPLE, root / "drivers" / "jail.py")
    (root / "drivers" / "mine.py").write_text(MINE)
    return root / "drivers" / "mine.py"


def test_a_driver_file_in_a_package_named_drivers_is_loaded_beside_the_suites(
    tmp_path: Path,
) -> None:
    mine = authors_repository(tmp_path)
    cls = get_driver_class(f"{mine}:MyDriver")
    assert cls.name == "authors-jail"  # their own module, imported relatively
    assert cls.__module__.endswith("_drivers.mine")
    assert not cls.__module__.startswith("drivers.")
    assert driver_argument(cls) == f"{mine}:MyDriver"  # what another process is told
    assert get_driver_class(driver_argument(cls)) is cls


def test_a_file_that_is_not_there_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(UnknownDriver, match=r"driver '.*nowhere\.py:X': no file .*nowhere\.py"):
        get_driver_class(f"{tmp_path}/nowhere.py:X")


def test_the_catalogue_judges_the_authors_driver_by_file_from_their_repository(
    pytester: pytest.Pytester,
) -> None:
    """Run as the page says, from the repository: no PYTHONPATH, the driver by its file."""
    authors_repository(pytester.path)
    report = pytester.path / "conformance.json"
    driver = "drivers/mine.py:MyDriver"
    run = pytester.runpytest_subprocess(
        "--pyargs", "conformance", "workloads", f"--driver={driver}", "--sim-gpus=2",
        f"--requirement={REQUIREMENTS}", "-p", "no:cacheprovider",
        f"--conformance-json={report}", timeout=600,
    )  # fmt: skip
    output = run.stdout.str() + run.stderr.str()
    assert "imported in the suite's place" not in output, output[-3000:]
    assert run.ret == 0, output[-4000:]
    result = json.loads(report.read_text())
    ran = {test["requirement"] for test in result["tests"] if test["outcome"] == "passed"}
    assert ran >= {"GPU-DEFAULT-01", "GPU-HOSTWIDE-01", "SANDBOX-REAP-01"}, sorted(ran)
    workload = [test for test in result["tests"] if test["requirement"] == "WORKLOAD-CUDA-01"]
    assert workload, "the workload plugin (the suite's workloads) ran nothing"


def test_a_driver_file_in_no_package_finds_its_neighbours_after_the_suites(
    tmp_path: Path,
) -> None:
    (tmp_path / "naming.py").write_text('NAME = "alone"\n')
    (tmp_path / "drivers").mkdir()  # theirs, beside the file: the suite's comes first
    (tmp_path / "drivers" / "__init__.py").write_text(SHADOW.format("drivers"))
    (tmp_path / "alone.py").write_text(
        "from drivers.reference import ReferenceDriver\nfrom naming import NAME\n\n\n"
        "class Alone(ReferenceDriver):\n    name = NAME\n"
    )
    cls = get_driver_class(f"{tmp_path / 'alone.py'}:Alone")
    assert cls.name == "alone"
    assert get_driver_class(driver_argument(cls)) is cls
