"""A fleet's results as people and tools read them: the terminal's lines, HTML, Markdown, JUnit.

Built to stay readable at 40 hosts and more: the hosts are rows of their own table (each
named with its GPUs, a verdict per driver), and the requirements' matrix stays a row per
requirement and a column per driver, each cell counting its hosts by status and opening onto
them. What drivers, hosts and payloads said is made inert as ``conformance.render`` makes
it: escaped in HTML and Markdown, its control characters written out on the terminal and in
the XML.
"""

from __future__ import annotations

import collections
import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from conformance.fleet import Fleet, FleetCell, Host
from conformance.render import LABELS, MARKS, STYLE, _css, _e, _md, gpus_of, visible, write_new
from conformance.report import Status

FILES = ("conformance.json", "conformance.xml", "conformance.html", "conformance.md")
MARKDOWN_NOTES = 100
"""Failures listed in the Markdown (a CI step summary holds 1 MiB); the HTML lists all."""
ORDER: tuple[Status, ...] = ("failed", "partial", "skipped", "not run", "passed", "not applicable")


def host_line(host: Host) -> str:
    return visible(f"{host.name}: {gpus_of(host.results.header)}{runs_on(host)}")


def runs_on(host: Host) -> str:
    """``; node 127.0.0.2 of ...``: where a run pinned to a cluster's node ran, or ""."""
    where = host.results.header.get("runs_on")
    return f"; {where}" if where else ""


def counts(cell: FleetCell) -> str:
    """``1 fail · 2 pass · 1 not in its report``: the hosts of a cell, by status."""
    counted = collections.Counter(c.status for c in cell.hosts.values() if c is not None)
    said = [f"{counted[status]} {LABELS[status]}" for status in ORDER if counted[status]]
    absent = sum(c is None for c in cell.hosts.values())
    return " · ".join([*said, *([f"{absent} not in its report"] if absent else [])])


def text_lines(fleet: Fleet, own_catalogue: str = "") -> list[str]:
    """The terminal's summary: the hosts, the matrix's counts, every verdict."""
    simulated = sum(bool(host.results.header["simulated"]) for host in fleet.hosts)
    note = ""
    if own_catalogue:
        note = (
            " (this suite's)"
            if own_catalogue == fleet.catalogue
            else f" (this suite's is {own_catalogue})"
        )
    lines = [
        f"fleet of {len(fleet.hosts)} hosts ({simulated} simulated), catalogue "
        f"{fleet.catalogue}{note}",
        *(f"  {host_line(host)}" for host in fleet.hosts),
        "",
        "=== conformance by requirement, hosts by status ===",
    ]
    first = max(len("requirement"), *(len(req) for req in fleet.cells)) + 2
    for driver in fleet.drivers:
        lines.append(visible(f"{driver}:"))
        for req, row in fleet.cells.items():
            lines.append(
                visible(f"  {req.ljust(first)}{row[driver].status:<15}{counts(row[driver])}")
            )
    lines += ["", "=== verdict, each driver on each host ==="]
    for verdict in fleet.verdicts:
        for host in fleet.hosts:
            on = fleet.verdict_on(verdict.driver, host)
            said = on.summary if on else "NOT RUN — not in its report"
            lines.append(visible(f"{verdict.driver} on {host.name}: {said}"))
    lines += ["", "=== verdict over the fleet ==="]
    if fleet.nothing_ran:
        lines.append("FAIL: no driver could run on any host; every conformance test was skipped.")
    return [*lines, *(verdict.line for verdict in fleet.verdicts)]


