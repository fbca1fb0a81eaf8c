"""The workload manifest's reader and the golden list's, on generated files.

Valid manifests, mutated: a field of the wrong type or out of range, a huge integer, NaN,
a strange string, an unknown key, an anchor and its alias, a tag, bytes that are not UTF-8.
Each is accepted, within the documented bounds, or refused with the typed error that names
its field; nothing else. The manifest has no dump form, so there is no round trip to check.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import event, given
from hypothesis import strategies as st

from conformance import requirements
from conformance.requirements import RequirementsError
from workloads.manifest import (
    MAX_GPUS,
    MAX_RUNS,
    MAX_TIMEOUT_S,
    OUTCOMES,
    ManifestError,
    Workload,
    load_manifest,
)

pytestmark = pytest.mark.fuzz

GOLDEN = requirements.load()
WORKLOAD_IDS = sorted(i for i in GOLDEN.by_id if i.startswith("WORKLOAD-"))


odd_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
"""What a field holds when the file is not what the format says."""

RAW = "RAWSCALAR"
raw_scalars = st.sampled_from(
    [
        "9" * 4400,
        "-" + "9" * 4400,
        "0x" + "f" * 4000,
        "1" + "0" * 400,
        "1.0e+400",
        ".nan",
        ".inf",
        "-.inf",
        "2001-13-45",
        "2001-12-14",
        "!!int 1",
        "!!binary aGk=",
        "!!python/object:object {}",
        "&a 1",
        "*a",
        "&a [x, x]",
        '"abc\\n"',
        '"\\0"',
        '"\\ud800"',
        "~",
        "=",
        "{<<: {a: 1}}",
        "[" * 40 + "]" * 40,
        "{a: 1, a: 2}",
    ]
)
"""YAML text put in a field's place as it stands: what yaml.safe_dump would not write."""

odd_bytes = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\t", b"\xef\xbb\xbf"])
"""Not UTF-8 (a stray byte, a cut sequence, an encoded surrogate), or not YAML's."""

words = st.text(st.characters(exclude_characters="\x00"), max_size=6)
workload_entries = st.fixed_dictionaries(
    {
        "name": st.from_regex(r"\A[a-z0-9][a-z0-9-]{0,12}\Z"),
        "requirement": st.sampled_from(WORKLOAD_IDS),
        "gpus": st.integers(0, 4) | st.just(MAX_GPUS),
        "expect": st.sampled_from(OUTCOMES),
    },
    optional={
        "image": st.sampled_from(["busybox", "nvcr.io/nvidia/cuda:12.4.1"]),
        "timeout_s": st.floats(0.001, MAX_TIMEOUT_S) | st.integers(1, int(MAX_TIMEOUT_S)),
        "runs": st.integers(1, MAX_RUNS),
    },
).flatmap(
    lambda entry: st.one_of(
        st.fixed_dictionaries(
            {"payload": st.sampled_from(["control.py", "cuda_init.py"])},
            optional={"args": st.lists(words, max_size=3)},
        ),
        st.fixed_dictionaries({"command": st.lists(words, min_size=1, max_size=3)}),
    ).map(lambda what: {**entry, **what})
)
"""Valid entries."""
NEAR_MISSES: dict[str, list[object]] = {
    "name": ["", "abc\n", "Abc", "a" * 256, "a b", "\ud800"],
    "requirement": ["GPU-NOPE-01", "WORKLOAD-CUDA-01\n", "workload-cuda-01", 1],
    "payload": ["../manifest.py", "nope.py", "x" * 300, "a\x00", ["control.py"]],
    "args": [["a\x00"], ["\ud800"], "a", [1], None],
    "command": [[], ["a\x00"], "sh", [None]],
    "gpus": [-1, MAX_GPUS + 1, 10**400, True, 1.5, "1", math.nan],
    "expect": ["Pass", "", ["pass"], None],
    "image": ["", "a b", "a\n", "é", "x" * 513, 1],
    "timeout_s": [0, -1, math.nan, math.inf, -math.inf, MAX_TIMEOUT_S + 1, 10**400, True, "9"],
    "runs": [0, MAX_RUNS + 1, 10**400, True, 1.0],
    "extra": [1],
}
"""Per field, values just past what it takes: a bound, a type, a character."""


