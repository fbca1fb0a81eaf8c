"""A run's results as people read them: the text table, the HTML matrix, the Markdown summary.

What drivers and payloads said (messages, skip reasons, versions, the host's description)
is held as it was said, and made inert where it is shown: on the terminal its control
characters are written out (``visible``: an escape sequence or a carriage return cannot
repaint the verdicts), in HTML it is escaped, and in Markdown (the CI step summary) every
character that could make a link, an image, HTML, emphasis or a table cell of it is escaped
(``_md``).
"""

from __future__ import annotations

import collections
import html
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conformance.report import Cell, Results, Status

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


_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
"""C0 and C1 control characters, DEL and the Unicode line breaks; the tab is kept."""


def visible(text: str) -> str:
    r"""``text`` for one line of a terminal: each control character written as ``\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def gpus_line(results: Results) -> str:
    return gpus_of(results.header)


def gpus_of(header: Mapping[str, Any]) -> str:
    """A report's GPUs in one line: each vendor's and model's, MIG, driver, real or simulated.

    ``8 x NVIDIA H100 80GB HBM3 (nvidia; 2 in MIG mode: 8 x 1g.10gb, 3 x 2g.20gb; driver
    simulated), 2 x AMD Instinct MI210 (amd; driver simulated) (SIMULATED)``; a report of a
    suite before ``gpus`` was recorded gives its NVIDIA GPUs alone.
    """
    kind = "SIMULATED" if header.get("simulated") else "real"
    groups = header.get("gpus")
    if groups is None:
        if not header.get("gpu_count"):
            return "no GPUs found"
        return f"{header['gpu_count']} x {header['gpu_model']} ({kind})"
    if not groups:
        return f"no GPUs found ({kind})"
    parts = []
    for group in groups:
        said = [str(group["vendor"])]
        if group["mig_gpus"]:
            instances = ", ".join(f"{n} x {p}" for p, n in group["mig_instances"].items())
            said.append(f"{group['mig_gpus']} in MIG mode: {instances or 'no instance'}")
        said.append(f"driver {group['driver']}")
        parts.append(f"{group['count']} x {group['model']} ({'; '.join(said)})")
    return f"{', '.join(parts)} ({kind})"


NOTHING_RAN = "FAIL: no driver could run here; every conformance test was skipped."


def skip_lines(reasons: Iterable[str]) -> list[str]:
    """Skipped tests grouped by reason with a count, instead of a line per test.

    Requirements that do not apply to a driver are left to the matrix, which shows them.
    """
    counted: collections.Counter[str] = collections.Counter()
    not_applicable = 0
    for reason in reasons:
        if " does not apply to " in reason or reason.startswith("not applicable: "):
            not_applicable += 1
        else:
            counted[reason] += 1
    lines = [f"{count:4d}  {visible(reason)}" for reason, count in counted.most_common()]
    if not_applicable:
        lines.append(f"{not_applicable:4d}  not applicable (n/a in the matrix)")
    return lines


def matrix_lines(results: Results) -> list[str]:
    """The terminal's summary: the host, the drivers with their versions, the matrix."""
    lines = [f"GPU host: {visible(str(results.header['host']))}"]
    if results.header["simulated"]:
        lines.append("These results used SIMULATED GPUs.")
    versions = [
        f"{name} ({info['version']})" if info["version"] else name
        for name, info in results.drivers.items()
    ]
    return [*lines, visible(f"drivers: {', '.join(versions)}"), *text_table(results)]


def text_table(results: Results) -> list[str]:
    drivers = list(results.drivers)
    first = max(len("requirement"), *(len(req) for req in results.cells)) + 2
    width = max(len("not applicable"), *(len(driver) for driver in drivers)) + 2
    lines = ["requirement".ljust(first) + "".join(driver.ljust(width) for driver in drivers)]
    for req, row in results.cells.items():
        statuses = (row[driver].status for driver in drivers)
        lines.append(req.ljust(first) + "".join(status.ljust(width) for status in statuses))
    return [visible(line.rstrip()) for line in lines]


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


_MD_SPECIAL = re.compile(r"[\\`*_~\[\]()!<>&|$#{}]|(?<=[wW]{3})\.|:(?=//)")
"""What Markdown (GitHub's) could read as syntax inside a line: code, emphasis, links and
images, HTML and entities, a table's cell break, math, references, and the starts of
autolinks (``www.``, ``http://``)."""
_AT = "@\u200b"
"""``@`` and a zero-width space: no e-mail autolink or mention is made of an address, which
GitHub links whatever its characters' escapes."""


def _md(value: object) -> str:
    """Text inert in a Markdown line or table cell: one line, its syntax backslash-escaped.

    No link, image, autolink, HTML or table break of what drivers and payloads said is live.
    """
    text = " ".join(visible(str(value)).split())
    return _MD_SPECIAL.sub(lambda m: "\\" + m.group(), text).replace("@", _AT)


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
    """``text`` as the file ``path``, written as a new file then renamed over the path.

    The new file is made O_CREAT|O_EXCL|O_NOFOLLOW (``mkstemp``): a link planted at the
    path is replaced, never written through, and no file already there is written into.
    """
    write_new(path, text.encode())


def write_new(path: Path, data: bytes) -> None:
    """``data`` as the file ``path`` (0644), made new and renamed over it (``_write``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            os.fchmod(file.fileno(), 0o644)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
