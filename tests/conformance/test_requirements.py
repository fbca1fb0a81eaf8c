"""The golden list and the tests must agree, requirement for requirement.

The conformance catalogue names its requirements in markers; the workload lane in its
manifest (one requirement per workload), each generated test carrying it as a marker.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from conformance import requirements
from conformance.requirements import RequirementsError
from drivers import REGISTRY
from workloads.manifest import MANIFEST, REQUIREMENT_PREFIX, load_manifest

ROOT = Path(__file__).parents[2]
CATALOGUE = ROOT / "conformance"
WORKLOADS = ROOT / "workloads"
KNOWN_DRIVERS = {"reference", "docker", "podman", "kubernetes", "vm"}


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
    golden_list = requirements.load()  # every key present, of its type; ids, drivers distinct
    assert set(golden_list.drivers) == KNOWN_DRIVERS
    assert set(REGISTRY) <= KNOWN_DRIVERS
    for entry in golden_list.requirements:
        assert " MUST " in f" {entry.statement} ", f"{entry.id} states no MUST"


def good_list() -> dict[str, Any]:
    return {
        "drivers": ["reference", "vm"],
        "requirements": [
            {"id": "A-01", "statement": "x MUST", "drivers": ["reference", "vm"]},
            {"id": "B-01", "statement": "x MUST", "drivers": ["vm"], "optional": ["vm"]},
        ],
    }


REMOVED = object()


def changed(path: str, value: object) -> dict[str, Any]:
    """The good list with ``path`` (keys and indices, dotted) set to ``value``, or removed."""
    document = good_list()
    *parents, last = [int(part) if part.isdigit() else part for part in path.split(".")]
    target: Any = document
    for part in parents:
        target = target[part]
    if value is REMOVED:
        del target[last]
    else:
        target[last] = value
    return document


BAD_LISTS = {
    "a statement missing": (
        changed("requirements.0.statement", REMOVED),
        "A-01.statement",
        "is required",
    ),
    "drivers a string": (
        changed("requirements.0.drivers", "reference"),
        "A-01.drivers",
        "must be a list of names, got 'reference'",
    ),
    "an unknown key": (
        changed("requirements.1.optinal", ["vm"]),
        "B-01.optinal",
        "unknown key 'optinal' (known: drivers, id, optional, statement)",
    ),
    "a driver not of the list": (
        changed("requirements.0.drivers", ["reference", "dockr"]),
        "A-01.drivers[1]",
        "must be one of reference, vm, got 'dockr'",
    ),
    "a declaration no catalogue marker has": (
        changed("accepted_declarations", ["shared=False", "exclusive=false"]),
        "accepted_declarations[1]",
        "must be one of exclusive=False, shared=False, pools=none, got 'exclusive=false'",
    ),
    "a driver twice": (
        changed("requirements.0.drivers", ["vm", "vm"]),
        "A-01.drivers[1]",
        "vm is listed twice",
    ),
    "optional but not applicable": (
        changed("requirements.1.optional", ["reference"]),
        "B-01.optional[0]",
        "must be one of vm, got 'reference'",
    ),
    "an id missing": (
        changed("requirements.1.id", REMOVED),
        "requirements[1].id",
        "must be an id such as GPU-COUNT-01, got None",
    ),
    "an id not upper case": (
        changed("requirements.0.id", "a-01"),
        "requirements[0].id",
        "must be an id such as GPU-COUNT-01, got 'a-01'",
    ),
    "an id twice": (
        changed("requirements.1.id", "A-01"),
        "requirements[1].id",
        "A-01 is used twice",
    ),
    "a statement not a string": (
        changed("requirements.0.statement", ["x MUST"]),
        "A-01.statement",
        "must be a sentence, got ['x MUST']",
    ),
    "an entry not a mapping": (
        changed("requirements.0", "A-01"),
        "requirements[0]",
        "must be a mapping, got 'A-01'",
    ),
    "no requirements": (
        changed("requirements", []),
        "requirements",
        "must be a non-empty list, got []",
    ),
    "the list's drivers missing": (
        changed("drivers", REMOVED),
        "drivers",
        "is required",
    ),
    "a driver's name with a newline": (
        changed("drivers", ["reference", "vm\n"]),
        "drivers[1]",
        "must be a driver's name (lower case letters, digits and dashes), got 'vm\\n'",
    ),
    "a key at the top": (
        changed("version", 2),
        "version",
        "unknown key 'version' (known: accepted_declarations, drivers, requirements)",
    ),
}


@pytest.mark.parametrize(("document", "field", "said"), BAD_LISTS.values(), ids=list(BAD_LISTS))
def test_a_bad_golden_list_names_the_requirement_the_field_and_the_value(
    document: dict[str, Any], field: str, said: str
) -> None:
    with pytest.raises(RequirementsError) as caught:
        requirements.parse(document, Path("REQUIREMENTS.yaml"))
    assert caught.value.field == field
    assert str(caught.value) == f"REQUIREMENTS.yaml: {field}: {said}"


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"drivers: [\xff]", "(document): is not UTF-8: b'\\xff' at byte offset 10"),
        (
            b"drivers: &d [reference]\nrequirements: *d",
            "drivers: line 1, column 10: an anchor '&d': anchors and aliases are not allowed",
        ),
        (b"- 1", "(document): must be a mapping, got [1]"),
    ],
    ids=["not-utf-8", "alias", "a-list"],
)
def test_a_golden_list_file_is_read_strictly(tmp_path: Path, data: bytes, said: str) -> None:
    path = tmp_path / "REQUIREMENTS.yaml"
    path.write_bytes(data)
    with pytest.raises(RequirementsError) as caught:
        requirements.load(path)
    assert str(caught.value) == f"{path}: {said}"


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
    in_golden = set(requirements.load().by_id)
    in_tests = in_catalogue | in_workloads
    assert in_golden - in_tests == set(), "golden requirements with no test"
    assert in_tests - in_golden == set(), "tests of requirements missing from the golden list"
    # Each lane owns its ids: the catalogue's never start with WORKLOAD-, the lane's always.
    assert {i for i in in_catalogue if i.startswith(REQUIREMENT_PREFIX)} == set()
    assert {i for i in in_workloads if not i.startswith(REQUIREMENT_PREFIX)} == set()
