"""What a CLI refuses of its own flags (a manifest's ``limits``), checked on a rendered argv.

A rule names a flag (``--name``) and what the CLI refuses of it: the flag given twice
(``once``), a value longer than ``maxLength`` UTF-8 bytes or not matching ``pattern`` whole,
a value that is not an image reference (``imageReference``). Only the words before the
argv's first ``--`` are flags; a flag's value is the rest of ``--flag=VALUE``, or the next
word after ``--flag`` for a rule about values. ``--gpu`` and ``--gpu=2`` are the same flag.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from drivers.external.manifest import FlagRule
from gpuhost.errors import shown

# The reference grammar of the OCI distribution spec (distribution/reference's
# reference.go): [domain[:port]/]path-component[/path-component...][:tag][@digest].
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(
    rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*(?::{_TAG})?(?:@{_DIGEST})?",
    re.ASCII,
)
MAX_REFERENCE_LEN = 255
"""distribution/reference's NameTotalLengthMax, for the name; the whole reference here."""


@dataclass(frozen=True)
class Broken:
    """One rule a rendered argv breaks: the flag, the word at ``index``, why."""

    flag: str
    index: int
    value: str
    problem: str

    def message(self, argv: Sequence[str]) -> str:
        return f"{shown(argv[self.index])}: {self.problem} (limits.{self.flag})"


def is_image_reference(value: str) -> bool:
    """Whether ``value`` is an image reference (never a path, an option, shell syntax)."""
    return len(value) <= MAX_REFERENCE_LEN and IMAGE_REFERENCE.fullmatch(value) is not None


def check(argv: Sequence[str], limits: Mapping[str, FlagRule]) -> Broken | None:
    """The first rule of ``limits`` that ``argv`` breaks, or None."""
    if not limits:
        return None
    seen: dict[str, int] = {}
    end = argv.index("--") if "--" in argv else len(argv)
    for i, word in enumerate(argv[:end]):
        flag, eq, value = word.partition("=")
        rule = limits.get(flag)
        if rule is None:
            continue
        seen[flag] = seen.get(flag, 0) + 1
        if rule.once and seen[flag] > 1:
            return Broken(flag, i, word, f"{flag} is given more than once: the CLI refuses that")
        if not rule.takes_value:
            continue
        at = i
        if not eq:
            at = i + 1
            if at >= end:
                return Broken(flag, i, "", f"{flag} is given no value")
            value = argv[at]
        problem = _value_problem(flag, rule, value)
        if problem:
            return Broken(flag, at, value, problem)
    return None


def _value_problem(flag: str, rule: FlagRule, value: str) -> str:
    size = len(value.encode())
    if rule.max_length is not None and size > rule.max_length:
        return (
            f"{flag}'s value {shown(value)} is {size} bytes: the CLI refuses more than "
            f"{rule.max_length}"
        )
    if rule.pattern is not None and rule.pattern.fullmatch(value) is None:
        return (
            f"{flag}'s value {shown(value)} does not match {rule.pattern.pattern!r}: the CLI "
            "refuses it"
        )
    if rule.image_reference and not is_image_reference(value):
        return (
            f"{flag}'s value {shown(value)} is not an image reference ([registry/]name[:tag]"
            "[@digest], the OCI distribution grammar): the CLI would read it as a local path"
        )
    return ""
