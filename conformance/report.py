"""Conformance results: one cell per requirement and driver, one verdict per driver.

The plugin (``conftest.py``) records one entry per test with ``entry()``, and at the end
of the run writes them with the run's header as ``conformance.json``. Everything else is
derived from that document, so that

    python -m conformance.report reports/conformance.json

writes the same HTML matrix (``conformance.html``) and Markdown summary
(``conformance.md``) as the run did.

A cell is ``passed`` when all its tests passed, ``partial`` when the others were skipped
(say, for want of GPUs), ``skipped``, ``failed``, ``not applicable`` (the golden list's
profile, or a driver capability, says the requirement does not apply) or ``not run``
(no selected test covered it, or the driver could not run here). A driver's verdict is
``FAIL`` when a mandatory requirement failed, ``NOT RUN`` when it could not run, and
``PASS`` otherwise.
"""

from __future__ import annotations

import argparse
import functools
import html
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

import pytest

Status = Literal["passed", "partial", "failed", "skipped", "not applicable", "not run"]
LABELS: dict[Status, str] = {
    "passed": "pass",
    "partial": "partial",
    "failed": "fail",
    "skipped": "skip",
    "not applicable": "n/a",
    "not run": "not run",
}
MARKS: dict[Status, str] = {
    "passed": "✅",
    "partial": "☑️",
    "failed": "❌",
    "skipped": "⏭️",
    "not applicable": "⚪",
    "not run": "⬜",
}
MESSAGE_CHARS = 300


class Entry(TypedDict):
    """One test's outcome; its properties are also the JUnit test case's."""

    nodeid: str
    requirement: str
    driver: str
    level: str
    outcome: str
    """pytest's: passed, failed or skipped; ``error`` for a failure outside the test."""
    message: str
    unavailable: str
    """Why the driver could not run here, when that is why the test did not run."""
    gpu_model: str
    gpu_count: int
    simulated: bool
    declared: NotRequired[str]
    """The driver's declaration that made the test not applicable (``shared=False``)."""


def entry(report: pytest.TestReport) -> Entry | None:
    """The entry of a test report of a conformance test, or ``None`` for anything else."""
    props = dict(report.user_properties)
    if "requirement" not in props or "driver" not in props:
        return None
    if report.when != "call" and not (report.failed or report.skipped):
        return None
    return Entry(
        nodeid=report.nodeid,
        requirement=str(props["requirement"]),
        driver=str(props["driver"]),
        level=str(props.get("level", "mandatory")),
        outcome="error" if report.failed and report.when != "call" else report.outcome,
        message=_message(report),
        unavailable=str(props.get("unavailable", "")),
        gpu_model=str(props.get("gpu_model", "")),
        gpu_count=int(str(props.get("gpu_count", 0))),
        simulated=props.get("simulated") == "true",
        declared=str(props.get("declared", "")),
    )


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = getattr(crash, "message", None) or str(report.longrepr).strip()
        return str(message).splitlines()[0][:MESSAGE_CHARS]
    return ""


@dataclass(frozen=True)
class Cell:
    status: Status
    level: str
    tests: tuple[Entry, ...]
    reason: str = ""
    """Why the cell has no test outcome of its own (not applicable, not run)."""

    @property
    def message(self) -> str:
        """The first failure's message, else the reason, else the first skip's."""
        failures = [test for test in self.tests if test["outcome"] in ("failed", "error")]
        if failures:
            return failures[0]["message"]
        skips = [test["message"] for test in self.tests if test["outcome"] == "skipped"]
        return self.reason or (skips[0] if skips else "")


@dataclass(frozen=True)
class Verdict:
    driver: str
    status: Literal["PASS", "FAIL", "NOT RUN"]
    detail: str

    @property
    def summary(self) -> str:
        joiner = " — " if self.status != "PASS" else " "
        return f"{self.status}{joiner}{self.detail}"

    @property
    def line(self) -> str:
        return f"{self.driver}: {self.summary}"


