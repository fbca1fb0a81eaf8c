"""bench/mutants.py: cosmic-ray's mutants enumerated, sampled, made, and named for the triage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import mutants as mx

MODULE = """\
from __future__ import annotations


def f(a: int | None, b: int) -> int | None:
    flags = a | b
    kept: int | str = flags
    return {**{"x": kept}}["x"]


def h() -> list[int]:
    return [1, 2, 3, 4, 5, 6, 7, 8]


def g(path: str) -> str:
    try:
        return open(path).read()
    except OSError:
        return "gone"
"""


def _enumerated(tmp_path: Path, text: str = MODULE) -> mx.Enumeration:
    (tmp_path / "m.py").write_text(text)
    return mx.enumerate_mutants(tmp_path, "m.py")


def test_mutants_in_annotations_are_left_out_and_counted(tmp_path: Path) -> None:
    enumeration = _enumerated(tmp_path)
    bit_or = [
        m for m in enumeration.mutants if m.operator.startswith("core/ReplaceBinaryOperator_BitOr")
    ]
    # `a | b` alone: the annotations' `|` are never evaluated (an assignment's, cosmic-ray
    # leaves out itself).
    assert {m.line for m in bit_or} == {5}
    assert enumeration.annotations == 2 * len(bit_or)
    assert {m.function for m in enumeration.mutants} == {"f", "g", "h"}


def test_the_sample_is_the_seeds_and_skips_what_does_not_compile(tmp_path: Path) -> None:
    enumeration = _enumerated(tmp_path)
    everything = mx.sample(enumeration, 10_000, 1, MODULE)
    # cosmic-ray takes `{**x}` for a power: of its 11 replacements, those that are no Python
    # (`{//{"x": kept}}`) are never drawn.
    unpacking = {m.mutant.operator for m in everything if m.mutant.line == 7}
    assert unpacking == {f"core/ReplaceBinaryOperator_Pow_{o}" for o in ("Add", "Sub", "Mul")}
    assert len(everything) == len(enumeration.mutants) - 8
    names = [m.mutant.name for m in mx.sample(enumeration, 5, 1, MODULE)]
    assert names == [m.mutant.name for m in mx.sample(enumeration, 5, 1, MODULE)]
    others = [[m.mutant.name for m in mx.sample(enumeration, 5, s, MODULE)] for s in range(2, 6)]
    assert any(o != names for o in others), "the seed chooses nothing"


def test_a_replaced_handler_catches_nothing_rather_than_failing_on_its_name(tmp_path: Path) -> None:
    enumeration = _enumerated(tmp_path)
    (replaced,) = [m for m in enumeration.mutants if m.operator == mx.EXCEPTION_REPLACER]
    made = mx.make(replaced, MODULE)
    assert made.after == "except CosmicRayTestingException:"
    namespace: dict[str, object] = {}
    exec(compile(made.source, "m.py", "exec"), namespace)
    with pytest.raises(FileNotFoundError):  # not NameError: the handler just no longer matches
        namespace["g"](str(tmp_path / "absent"))  # type: ignore[operator]


def test_a_mutant_keeps_its_key_when_lines_move(tmp_path: Path) -> None:
    def keys(text: str) -> set[tuple[str, ...]]:
        return {m.key for m in mx.sample(_enumerated(tmp_path, text), 10_000, 1, text)}

    moved = MODULE.replace("\n\ndef f", "\n# a comment, and the lines below move down\n\ndef f")
    assert keys(MODULE) == keys(moved)


def _triage(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mutants.yaml"
    path.write_text(text)
    return path


def test_the_triage_names_each_mutant_once_with_every_field(tmp_path: Path) -> None:
    entry = (
        "  - {module: m.py, function: f, operator: core/AddNot, before: a, after: b, reason: why}\n"
    )
    verdicts = mx.read_triage(_triage(tmp_path, f"equivalent:\n{entry}holes: []\n"))
    assert [v.kind for v in verdicts.values()] == ["equivalent"]
    with pytest.raises(mx.TriageError, match=r"equivalent\[1\]: the mutant is triaged already"):
        mx.read_triage(_triage(tmp_path, f"equivalent:\n{entry}{entry}"))
    with pytest.raises(mx.TriageError, match=r"holes\[0\]: needs exactly .*requirement, missing"):
        mx.read_triage(_triage(tmp_path, f"holes:\n{entry}"))
    with pytest.raises(mx.TriageError, match=r"equivalent\[0\]\.reason: '' is not a text"):
        mx.read_triage(_triage(tmp_path, "equivalent:\n" + entry.replace("why", "''")))


def test_a_verdict_that_names_no_mutant_any_more_is_stale(tmp_path: Path) -> None:
    enumeration = _enumerated(tmp_path)
    made = mx.sample(enumeration, 1, 1, MODULE)[0]
    m = made.mutant
    text = (
        f"equivalent:\n  - {{module: m.py, function: {m.function}, operator: {m.operator}, "
        f"before: {json.dumps(made.before)}, after: {json.dumps(made.after)}, reason: why}}\n"
        f"  - {{module: m.py, function: {m.function}, operator: {m.operator}, "
        f"before: {json.dumps(made.before)}, after: 'something else', reason: why}}\n"
    )
    verdicts = mx.read_triage(_triage(tmp_path, text))
    assert [v.after for v in mx.stale(verdicts, tmp_path, {"m.py": enumeration})] == [
        "something else"
    ]
