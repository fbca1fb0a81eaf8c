"""examples/drivers/gosandbox: a jsonl driver in Go (standard library only), judged as any.

It is built here when Go is present (``make gosandbox`` does the same); without Go and
without a built binary these tests are skipped, saying so. The quick tests drive it through
the adapter on a small simulated host and hold every message it sends to the protocol's
schema, and the leases it writes to the lease protocol's; the lane runs the whole catalogue
on it, alone and beside the reference driver (GPU-HOSTWIDE-01 checks each against the other).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from drivers.external import driver_class
from gpuhost import simulated
from gpuhost.errors import (
    DuplicateGpuDevice,
    ExecTimeout,
    GpuBusy,
    GpusExhausted,
    InvalidGpuCount,
    UnknownGpuDevice,
)
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec
from tests.catalogue import ROOT, golden_ids, run_catalogue, what_failed
from tests.conformance.test_example_driver import (
    PEERS_AND_PRIVILEGES,
    assert_impostor_is_no_sandbox,
    assert_sandboxes_of_users_of_their_own,
)
from tests.drivers.test_external_jsonl import assert_every_message_in_the_protocol, trace  # noqa: F401

SOURCE = ROOT / "examples" / "drivers" / "gosandbox"
MANIFEST = SOURCE / "driver.yaml"
NAME = "gosandbox"


@pytest.fixture(scope="module", autouse=True)
def built() -> Path:
    """The driver's binary, built from its sources when Go is here."""
    binary = SOURCE / "gosandbox"
    go = shutil.which("go")
    if go is not None:
        # As `make gosandbox`: the jails' system call filter, which the build embeds.
        subprocess.run(
            [sys.executable, "-m", "drivers.seccomp", str(SOURCE / "seccomp.bpf")], check=True
        )
        env = {"GOFLAGS": "-mod=mod", "GOPROXY": "off"}
        done = subprocess.run(
            [go, "build", "-o", "gosandbox", "."], cwd=SOURCE, capture_output=True, text=True,
            env={**os.environ, **env}, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, f"go build failed: {done.stderr}"
    elif not binary.exists():
        pytest.skip("needed go on PATH to build examples/drivers/gosandbox (found none)")
    return binary


@pytest.fixture
def host(tmp_path: Path) -> Iterator[GpuHost]:
    mig, dri = simulated.parse_mig_layout("1:2x3g.40gb"), simulated.parse_dri_layout("amd:1")
    sim = simulated.setup(tmp_path / "sim", 3, mig=mig, dri=dri)
    yield GpuHost.open(HostConfig(sim.root))
    simulated.teardown(sim.root)


def test_the_go_driver_creates_execs_refuses_lists_and_reaps(host: GpuHost, trace: Path) -> None:  # noqa: F811
    driver = driver_class(MANIFEST)(host, "go-a")
    assert driver.probe().ok, driver.probe().reason
    assert driver.version().startswith("1.0 (bubblewrap")
    sandbox = driver.create(SandboxSpec.with_gpus(2))
    with sandbox:
        assert (len(sandbox.gpus), driver.sandboxes("go-a")) == (2, [sandbox.id])
        commands = {  # what each gives back: exit code, stdout, stderr
            "printf 'o\\r\\n\\0'; printf e >&2; exit 130": (130, "o\r\n\0", "e"),
            "kill -9 $$": (128 + 9, "", ""),
            "ls /dev | grep -c '^nvidia[0-9]'": (0, "2\n", ""),
        }
        for script, expected in commands.items():
            got = sandbox.exec(["sh", "-c", script])
            assert (got.returncode, got.stdout, got.stderr) == expected, script
        with pytest.raises(ExecTimeout):
            sandbox.exec(["sleep", "5"], timeout=0.3)
        with pytest.raises(GpusExhausted):
            driver.create(SandboxSpec.with_gpus(1))
        with pytest.raises(GpuBusy):
            driver.create(SandboxSpec.with_gpus(driver=NAME, device_ids=[sandbox.gpus[0].uuid]))
    with pytest.raises(UnknownGpuDevice) as refused:
        driver.create(SandboxSpec.with_gpus(driver=NAME, device_ids=["no-such-gpu-0"]))
    assert refused.value.field == f"template.driver_config.{NAME}.gpu_device_ids"
    with pytest.raises(InvalidGpuCount, match=r"got 2\.0"):
        driver.create(SandboxSpec.with_gpus(2.0))
    gpu = host.gpus[0]
    with pytest.raises(DuplicateGpuDevice, match=gpu.pci_bus_id.upper()):
        driver.create(SandboxSpec.with_gpus(driver=NAME, device_ids=["0", gpu.pci_bus_id.upper()]))
    left = driver.create(SandboxSpec())
    assert driver.reap("go-a") == [left.id]
    assert driver.sandboxes("go-a") == []
    assert host.leases.leases() == []
    assert assert_every_message_in_the_protocol(trace) > 10


def test_its_leases_are_the_lease_protocols_and_the_python_registry_reads_them(
    host: GpuHost,
) -> None:
    import jsonschema

    driver = driver_class(MANIFEST)(host, "go-l")
    mig = host.mig_devices[0]
    with driver.create(SandboxSpec.with_gpus(driver=NAME, device_ids=[mig.uuid])) as sandbox:
        schema = json.loads((ROOT / "docs" / "lease-file.schema.json").read_text())
        for path in host.leases.directory.glob("leases.*.json"):
            jsonschema.validate(json.loads(path.read_text()), schema)
        (lease,) = host.leases.leases()
        assert (lease.gpu_uuid, lease.parent_uuid) == (mig.uuid, mig.parent_uuid)
        assert (lease.driver, lease.sandbox_id) == (NAME, sandbox.id)
        assert lease.holder.kind == "process"
        # The Python registry sees the instance's GPU busy, held by the jail's pid 1.
        with pytest.raises(GpuBusy):
            driver_class(ROOT / "examples" / "drivers" / "jsonl-jail.yaml")(host, "go-l").create(
                SandboxSpec.with_gpus(driver="jsonl-jail", device_ids=[mig.parent_uuid or ""])
            )
    assert host.leases.leases() == []


def test_each_jail_runs_as_a_user_of_its_own_under_the_filter(host: GpuHost) -> None:
    assert_sandboxes_of_users_of_their_own(driver_class(MANIFEST)(host, "go-users"))


def test_another_users_bwrap_with_the_sessions_stamp_is_not_a_jail(host: GpuHost) -> None:
    driver = driver_class(MANIFEST)(host, "go-impostor")
    assert_impostor_is_no_sandbox(driver, "GOSANDBOX_SANDBOX", "go-impostor")


# -- the catalogue (lane) ----------------------------------------------------------------------


def test_the_go_driver_passes_the_peer_and_privilege_requirements(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    name = f"exec:{MANIFEST}"
    result, run = run_catalogue(pytester, tmp_path, name, 4, PEERS_AND_PRIVILEGES, full=False)
    verdicts = {req: result["matrix"][req][name] for req in ("SANDBOX-PEER-01", "SANDBOX-PRIV-01")}
    assert set(verdicts.values()) == {"passed"}, (verdicts, run.stdout.str()[-3000:])


def test_the_go_driver_passes_the_whole_catalogue(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    name = f"exec:{MANIFEST}"
    result, run = run_catalogue(pytester, tmp_path, name, 8)
    assert result["verdicts"][name]["status"] == "PASS", (
        what_failed(result, name) or run.stdout.str()[-3000:]
    )
    assert run.ret == 0
    verdicts = {req: cells[name] for req, cells in result["matrix"].items()}
    assert {verdicts[req] for req in golden_ids()} <= {"passed", "not applicable"}, (
        f"{what_failed(result, name)}\nverdicts: {verdicts}"
    )


def test_the_go_driver_and_the_reference_driver_pass_side_by_side(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """One run, both drivers: GPU-HOSTWIDE-01 checks each one's sandboxes against the other's."""
    go = f"exec:{MANIFEST}"
    result, run = run_catalogue(pytester, tmp_path, f"reference,{go}", 8)
    for name in ("reference", go):
        assert result["verdicts"][name]["status"] == "PASS", run.stdout.str()[-3000:]
        assert result["matrix"]["GPU-HOSTWIDE-01"][name] == "passed", result["matrix"]
    assert run.ret == 0