@dataclass(frozen=True)
class Results:
    """A run's results: the JSON document's content, and what follows from it."""

    header: dict[str, Any]
    """session, host, hostname, generated, gpu_model, gpu_count, simulated, require_complete"""
    drivers: dict[str, dict[str, Any]]
    """driver → version, explicit (named in --driver)"""
    requirements: list[dict[str, Any]]
    """id, statement, levels (driver → mandatory / optional / not applicable)"""
    tests: list[Entry]

    @functools.cached_property
    def requirement_ids(self) -> list[str]:
        known = [str(row["id"]) for row in self.requirements]
        return known + sorted({test["requirement"] for test in self.tests} - set(known))

    def level(self, requirement: str, driver: str) -> str:
        for row in self.requirements:
            if row["id"] == requirement:
                return str(row["levels"].get(driver, "mandatory"))
        return "mandatory"

    @functools.cached_property
    def cells(self) -> dict[str, dict[str, Cell]]:
        by_cell: dict[tuple[str, str], list[Entry]] = {}
        for test in self.tests:
            by_cell.setdefault((test["requirement"], test["driver"]), []).append(test)
        return {
            req: {
                driver: _cell(self.level(req, driver), tuple(by_cell.get((req, driver), ())))
                for driver in self.drivers
            }
            for req in self.requirement_ids
        }

    @functools.cached_property
    def verdicts(self) -> list[Verdict]:
        return [self._verdict(driver) for driver in self.drivers]

    def _verdict(self, driver: str) -> Verdict:
        cells = {req: row[driver] for req, row in self.cells.items()}
        tests = [test for cell in cells.values() for test in cell.tests]
        unavailable = [test["unavailable"] for test in tests if test["unavailable"]]
        if not tests or len(unavailable) == len(tests):
            return Verdict(driver, "NOT RUN", unavailable[0] if unavailable else "no test ran")
        failed = [req for req, cell in cells.items() if cell.status == "failed"]
        mandatory = [req for req, cell in cells.items() if cell.level == "mandatory"]
        broken = [req for req in failed if req in mandatory]
        if broken:
            first = broken[0]
            more = f" (and {len(broken) - 1} more: {_some(broken[1:])})" if broken[1:] else ""
            return Verdict(driver, "FAIL", f"{first} failed: {cells[first].message}{more}")
        # Counted: what applies to this driver and had a test in this run. A cell the tests
        # found not applicable (a declared capability) is not counted; neither is one no
        # selected test covers (--requirement, or `--pyargs conformance` without workloads),
        # which the verdict names apart.
        applies = [req for req in mandatory if cells[req].status != "not applicable"]
        unselected = [req for req in applies if not cells[req].tests]
        counted = [req for req in applies if cells[req].tests]
        passed = [req for req in counted if cells[req].status == "passed"]
        if not passed:
            # A PASS with nothing passed would let a lane that never ran through a gate.
            return Verdict(driver, "NOT RUN", _why_none_ran(cells, unavailable, applies))
        unchecked = [req for req in counted if req not in passed]
        if self.header.get("require_complete") and (unchecked or unselected):
            missing = [*unchecked, *unselected]
            first = missing[0]
            why = cells[first].message or "no test of it ran"
            more = f" (and {len(missing) - 1} more: {_some(missing[1:])})" if missing[1:] else ""
            return Verdict(
                driver,
                "FAIL",
                f"{first} not fully checked, and --require-complete asks it: {why}{more}",
            )
        detail = f"{len(passed)}/{len(counted)} mandatory passed"
        if unchecked:
            detail += f", {len(unchecked)} not fully checked: {_some(unchecked)}"
        if unselected:
            detail += f"; {len(unselected)} not run (no test selected): {_some(unselected)}"
        declared = {
            req: test["declared"]
            for req in mandatory
            if cells[req].status == "not applicable"
            for test in cells[req].tests
            if test.get("declared")
        }
        if declared:
            left_out = [f"{req} ({declaration})" for req, declaration in declared.items()]
            detail += f"; {len(left_out)} left out by its declarations: {_some(left_out)}"
        optional_failed = len([req for req in failed if cells[req].level == "optional"])
        return Verdict(driver, "PASS", f"({detail}; {optional_failed} optional failed)")

    @property
    def nothing_ran(self) -> bool:
        """Every test was skipped: the run checked nothing."""
        return bool(self.tests) and all(test["outcome"] == "skipped" for test in self.tests)

    def gate_fails(self) -> bool:
        """A mandatory requirement failed, or a driver named in --driver could not run."""
        return any(
            verdict.status == "FAIL"
            or (verdict.status == "NOT RUN" and self.drivers[verdict.driver]["explicit"])
            for verdict in self.verdicts
        )

    def optional_failures(self) -> int:
        """How many failed test reports are of optional requirements (they do not gate)."""
        return sum(
            test["outcome"] in ("failed", "error") and test["level"] == "optional"
            for test in self.tests
        )

    @property
    def matrix(self) -> dict[str, dict[str, str]]:
        """Requirement → driver → status, the shape of the JSON's ``matrix``."""
        return {
            req: {driver: cell.status for driver, cell in row.items()}
            for req, row in self.cells.items()
        }

    def to_json(self) -> dict[str, Any]:
        return {
            **self.header,
            "drivers": self.drivers,
            "requirements": self.requirements,
            "tests": self.tests,
            "matrix": self.matrix,
            "verdicts": {v.driver: {"status": v.status, "line": v.line} for v in self.verdicts},
        }

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> Results:
        derived = ("drivers", "requirements", "tests", "matrix", "verdicts")
        return cls(
            header={key: value for key, value in document.items() if key not in derived},
            drivers=document["drivers"],
            requirements=document["requirements"],
            tests=document["tests"],
        )


