"""Many hosts' reports, one verdict: the catalogue across a fleet.

    gpu-sandbox report merge --out DIR REPORT.json...

Each report is a run's ``conformance.json`` (``--conformance-json``) on one host, or a fleet
report made before (its hosts are taken one by one). ``load`` reads them and ``Fleet`` holds
their hosts, drivers and requirements: each host's own cells and verdicts, as its run judged
them (derived again from its tests, never taken from the document), and over the fleet

- **a verdict per driver**: ``FAIL`` where it failed on any host, or could not run on a
  host whose run named it (``--driver``); ``PASS`` where it passed on every host it ran on,
  the hosts where it did not run (or that have no column of it) named beside it and never
  counted as passes; ``NOT RUN`` where it ran on none;
- **a cell per requirement and driver**: ``failed`` where any host's failed, ``passed``
  where it passed on every host the driver ran on, ``partial`` where it passed on some,
  else what the hosts say (skipped, not run, not applicable); each lists its hosts.

The gate fails when a driver's verdict over the fleet is FAIL, or when nothing ran at all.
Refused, each naming the report (``FleetError``): a file that is not a results document
(corrupt, truncated, not JSON, not as the recorder writes it), one without the catalogue's
version or the host's identity (a suite before they were recorded), one of another
catalogue version than the first's (or of other requirements under the same version), and
a host already merged, by its identity (``conformance.identity``), naming both reports.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from conformance.render import gpus_of, visible
from conformance.report import (
    MAX_REPORT_BYTES,
    RESULTS_SCHEMA,
    Cell,
    InvalidResults,
    Results,
    Status,
    Verdict,
)
from gpuhost import strict

HOSTNAME_CHARS = 64
"""What of a report's hostname names its host: a hostname is at most 64 characters."""
FLEET_KEYS = ("catalogue", "generated", "hosts", "drivers", "requirements", "matrix", "verdicts")
_HOST_ENTRY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "source", "report"],
    "properties": {
        **{key: {"type": "string"} for key in ("name", "source", "gpus")},
        "report": {},
    },
}
FLEET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["catalogue", "hosts"],
    "properties": {
        "catalogue": RESULTS_SCHEMA["properties"]["catalogue"],
        "generated": {"type": "string"},
        "hosts": {"type": "array", "items": _HOST_ENTRY},
        **{key: {"type": "object"} for key in ("drivers", "matrix", "verdicts")},
        "requirements": {"type": "array"},
    },
}
"""A fleet report read back: its hosts' reports are each held to ``RESULTS_SCHEMA``."""
NEEDED = ("catalogue", "host_id", "gpus")
"""What a run's header must hold to be merged (``conformance.identity``)."""


class FleetError(ValueError):
    """A report that cannot be merged: ``source`` names it."""

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(visible(f"{source}: {problem}")[:600])
        self.source = source


@dataclass(frozen=True)
class Host:
    name: str
    """Its hostname; with its identity's first digits where another host has the same."""
    source: str
    """The report it came from, as given."""
    results: Results

    @property
    def host_id(self) -> str:
        return str(self.results.header["host_id"])

    @functools.cached_property
    def verdicts(self) -> dict[str, Verdict]:
        return {verdict.driver: verdict for verdict in self.results.verdicts}


@dataclass(frozen=True)
class FleetCell:
    status: Status
    level: str
    hosts: dict[str, Cell | None]
    """Host name → its cell; ``None`` where the host's report has no column of the driver."""

    def count(self, status: Status) -> int:
        return sum(cell is not None and cell.status == status for cell in self.hosts.values())


