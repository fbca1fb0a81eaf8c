"""The workload manifest: the shipped one loads; a bad one fails with the field and the value."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conformance import requirements
from gpuhost.errors import shown
from workloads.manifest import (
    MANIFEST,
    PAYLOADS,
    DuplicateName,
    InvalidValue,
    ManifestError,
    MissingField,
    UnknownField,
    Workload,
    load_manifest,
)

GOLDEN = set(requirements.load().by_id)
GOOD = {
    "name": "mine",
    "requirement": "WORKLOAD-CUDA-01",
    "payload": "control.py",
    "gpus": 1,
    "expect": "pass",
}


def test_the_shipped_manifest_loads_against_the_golden_list() -> None:
    workloads = load_manifest(MANIFEST, GOLDEN)
    assert {workload.expect for workload in workloads} == {"pass", "fail"}, "no control"
    assert all(workload.payload is None or workload.payload.is_file() for workload in workloads)
    multi = [workload for workload in workloads if workload.gpus >= 2]
    assert multi, "no multi-GPU workload"
    # CUDA must work in a sandbox's second command too, in each framework.
    again = {w.args[1] for w in workloads if w.requirement == "WORKLOAD-CUDA-01" and w.runs >= 2}
    assert again == {"torch", "cupy"}


def write(tmp_path: Path, document: object) -> Path:
    path = tmp_path / "manifest.yaml"
    if isinstance(document, bytes):
        path.write_bytes(document)
    else:
        path.write_text(document if isinstance(document, str) else yaml.safe_dump(document))
    return path


def entry(**changes: object) -> dict[str, object]:
    fields = {**GOOD, **changes}
    return {key: value for key, value in fields.items() if value is not None}


BAD = {
    "not YAML": ("workloads: [", InvalidValue, "(document)", None),
    "not a mapping": (["a"], InvalidValue, "(document)", ["a"]),
    "no workloads": ({"workloads": []}, InvalidValue, "workloads", []),
    "missing name": ([entry(name=None)], MissingField, "workloads[0].name", None),
    "bad name": ([entry(name="My Test")], InvalidValue, "workloads[0].name", "My Test"),
    "unknown field": ([{**GOOD, "gpu": 1}], UnknownField, "workloads[0].gpu", 1),
    "expect": ([entry(expect="maybe")], InvalidValue, "workloads[0].expect", "maybe"),
    "gpus bool": ([entry(gpus=True)], InvalidValue, "workloads[0].gpus", True),
    "gpus negative": ([entry(gpus=-1)], InvalidValue, "workloads[0].gpus", -1),
    "requirement": (
        [entry(requirement="GPU-NOPE-01")],
        InvalidValue,
        "workloads[0].requirement",
        "GPU-NOPE-01",
    ),
    "payload and command": (
        [entry(command=["true"])],
        InvalidValue,
        "workloads[0].payload",
        "control.py",
    ),
    "no such payload": (
        [entry(payload="nope.py")],
        InvalidValue,
        "workloads[0].payload",
        "nope.py",
    ),
    "payload outside": (
        [entry(payload="../manifest.py")],
        InvalidValue,
        "workloads[0].payload",
        "../manifest.py",
    ),
    "args of a command": (
        [entry(payload=None, command=["true"], args=["x"])],
        InvalidValue,
        "workloads[0].args",
        ["x"],
    ),
    "timeout": ([entry(timeout_s=0)], InvalidValue, "workloads[0].timeout_s", 0),
    "timeout over a day": (
        [entry(timeout_s=86_401)],
        InvalidValue,
        "workloads[0].timeout_s",
        86_401,
    ),
    "gpus over 1024": ([entry(gpus=1025)], InvalidValue, "workloads[0].gpus", 1025),
    "runs over 100": ([entry(runs=101)], InvalidValue, "workloads[0].runs", 101),
    "name over 255": ([entry(name="a" * 256)], InvalidValue, "workloads[0].name", "a" * 256),
    "image with a space": ([entry(image="a b")], InvalidValue, "workloads[0].image", "a b"),
    "arg with a NUL": ([entry(args=["a\0"])], InvalidValue, "workloads[0].args[0]", "a\0"),
    "runs zero": ([entry(runs=0)], InvalidValue, "workloads[0].runs", 0),
    "runs bool": ([entry(runs=True)], InvalidValue, "workloads[0].runs", True),
    "duplicate": ([entry(), entry()], DuplicateName, "workloads[1].name", "mine"),
}


@pytest.mark.parametrize(("document", "error", "field", "value"), BAD.values(), ids=list(BAD))
def test_a_bad_manifest_names_the_field_and_the_value(
    tmp_path: Path, document: object, error: type[ManifestError], field: str, value: object
) -> None:
    if isinstance(document, list) and document and isinstance(document[0], dict):
        document = {"workloads": document}
    with pytest.raises(error) as caught:
        load_manifest(write(tmp_path, document), GOLDEN)
    assert (caught.value.field, caught.value.value) == (field, value)
    assert field in str(caught.value)
    if value is not None:
        assert shown(value) in str(caught.value)


ENTRY = """workloads:
  - name: mine
    requirement: WORKLOAD-CUDA-01
    payload: control.py
    gpus: 1
    expect: pass
