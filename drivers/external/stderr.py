"""A CLI's stderr read as the suite's typed errors, by the manifest's ``errors`` rules.

A CLI without structured errors says what went wrong in text, often framed and wrapped to
its terminal's width (miette's box drawing, ANSI colours). The text is read as one line
(``one_line``), and the first rule whose expression is found in it gives the typed error,
its named groups the error's fields: ``GpusExhausted`` (requested, available and, where
the CLI says it, total, as integers; a CLI that keeps no record of use counts every device
it can select as available, and says no more: total is then that number), ``GpuBusy``
(device, and holder where the CLI names it). ``SandboxGone`` is not an error: a close or kill
whose CLI failed saying so found the sandbox already gone, which is what it was asked for.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from drivers.external.manifest import ErrorRule
from gpuhost.errors import GpuAllocationError, GpuBusy, GpusExhausted

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_FRAME = re.compile(r"[\u2500-\u257f\u25b6\u00d7]")
"""Box drawing (U+2500 to U+257F), U+25B6 and U+00D7: what a CLI frames its errors with."""


def one_line(text: str) -> str:
    """``text`` without ANSI escapes, its frame characters and line breaks as single spaces.

    A line that ends with a hyphen goes on without a space: text wrapped to a terminal's
    width breaks words after their hyphens (a UUID: ``GPU-21a9a674-`` then ``448b-...``).
    """
    lines = [" ".join(_FRAME.sub(" ", line).split()) for line in _ANSI.sub("", text).splitlines()]
    out = ""
    for line in filter(None, lines):
        out += line if not out or out.endswith("-") else f" {line}"
    return out


def typed_error(rules: Sequence[ErrorRule], stderr: str) -> GpuAllocationError | None:
    """The typed error the first matching rule reads from ``stderr``, or None."""
    text = one_line(stderr)
    for rule in rules:
        found = rule.match.search(text)
        if found is None:
            continue
        groups = found.groupdict()
        if rule.error == "GpusExhausted":
            total = groups.get("total") or groups["available"]
            numbers = [groups["requested"] or "", groups["available"] or "", total or ""]
            if all(n.isascii() and n.isdigit() for n in numbers):
                requested, available, count = (int(n) for n in numbers)
                return GpusExhausted(requested, available, count, why=f"the CLI said: {text}")
        elif rule.error == "GpuBusy":
            holder = groups.get("holder") or "a sandbox the CLI did not name"
            return GpuBusy(groups["device"] or "", f"{holder}; the CLI said: {text}")
    return None


def says_gone(rules: Sequence[ErrorRule], stderr: str) -> bool:
    """Whether a ``SandboxGone`` rule is found in ``stderr``."""
    text = one_line(stderr)
    return any(rule.error == "SandboxGone" and rule.match.search(text) for rule in rules)