@dataclass(frozen=True)
class Fleet:
    hosts: tuple[Host, ...]
    generated: str

    @property
    def catalogue(self) -> str:
        return str(self.hosts[0].results.header["catalogue"])

    @functools.cached_property
    def drivers(self) -> list[str]:
        """Every host's drivers, in the order the reports first name them."""
        return list(dict.fromkeys(d for host in self.hosts for d in host.results.drivers))

    @functools.cached_property
    def requirements(self) -> list[dict[str, Any]]:
        """The catalogue's requirements, each with every driver's level on the hosts."""
        levels: dict[str, dict[str, str]] = {}
        for host in self.hosts:
            for row in host.results.requirements:
                levels.setdefault(str(row["id"]), {}).update(row["levels"])
        first = self.hosts[0].results.requirements
        return [{**row, "levels": levels[str(row["id"])]} for row in first]

    @functools.cached_property
    def requirement_ids(self) -> list[str]:
        return list(dict.fromkeys(r for host in self.hosts for r in host.results.requirement_ids))

    def verdict_on(self, driver: str, host: Host) -> Verdict | None:
        """The driver's verdict on the host; ``None`` where its report has no such column."""
        return host.verdicts.get(driver)

    @functools.cached_property
    def cells(self) -> dict[str, dict[str, FleetCell]]:
        return {
            req: {driver: self._cell(req, driver) for driver in self.drivers}
            for req in self.requirement_ids
        }

    def _cell(self, req: str, driver: str) -> FleetCell:
        hosts: dict[str, Cell | None] = {}
        for host in self.hosts:
            row = host.results.cells.get(req, {})
            hosts[host.name] = row.get(driver)
        ran = [
            cell
            for host in self.hosts
            if (cell := hosts[host.name]) is not None
            and host.verdicts[driver].status != "NOT RUN"
            and cell.status != "not applicable"
        ]
        levels = [cell.level for cell in hosts.values() if cell is not None]
        level = "mandatory" if "mandatory" in levels else (levels[0] if levels else "mandatory")
        return FleetCell(_fleet_status(hosts, ran), level, hosts)

    @functools.cached_property
    def verdicts(self) -> list[Verdict]:
        return [self._verdict(driver) for driver in self.drivers]

    def _verdict(self, driver: str) -> Verdict:
        total = len(self.hosts)
        on = {host.name: self.verdict_on(driver, host) for host in self.hosts}
        ran = [name for name, verdict in on.items() if verdict and verdict.status != "NOT RUN"]
        failed = [name for name, verdict in on.items() if verdict and verdict.status == "FAIL"]
        not_run = [
            f"{name} ({verdict.detail if verdict else 'not in its report'})"
            for name, verdict in on.items()
            if name not in ran
        ]
        named = [
            f"{host.name} ({verdict.detail})"
            for host in self.hosts
            if (verdict := on[host.name]) is not None
            and verdict.status == "NOT RUN"
            and host.results.drivers[driver]["explicit"]
        ]
        if failed or named:
            parts = []
            if failed:
                first = on[failed[0]]
                assert first is not None
                more = f"; also on {_some(failed[1:])}" if failed[1:] else ""
                parts.append(
                    f"failed on {len(failed)} of the {len(ran)} hosts it ran on, first "
                    f"{failed[0]}: {first.detail}{more}"
                )
            if named:
                parts.append(f"named but could not run on {len(named)}: {_some(named)}")
            return Verdict(driver, "FAIL", "; ".join(parts))
        if not ran:
            return Verdict(driver, "NOT RUN", f"ran on none of the {total} hosts: {not_run[0]}")
        detail = f"passed on every host it ran on, {len(ran)} of {total}"
        if not_run:
            detail += f"; not run on {len(not_run)}, not counted: {_some(not_run)}"
        return Verdict(driver, "PASS", f"({detail})")

    @property
    def nothing_ran(self) -> bool:
        return all(host.results.nothing_ran or not host.results.tests for host in self.hosts)

    def gate_fails(self) -> bool:
        """A driver failed the fleet (on a host, or named where it could not run), or none ran."""
        return self.nothing_ran or any(v.status == "FAIL" for v in self.verdicts)

    def to_json(self) -> dict[str, Any]:
        names = [host.name for host in self.hosts]
        return {
            "catalogue": self.catalogue,
            "generated": self.generated,
            "hosts": [
                {
                    "name": host.name,
                    "gpus": gpus_of(host.results.header),
                    "source": host.source,
                    "report": host.results.to_json(),
                }
                for host in self.hosts
            ],
            "drivers": {
                driver: {
                    name: str(host.results.drivers[driver]["version"])
                    for name, host in zip(names, self.hosts, strict=True)
                    if driver in host.results.drivers
                }
                for driver in self.drivers
            },
            "requirements": self.requirements,
            "matrix": {
                req: {
                    driver: {
                        "status": cell.status,
                        "hosts": {
                            name: each.status if each else "not run"
                            for name, each in cell.hosts.items()
                        },
                    }
                    for driver, cell in row.items()
                }
                for req, row in self.cells.items()
            },
            "verdicts": {
                verdict.driver: {
                    "status": verdict.status,
                    "line": verdict.line,
                    "hosts": {
                        host.name: (self.verdict_on(verdict.driver, host) or _ABSENT).status
                        for host in self.hosts
                    },
                }
                for verdict in self.verdicts
            },
        }


_ABSENT = Verdict("", "NOT RUN", "not in its report")