FLEET_STYLE = """
h2 { font-size: 1.15em; margin: 1.4em 0 .4em; }
thead th { position: sticky; top: 0; z-index: 1; }
table.hosts td, table.hosts th { white-space: nowrap; }
table.hosts td.gpus { white-space: normal; max-width: 48em; font-size: .9em; }
table.hosts td.verdict details { white-space: normal; max-width: 28em; font-size: .85em; }
table.hosts th .source, th .version { display: block; font-weight: normal; color: #555;
  font-size: .8em; }
td.cell .counts { display: block; font-weight: normal; font-size: .8em; color: #333; }
td.cell li.passed-hosts { color: #166534; }
td.verdict.PASS { background: #dcfce7; } td.verdict.FAIL { background: #fee2e2; }
td.verdict.NOT-RUN { background: #fff7ed; }
p.failing { background: #fee2e2; padding: .4em .6em; }
tr:target th, tr:target td { outline: 2px solid #b91c1c; }
"""


def _host_row(fleet: Fleet, number: int, host: Host) -> str:
    cells = []
    for driver in fleet.drivers:
        verdict = fleet.verdict_on(driver, host)
        status, detail = (
            (verdict.status, verdict.detail) if verdict else ("NOT RUN", "not in its report")
        )
        cells.append(
            f'<td class="verdict {_css(status)}"><details><summary>{_e(status)}</summary>'
            f"{_e(detail)}</details></td>"
        )
    simulated = " simulated" if host.results.header["simulated"] else ""
    source = host.source.rpartition("/")[2]  # the directory of every report is the same
    return (
        f'<tr id="host-{number}"><th scope="row">{_e(host.name)}<span class="source" '
        f'title="{_e(host.source)}">{_e(source)}</span></th>'
        f'<td class="gpus{simulated}">{_e(gpus_of(host.results.header) + runs_on(host))}</td>'
        f"{''.join(cells)}</tr>"
    )


def _not_passing(fleet: Fleet) -> str:
    """The hosts where a driver failed, each a link to its row: at 40 hosts, what to look at."""
    links = []
    for number, host in enumerate(fleet.hosts, 1):
        failed = [
            d for d in fleet.drivers if (v := fleet.verdict_on(d, host)) and v.status == "FAIL"
        ]
        if failed:
            links.append(f'<a href="#host-{number}">{_e(host.name)}</a> ({_e(", ".join(failed))})')
    if not links:
        return "<p>No driver failed on any host.</p>\n"
    return f'<p class="failing">Failed on {len(links)} hosts: {", ".join(links)}.</p>\n'


def _html_cell(cell: FleetCell) -> str:
    tagged = cell.level == "optional" and cell.status != "not applicable"
    level = ' <span class="level">optional</span>' if tagged else ""
    passed = [name for name, c in cell.hosts.items() if c is not None and c.status == "passed"]
    items = [f'<li class="passed-hosts">pass: {_e(", ".join(passed))}</li>'] if passed else []
    for name, each in cell.hosts.items():
        if each is None:
            items.append(f"<li><strong>{_e(name)}</strong>: not in its report</li>")
        elif each.status != "passed":
            said = f": {each.message}" if each.message else ""
            items.append(
                f"<li><strong>{_e(name)}</strong> {_e(LABELS[each.status])}{_e(said)}</li>"
            )
    return (
        f'<td class="cell {_css(cell.status)}"><details><summary>{_e(LABELS[cell.status])}{level}'
        f'<span class="counts">{_e(counts(cell))}</span></summary><ul>{"".join(items)}</ul>'
        "</details></td>"
    )


def _versions(fleet: Fleet, driver: str) -> str:
    """One version where every host ran the same, else how many and which."""
    versions = list(
        dict.fromkeys(
            str(host.results.drivers[driver]["version"])
            for host in fleet.hosts
            if driver in host.results.drivers and host.verdicts[driver].status != "NOT RUN"
        )
    )
    if len(versions) <= 1:
        return versions[0] if versions else "not running"
    return f"{len(versions)} versions: {'; '.join(versions[:3])}" + (" …" if versions[3:] else "")