"""
BOMB = "".join(
    f"      {chr(98 + level)}: &{chr(98 + level)} [{', '.join([f'*{chr(97 + level)}'] * 9)}]\n"
    for level in range(9)
)
HOSTILE = {
    "not UTF-8": (
        ENTRY.encode().replace(b"mine", b"m\xffne"),
        "(document): is not UTF-8: b'\\xff' at byte offset 22",
    ),
    "an integer of 4,400 digits": (
        ENTRY.replace("gpus: 1", "gpus: " + "9" * 4400),
        "workloads[0].gpus: must be a whole number from 0 to 1024, got an integer of 4400 digits",
    ),
    "a huge timeout": (
        ENTRY + "    timeout_s: 1" + "0" * 400,
        "workloads[0].timeout_s: must be seconds, over 0 and at most 86400, "
        "got an integer of 401 digits",
    ),
    "a payload name over 255 characters": (
        ENTRY.replace("control.py", "x" * 300),
        f"workloads[0].payload: must name a file in {PAYLOADS}, got '{'x' * 79}… (300 characters)",
    ),
    "timeout .nan": (
        ENTRY + "    timeout_s: .nan",
        "workloads[0].timeout_s: line 7, column 16: .nan is not a finite number",
    ),
    "timeout .inf": (
        ENTRY + "    timeout_s: .inf",
        "workloads[0].timeout_s: line 7, column 16: .inf is not a finite number",
    ),
    "a name ending in a newline": (
        ENTRY.replace("name: mine", 'name: "abc\\n"'),
        "workloads[0].name: must be lower case letters, digits and dashes, 255 at most, "
        "got 'abc\\n'",
    ),
    "gpus 10**400": (
        ENTRY.replace("gpus: 1", "gpus: 1" + "0" * 400),
        "workloads[0].gpus: must be a whole number from 0 to 1024, got an integer of 401 digits",
    ),
    "an alias bomb under an unknown key": (
        ENTRY + "    extra:\n      a: &a [x, x, x, x, x, x, x, x, x]\n" + BOMB,
        "workloads[0].extra.a: line 8, column 10: "
        "an anchor '&a': anchors and aliases are not allowed",
    ),
    "an alias alone": (
        ENTRY.replace("gpus: 1", "gpus: *one"),
        "workloads[0].gpus: line 5, column 11: "
        "an alias '*one': anchors and aliases are not allowed",
    ),
    "a tag": (
        ENTRY.replace("gpus: 1", "gpus: !!int '1'"),
        "workloads[0].gpus: line 5, column 11: "
        "the tag 'tag:yaml.org,2002:int': tags are not allowed",
    ),
    "a key twice": (
        ENTRY + "    gpus: 2",
        "workloads[0].gpus: line 7, column 5: the key 'gpus' is given twice",
    ),
    "nested 5,000 deep": (
        ENTRY + "    args: " + "[" * 5000 + "]" * 5000,
        "workloads[0].args" + "[0]" * 13 + ": line 7, column 24: nested over 16 deep",
    ),
    "a hexadecimal integer of 6,021 digits": (
        ENTRY.replace("gpus: 1", "gpus: [0x" + "f" * 5000 + "]"),
        "workloads[0].gpus: must be a whole number from 0 to 1024, got [an integer of 6021 digits]",
    ),
    "the 13th month": (
        ENTRY.replace("gpus: 1", "gpus: 2001-13-01"),
        "workloads[0].gpus: must be a whole number from 0 to 1024, "
        "got the impossible date '2001-13-01': month must be in 1..12",
    ),
    "an unknown key with a newline": (
        ENTRY + '    "gp\\nus": 1',
        "workloads[0]['gp\\nus']: unknown field 'gp\\nus', set to 1 (known: args, command, "
        "expect, gpus, image, name, payload, requirement, runs, timeout_s)",
    ),
    "a lone surrogate in a command": (
        ENTRY.replace("payload: control.py", 'command: ["\\ud800"]'),
        "workloads[0].command[0]: must be text without a NUL byte or a lone surrogate, "
        "got '\\ud800'",
    ),
    "over 64 KiB": (
        ENTRY + "#" * (64 << 10),
        "(document): is over 65536 bytes",
    ),
}


@pytest.mark.parametrize(("text", "said"), HOSTILE.values(), ids=list(HOSTILE))
def test_hostile_input_is_refused_by_field_on_one_line(
    tmp_path: Path, text: str | bytes, said: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ManifestError) as caught:
        load_manifest(path, GOLDEN)
    assert str(caught.value) == f"{path}: {said}"
    assert caught.value.field == said.split(": ")[0]


def test_a_missing_manifest_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(InvalidValue, match="cannot be read: No such file or directory"):
        load_manifest(tmp_path / "nope.yaml")


def test_the_bounds_themselves_are_accepted(tmp_path: Path) -> None:
    top = entry(name="a" * 255, gpus=1024, timeout_s=86_400, runs=100, image="a/b:c")
    (workload,) = load_manifest(write(tmp_path, {"workloads": [top]}), GOLDEN)
    assert (workload.gpus, workload.timeout_s, workload.runs) == (1024, 86_400.0, 100)


def test_placeholders_become_the_sandboxes_gpus() -> None:
    workload = Workload(
        "w", "WORKLOAD-CUDA-01", "pass", 2, PAYLOADS / "control.py", args=("{gpu_uuids}",)
    )
    argv = workload.argv("py", ["GPU-a", "GPU-b"], cpu=True)
    assert argv[:2] == ["py", "-c"]
    assert argv[2] == (PAYLOADS / "control.py").read_text()
    assert argv[3:] == ["GPU-a,GPU-b", "--cpu"]
    command = Workload("c", "WORKLOAD-CUDA-01", "pass", 2, command=("echo", "{gpu_count}"))
    assert command.argv("py", ["GPU-a", "GPU-b"]) == ["echo", "2"]