def _why_none_ran(cells: dict[str, Cell], unavailable: list[str], applies: list[str]) -> str:
    """Why no mandatory requirement of a driver passed, none having failed."""
    if unavailable:
        return unavailable[0]
    reasons = [cells[req].message for req in applies if cells[req].message]
    if reasons:
        return f"no mandatory requirement passed; {len(applies)} not checked, first: {reasons[0]}"
    return "no mandatory requirement passed: none was selected"


def _some(names: list[str], most: int = 4) -> str:
    """Up to ``most`` names, and how many more: a verdict stays one readable line."""
    shown = ", ".join(names[:most])
    return f"{shown} and {len(names) - most} more" if len(names) > most else shown


def _cell(level: str, tests: tuple[Entry, ...]) -> Cell:
    if level == "not applicable":
        return Cell("not applicable", level, tests, "the golden list's profile excludes it")
    applicable = tuple(test for test in tests if test["level"] != "not applicable")
    if not tests:
        return Cell("not run", level, tests, "no selected test covers it")
    if not applicable:
        return Cell("not applicable", level, tests)
    if all(test["unavailable"] for test in applicable):
        return Cell("not run", level, tests, applicable[0]["unavailable"])
    outcomes = {test["outcome"] for test in applicable}
    if outcomes & {"failed", "error"}:
        return Cell("failed", level, tests)
    if outcomes == {"passed"}:
        return Cell("passed", level, tests)
    return Cell("partial" if "passed" in outcomes else "skipped", level, tests)


# -- renderings -------------------------------------------------------------------------


def gpus_line(results: Results) -> str:
    header = results.header
    if not header.get("gpu_count"):
        return "no GPUs found"
    kind = "SIMULATED" if header.get("simulated") else "real"
    return f"{header['gpu_count']} x {header['gpu_model']} ({kind})"


