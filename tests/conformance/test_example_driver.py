"""The example driver a driver author copies (examples/drivers/jail.py) passes the catalogue.

It runs as docs/writing-a-driver.md says a driver's own repository runs it: from a directory
outside this checkout, the driver found through PYTHONPATH, on the gate's host layout (the
simulated host of `make conformance`); and the page shows what that run prints.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples" / "drivers"
EXAMPLE = EXAMPLES / "jail.py"
PAGE = ROOT / "docs" / "writing-a-driver.md"
DRIVER = "jail:JailDriver"
MAX_LINES = 200
"""A driver to read in one sitting: the example stays under this many lines."""
COUNTS = re.compile(r"^=+ (\d+ passed(?:, \d+ [a-z]+)*) in [0-9.]+s =+$", re.MULTILINE)
"""pytest's last line, e.g. ``97 passed, 5 skipped``, its timing left out."""


def gate_layout() -> list[str]:
    """The simulated host `make conformance` makes where it finds no GPU: the Makefile's own."""
    makefile = (ROOT / "Makefile").read_text()
    found = dict(re.findall(r"^(SIM_GPUS|SIM_MIG|SIM_DRI) \?= (\S+)$", makefile, re.MULTILINE))
    assert set(found) == {"SIM_GPUS", "SIM_MIG", "SIM_DRI"}, f"the Makefile's layout: {found}"
    return [
        f"--sim-gpus={found['SIM_GPUS']}",
        f"--sim-mig={found['SIM_MIG']}",
        f"--sim-dri={found['SIM_DRI']}",
    ]


def the_verdict(text: str) -> str:
    """The driver's verdict line in a run's output (or the page's copy of one)."""
    lines = [line for line in text.splitlines() if line.startswith(f"{DRIVER}: ")]
    assert len(lines) == 1, f"one verdict line of {DRIVER} expected, found {lines}"
    return lines[0]


def the_counts(text: str) -> str:
    counts = COUNTS.findall(text)
    assert len(counts) == 1, f"one pytest summary line expected, found {counts}"
    return str(counts[0])


def test_the_example_is_small_and_stands_alone() -> None:
    """Under MAX_LINES lines, and of the built-in drivers it imports the contract alone."""
    source = EXAMPLE.read_text()
    assert len(source.splitlines()) < MAX_LINES, f"{EXAMPLE} has grown past {MAX_LINES} lines"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    drivers = sorted(name for name in imported if name.split(".")[0] == "drivers")
    assert drivers == ["drivers.base"], f"{EXAMPLE} imports {drivers}: only the contract"


def test_the_page_shows_the_gate_layout() -> None:
    """The page runs the catalogue on the gate's layout, not on --sim-gpus alone."""
    page = PAGE.read_text()
    for option in gate_layout():
        assert option in page, f"{PAGE.name} does not run the gate's layout ({option})"


def test_the_example_passes_the_catalogue_as_its_page_shows(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PASS, no mandatory requirement failed; the page's verdict and counts are this run's."""
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))  # pytester runs it from a directory of its own
    report = pytester.path / "conformance.json"
    run = pytester.runpytest_subprocess(
        "--pyargs",
        "conformance",
        f"--driver={DRIVER}",
        *gate_layout(),
        "-p",
        "no:cacheprovider",
        f"--conformance-json={report}",
        timeout=600,
    )
    output = run.stdout.str()
    assert run.ret == 0, output[-4000:] + run.stderr.str()[-2000:]
    result = json.loads(report.read_text())
    assert result["verdicts"][DRIVER]["status"] == "PASS", the_verdict(output)
    failed = sorted(
        {
            test["requirement"]
            for test in result["tests"]
            if test["level"] == "mandatory" and test["outcome"] in ("failed", "error")
        }
    )
    assert failed == [], f"{DRIVER} failed mandatory requirements {failed}"
    assert the_verdict(output).startswith(f"{DRIVER}: PASS (")
    page = PAGE.read_text()
    assert the_verdict(page) == the_verdict(output), (
        f"{PAGE.name} shows another verdict than the run's: run examples/drivers/output.sh "
        "and put its output on the page"
    )
    assert the_counts(page) == the_counts(output), (
        f"{PAGE.name} shows other counts than the run's: run examples/drivers/output.sh"
    )


def test_the_pages_excerpts_are_the_examples_own() -> None:
    """Each Python excerpt on the page stands in jail.py as shown: the walk-through is current."""
    source = EXAMPLE.read_text()
    excerpts = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), re.MULTILINE | re.DOTALL)
    assert excerpts, f"{PAGE.name} quotes nothing of {EXAMPLE.name}"
    for excerpt in excerpts:
        assert excerpt in source, (
            f"{PAGE.name} quotes lines {EXAMPLE.name} no longer has:\n{excerpt}"
        )
