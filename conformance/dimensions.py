"""Each requirement's dimensions: what its tests vary, and every value they try.

A test samples its requirement; a driver whose defect lives in a value the test never
varies passes. So each test module declares, beside its tests, ``DIMENSIONS``: for each
requirement it covers, each dimension (who holds, how it ends, which path, which form, which
pool, which host) and the values tried, the very tuples its tests are parametrised over and
its planted breakers are generated from. ``python -m conformance.dimensions`` writes the
table of docs/catalogue.md ("Dimensions") from them; tests/conformance/test_dimensions.py
holds the page and the golden list to it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import conformance

Dimensions = Mapping[str, Mapping[str, Sequence[str]]]
"""requirement id → dimension → the values its tests try, in order."""

HEADING = "## Dimensions"


def declared(
    **dimensions: Sequence[str],
) -> Mapping[str, tuple[str, ...]]:
    """One requirement's dimensions, as a test module declares them: ``who=HOLDERS, ...``.

    A dimension's name is the keyword with ``_`` for a space.
    """
    return MappingProxyType(
        {name.replace("_", " "): tuple(values) for name, values in dimensions.items()}
    )


def collect() -> dict[str, dict[str, tuple[str, ...]]]:
    """Every conformance test module's ``DIMENSIONS``, by requirement, in the modules' order.

    A requirement two modules cover has the dimensions of both; a dimension both name, the
    values of both, each once.
    """
    found: dict[str, dict[str, tuple[str, ...]]] = {}
    for info in pkgutil.iter_modules(conformance.__path__):
        if not info.name.startswith("test_"):
            continue
        module = importlib.import_module(f"conformance.{info.name}")
        for requirement, dimensions in getattr(module, "DIMENSIONS", {}).items():
            mine = found.setdefault(requirement, {})
            for name, values in dimensions.items():
                mine[name] = tuple(dict.fromkeys([*mine.get(name, ()), *values]))
    return found


def markdown(dimensions: Dimensions, order: Sequence[str]) -> str:
    """The "Dimensions" section of docs/catalogue.md: a row per requirement and dimension."""
    lines = [
        HEADING,
        "",
        "What each requirement's tests vary, and every value they try (each test module's",
        "`DIMENSIONS`; `python -m conformance.dimensions` writes this section). A planted",
        "breaker is generated for each value where a driver could get that value alone wrong;",
        "a value a host cannot show leaves the requirement partial there, naming it.",
        "",
        "| requirement | dimension | values tried |",
        "|---|---|---|",
    ]
    for requirement in order:
        for name, values in dimensions.get(requirement, {}).items():
            lines.append(f"| {requirement} | {name} | {'; '.join(values)} |")
    return "\n".join(lines) + "\n"


def section_of(page: str) -> tuple[int, int]:
    """Where the "Dimensions" section of a page begins and ends (up to the next ``## ``)."""
    start = page.index(HEADING)
    end = page.find("\n## ", start + len(HEADING))
    return start, len(page) if end < 0 else end + 1


def main() -> int:
    """Write the "Dimensions" section of docs/catalogue.md from the test modules."""
    from conformance import requirements

    page_path = Path(conformance.__file__).parent.parent / "docs" / "catalogue.md"
    order = [req.id for req in requirements.load().requirements]
    page = page_path.read_text()
    start, end = section_of(page)
    page_path.write_text(page[:start] + markdown(collect(), order) + page[end:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
