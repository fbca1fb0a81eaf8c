"""Conformance results: one cell per requirement and driver, one verdict per driver.

The plugin's recorder (``conformance.recorder``) records one entry per test with
``entry()``, and at the end of the run writes them with the run's header as
``conformance.json``. Everything else is derived from that document (``conformance.render``),
so that

    python -m conformance.report reports/conformance.json

writes the same HTML matrix (``conformance.html``) and Markdown summary
(``conformance.md``) as the run did.

A cell is ``passed`` when all its tests passed and tried every case, ``partial`` when the
others were skipped (say, for want of GPUs) or a test passed without some cases of its
requirement that this host cannot show (``fixtures.dropped``), ``skipped``, ``failed``,
``not applicable`` (the golden list's profile, or a driver capability, says the requirement
does not apply) or ``not run`` (no selected test covered it, or the driver could not run
here). A driver's verdict is
``FAIL`` when a mandatory requirement failed, ``NOT RUN`` when it could not run, and
``PASS`` otherwise.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

import pytest

from conformance.render import visible, write
from gpuhost import strict

Status = Literal["passed", "partial", "failed", "skipped", "not applicable", "not run"]
MESSAGE_CHARS = 300
MAX_REPORT_BYTES = 256 << 20
"""A results document read back: far over a whole catalogue's of every driver (a few MiB)."""


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
    dropped: NotRequired[str]
    """The cases of its requirement a passed test could not try on this host, with why
    (``fixtures.dropped``): its cell is partial, never passed."""


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
        dropped="; ".join(str(value) for key, value in report.user_properties if key == "dropped"),
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
        dropped = [test["dropped"] for test in self.tests if test.get("dropped")]
        return (
            self.reason
            or (skips[0] if skips else "")
            or (f"cases not tried here: {dropped[0]}" if dropped else "")
        )


@dataclass(frozen=True)
class Verdict:
    driver: str
    status: Literal["PASS", "FAIL", "NOT RUN"]
    detail: str
    """One line, its control characters written out (``render.visible``): it quotes what
    drivers and payloads said, and goes to the terminal as it is."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "driver", visible(self.driver))
        object.__setattr__(self, "detail", visible(self.detail))

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
    """session, host, hostname, generated, gpu_model, gpu_count, simulated, require_complete;
    catalogue, host_id and gpus (``conformance.identity``), which a fleet report needs"""
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
    def checked(cls, document: object) -> Results:
        """The results of a document read back, once it is one (``RESULTS_SCHEMA``).

        ``InvalidResults`` naming the first field that is not as the recorder writes it.
        """
        import jsonschema  # a dependency of the plugin's; imported where a report is read

        validator = jsonschema.Draft202012Validator(RESULTS_SCHEMA)
        for error in validator.iter_errors(document):
            field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.path)
            raise InvalidResults(field.lstrip(".") or "(document)", error.message)
        assert isinstance(document, dict)
        return cls.from_json(document)

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> Results:
        derived = ("drivers", "requirements", "tests", "matrix", "verdicts")
        return cls(
            header={key: value for key, value in document.items() if key not in derived},
            drivers=document["drivers"],
            requirements=document["requirements"],
            tests=document["tests"],
        )

    @classmethod
    def merged(cls, parts: Sequence[Results]) -> Results:
        """One run's results from its lanes' (``conformance.lanes``), in the lanes' order.

        The header is the first lane's, its session each lane's in turn (and its host, when
        each lane had a simulated host of its own, says so); a requirement's levels are each
        lane's for its own drivers.
        """
        first = parts[0]
        sessions = ", ".join(str(part.header["session"]) for part in parts)
        host = str(first.header["host"])
        if len({part.header["host"] for part in parts}) > 1:
            host += f"; each of the {len(parts)} lanes had a host like it of its own"
        levels: dict[str, dict[str, str]] = {}
        for part in parts:
            for row in part.requirements:
                levels.setdefault(str(row["id"]), {}).update(row["levels"])
        return cls(
            header={**first.header, "session": sessions, "host": host},
            drivers={name: info for part in parts for name, info in part.drivers.items()},
            requirements=[{**row, "levels": levels[str(row["id"])]} for row in first.requirements],
            tests=[test for part in parts for test in part.tests],
        )


class InvalidResults(ValueError):
    """A results document that is not as the recorder writes it: ``field`` is where."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {visible(problem)[:300]}")
        self.field = field


