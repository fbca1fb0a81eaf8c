"""examples/drivers/openshell.yaml: OpenShell's CLI as the seeds describe it, by its dry render.

OpenShell does not run here; what can be checked is what the adapter would run: the validate
command's render of each sample request must be the argv the seeds' flag mapping gives
(seed 000: ``--gpu``, ``--gpu-count=N``, ``--gpu-device=ID``; seed 003: exact devices are the
request's, their number its count).
"""

from __future__ import annotations

import shlex

import pytest

from drivers.external import driver_class
from drivers.external.validate import main
from tests.catalogue import ROOT

MANIFEST = ROOT / "examples" / "drivers" / "openshell.yaml"
NAME = "openshell-<session>-0123456789ab"
"""The sandbox's name in the render: <driver>-<session>-<the adapter's sandbox id>."""
CREATE = ["openshell", "sandbox", "create", "--name", NAME]
FLAGS = {  # the seeds' flag mapping, per sample request of the validate command
    "no GPU": [],
    "default (one free GPU)": ["--gpu"],
    "count 2": ["--gpu", "--gpu-count", "2"],
    "exact IDs": [
        "--gpu-count", "2", "--gpu-device", "nvidia.com/gpu=0", "--gpu-device", "nvidia.com/gpu=1",
    ],
    "shared": ["--gpu"],  # no sharing flag: the manifest declares shared: false
    "env and image": ["--from", "my-image:1"],
}  # fmt: skip


def rendered(capsys: pytest.CaptureFixture[str]) -> dict[str, list[str]]:
    """Each rendered argv of the validate command's output, by what it is of."""
    assert main([str(MANIFEST)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{MANIFEST}: valid (openshell, driver)"
    return {
        label.rstrip(":"): shlex.split(argv.strip())
        for label, argv in zip(lines[1::2], lines[2::2], strict=True)
    }


def test_each_sample_request_renders_the_seeds_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = rendered(capsys)
    for what, flags in FLAGS.items():
        assert argv[f"create, {what}"] == [*CREATE, *flags], what


def test_exec_close_list_and_reap_name_the_sandbox_by_its_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = rendered(capsys)
    probe = ["sh", "-c", "printf o; printf e >&2; exit 42"]
    assert argv[f"exec of {shlex.join(probe)}"] == [
        "openshell",
        "sandbox",
        "exec",
        NAME,
        "--",
        *probe,
    ]
    assert argv["close"] == ["openshell", "sandbox", "delete", NAME]
    for op in ("list", "reap"):  # sh -c SCRIPT $0 driver session: the values never in the script
        assert argv[op][:2] == ["sh", "-c"]
        assert argv[op][3:] == [op, "openshell", "<session>"]


def test_the_manifest_declares_what_the_seeds_give() -> None:
    manifest = driver_class(MANIFEST).manifest
    caps = manifest.capabilities
    assert (manifest.allocation, caps["exactIds"], caps["shared"]) == ("driver", True, False)
    assert manifest.templates["create"][0] == "openshell"