def to_html(fleet: Fleet) -> str:
    simulated = sum(bool(host.results.header["simulated"]) for host in fleet.hosts)
    info = [
        (
            "Hosts",
            f"{len(fleet.hosts)} ({len(fleet.hosts) - simulated} real, {simulated} simulated)",
        ),
        ("Catalogue", fleet.catalogue),
        ("Date", fleet.generated),
    ]
    verdicts = "".join(
        f'<li class="verdict-{_css(v.status)}"><strong>{_e(v.driver)}</strong>: '
        f"{_e(v.summary)}</li>"
        for v in fleet.verdicts
    )
    columns = "".join(
        f'<th scope="col">{_e(d)}<span class="version">{_e(_versions(fleet, d))}</span></th>'
        for d in fleet.drivers
    )
    statements = {str(row["id"]): str(row["statement"]) for row in fleet.requirements}
    rows = "".join(
        f'<tr><th scope="row">{_e(req)}<span class="statement">{_e(statements.get(req, ""))}'
        f"</span></th>{''.join(_html_cell(cell) for cell in row.values())}</tr>"
        for req, row in fleet.cells.items()
    )
    driver_heads = "".join(f'<th scope="col">{_e(d)}</th>' for d in fleet.drivers)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>GPU sandbox conformance: a fleet of {len(fleet.hosts)} hosts</title>"
        f"<style>{STYLE}{FLEET_STYLE}</style></head><body>\n"
        f"<h1>GPU sandbox conformance: a fleet of {len(fleet.hosts)} hosts</h1>\n"
        '<dl class="header">'
        + "".join(f"<dt>{name}</dt><dd>{_e(value)}</dd>" for name, value in info)
        + "</dl>\n<h2>Each driver over the fleet</h2>\n"
        f'<ul class="verdicts">{verdicts}</ul>\n'
        "<p>A driver passes the fleet where it passed on every host it ran on; a host where "
        "it did not run is named, never counted as a pass.</p>\n<h2>Hosts</h2>\n"
        + _not_passing(fleet)
        + f'<table class="hosts"><thead><tr><th scope="col">host</th><th scope="col">GPUs</th>'
        f"{driver_heads}</tr></thead>\n<tbody>"
        + "".join(_host_row(fleet, n, host) for n, host in enumerate(fleet.hosts, 1))
        + "</tbody></table>\n<h2>Requirements</h2>\n"
        f'<table class="matrix"><thead><tr><th scope="col">requirement</th>{columns}</tr>'
        f"</thead>\n<tbody>{rows}</tbody></table>\n"
        "<p>Each cell: fail where any host failed, pass where every host the driver ran on "
        "passed, partial where some did, and its hosts counted by status; open it for each "
        "host that did not pass, with its message. Cells marked optional do not gate.</p>\n"
        "</body></html>\n"
    )


def to_markdown(fleet: Fleet) -> str:
    lines = [
        f"## GPU sandbox conformance: a fleet of {len(fleet.hosts)} hosts",
        "",
        f"**Catalogue** {_md(fleet.catalogue)} · **Date** {_md(fleet.generated)}",
        "",
        "| driver | over the fleet |",
        "|---|---|",
        *(f"| {_md(v.driver)} | {_md(v.summary)} |" for v in fleet.verdicts),
        "",
        f"| host | GPUs | {' | '.join(_md(d) for d in fleet.drivers)} |",
        "|---" * (len(fleet.drivers) + 2) + "|",
    ]
    for host in fleet.hosts:
        marks = []
        for driver in fleet.drivers:
            verdict = fleet.verdict_on(driver, host)
            marks.append(_md(verdict.status if verdict else "not in its report"))
        gpus = _md(gpus_of(host.results.header))
        lines.append(f"| {_md(host.name)} | {gpus} | {' | '.join(marks)} |")
    lines += ["", f"| requirement | {' | '.join(_md(d) for d in fleet.drivers)} |"]
    lines.append("|---" * (len(fleet.drivers) + 1) + "|")
    notes = []
    for req, row in fleet.cells.items():
        marks = []
        for driver, cell in row.items():
            optional = " (optional)" if cell.level == "optional" else ""
            marks.append(
                f"{MARKS[cell.status]} {LABELS[cell.status]}{optional}: {_md(counts(cell))}"
            )
            notes += [
                f"- **{_md(req)}** on {_md(driver)}, {_md(name)}: failed: {_md(each.message)}"
                for name, each in cell.hosts.items()
                if each is not None and each.status == "failed"
            ]
        lines.append(f"| {_md(req)} | {' | '.join(marks)} |")
    if notes:
        more = len(notes) - MARKDOWN_NOTES
        shown = notes[:MARKDOWN_NOTES] + (
            [f"- and {more} more: see conformance.html"] if more > 0 else []
        )
        lines += ["", "<details><summary>Failures</summary>", "", *shown, "", "</details>"]
    return "\n".join(lines) + "\n"


