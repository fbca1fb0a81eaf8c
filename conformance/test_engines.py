"""What only container drivers promise: the engine's own view agrees, `=all`, out-of-band removal.

These tests speak to the engine beside the driver, through its CLI, as a user would.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance.dimensions import declared
from conformance.fixtures import SandboxFactory, not_applicable
from conformance.hold import REPLY_TIMEOUT_S, HeldSandbox, reap_from_a_fresh_process
from conformance.observe import (
    assert_all_gpus_grantable,
    parse_list,
    retake,
    specs_for_gpus,
    uuids,
    visible_gpu_uuids,
)
from conformance.settings import Settings
from drivers.base import Driver
from drivers.container import SESSION_LABEL, ContainerDriver, ContainerSandbox
from gpuhost import cdi
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuBusy, GpusExhausted
from gpuhost.spec import SandboxSpec

CLI_TIMEOUT_S = 120
DIMENSIONS = {
    "SANDBOX-REAP-01": declared(
        reaped_from=("a fresh process, its creator killed between creating and starting it",),
        of_the_session=("a container created, never started (the engine's `ps --all`)",),
    )
}


@pytest.fixture
def engine(driver: Driver, request: pytest.FixtureRequest) -> ContainerDriver:
    """The driver under test, where it is a container driver; elsewhere not applicable."""
    if isinstance(driver, ContainerDriver):
        return driver
    not_applicable(request.node, f"{driver.name} is not a container driver")


def _cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    __tracebackhide__ = True
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        pytest.fail(f"needed the engine's CLI to check the driver against: {argv[0]} not found")


@pytest.mark.requirement("GPU-ORACLE-01")
def test_sandbox_sees_what_the_engine_injects(
    engine: ContainerDriver, sandboxes: SandboxFactory
) -> None:
    """For every GPU, nvidia-smi -L in a sandbox holding it MUST match the engine's own run."""
    devices = {gpu.uuid: engine.device_ids(gpu)[0] for gpu in engine.inventory()}

    def inside(gpu: GpuDevice) -> str:
        spec = SandboxSpec.with_gpus(driver=engine.name, device_ids=[devices[gpu.uuid]])
        with sandboxes(spec) as sandbox:
            return sandbox.exec(["nvidia-smi", "-L"]).check().stdout

    with ThreadPoolExecutor(len(devices)) as pool:
        listed = dict(zip(devices, pool.map(inside, engine.inventory()), strict=True))
    # The engine's own run, given every GPU's device: each GPU's lines (with its MIG devices)
    # are what a sandbox holding that GPU alone must list, numbered from 0.
    plain = _cli(engine.oracle_argv(list(devices.values()), None, ["nvidia-smi", "-L"]))
    assert plain.returncode == 0, f"the engine's own run failed: {plain.stderr.strip()}"
    by_uuid = {gpu.uuid: dataclasses.replace(gpu, index=0) for gpu in parse_list(plain.stdout)}
    assert sorted(by_uuid) == sorted(devices), (
        f"`{engine.cli} run` with {sorted(devices.values())} lists {plain.stdout!r}"
    )
    for uuid, device in devices.items():
        assert parse_list(listed[uuid]) == [by_uuid[uuid]], (
            f"{device}: the sandbox lists {listed[uuid]!r}; `{engine.cli} run --device "
            f"{device}` lists {by_uuid[uuid]}"
        )


@pytest.mark.requirement("GPU-ALL-01")
@pytest.mark.gpus(2)
def test_all_devices_only_when_asked_and_then_every_gpu(
    engine: ContainerDriver, sandboxes: SandboxFactory, host_gpus: tuple[str, ...]
) -> None:
    """`nvidia.com/gpu=all`, asked for explicitly, MUST hold every GPU, exclusively."""
    default = sandboxes(SandboxSpec.with_gpus())
    assert len(uuids(default)) == 1, f"a default request got {uuids(default)}"
    default.close()
    name = cdi.all_devices(engine.cdi_kind)
    everything = sandboxes(SandboxSpec.with_gpus(driver=engine.name, device_ids=[name]))
    every_gpu = sorted(gpu.uuid for gpu in engine.host.gpus)  # those in MIG mode too
    assert sorted(uuids(everything)) == every_gpu, (
        f"{name} should hold all {len(every_gpu)} GPUs; the driver reports {uuids(everything)}"
    )
    assert sorted(visible_gpu_uuids(everything)) == every_gpu
    with pytest.raises(GpusExhausted):
        sandboxes(SandboxSpec.with_gpus())
    for profile in sorted({mig.profile for mig in engine.host.mig_devices if mig.profile}):
        with pytest.raises(GpusExhausted):  # every instance's GPU is held whole
            sandboxes(SandboxSpec.with_gpus(driver=engine.name, block={"mig_profile": profile}))


