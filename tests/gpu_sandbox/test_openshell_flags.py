"""``gpu-sandbox`` speaks OpenShell's current GPU flags beside the seeds' (in-process, spec --json).

OpenShell's CLI took ``--gpu`` alone up to v0.0.68 and ``--gpu [COUNT]`` from v0.0.69
(crates/openshell-cli/src/main.rs:1376 at v0.0.111), with exact devices only in
``--driver-config-json``, a JSON object keyed by driver name; the seeds' ``--gpu-count`` and
repeatable ``--gpu-device`` never shipped. Every spelling of one request makes the same spec.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from drivers import get_driver_class
from gpu_sandbox.cli import main
from gpu_sandbox.commands.run import run_command
from gpu_sandbox.options import EXIT_USAGE, parser
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.leases import Holder
from tests.gpu_sandbox.test_cli import CDI_DIR


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Four GPUs, registered with the engines' CDI where this user may (docker's IDs need it)."""
    registry = CDI_DIR if os.access(CDI_DIR.parent, os.W_OK) else None
    root = tmp_path_factory.mktemp("openshell-flags") / "sim"
    host = simulated.setup(root, 4, registry, owner=Holder.process(os.getpid()))
    yield host.root
    simulated.teardown(host.root)


def spec(sim: Path, *argv: str) -> tuple[int, dict[str, Any], str]:
    """``gpu-sandbox spec --json ARGV``: its status, its JSON report, its stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(["spec", "--json", *argv, f"--sim-root={sim}"])
        except SystemExit as exc:  # argparse's refusals
            status = int(exc.code or 0)
    report = json.loads(out.getvalue()) if out.getvalue() else {}
    return status, report, err.getvalue()


COUNT_2 = {"resource_requirements": {"gpu": {"count": 2}}}


@pytest.mark.parametrize(
    "argv",
    [["--gpu", "2"], ["--gpu=2"], ["--gpu", "--gpu-count", "2"], ["--gpu-count=2"],
     ["--gpu=2", "--gpu-count=2"], ["--gpu=2", "--gpu=2"]],
    ids=["openshell-space", "openshell-equals", "seeds", "seeds-count-alone", "both-agreeing",
         "repeated-agreeing"],
)  # fmt: skip
def test_every_spelling_of_a_count_makes_the_same_request(sim: Path, argv: list[str]) -> None:
    status, report, err = spec(sim, *argv)
    assert status == 0, err
    assert report["spec"] == COUNT_2
    assert report["plan"]["count"] == 2


@pytest.mark.parametrize("argv", [["--gpu"], ["--gpu="]], ids=["alone", "empty-value"])
def test_gpu_without_a_count_is_the_default_request(sim: Path, argv: list[str]) -> None:
    status, report, _ = spec(sim, *argv)
    assert (status, report["spec"]) == (0, {"resource_requirements": {"gpu": {}}})


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--gpu=0"], "--gpu=0: gpu count must be greater than 0, got 0 (InvalidGpuCount at "
                      "resource_requirements.gpu.count)"),
        (["--gpu", "-1"], "--gpu=-1: gpu count must be greater than 0, got -1"),
        (["--gpu=two"], "argument --gpu: invalid int value: 'two'"),
        (["--gpu=2", "--gpu-count=3"], "--gpu=2 and --gpu-count=3 both give the count"),
        (["--gpu", "2", "--gpu", "3"], "--gpu=2 and --gpu=3 disagree: give --gpu once"),
        (["--gpu", "--gpu=3"], "--gpu and --gpu=3 disagree"),
    ],
    ids=["zero", "negative", "not-a-number", "two-counts", "gpu-twice", "default-then-count"],
)  # fmt: skip
def test_a_bad_count_exits_2_naming_the_flag_as_given(
    sim: Path, argv: list[str], said: str
) -> None:
    status, _, err = spec(sim, *argv)
    assert status == EXIT_USAGE
    assert said in err, err
    assert len(err.splitlines()) == 1, err


def test_run_takes_the_count_before_the_command() -> None:
    handlers = {name: run_command for name in ("run", "spec", "gpus", "reap")}
    args, extra = parser(handlers).parse_known_args(["run", "--gpu", "2", "--", "sh", "-c", "x"])
    assert (args.gpu, args.cmd, extra) == (2, ["sh", "-c", "x"], [])
    args, _ = parser(handlers).parse_known_args(["run", "--gpu", "--", "nvidia-smi", "-L"])
    assert (args.gpu, args.cmd) == (True, ["nvidia-smi", "-L"])


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_openshells_driver_config_json_names_exact_devices(sim: Path, engine: str) -> None:
    """``--gpu=2 --driver-config-json '{"docker": {"cdi_devices": [...]}}'``, OpenShell's form."""
    cls = get_driver_class(engine)
    host = GpuHost.open(HostConfig(sim))
    ids = [cls(host, "flags").device_ids(gpu) for gpu in host.gpus[1:3]]
    if not all(ids):
        pytest.skip(f"needs the host registered in {CDI_DIR} (root): {engine} names GPUs by CDI")
    names = [each[0] for each in ids]
    envelope = {engine: {"cdi_devices": names}}
    status, report, err = spec(sim, f"--driver={engine}", "--gpu=2",
                               f"--driver-config-json={json.dumps(envelope)}")  # fmt: skip
    assert status == 0, err
    assert report["spec"]["template"]["driver_config"] == envelope
    assert [gpu["uuid"] for gpu in report["resolved"]] == [gpu.uuid for gpu in host.gpus[1:3]]
    # Without --gpu, as OpenShell since v0.0.69 (#1835): IDs need a GPU request.
    status, _, err = spec(sim, f"--driver={engine}", f"--driver-config-json={json.dumps(envelope)}")
    assert status == EXIT_USAGE
    assert "GpuDevicesWithoutRequest" in err


def test_another_drivers_block_is_not_read_as_the_gateway_forwards_only_the_active_one(
    sim: Path,
) -> None:
    other = json.dumps({"vm": {"gpu_device_ids": ["0000:18:00.0"]}})
    status, report, err = spec(sim, "--driver=docker", "--gpu", f"--driver-config-json={other}")
    assert status == 0, err
    assert report["received"]["driver_config"] == {}
    assert report["plan"]["count"] == 1
