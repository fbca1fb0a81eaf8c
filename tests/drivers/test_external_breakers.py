"""Planted broken external drivers: each fails, through the adapter, the requirement it breaks.

Two templates manifests (tests/data/external/: examples/drivers/podman-cli.yaml with one
fault each, on the podman of `make engines`) and a jsonl driver (examples/drivers/
jsonl_jail.py with ``JSONL_JAIL_BREAK``). Each runs the catalogue in a subprocess (lane).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuhost import simulated
from tests.catalogue import ROOT, run_catalogue
from tests.drivers.test_external_driver import PODMAN_CLI, _podman_answers

DATA = ROOT / "tests" / "data" / "external"
JSONL_JAIL = ROOT / "examples" / "drivers" / "jsonl-jail.yaml"


def assert_verdict(result: dict[str, Any], run: pytest.RunResult, name: str, requirement: str,
                   verdict: str = "failed") -> None:  # fmt: skip
    """``name``'s cell of ``requirement`` (and, when failed, its verdict line says so)."""
    __tracebackhide__ = True
    assert result["matrix"][requirement][name] == verdict, result["tests"]
    if verdict == "failed":
        run.stdout.fnmatch_lines([f"{name}: FAIL — *{requirement}*"])


@pytest.mark.xdist_group("engines")
@pytest.mark.parametrize(
    ("manifest", "requirement"),
    [
        (DATA / "podman-cli-ignores-ids.yaml", "GPU-EXACT-01"),  # create gives GPU 0, not the IDs
        (DATA / "podman-cli-early-close.yaml", "GPU-RELEASE-01"),  # close backgrounds `podman rm`
        (PODMAN_CLI, "GPU-EXACT-01"),  # the controls: unbroken, it passes both
        (PODMAN_CLI, "GPU-RELEASE-01"),
    ],
    ids=["ignores-ids", "early-close", "control-exact", "control-release"],
)
def test_a_planted_broken_templates_driver_fails_the_requirement_it_breaks(
    pytester: pytest.Pytester, tmp_path: Path, manifest: Path, requirement: str
) -> None:
    missing = _podman_answers()
    if missing:
        pytest.skip(f"needs podman answering at /run/podman/podman.sock (make engines): {missing}")
    sim = simulated.setup(tmp_path / "sim", 4, cdi_dir=Path("/var/run/cdi"))
    name = f"exec:{manifest}"
    try:
        result, run = run_catalogue(
            pytester, tmp_path, name, 4, f"--requirement={requirement}", sim_root=sim.root
        )
    finally:
        simulated.teardown(sim.root)
    assert_verdict(result, run, name, requirement, "passed" if manifest == PODMAN_CLI else "failed")


@pytest.mark.parametrize("breaker", ["forget-on-restart", ""], ids=["forgets", "control"])
def test_a_jsonl_driver_whose_list_forgets_after_a_restart_fails_sandbox_reap_01(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, breaker: str
) -> None:
    """A fresh driver process lists and reaps none of the sandboxes another one made."""
    monkeypatch.setenv("JSONL_JAIL_BREAK", breaker)
    name = f"exec:{JSONL_JAIL}"
    result, run = run_catalogue(
        pytester, tmp_path, name, 4, "--requirement=SANDBOX-REAP-01", full=False
    )
    assert_verdict(result, run, name, "SANDBOX-REAP-01", "failed" if breaker else "passed")
    if not breaker:
        return
    failed = [t["message"] for t in result["tests"] if t["outcome"] in ("failed", "error")]
    assert any("reap" in message for message in failed), failed