@pytest.mark.requirement("GPU-RECLAIM-03")
def test_container_removed_out_of_band_frees_its_gpus(
    engine: ContainerDriver,
    sandboxes: SandboxFactory,
    settings: Settings,
    host_gpus: tuple[str, ...],
) -> None:
    """The GPUs of a container removed by the engine's CLI MUST go to the next request."""
    spec = SandboxSpec.with_gpus(len(host_gpus))
    victim = sandboxes(spec)
    assert isinstance(victim, ContainerSandbox)
    removed = _cli(engine.cli_argv("rm", "--force", victim.container_id))
    assert removed.returncode == 0, f"`{engine.cli} rm --force` failed: {removed.stderr.strip()}"
    successor = retake(
        lambda: sandboxes(spec),
        settings.reclaim_timeout_s,
        f"re-taking the GPUs of container {victim.container_id[:12]}, removed out-of-band",
    )
    assert sorted(uuids(successor)) == sorted(host_gpus)


@pytest.mark.requirement("SANDBOX-REAP-01")
def test_reap_removes_a_container_whose_creator_died_before_starting_it(
    engine: ContainerDriver, settings: Settings
) -> None:
    """Reap from a fresh process MUST remove a container created but never started."""
    session = f"reap-unstarted-{time.time_ns()}"
    theirs = type(engine)(engine.host, session, engine.image)
    listing = engine.cli_argv(
        "ps", "--all", "--filter", f"label={SESSION_LABEL}={session}", "--format", "{{.ID}}"
    )
    with HeldSandbox.start(
        theirs, settings, specs_for_gpus(engine, 1)[0], die_at_hand_over=True
    ) as creator:
        creator.send_go()
        died = creator.process.wait(REPLY_TIMEOUT_S)
    made = _cli(listing).stdout.split()
    if died != -signal.SIGKILL or not made:
        pytest.fail(
            f"the creator should have died between creating its container and starting it "
            f"(exit {died}, containers of the session: {made})"
        )
    try:
        reap_from_a_fresh_process(engine, settings.host_config, session)
        left = _cli(listing)
        assert left.returncode == 0, f"`{engine.cli} ps` failed: {left.stderr.strip()}"
        assert left.stdout.split() == [], (
            f"reaped from a fresh process, session {session} still has containers "
            f"{left.stdout.split()}, created and never started (`{' '.join(listing)}`)"
        )
    finally:
        for container_id in _cli(listing).stdout.split():
            _cli(engine.cli_argv("rm", "--force", container_id))
    assert_all_gpus_grantable(engine, after=f"reaping session {session}")


@pytest.mark.requirement("GPU-BUSY-01")
def test_a_paused_container_keeps_its_gpus(
    engine: ContainerDriver, sandboxes: SandboxFactory
) -> None:
    """A container paused through the engine's CLI MUST keep its GPUs: busy to exact requests."""
    # It exists and holds them, its processes frozen with the GPU open: not running, not gone.
    victim = sandboxes(SandboxSpec.with_gpus())
    assert isinstance(victim, ContainerSandbox)
    paused = _cli(engine.cli_argv("pause", victim.container_id))
    assert paused.returncode == 0, f"`{engine.cli} pause` failed: {paused.stderr.strip()}"
    try:
        for device_id in engine.device_ids(victim.gpus[0]):
            with pytest.raises(GpuBusy):
                sandboxes(SandboxSpec.with_gpus(driver=engine.name, device_ids=[device_id]))
    finally:
        _cli(engine.cli_argv("unpause", victim.container_id))
