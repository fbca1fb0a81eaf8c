"""OpenShell's real CLI (v0.0.111) judged by the catalogue, against the stand-in gateway.

Not OpenShell: the gateway is ``openshell_standin`` (reference-driver sandboxes, GPUs through
the host registry); the CLI is NVIDIA's binary (scripts/openshell.sh install). A lane, as
the engine lanes are: the whole catalogue on the gate's simulated host through
examples/drivers/openshell.yaml, whose column must be the one docs/drivers/openshell.md
gives and explains, requirement by requirement; three planted broken manifests
(tests/data/external/openshell-*.yaml), each failing what it breaks from the CLI's or the
gateway's own refusal; and the manifest's validate --probe. Skipped, saying what is
missing, where the CLI or its generated code is not installed (make openshell).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from drivers.external import driver_class
from drivers.external.stderr import one_line
from drivers.external.validate import main as validate
from gpuhost import simulated
from gpuhost.errors import SandboxStartError
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import parse_spec
from openshell_standin.catalogue import lane, missing
from openshell_standin.client import RunningGateway
from openshell_standin.stubs import LAUNCHER
from tests.catalogue import DRI_LAYOUT, MIG_LAYOUT, ROOT, golden_ids, run_catalogue
from tests.drivers.test_external_breakers import assert_verdict

MANIFEST = ROOT / "examples" / "drivers" / "openshell.yaml"
DATA = ROOT / "tests" / "data" / "external"
PAGE = ROOT / "docs" / "drivers" / "openshell.md"
ROW = re.compile(r"^\| ([A-Z]+-[A-Z]+-[0-9]+) \| (passed|failed|not applicable) \| (.*) \|$")
"""A row of the page's verdict table: the requirement, its cell, why."""
PWNED = Path("/tmp/gpu-sandbox-pwned")


def explained() -> dict[str, tuple[str, str]]:
    """The page's verdict table: each requirement's cell, and why."""
    rows = (ROW.match(line) for line in PAGE.read_text().splitlines())
    return {row[1]: (row[2], row[3].strip()) for row in rows if row}


