"""examples/drivers/openshell.yaml: OpenShell's CLI as v0.0.111 ships it, by its dry render.

The validate command's render of each sample request must be the argv OpenShell's CLI takes
(crates/openshell-cli/src/main.rs:1329-1452 at v0.0.111): ``--gpu`` alone for the default
request, ``--gpu=N`` for a count, exact devices as docker's and podman's ``cdi_devices`` in
one ``--driver-config-json``, the image in ``--from``; every render is held to the
manifest's ``limits`` (a name of 19 bytes at most, each of ``--gpu``, ``--from`` and
``--driver-config-json`` once). Where the CLI is installed (scripts/openshell.sh), its own
parser takes each rendered create: it exits 1 (no gateway answers), never 2 (a usage error).
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from drivers.external import driver_class
from drivers.external.validate import main
from openshell_standin.stubs import LAUNCHER, cli_missing
from tests.catalogue import ROOT

MANIFEST = ROOT / "examples" / "drivers" / "openshell.yaml"
IMAGE = "ghcr.io/nvidia/openshell-community/sandboxes/base:latest"
LABELS = ["--label=gpu-sandbox.dev/session=<session>", "--label=gpu-sandbox.dev/driver=openshell"]
CREATE = ["openshell", "sandbox", "create", "--name=0123456789ab", *LABELS]
MAIN = ["--no-tty", "--detach", "--", "sleep", "infinity"]
IDS = ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
CONFIG = {"docker": {"cdi_devices": IDS}, "podman": {"cdi_devices": IDS}}
FLAGS = {  # v0.0.111's flags, per sample request of the validate command
    "no GPU": [f"--from={IMAGE}"],
    "default (one free GPU)": ["--gpu", f"--from={IMAGE}"],
    "count 2": ["--gpu=2", f"--from={IMAGE}"],
    "exact IDs": [
        "--gpu=2",
        "--driver-config-json",
        json.dumps(CONFIG, separators=(",", ":")),
        f"--from={IMAGE}",
    ],
    "shared": ["--gpu", f"--from={IMAGE}"],  # no sharing in v0.0.111: declared shared: false
    "env and image": ["--from=my-image:1", "--env=GREETING=hello world", "--env=EMPTY="],
}  # fmt: skip


def rendered(capsys: pytest.CaptureFixture[str], path: Path = MANIFEST) -> dict[str, list[str]]:
    """Each rendered argv of the validate command's output, by what it is of."""
    assert main([str(path)]) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{path}: valid (openshell, driver)"
    return {
        label.rstrip(":"): shlex.split(argv.strip())
        for label, argv in zip(lines[1::2], lines[2::2], strict=True)
    }


def test_each_sample_request_renders_v0_0_111s_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = rendered(capsys)
    for what, flags in FLAGS.items():
        assert argv[f"create, {what}"] == [*CREATE, *flags, *MAIN], what


def test_exec_close_and_list_name_the_sandbox_by_its_name_and_labels(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = rendered(capsys)
    probe = ["sh", "-c", "printf o; printf e >&2; exit 42"]
    (exec_argv,) = [v for k, v in argv.items() if k.startswith("exec of")]
    assert exec_argv[:5] == ["openshell", "sandbox", "exec", "--name=0123456789ab", "--no-tty"]
    assert exec_argv[5].startswith("--env=GPU_SANDBOX_EXEC=")  # the marker reaches the command
    assert exec_argv[6:] == ["--", *probe]
    assert argv["close"] == ["openshell", "sandbox", "delete", "0123456789ab"]
    assert argv["list"] == [
        "openshell", "sandbox", "list", "--names", "--limit=1000",
        "--selector=gpu-sandbox.dev/session=<session>,gpu-sandbox.dev/driver=openshell",
    ]  # fmt: skip
    assert "reap" not in argv, "sandbox delete takes names: the adapter deletes what list prints"


def test_the_manifest_declares_what_v0_0_111_gives() -> None:
    manifest = driver_class(MANIFEST).manifest
    caps = manifest.capabilities
    assert (manifest.allocation, manifest.sandbox_id) == ("driver", "adapter")
    assert (caps["exactIds"], caps["idForms"], caps["shared"], caps["mig"]) == (
        True, ["cdi"], False, False,
    )  # fmt: skip
    assert manifest.limits["--name"].max_length == 19
    assert all(manifest.limits[flag].once for flag in ("--gpu", "--from", "--driver-config-json"))
    assert "reap" not in manifest.templates


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (
            ("--name={sandbox_id}", "--name={driver}-{session_id}-{sandbox_id}"),
            "is 86 bytes: the CLI refuses more than 19 (limits.--name)",
        ),
        (('gpu_default: [--gpu]', 'gpu_default: [--gpu]\n  gpu: ["--gpu"]'), None),
        (('count: ["--gpu={count}"]', 'count: [--gpu, "--gpu={count}"]'), "--gpu is given more"),
    ],
    ids=["name-over-19-bytes", "gpu-and-count-fragments", "two-gpu-flags"],
)  # fmt: skip
def test_validate_refuses_a_render_the_cli_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: tuple[str, str], refusal: str | None
) -> None:
    """The limits the manifest declares: validate exits 2 naming the flag, nothing is run."""
    text = MANIFEST.read_text()
    assert change[0] in text
    path = tmp_path / "openshell.yaml"
    path.write_text(text.replace(change[0], change[1]))
    if refusal is None:  # `gpu` as well as `count`: a count request renders --gpu twice
        path.write_text(
            path.read_text().replace('- "{@gpu_default}"', '- "{@gpu_default}"\n    - "{@gpu}"')
        )
        refusal = "--gpu is given more than once"
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert refusal in err, err
    assert "(limits." in err


# -- the CLI's own parser ---------------------------------------------------------------------


def test_the_clis_parser_takes_every_rendered_create(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 1 (no gateway at 127.0.0.1:9), never 2: the CLI read every flag of the render."""
    if cli_missing():
        pytest.skip(cli_missing())
    env = {"PATH": "/usr/bin:/bin", "OPENSHELL_GATEWAY_ENDPOINT": "https://127.0.0.1:9"}
    for what, argv in rendered(capsys).items():
        if not what.startswith("create"):
            continue
        argv = [str(LAUNCHER), *argv[1:]]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 1, (what, done.stderr)
        assert "Connection refused" in done.stderr or "connect" in done.stderr, done.stderr
