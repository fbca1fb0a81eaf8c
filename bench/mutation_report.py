"""What ``make mutate`` found: each mutant's outcome, the score a module, the survivors' triage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from bench import mutants as mx

if TYPE_CHECKING:
    from bench.mutate import Run

DETECTED = ("killed", "timed out")
COUNTED = (*DETECTED, "survived", "unconfirmed")
"""The outcomes the score counts: not the equivalent ones, nor those the budget left out."""
OUTCOMES = (*COUNTED, "equivalent", "not run")


@dataclass(frozen=True)
class Result:
    """One mutant's outcome.

    Killed (``detail``: the test), timed out, survived, unconfirmed (killed by a test that
    fails unmutated too), equivalent (triaged; not run) or not run (the budget was spent).
    """

    made: mx.Made
    outcome: str
    seconds: float
    detail: str
    verdict: mx.Verdict | None

    def unconfirmed(self) -> Result:
        return replace(self, outcome="unconfirmed", detail=f"{self.detail} fails unmutated too")

    @property
    def untriaged(self) -> bool:
        return self.outcome in ("survived", "unconfirmed") and self.verdict is None

    def as_json(self) -> dict[str, object]:
        m = self.made.mutant
        return {
            "module": m.module, "line": m.line, "function": m.function, "operator": m.operator,
            "occurrence": m.occurrence, "before": self.made.before, "after": self.made.after,
            "outcome": self.outcome, "seconds": round(self.seconds, 1), "detail": self.detail,
            "triage": None if self.verdict is None else self.verdict.kind,
        }  # fmt: skip


def score(results: Sequence[Result]) -> tuple[int, int]:
    """(detected, counted): killed and timed out, of every mutant not equivalent and run."""
    return (
        sum(r.outcome in DETECTED for r in results),
        sum(r.outcome in COUNTED for r in results),
    )


def percent(detected: int, counted: int) -> str:
    return f"{100 * detected / counted:.0f} %" if counted else "-"


def table(results: Sequence[Result], enumerations: Mapping[str, mx.Enumeration]) -> list[str]:
    """The Markdown table of the run, a row a module and one for all."""
    head = ["module", "mutants", "sampled", *OUTCOMES, "score"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    rows = [(m, [r for r in results if r.made.mutant.module == m]) for m in enumerations]
    rows.append(("all", list(results)))
    for module, mine in rows:
        total = (
            sum(len(e.mutants) for e in enumerations.values())
            if module == "all"
            else len(enumerations[module].mutants)
        )
        counts = [str(sum(r.outcome == o for r in mine)) for o in OUTCOMES]
        cells = [f"`{module}`" if module != "all" else "all", str(total), str(len(mine)), *counts]
        lines.append("| " + " | ".join([*cells, percent(*score(mine))]) + " |")
    return lines


def print_report(
    results: Sequence[Result],
    enumerations: Mapping[str, mx.Enumeration],
    confirmation: Run | None,
    wall_s: float,
    baseline_s: float,
    timeout_s: float,
) -> None:
    annotations = sum(e.annotations for e in enumerations.values())
    print()
    print("\n".join(table(results, enumerations)))
    print(
        f"\nmutants: cosmic-ray's, outside annotations ({annotations} in annotations left out); "
        f"unmutated run {baseline_s:.0f} s, per-mutant timeout {timeout_s:.0f} s, "
        f"wall time {wall_s / 60:.1f} min"
    )
    if confirmation is not None and confirmation.returncode != 0:
        print(f"tests that failed unmutated too: {', '.join(confirmation.failed) or 'timed out'}")
    for title, chosen in (
        ("survivors, holes", [r for r in results if r.verdict and r.verdict.kind == "hole"
                              and r.outcome in ("survived", "unconfirmed")]),
        ("survivors, untriaged", [r for r in results if r.untriaged]),
        ("holes now closed (killed): drop them from bench/mutants.yaml",
         [r for r in results if r.verdict and r.verdict.kind == "hole" and r.outcome in DETECTED]),
        ("timed out", [r for r in results if r.outcome == "timed out"]),
    ):  # fmt: skip
        if chosen:
            print(f"\n{title}:")
            for r in chosen:
                m = r.made.mutant
                why = f" [{r.verdict.requirement}: {r.verdict.reason}]" if r.verdict else ""
                print(f"  {m.name} [{m.function}]: {r.made.before!r} -> {r.made.after!r}{why}")


def score_failures(results: Sequence[Result], fail_under: float) -> list[str]:
    """Why the run fails: a survivor nobody triaged, or a score under ``fail_under`` %."""
    failures = [f"untriaged survivor {r.made.mutant.name}" for r in results if r.untriaged]
    detected, counted = score(results)
    if counted and 100 * detected / counted < fail_under:
        failures.append(f"score {percent(detected, counted)} under {fail_under:g} %")
    for failure in failures:
        print(failure)
    return failures
