"""The golden list and the tests must agree, requirement for requirement.

The conformance catalogue names its requirements in markers; the workload lane in its
manifest (one requirement per workload), each generated test carrying it as a marker.
"""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from conformance import requirements
from drivers import REGISTRY
from workloads.manifest import MANIFEST, REQUIREMENT_PREFIX, load_manifest

ROOT = Path(__file__).parent.parent
CATALOGUE = ROOT / "conformance"
WORKLOADS = ROOT / "workloads"
KNOWN_DRIVERS = {"reference", "docker", "podman", "kubernetes", "vm"}


def golden() -> list[dict[str, object]]:
    entries: list[dict[str, object]] = yaml.safe_load(
        (CATALOGUE / "REQUIREMENTS.yaml").read_text()
    )["requirements"]
    return entries


def catalogue_tests(directory: Path = CATALOGUE) -> dict[str, list[str]]:
    """Each test's requirement ids (from its decorators) and its docstring.

    A workload test that takes the ``workload`` parameter gets its requirement from the
    manifest; it stands here as the id ``(manifest)``.
    """
    found: dict[str, list[str]] = {}
    for path in sorted(directory.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            from_manifest = ["(manifest)"] if "workload" in {a.arg for a in node.args.args} else []
            ids = from_manifest + [
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


def manifest_requirements() -> set[str]:
    return {workload.requirement for workload in load_manifest(MANIFEST)}


def test_every_conformance_test_has_one_requirement_and_a_must_docstring() -> None:
    tests = {**catalogue_tests(), **catalogue_tests(WORKLOADS)}
    assert any(ids == ["(manifest)"] for *ids, _ in tests.values()), "no manifest-driven test"
    for test, (*ids, docstring) in tests.items():
        assert len(ids) == 1, f"{test} must carry exactly one requirement marker, has {ids}"
        assert "MUST" in docstring, f"{test} needs a MUST docstring"
        assert "\n" not in docstring.strip(), f"{test}: the docstring must be one line"


def test_golden_list_matches_the_catalogue() -> None:
    in_catalogue = {ids[0] for *ids, _ in catalogue_tests().values() if ids}
    in_workloads = {ids[0] for *ids, _ in catalogue_tests(WORKLOADS).values() if ids}
    in_workloads = (in_workloads - {"(manifest)"}) | manifest_requirements()
    in_golden = {str(entry["id"]) for entry in golden()}
    in_tests = in_catalogue | in_workloads
    assert in_golden - in_tests == set(), "golden requirements with no test"
    assert in_tests - in_golden == set(), "tests of requirements missing from the golden list"
    # Each lane owns its ids: the catalogue's never start with WORKLOAD-, the lane's always.
    assert {i for i in in_catalogue if i.startswith(REQUIREMENT_PREFIX)} == set()
    assert {i for i in in_workloads if not i.startswith(REQUIREMENT_PREFIX)} == set()