_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
"""What XML 1.0 cannot hold at all: control characters, lone surrogates, U+FFFE and U+FFFF."""


def _x(value: object) -> str:
    """Text an XML reader takes: control characters written out, the rest escaped by ET."""
    text = visible(str(value))
    return _NOT_XML.sub(lambda m: f"\\x{{{ord(m.group()):x}}}", text)


def to_junit(fleet: Fleet) -> bytes:
    """JUnit XML: a suite ``fleet`` of a case per driver's verdict, then a suite per host."""
    root = ET.Element("testsuites", name="conformance-fleet")
    over = ET.SubElement(root, "testsuite", name="fleet", tests=str(len(fleet.verdicts)))
    for verdict in fleet.verdicts:
        case = ET.SubElement(over, "testcase", classname="fleet", name=_x(verdict.driver))
        if verdict.status == "FAIL":
            ET.SubElement(case, "failure", message=_x(verdict.detail))
        elif verdict.status == "NOT RUN":
            ET.SubElement(case, "skipped", message=_x(verdict.detail))
    over.set("failures", str(sum(v.status == "FAIL" for v in fleet.verdicts)))
    for host in fleet.hosts:
        header = host.results.header
        suite = ET.SubElement(
            root, "testsuite", name=_x(f"conformance-{host.name}"), hostname=_x(host.name)
        )
        properties = ET.SubElement(suite, "properties")
        for key, value in (
            ("gpus", gpus_of(header)), ("simulated", str(bool(header["simulated"])).lower()),
            ("host_id", host.host_id), ("catalogue", header["catalogue"]), ("report", host.source),
        ):  # fmt: skip
            ET.SubElement(properties, "property", name=key, value=_x(value))
        outcomes: collections.Counter[str] = collections.Counter()
        for test in host.results.tests:
            outcomes[test["outcome"]] += 1
            path, _, name = test["nodeid"].partition("::")
            case = ET.SubElement(suite, "testcase", classname=_x(path), name=_x(name))
            props = ET.SubElement(case, "properties")
            for key, value in (
                ("requirement", test["requirement"]), ("driver", test["driver"]),
                ("level", test["level"]), ("host", host.name),
            ):  # fmt: skip
                ET.SubElement(props, "property", name=key, value=_x(value))
            if test["outcome"] in ("failed", "error"):
                ET.SubElement(case, test["outcome"] if test["outcome"] == "error" else "failure",
                              message=_x(test["message"]))  # fmt: skip
            elif test["outcome"] == "skipped":
                ET.SubElement(case, "skipped", message=_x(test["message"]))
        suite.set("tests", str(len(host.results.tests)))
        for key, outcome in (("failures", "failed"), ("errors", "error"), ("skipped", "skipped")):
            suite.set(key, str(outcomes[outcome]))
    data: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return data


def write(fleet: Fleet, out: Path) -> list[Path]:
    """The fleet's four files in ``out``, each made new and renamed over its path."""
    paths = [out / name for name in FILES]
    text = (
        # Compact: it holds every host's report whole (14 MB at 200 hosts), and an indent
        # turns json's C encoder off (1.3 s against 0.5 s there).
        json.dumps(fleet.to_json(), separators=(",", ":")) + "\n",
        None,
        to_html(fleet),
        to_markdown(fleet),
    )
    for path, content in zip(paths, text, strict=True):
        data = to_junit(fleet) if content is None else content.encode(errors="backslashreplace")
        write_new(path, data)
    return paths
