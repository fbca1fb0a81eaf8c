"""The mutants of a module, by cosmic-ray's operators: enumerated, sampled, made, triaged.

Every operator of cosmic-ray that takes no arguments, at every position it finds, as
``cosmic-ray init`` enumerates them; a mutant is made by ``cosmic_ray.mutating.mutate_code``,
as ``cosmic-ray exec`` makes it, but written to a copy of the tree (bench/mutate.py), never
to the tree itself. Two things differ from cosmic-ray's own run, each for a reason:

- A mutant inside an annotation is equivalent by construction in a module that imports
  ``annotations`` from ``__future__`` (every module sampled here): its annotations are never
  evaluated. Those are counted, and not run.
- A mutant of ``ExceptionReplacer`` names ``CosmicRayTestingException`` in its handler;
  cosmic-ray leaves the name undefined in the mutated module, so the handler raises
  ``NameError`` where it meant to catch nothing. The mutant made here defines the name at
  the end of the module, so the handler catches nothing, as the operator means.

A mutant is known across edits by its module, the function it is in, its operator and the
lines it changes (before and after), not by its line number or its occurrence: that is the
key the triage (bench/mutants.yaml) names it by.
"""

from __future__ import annotations

import difflib
import random
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cosmic_ray.plugins
import parso.tree
from cosmic_ray.ast import ast_nodes, get_ast
from cosmic_ray.mutating import mutate_code

from gpuhost.strict import read_yaml

TRIAGE_FILE = Path(__file__).with_name("mutants.yaml")
EXCEPTION_REPLACER = "core/ExceptionReplacer"
_TESTING_EXCEPTION = (
    "\n\nclass CosmicRayTestingException(Exception):\n"
    '    """Raised by nothing: the handler that names it catches nothing."""\n'
)
_TOP = "<module>"


@dataclass(frozen=True)
class Mutant:
    """One mutation of one module: cosmic-ray's operator at its occurrence in the module."""

    module: str
    """The module's path under the tree's root, with ``/``."""
    operator: str
    occurrence: int
    line: int
    function: str
    """Where it is: ``Class.method``, ``function``, or ``<module>``."""

    @property
    def name(self) -> str:
        return f"{self.module}:{self.line} {self.operator.removeprefix('core/')}#{self.occurrence}"


@dataclass(frozen=True)
class Made:
    """A mutant made: the module's mutated source, and the lines it changed."""

    mutant: Mutant
    source: str
    before: str
    after: str

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (
            self.mutant.module,
            self.mutant.function,
            self.mutant.operator,
            self.before,
            self.after,
        )


@dataclass(frozen=True)
class Enumeration:
    """A module's mutants, and how many were left out as annotations."""

    module: str
    mutants: tuple[Mutant, ...]
    annotations: int


def operators() -> tuple[str, ...]:
    """cosmic-ray's operators that take no arguments, as ``cosmic-ray init`` uses them."""
    return tuple(
        name
        for name in cosmic_ray.plugins.operator_names()
        if not cosmic_ray.plugins.get_operator(name).arguments()
    )


def enumerate_mutants(root: Path, module: str) -> Enumeration:
    """Every mutant of ``root/module``, in cosmic-ray's order of occurrences."""
    tree = get_ast((root / module).read_text())
    spans = list(_annotation_spans(tree))
    mutants: list[Mutant] = []
    annotations = 0
    for name in operators():
        operator = cosmic_ray.plugins.get_operator(name)()
        occurrence = 0
        for node in ast_nodes(tree):
            for start, end in operator.mutation_positions(node):
                if any(first <= start and end <= last for first, last in spans):
                    annotations += 1
                else:
                    mutants.append(Mutant(module, name, occurrence, start[0], _where(node)))
                occurrence += 1
    return Enumeration(module, tuple(mutants), annotations)


def make(mutant: Mutant, source: str) -> Made:
    """``mutant`` applied to ``source`` (its module's text), by cosmic-ray."""
    operator = cosmic_ray.plugins.get_operator(mutant.operator)()
    mutated = mutate_code(source, operator, mutant.occurrence)
    if mutated is None:
        raise ValueError(f"{mutant.name}: no such occurrence in {mutant.module}")
    before, after = _changed(source, mutated)
    if mutant.operator == EXCEPTION_REPLACER:
        mutated += _TESTING_EXCEPTION
    return Made(mutant, mutated, before, after)


def sample(enumeration: Enumeration, size: int, seed: int, source: str) -> list[Made]:
    """``size`` of the module's mutants, made: the same for the same seed and module text.

    Each module draws from a generator of its own, seeded with the seed and its name, so
    that adding or dropping a module changes no other module's sample. A mutant that does
    not compile is drawn past (cosmic-ray takes the ``**`` of ``{**a}`` for a power).
    """
    rng = random.Random(f"{seed}:{enumeration.module}")
    drawn = list(enumeration.mutants)
    rng.shuffle(drawn)
    chosen: list[Made] = []
    for mutant in drawn:
        if len(chosen) == size:
            break
        made = make(mutant, source)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", SyntaxWarning)
                compile(made.source, mutant.module, "exec")
        except SyntaxError:
            continue
        chosen.append(made)
    return sorted(chosen, key=lambda m: (m.mutant.line, m.mutant.operator, m.mutant.occurrence))