def _fleet_status(hosts: dict[str, Cell | None], ran: list[Cell]) -> Status:
    """A requirement's status over the hosts; ``ran``: the cells of hosts its driver ran on."""
    statuses = {cell.status for cell in ran}
    if "failed" in statuses:
        return "failed"
    if not ran:
        present = [cell.status for cell in hosts.values() if cell is not None]
        if present and all(status == "not applicable" for status in present):
            return "not applicable"
        return "not run"
    if statuses == {"passed"}:
        return "passed"
    if statuses & {"passed", "partial"}:
        return "partial"
    return "skipped" if "skipped" in statuses else "not run"


def _some(names: Sequence[str], most: int = 3) -> str:
    shown = ", ".join(names[:most])
    return f"{shown} and {len(names) - most} more" if len(names) > most else shown


# -- reading the reports ----------------------------------------------------------------------


def load(paths: Iterable[Path], generated: str | None = None) -> Fleet:
    """The fleet of the reports at ``paths``, in their order; else ``FleetError`` naming one."""
    hosts: list[Host] = []
    first: Host | None = None
    seen: dict[str, Host] = {}
    for path in paths:
        for source, results in _read(path):
            host = Host("", source, results)
            if first is None:
                first = host
            _check_against(host, first)
            if host.host_id in seen:
                other = seen[host.host_id]
                raise FleetError(
                    source,
                    f"the same host as {other.source} (hostname "
                    f"{_hostname(results)!r}, host_id {host.host_id}): each host's report "
                    "once (docs/ci.md: A fleet's verdict)",
                )
            seen[host.host_id] = host
            hosts.append(host)
    if not hosts:
        raise FleetError("(no report)", "give at least one report to merge")
    return Fleet(_named(hosts), generated or datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))


def _read(path: Path) -> list[tuple[str, Results]]:
    """The run reports of the file: itself, or each host of a fleet report."""
    source = str(path)
    document = strict.read_json(path, _unreadable, MAX_REPORT_BYTES)
    if isinstance(document, dict) and "hosts" in document:
        _check_fleet(source, document)
        return [
            (f"{source} [{entry['name']}]", _checked(f"{source}: hosts[{index}].report", doc))
            for index, entry in enumerate(document["hosts"])
            for doc in (entry["report"],)
        ]
    return [(source, _checked(source, document))]


def _unreadable(path: Path, field: str, value: object, problem: str) -> FleetError:
    return FleetError(str(path), f"not a conformance report: {field}: {problem}")


def _check_fleet(source: str, document: dict[str, Any]) -> None:
    import jsonschema

    for error in jsonschema.Draft202012Validator(FLEET_SCHEMA).iter_errors(document):
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.path)
        raise FleetError(
            source, f"not a fleet report: {field.lstrip('.') or '(document)'}: {error.message}"
        )


def _checked(source: str, document: object) -> Results:
    try:
        results = Results.checked(document)
    except InvalidResults as exc:
        raise FleetError(source, f"not a conformance report: {exc}") from None
    missing = [key for key in NEEDED if key not in results.header]
    if missing:
        raise FleetError(
            source,
            f"no {', '.join(missing)}: a report of a suite that did not record its "
            "catalogue's version and its host; run the catalogue again to merge it",
        )
    return results


def _check_against(host: Host, first: Host) -> None:
    """One catalogue: the first report's version, and its requirements under it."""
    mine, theirs = host.results.header["catalogue"], first.results.header["catalogue"]
    if mine != theirs:
        raise FleetError(
            host.source,
            f"catalogue {mine}, not {theirs} as {first.source}: a fleet report merges "
            "reports of one catalogue version",
        )
    if _statements(host.results) != _statements(first.results):
        raise FleetError(
            host.source,
            f"requirements that are not {first.source}'s, under the same catalogue {mine}",
        )


def _statements(results: Results) -> list[tuple[str, str]]:
    return [(str(row["id"]), str(row["statement"])) for row in results.requirements]


def _hostname(results: Results) -> str:
    return visible(str(results.header.get("hostname") or "unnamed"))[:HOSTNAME_CHARS]


def _named(hosts: list[Host]) -> tuple[Host, ...]:
    """Each host named by its hostname, with its identity's digits where a hostname repeats.

    The first 8 digits, or all 32 where even those repeat (host ids are distinct), and its
    position past that (a hostname may be written to look like another's name).
    """
    names = [_hostname(host.results) for host in hosts]
    for digits in (8, 32, 0):
        counts = collections.Counter(names)
        if len(counts) == len(names):
            break
        names = [
            (
                f"{_hostname(host.results)} ({host.host_id[:digits]})"
                if digits
                else f"{name} #{index + 1}"
            )
            if counts[name] > 1
            else name
            for index, (name, host) in enumerate(zip(names, hosts, strict=True))
        ]
    return tuple(
        Host(name, host.source, host.results) for name, host in zip(names, hosts, strict=True)
    )
