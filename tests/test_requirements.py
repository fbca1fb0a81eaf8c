"""The golden list and the catalogue must agree, requirement for requirement."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from conformance import requirements
from drivers import REGISTRY

ROOT = Path(__file__).parent.parent
CATALOGUE = ROOT / "conformance"
KNOWN_DRIVERS = {"reference", "docker", "podman", "kubernetes", "vm"}


def golden() -> list[dict[str, object]]:
    entries: list[dict[str, object]] = yaml.safe_load(
        (CATALOGUE / "REQUIREMENTS.yaml").read_text()
    )["requirements"]
    return entries


def catalogue_tests() -> dict[str, list[str]]:
    """Each conformance test's requirement ids (from its decorators) and its docstring."""
    found: dict[str, list[str]] = {}
    for path in sorted(CATALOGUE.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            ids = [
                d.args[0].value
                for d in node.decorator_list
                if isinstance(d, ast.Call)
                and ast.unparse(d.func) == "pytest.mark.requirement"
                and isinstance(d.args[0], ast.Constant)
            ]
            found[f"{path.name}::{node.name}"] = [str(i) for i in ids] + [
                ast.get_docstring(node) or ""
            ]
    return found


def test_golden_list_is_well_formed() -> None:
    entries = golden()
    ids = [entry["id"] for entry in entries]
    assert len(ids) == len(set(ids)), "duplicate requirement ids"
    assert set(requirements.load().drivers) == KNOWN_DRIVERS
    assert set(REGISTRY) <= KNOWN_DRIVERS
    for entry in entries:
        assert (
            {"id", "statement", "drivers"}
            <= set(entry)
            <= {
                "id",
                "statement",
                "drivers",
                "optional",
            }
        ), entry
        assert " MUST " in f" {entry['statement']} ", f"{entry['id']} states no MUST"
        assert isinstance(entry["drivers"], list)
        assert set(entry["drivers"]) <= KNOWN_DRIVERS, entry
        optional = entry.get("optional", [])
        assert isinstance(optional, list)
        assert set(optional) <= set(entry["drivers"]), f"{entry['id']}: optional but n.a."


def test_every_driver_of_the_golden_list_has_mandatory_requirements() -> None:
    golden_list = requirements.load()
    for driver in golden_list.drivers:
        levels = golden_list.profile(driver).values()
        assert "mandatory" in levels, f"{driver} would pass a release by checking nothing"


def test_profile_levels() -> None:
    golden_list = requirements.parse(
        {
            "drivers": ["reference", "vm"],
            "requirements": [
                {"id": "A-01", "statement": "x MUST", "drivers": ["reference", "vm"]},
                {"id": "B-01", "statement": "x MUST", "drivers": ["reference"]},
                {
                    "id": "C-01",
                    "statement": "x MUST",
                    "drivers": ["reference", "vm"],
                    "optional": ["vm"],
                },
            ],
        }
    )
    assert golden_list.profile("reference") == dict.fromkeys(["A-01", "B-01", "C-01"], "mandatory")
    assert golden_list.profile("vm") == {
        "A-01": "mandatory",
        "B-01": "not applicable",
        "C-01": "optional",
    }
    # A driver selected by import path, and a requirement the list does not know: held to it.
    assert golden_list.level("B-01", "mypkg.mod:MyDriver") == "mandatory"
    assert golden_list.level("Z-99", "vm") == "mandatory"


def test_every_conformance_test_has_one_requirement_and_a_must_docstring() -> None:
    for test, (*ids, docstring) in catalogue_tests().items():
        assert len(ids) == 1, f"{test} must carry exactly one requirement marker, has {ids}"
        assert "MUST" in docstring, f"{test} needs a MUST docstring"
        assert "\n" not in docstring.strip(), f"{test}: the docstring must be one line"


def test_golden_list_matches_the_catalogue() -> None:
    in_tests = {ids[0] for *ids, _ in catalogue_tests().values() if ids}
    in_golden = {str(entry["id"]) for entry in golden()}
    assert in_golden - in_tests == set(), "golden requirements with no test"
    assert in_tests - in_golden == set(), "tests of requirements missing from the golden list"