def text_table(results: Results) -> list[str]:
    drivers = list(results.drivers)
    first = max(len("requirement"), *(len(req) for req in results.cells)) + 2
    width = max(len("not applicable"), *(len(driver) for driver in drivers)) + 2
    lines = ["requirement".ljust(first) + "".join(driver.ljust(width) for driver in drivers)]
    for req, row in results.cells.items():
        statuses = (row[driver].status for driver in drivers)
        lines.append(req.ljust(first) + "".join(status.ljust(width) for status in statuses))
    return [line.rstrip() for line in lines]


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d1d1f; }
h1 { font-size: 1.4em; margin: 0 0 .5em; }
dl.header { display: grid; grid-template-columns: max-content auto; gap: .2em 1em; }
dl.header dt { font-weight: 600; }
dl.header dd { margin: 0; }
.simulated { color: #9a3412; font-weight: 600; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #d0d0d7; padding: .3em .6em; text-align: left; vertical-align: top; }
thead th { background: #f3f3f6; }
th .version, th .statement { display: block; font-weight: normal; color: #555; }
th .statement { max-width: 40em; font-size: .85em; }
td.cell { min-width: 7em; }
td.cell details summary { cursor: pointer; font-weight: 600; }
td.cell ul { margin: .3em 0 0; padding-left: 1.2em; font-size: .85em; max-width: 40em; }
.passed { background: #dcfce7; } .partial { background: #ecfccb; }
.failed { background: #fee2e2; } .skipped { background: #fef9c3; }
.not-applicable { background: #f4f4f5; color: #71717a; } .not-run { background: #fff; }
.level { font-size: .75em; color: #555; font-weight: normal; }
.verdict-PASS { color: #166534; } .verdict-FAIL { color: #b91c1c; }
.verdict-NOT-RUN { color: #92400e; }
"""


def _css(status: str) -> str:
    return status.replace(" ", "-")


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _html_cell(cell: Cell) -> str:
    tagged = cell.level == "optional" and cell.status != "not applicable"
    level = ' <span class="level">optional</span>' if tagged else ""
    items = [f"<li>{_e(cell.reason)}</li>"] if cell.reason else []
    for test in cell.tests:
        said = f": {test['message']}" if test["message"] else ""
        items.append(f"<li><code>{_e(test['nodeid'])}</code> {_e(test['outcome'])}{_e(said)}</li>")
    return (
        f'<td class="cell {_css(cell.status)}"><details><summary>{_e(LABELS[cell.status])}'
        f"{level}</summary><ul>{''.join(items)}</ul></details></td>"
    )


def to_html(results: Results) -> str:
    header = results.header
    gpus = _e(gpus_line(results))
    if header.get("simulated"):
        gpus = f'<span class="simulated">{gpus}</span>'
    info = [
        ("Host", _e(header.get("hostname", ""))),
        ("GPUs", gpus),
        ("Date", _e(header.get("generated", ""))),
        ("Session", _e(header.get("session", ""))),
    ]
    verdicts = "".join(
        f'<li class="verdict-{_css(v.status)}"><strong>{_e(v.driver)}</strong>: '
        f"{_e(v.summary)}</li>"
        for v in results.verdicts
    )
    columns = "".join(
        f'<th scope="col">{_e(name)}<span class="version">{_e(version)}</span></th>'
        for name, version in ((name, _version(results, name)) for name in results.drivers)
    )
    statements = {str(row["id"]): str(row["statement"]) for row in results.requirements}
    rows = "".join(
        f'<tr><th scope="row">{_e(req)}<span class="statement">{_e(statements.get(req, ""))}'
        f"</span></th>{''.join(_html_cell(cell) for cell in row.values())}</tr>"
        for req, row in results.cells.items()
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>GPU sandbox conformance: {_e(header.get('hostname', ''))}</title>"
        f"<style>{STYLE}</style></head><body>\n<h1>GPU sandbox conformance</h1>\n"
        '<dl class="header">'
        + "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in info)
        + f'</dl>\n<ul class="verdicts">{verdicts}</ul>\n'
        f'<table class="matrix"><thead><tr><th scope="col">requirement</th>{columns}</tr>'
        f"</thead>\n<tbody>{rows}</tbody></table>\n"
        "<p>Each cell: pass, partial (the other tests were skipped), fail, skip, n/a (not "
        "applicable) or not run; open it for its tests and their messages. Cells marked "
        "optional do not gate a release.</p>\n</body></html>\n"
    )


def _version(results: Results, driver: str) -> str:
    """A driver's version for a column header; "not running" for one that could not run.

    Why it could not is in its verdict, once, not in a header's wall of exception text.
    """
    verdicts = {verdict.driver: verdict for verdict in results.verdicts}
    if verdicts[driver].status == "NOT RUN":
        return "not running"
    return str(results.drivers[driver].get("version") or "")


def _md(value: object) -> str:
    """Text safe in a Markdown table cell: escaped HTML, no pipes, one line."""
    return html.escape(" ".join(str(value).split())).replace("|", "\\|")


def to_markdown(results: Results) -> str:
    drivers = list(results.drivers)
    lines = [
        "## GPU sandbox conformance",
        "",
        f"**Host** {_md(results.header.get('hostname', ''))} · **GPUs** "
        f"{_md(gpus_line(results))} · **Date** {_md(results.header.get('generated', ''))}",
        "",
        "| driver | version | verdict |",
        "|---|---|---|",
    ]
    for verdict in results.verdicts:
        version = _version(results, verdict.driver)
        lines.append(f"| {_md(verdict.driver)} | {_md(version)} | {_md(verdict.summary)} |")
    lines += ["", f"| requirement | {' | '.join(_md(d) for d in drivers)} |"]
    lines.append("|---" * (len(drivers) + 1) + "|")
    notes = []
    for req, row in results.cells.items():
        marks = []
        for driver, cell in row.items():
            optional = " (optional)" if cell.level == "optional" else ""
            marks.append(f"{MARKS[cell.status]} {LABELS[cell.status]}{optional}")
            if cell.status in ("failed", "partial", "skipped", "not run") and cell.message:
                notes.append(
                    f"- **{_md(req)}** on {_md(driver)}: {cell.status}: {_md(cell.message)}"
                )
        lines.append(f"| {_md(req)} | {' | '.join(marks)} |")
    if notes:
        lines += [
            "",
            "<details><summary>Failures and skips</summary>",
            "",
            *notes,
            "",
            "</details>",
        ]
    return "\n".join(lines) + "\n"


def write(
    results: Results,
    json_path: Path | None = None,
    html_path: Path | None = None,
    md_path: Path | None = None,
) -> None:
    """Write whichever of the JSON document, the HTML page and the Markdown is asked for."""
    if json_path:
        _write(json_path, json.dumps(results.to_json(), indent=2) + "\n")
    if html_path:
        _write(html_path, to_html(results))
    if md_path:
        _write(md_path, to_markdown(results))


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.report",
        description="Write the HTML matrix and the Markdown summary of a conformance run.",
    )
    parser.add_argument("json", type=Path, help="the run's conformance.json")
    parser.add_argument("--html", type=Path, help="default: beside the JSON, .html")
    parser.add_argument("--markdown", type=Path, help="default: beside the JSON, .md")
    args = parser.parse_args(None if argv is None else list(argv))
    results = Results.from_json(json.loads(args.json.read_text()))
    html_path = args.html or args.json.with_suffix(".html")
    md_path = args.markdown or args.json.with_suffix(".md")
    write(results, html_path=html_path, md_path=md_path)
    for verdict in results.verdicts:
        print(verdict.line)  # noqa: T201
    print(f"wrote {html_path} and {md_path}")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
