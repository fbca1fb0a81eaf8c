"""docs/catalogue.md's dimensions are those the conformance tests declare and try."""

from __future__ import annotations

from pathlib import Path

from conformance import dimensions, requirements
from workloads.manifest import REQUIREMENT_PREFIX as WORKLOADS

CATALOGUE = Path(__file__).parents[2] / "docs" / "catalogue.md"


def test_the_catalogue_page_lists_the_declared_dimensions() -> None:
    """Regenerate with: python -m conformance.dimensions (its section of docs/catalogue.md)."""
    order = [req.id for req in requirements.load().requirements]
    expected = dimensions.markdown(dimensions.collect(), order)
    page = CATALOGUE.read_text()
    assert dimensions.HEADING in page, f"{CATALOGUE} has no {dimensions.HEADING!r} section"
    start, end = dimensions.section_of(page)
    assert page[start:end] == expected


def test_declared_dimensions_name_requirements_of_the_golden_list() -> None:
    known = {req.id for req in requirements.load().requirements}
    declared = dimensions.collect()
    assert set(declared) <= known, sorted(set(declared) - known)
    assert all(values for dims in declared.values() for values in dims.values())


def test_every_requirement_of_the_catalogue_declares_its_dimensions() -> None:
    """A requirement with none declared samples one point and says nothing of the rest.

    The workload lane's requirements are left out: their cases are the workloads manifest's.
    """
    catalogue = [
        req.id for req in requirements.load().requirements if not req.id.startswith(WORKLOADS)
    ]
    undeclared = [req for req in catalogue if req not in dimensions.collect()]
    assert undeclared == [], (
        f"no DIMENSIONS declared in any conformance test module for {undeclared}"
    )