def _name(entry: dict[str, Any]) -> object:
    return entry["name"]


def _mutate(
    draw: st.DrawFn,
    mappings: list[dict[str, Any]],
    near: dict[str, list[object]],
    odd: st.SearchStrategy[Any],
) -> None:
    """Mostly once, a key of one of ``mappings``: set to a near miss, or ``odd``, or dropped."""
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
        mapping = draw(st.sampled_from(mappings))
        key = draw(st.sampled_from(sorted(near)))
        how = draw(st.sampled_from(["near", "near", "odd", "drop"]))
        mapping.pop(key, None)
        if how != "drop":
            mapping[key] = draw(st.sampled_from(near[key]) if how == "near" else odd)


@st.composite
def manifests(draw: st.DrawFn) -> bytes:
    """A manifest's bytes: valid entries, mutated a few times, now and then in its bytes."""
    entries = draw(st.lists(workload_entries, min_size=1, max_size=3, unique_by=_name))
    _mutate(draw, entries, NEAR_MISSES, odd_values | st.just(RAW))
    text = yaml.safe_dump({"workloads": entries}, allow_unicode=draw(st.booleans()))
    while RAW in text:
        text = text.replace(RAW, draw(raw_scalars), 1)
    data = text.encode("utf-8", "surrogatepass")
    if draw(st.integers(0, 7)) == 7:
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(odd_bytes) + data[at:]
    return data


@pytest.fixture(scope="module")
def manifest_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "manifest.yaml"


def _named(error: ManifestError | RequirementsError) -> None:
    message = str(error)
    assert error.field, message
    assert f": {error.field}: " in message, message
    assert "\n" not in message, message
    assert len(message) < 600, message


def _within_bounds(workload: Workload) -> None:
    assert 0 <= workload.gpus <= MAX_GPUS
    assert 1 <= workload.runs <= MAX_RUNS
    assert math.isfinite(workload.timeout_s)
    assert 0 < workload.timeout_s <= MAX_TIMEOUT_S
    assert workload.name.isprintable()
    assert workload.image is None or (workload.image.isascii() and workload.image.isprintable())
    assert len(workload.name) <= 255
    assert workload.requirement in GOLDEN.by_id
    assert workload.expect in OUTCOMES
    assert not any("\x00" in text for text in (*workload.args, *workload.command))
    assert (workload.payload is None) != (not workload.command)


@given(manifests())
def test_a_mutated_manifest_is_accepted_or_refused_by_name(
    manifest_file: Path, data: bytes
) -> None:
    """Each generated manifest: accepted within its bounds, or a ManifestError by field."""
    manifest_file.write_bytes(data)
    try:
        workloads = load_manifest(manifest_file, GOLDEN.by_id)
    except ManifestError as refused:
        event(f"refused: {type(refused).__name__} {refused.field.split('.')[-1]}")
        _named(refused)
    else:
        event("accepted")
        for workload in workloads:
            _within_bounds(workload)


@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_bytes_are_read_or_refused_by_name(manifest_file: Path, data: bytes) -> None:
    manifest_file.write_bytes(data)
    try:
        load_manifest(manifest_file)
    except ManifestError as refused:
        _named(refused)


golden_entries = st.fixed_dictionaries(
    {
        "id": st.sampled_from(["A-01", "B-01", "C-01"]),
        "statement": st.just("It MUST work."),
        "drivers": st.lists(st.sampled_from(["reference", "vm"]), unique=True),
    },
    optional={"optional": st.lists(st.just("vm"), max_size=1)},
)