_TEXT = {"type": "string"}
_ENTRY_TEXT = (
    "nodeid", "requirement", "driver", "level", "message", "unavailable", "gpu_model", "declared",
    "dropped",
)  # fmt: skip
_ENTRY_OPTIONAL = ("declared", "dropped")
_GPU_GROUP = {
    "type": "object",
    "additionalProperties": False,
    "required": ["vendor", "model", "count", "mig_gpus", "mig_instances", "driver"],
    "properties": {
        **{key: _TEXT for key in ("vendor", "model", "driver")},
        "count": {"type": "integer", "minimum": 1},
        "mig_gpus": {"type": "integer", "minimum": 0},
        "mig_instances": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
}
"""One vendor and model of the host's GPUs (``conformance.identity.gpu_groups``)."""
RESULTS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["session", "simulated", "host", "drivers", "requirements", "tests"],
    "properties": {
        **{
            key: _TEXT
            for key in ("session", "host", "hostname", "generated", "gpu_model", "runs_on")
        },
        "simulated": {"type": "boolean"},
        "require_complete": {"type": "boolean"},
        "gpu_count": {"type": "integer", "minimum": 0},
        "catalogue": {"type": "string", "pattern": "^sha256:[0-9a-f]{16}$"},
        "host_id": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
        "gpus": {"type": "array", "items": _GPU_GROUP},
        "drivers": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["version", "explicit"],
                "properties": {"version": _TEXT, "explicit": {"type": "boolean"}},
            },
        },
        "requirements": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["id", "statement", "levels"],
                "properties": {
                    "id": _TEXT,
                    "statement": _TEXT,
                    "levels": {
                        "type": "object",
                        "additionalProperties": {
                            "enum": ["mandatory", "optional", "not applicable"]
                        },
                    },
                },
            },
        },
        "tests": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": [key for key in _ENTRY_TEXT if key not in _ENTRY_OPTIONAL]
                + ["outcome", "gpu_count", "simulated"],
                "properties": {
                    **{key: _TEXT for key in _ENTRY_TEXT},
                    "outcome": {"enum": ["passed", "failed", "skipped", "error"]},
                    "gpu_count": {"type": "integer", "minimum": 0},
                    "simulated": {"type": "boolean"},
                },
            },
        },
        "matrix": {"type": "object"},
        "verdicts": {"type": "object"},
    },
}
"""What ``Results.to_json`` writes; a document read back is held to it (``Results.checked``)."""


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
    if any(test.get("dropped") for test in applicable if test["outcome"] == "passed"):
        return Cell("partial", level, tests)
    if outcomes == {"passed"}:
        return Cell("passed", level, tests)
    return Cell("partial" if "passed" in outcomes else "skipped", level, tests)


# -- renderings -------------------------------------------------------------------------


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.report",
        description="Write the HTML matrix and the Markdown summary of a conformance run.",
    )
    parser.add_argument("json", type=Path, help="the run's conformance.json")
    parser.add_argument("--html", type=Path, help="default: beside the JSON, .html")
    parser.add_argument("--markdown", type=Path, help="default: beside the JSON, .md")
    args = parser.parse_args(None if argv is None else list(argv))
    results = Results.checked(strict.read_json(args.json, max_bytes=MAX_REPORT_BYTES))
    html_path = args.html or args.json.with_suffix(".html")
    md_path = args.markdown or args.json.with_suffix(".md")
    write(results, html_path=html_path, md_path=md_path)
    for verdict in results.verdicts:
        print(verdict.line)  # noqa: T201
    print(f"wrote {html_path} and {md_path}")  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
