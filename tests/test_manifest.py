"""The workload manifest: the shipped one loads; a bad one fails with the field and the value."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

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

ROOT = Path(__file__).parent.parent
GOLDEN = {
    str(entry["id"])
    for entry in yaml.safe_load((ROOT / "conformance" / "REQUIREMENTS.yaml").read_text())[
        "requirements"
    ]
}
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
        assert repr(value) in str(caught.value)


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