GOLDEN_NEAR_MISSES: dict[str, list[object]] = {
    "drivers": ["reference", ["vm", "vm"], ["dockr"], ["VM"], []],
    "requirements": [[], {}, ["A-01"]],
    "id": ["a-01", "A-01\n", "A-", "", "A-01"],
    "statement": ["", [], None],
    "optional": [["reference"], "vm", ["vm", "vm"]],
    "extra": [1],
}


@st.composite
def golden_lists(draw: st.DrawFn) -> dict[str, Any]:
    """A golden list's document: valid entries, mutated a few times."""
    entries = draw(st.lists(golden_entries, min_size=1, max_size=3, unique_by=_id))
    document = {"drivers": ["reference", "vm"], "requirements": entries}
    _mutate(draw, [document, *entries], GOLDEN_NEAR_MISSES, odd_values)
    return document


def _id(entry: dict[str, Any]) -> object:
    return entry["id"]


@given(golden_lists())
def test_a_golden_list_is_read_or_refused_by_name(document: dict[str, Any]) -> None:
    try:
        golden = requirements.parse(document)
    except RequirementsError as refused:
        event(f"refused: {refused.field.split('.')[-1]}")
        _named(refused)
    else:
        event("accepted")
        assert len(golden.by_id) == len(golden.requirements) == len(document["requirements"])
        for entry in golden.requirements:
            assert set(entry.optional) <= set(entry.drivers) <= set(golden.drivers)
        lists = [golden.drivers] + [e.drivers for e in golden.requirements]
        for names in lists + [e.optional for e in golden.requirements]:
            assert len(set(names)) == len(names), names


# -- external drivers' manifests (drivers.external.manifest) ----------------------------------

EXTERNAL_NEAR_MISSES: dict[str, list[object]] = {
    "timeouts": [{"create": 0}, {"create": -1}, {"create": math.nan}, {"create": 1e400}, []],
    "templates": [{"create": ["x"]}, {}, None, {"create": "sh -c x"}],
    "defaultImage": ["--privileged", "", "-v/:/host", 1],
    "passEnv": [["A=B"], ["PATH", "PATH"], "HOME", [1]],
    "capabilities": [{}, {"maxGpusPerSandbox": 0, "exactIds": True}, []],
    "name": ["", "Bad", "a" * 64, None],
    "extra": [1],
}
"""Per key of an external manifest, values just past what it takes."""


@st.composite
def external_manifests(draw: st.DrawFn) -> bytes:
    """An external driver's manifest (the sh driver of the adapter's tests), mutated."""
    from tests.drivers.test_external_driver import sh_manifest

    manifest = sh_manifest(Path("/nonexistent"))
    _mutate(draw, [manifest], EXTERNAL_NEAR_MISSES, odd_values | st.just(RAW))
    text = yaml.safe_dump(manifest, allow_unicode=draw(st.booleans()))
    while RAW in text:
        text = text.replace(RAW, draw(raw_scalars), 1)
    return text.encode("utf-8", "surrogatepass")


@given(external_manifests())
def test_an_external_manifest_is_accepted_or_refused_by_key(
    manifest_file: Path, data: bytes
) -> None:
    """Accepted with finite timeouts and no option-like default image, or a ManifestError."""
    from drivers.external.manifest import ManifestError as ExternalManifestError
    from drivers.external.manifest import load

    manifest_file.write_bytes(data)
    try:
        manifest = load(manifest_file)
    except ExternalManifestError as refused:
        event(f"refused: {refused.key.split('.')[0]}")
        _keyed(refused)
    else:
        event("accepted")
        assert all(math.isfinite(t) and 0 < t <= 3600 for t in manifest.timeouts.values())
        assert not (manifest.default_image or "").startswith("-")


def _keyed(error: Exception) -> None:
    message, key = str(error), getattr(error, "key", "")
    assert key, message
    assert f": {key}: " in message, message
    assert "\n" not in message, message