@pytest.fixture
def openshell_lane(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[tuple[Path, Path, RunningGateway]]:
    """(a manifest's copy that reaches the gateway, the simulated host, the gateway)."""
    if missing():
        pytest.skip(missing())
    manifest: Path = getattr(request, "param", MANIFEST)
    sim = simulated.setup(tmp_path / "sim", 8, mig=MIG_LAYOUT, dri=DRI_LAYOUT)
    try:
        with lane(tmp_path, sim.root, manifest, tmp_path / "gateway.log") as (copy, gateway):
            for key, value in gateway.env.items():  # what the manifest's passEnv hands the CLI
                monkeypatch.setenv(key, value)
            yield copy, sim.root, gateway
    finally:
        simulated.teardown(sim.root)


def failures(result: dict[str, Any], requirement: str) -> list[str]:
    return [
        test["message"]
        for test in result["tests"]
        if test["requirement"] == requirement and test["outcome"] in ("failed", "error")
    ]


@pytest.mark.xdist_group("openshell")
def test_the_openshell_cli_gets_the_column_its_page_explains(
    pytester: pytest.Pytester, tmp_path: Path, openshell_lane: tuple[Path, Path, RunningGateway]
) -> None:
    copy, sim_root, _ = openshell_lane
    name = f"exec:{copy}"
    result, run = run_catalogue(pytester, tmp_path / "run", name, sim_root=sim_root)
    column = {req: cells[name] for req, cells in result["matrix"].items() if req in golden_ids()}
    page = explained()
    assert set(page) == golden_ids(), "docs/drivers/openshell.md: one row per requirement"
    assert column == {req: cell for req, (cell, _) in page.items()}, result["tests"]
    assert all(why for cell, why in page.values() if cell != "passed"), "a non-pass unexplained"
    run.stdout.fnmatch_lines([f"{name}: FAIL — GPU-DEFAULT-01 failed: *the driver reports *"])
    # The control of the planted list below: this list shows both of the session's sandboxes.
    assert not [m for m in failures(result, "SANDBOX-REAP-01") if "assert 0 == 2" in m]


@pytest.mark.xdist_group("openshell")
@pytest.mark.parametrize(
    ("openshell_lane", "requirements", "refusal"),
    [
        (DATA / "openshell-long-names.yaml", ["GPU-NONE-01"], "name exceeds maximum length ("),
        (DATA / "openshell-two-gpu-flags.yaml", ["GPU-COUNT-01", "GPU-EXHAUST-01"],
         "the argument '--gpu [<COUNT>]' cannot be used multiple times"),
        (DATA / "openshell-list-hides-failure.yaml", ["SANDBOX-REAP-01"], "assert 0 == 2"),
    ],
    ids=["long-names", "two-gpu-flags", "list-hides-failure"],
    indirect=["openshell_lane"],
)  # fmt: skip
def test_a_planted_broken_openshell_manifest_fails_the_requirement_it_breaks(
    pytester: pytest.Pytester,
    tmp_path: Path,
    openshell_lane: tuple[Path, Path, RunningGateway],
    requirements: list[str],
    refusal: str,
) -> None:
    """Each fails from the CLI's (or the gateway's) own refusal.

    The unbroken manifest passes GPU-NONE-01 and GPU-EXHAUST-01, and lists both sandboxes of
    SANDBOX-REAP-01 (the test above).
    """
    copy, sim_root, gateway = openshell_lane
    name = f"exec:{copy}"
    result, run = run_catalogue(
        pytester, tmp_path / "run", name, 8, f"--requirement={','.join(requirements)}",
        sim_root=sim_root,
    )  # fmt: skip
    # The CLI's refusal, wrapped to 80 columns, in pytest's "E" lines of the run.
    output = one_line(re.sub(r"(?m)^E ", "", run.stdout.str()))
    for requirement in requirements:
        assert_verdict(result, run, name, requirement)
        assert failures(result, requirement)
    assert refusal in output, output[-3000:]
    if "list-hides-failure" in copy.name:  # what the pipe hid: the gateway's refusal
        shown = gateway.cli("sandbox", "list", "--names", "--selector=gpu-sandbox.dev/session==s")
        assert shown.returncode == 1
        assert "label value contains invalid characters" in one_line(shown.stderr)


@pytest.mark.xdist_group("openshell")
def test_validate_probe_through_the_real_cli_comes_back_intact(
    openshell_lane: tuple[Path, Path, RunningGateway], capsys: pytest.CaptureFixture[str]
) -> None:
    copy, sim_root, _ = openshell_lane
    assert validate([str(copy), "--probe", f"--sim-root={sim_root}"]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "probe: passed (exit 42, stdout 'o', stderr 'e')"
    assert f"{LAUNCHER} sandbox create --name=0123456789ab" in out


@pytest.mark.xdist_group("openshell")
def test_env_values_reach_the_sandbox_as_values_through_the_real_cli(
    openshell_lane: tuple[Path, Path, RunningGateway],
) -> None:
    """``--gpu``, ``;`` and ``$(…)`` arrive as the values they are.

    A newline the gateway refuses by its own rule (validation.rs:80-104), and nothing is made.
    """
    copy, sim_root, _ = openshell_lane
    driver = driver_class(copy)(GpuHost.open(HostConfig(sim_root)), "injected")
    env = {"V1": "--gpu", "V2": ";", "V3": f"$(touch {PWNED})"}
    with driver.create(parse_spec({"template": {"env": env}})) as sandbox:
        shown = sandbox.exec(["sh", "-c", 'printf "%s|" "$V1" "$V2" "$V3"'], timeout=60)
        assert (shown.returncode, shown.stdout) == (0, "".join(f"{v}|" for v in env.values()))
    with pytest.raises(SandboxStartError, match="contains newline or carriage return"):
        driver.create(parse_spec({"template": {"env": {"V": "a\nb"}}}))
    assert driver.sandboxes("injected") == []
    assert not PWNED.exists()