def interleaved(samples: Sequence[Sequence[Made]]) -> list[Made]:
    """The samples' mutants, a module's at a time in turn.

    A run cut short by its budget has then tried every module alike.
    """
    longest = max((len(s) for s in samples), default=0)
    return [s[i] for i in range(longest) for s in samples if i < len(s)]


def _changed(source: str, mutated: str) -> tuple[str, str]:
    """The lines that differ, before and after, each stripped and joined by `` / ``."""
    old, new = source.splitlines(), mutated.splitlines()
    before: list[str] = []
    after: list[str] = []
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            before += [line.strip() for line in old[i1:i2]]
            after += [line.strip() for line in new[j1:j2]]
    return " / ".join(before), " / ".join(after)


def _annotation_spans(tree: Any) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
    """Where the annotations are: of parameters, of returns, of annotated assignments."""
    for node in ast_nodes(tree):
        annotation = None
        if node.type in ("param", "funcdef"):
            annotation = node.annotation
        elif node.type == "annassign":
            annotation = node.children[1]
        if annotation is not None:
            yield annotation.start_pos, annotation.end_pos


def _where(node: parso.tree.NodeOrLeaf) -> str:
    names = []
    parent = node.parent
    while parent is not None:
        if parent.type in ("funcdef", "classdef"):
            names.append(parent.children[1].get_code().strip())
        parent = parent.parent
    return ".".join(reversed(names)) or _TOP


# -- the triage ---------------------------------------------------------------------------------


class TriageError(ValueError):
    """bench/mutants.yaml is not as this module reads it: the field, the value, the problem."""


@dataclass(frozen=True)
class Verdict:
    """A survivor triaged: equivalent (with why), or a hole (the requirement, the case)."""

    module: str
    function: str
    operator: str
    before: str
    after: str
    kind: str
    """``equivalent`` or ``hole``."""
    reason: str
    """Why it is equivalent; for a hole, the case the requirement's test does not try."""
    requirement: str = ""

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.module, self.function, self.operator, self.before, self.after)


_FIELDS = {
    "equivalent": ("module", "function", "operator", "before", "after", "reason"),
    "holes": ("module", "function", "operator", "before", "after", "requirement", "missing"),
}


def read_triage(path: Path = TRIAGE_FILE) -> dict[tuple[str, str, str, str, str], Verdict]:
    """The verdicts of bench/mutants.yaml by key; a key given twice is refused."""
    document = read_yaml(path, max_bytes=1 << 20)
    if not isinstance(document, Mapping) or set(document) - set(_FIELDS):
        raise TriageError(f"{path}: a mapping of {' and '.join(_FIELDS)} lists is expected")
    verdicts: dict[tuple[str, str, str, str, str], Verdict] = {}
    for kind, fields in _FIELDS.items():
        entries = document.get(kind) or []
        if not isinstance(entries, list):
            raise TriageError(f"{path}: {kind} is {type(entries).__name__}, not a list")
        for index, entry in enumerate(entries):
            where = f"{path}: {kind}[{index}]"
            if not isinstance(entry, Mapping) or set(entry) != set(fields):
                got = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
                raise TriageError(f"{where}: needs exactly {', '.join(fields)} (got {got})")
            for field in fields:
                if not isinstance(entry[field], str) or not entry[field].strip():
                    raise TriageError(f"{where}.{field}: {entry[field]!r} is not a text")
            verdict = Verdict(
                entry["module"], entry["function"], entry["operator"], entry["before"],
                entry["after"], "equivalent" if kind == "equivalent" else "hole",
                entry.get("reason") or entry["missing"], entry.get("requirement", ""),
            )  # fmt: skip
            if verdict.key in verdicts:
                raise TriageError(f"{where}: the mutant is triaged already ({verdict.key})")
            verdicts[verdict.key] = verdict
    return verdicts


def stale(
    verdicts: Mapping[tuple[str, str, str, str, str], Verdict],
    root: Path,
    enumerations: Mapping[str, Enumeration],
) -> list[Verdict]:
    """The verdicts of the modules enumerated that name no mutant of them any more."""
    found: list[Verdict] = []
    sources = {module: (root / module).read_text() for module in enumerations}
    for verdict in verdicts.values():
        enumeration = enumerations.get(verdict.module)
        if enumeration is None:
            continue
        candidates = (
            m
            for m in enumeration.mutants
            if (m.function, m.operator) == (verdict.function, verdict.operator)
        )
        if not any(make(m, sources[m.module]).key == verdict.key for m in candidates):
            found.append(verdict)
    return found
