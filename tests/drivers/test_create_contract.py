"""The create sequence's seams: declared by the contract, not patched from outside.

``Driver.create`` and ``check_request`` are final; each step is a hook (``select``,
``validate``, ``plan``, ``allocate``, ``start``); who allocates is a capability; the one
timing hook (``drivers.watch``) sees each create, exec and close; ``reap`` is the contract's
over a driver's ``remove_session``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from drivers import watch
from drivers.base import Driver, Sandbox
from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.errors import UnknownGpuDevice, UnsupportedGpuRequest
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import (
    DRIVER_SCHEDULER,
    DriverCapabilities,
    DriverRequest,
    GpuPlan,
    GpuRequest,
    SandboxSpec,
)
from tests.offline_drivers import NotStarted, OfflineKubernetes, OfflineReference


@pytest.fixture
def host(tmp_path: Path) -> Iterator[GpuHost]:
    sim = simulated.setup(tmp_path / "sim", 2)
    yield GpuHost.open(HostConfig(sim_root=sim.root))
    simulated.teardown(sim.root)


@pytest.mark.parametrize("final", ["create", "check_request"])
def test_a_driver_that_defines_a_step_the_contract_owns_is_refused_as_it_is_defined(
    final: str,
) -> None:
    def own(self: Driver, spec: SandboxSpec) -> Sandbox:
        raise AssertionError("never called")

    with pytest.raises(TypeError, match=rf"Bent overrides Driver\.{final}, the contract's own"):
        type("Bent", (ReferenceDriver,), {final: own})


def test_check_request_without_resolving_asks_nothing_of_the_host(host: GpuHost) -> None:
    class NoDevices(OfflineReference):
        def exact_devices(self) -> tuple:  # type: ignore[type-arg]
            raise AssertionError("resolving asked the host")

    driver = NoDevices(host, "s1")
    spec = SandboxSpec(gpu=GpuRequest(1), driver_config={"reference": {"gpu_device_ids": ["9"]}})
    request, plan = driver.check_request(spec, resolve=False)
    assert list(request.config["gpu_device_ids"]) == ["9"]
    assert plan is not None
    assert plan.device_ids == ("9",)
    with pytest.raises(AssertionError, match="resolving asked the host"):
        driver.check_request(spec)


def test_check_request_refuses_by_the_drivers_own_hooks(host: GpuHost) -> None:
    driver = OfflineReference(host, "s1")
    unknown = SandboxSpec(gpu=GpuRequest(1), driver_config={"reference": {"gpu_device_ids": ["9"]}})
    with pytest.raises(UnknownGpuDevice, match="gpu_device_ids"):
        driver.check_request(unknown)
    vendor = SandboxSpec(gpu=GpuRequest(1), driver_config={"reference": {"vendor": "amd"}})
    with pytest.raises(UnsupportedGpuRequest, match="vendor"):
        driver.check_request(vendor)
    assert host.leases.leases() == []


def test_create_runs_select_validate_plan_allocate_start_in_that_order(host: GpuHost) -> None:
    steps: list[str] = []

    class Traced(OfflineReference):
        def select(self, spec: SandboxSpec) -> DriverRequest:
            steps.append("select")
            return super().select(spec)

        def validate(self, request: DriverRequest) -> GpuPlan | None:
            steps.append("validate")
            return super().validate(request)

        def plan(self, request: DriverRequest) -> GpuPlan | None:
            steps.append("plan")
            return super().plan(request)

        def new_sandbox_id(self) -> str:
            steps.append("id")
            return "traced"

        def allocate(self, sandbox_id: str, plan: GpuPlan):  # type: ignore[no-untyped-def]
            steps.append(f"allocate {sandbox_id}")
            return super().allocate(sandbox_id, plan)

    with pytest.raises(NotStarted, match="traced"):
        Traced(host, "s1").create(SandboxSpec(gpu=GpuRequest(1)))
    assert steps == ["select", "plan", "validate", "id", "allocate traced"]
    assert host.leases.leases() == []  # the failed start gave its lease back


def test_a_driver_whose_scheduler_allocates_takes_no_lease_and_reap_releases_none(
    host: GpuHost,
) -> None:
    driver = OfflineKubernetes(host, "s1")
    assert driver.capabilities.allocated_by == DRIVER_SCHEDULER
    reached: list[tuple[int, int]] = []

    class Seen(OfflineKubernetes):
        def start(self, launch):  # type: ignore[no-untyped-def]
            reached.append((len(launch.gpus), len(host.leases.leases())))
            return super().start(launch)

    with pytest.raises(NotStarted):
        Seen(host, "s1").create(SandboxSpec(gpu=GpuRequest(1)))
    assert reached == [(0, 0)]


def test_an_allocator_outside_the_list_is_refused() -> None:
    with pytest.raises(ValueError, match="allocated_by 'cluster'"):
        DriverCapabilities(max_gpus_per_sandbox=1, exact_ids=False, allocated_by="cluster")


def test_reap_releases_the_sessions_leases_after_the_drivers_removal(host: GpuHost) -> None:
    order: list[str] = []

    class Removes(OfflineReference):
        def remove_session(self, session_id: str) -> list[str]:
            order.append(f"removed, {len(host.leases.leases())} leased")
            return ["gone"]

    driver = Removes(host, "s1")
    driver.allocate("held", GpuPlan(count=1))
    assert driver.reap("s1") == ["gone", "held"]
    assert order == ["removed, 1 leased"]
    assert host.leases.leases() == []


def test_the_watch_sees_each_create_exec_and_close_of_a_real_sandbox(host: GpuHost) -> None:
    seen: list[str] = []

    class Recording(watch.Watch):
        def create(self, driver: Driver, spec: SandboxSpec, call: Callable[[], Sandbox]) -> Sandbox:
            seen.append(f"create {driver.name}")
            return call()

        def exec(
            self, sandbox: Sandbox, argv: Sequence[str], timeout: float, call: Callable[[], int]
        ) -> int:
            seen.append(f"exec {list(argv)} {timeout:g}")
            return call()

        def close(self, sandbox: Sandbox, call: Callable[[], None]) -> None:
            seen.append("close")
            call()

    driver = ReferenceDriver(host, "s1")
    if not driver.probe().ok:
        pytest.skip(f"the reference driver cannot run here: {driver.probe().reason}")
    with watch.watched(Recording()), driver.create(SandboxSpec(gpu=GpuRequest(1))) as sandbox:
        assert sandbox.exec(["true"], timeout=7).returncode == 0
    assert seen == ["create reference", "exec ['true'] 7", "close"]
    assert type(watch.current()) is watch.Watch  # set back as it was
    driver.reap("s1")


def test_a_breaker_changes_a_step_by_its_hook_and_the_contract_still_runs_the_rest(
    host: GpuHost,
) -> None:
    class ReadsAnyBlock(OfflineReference):
        def select(self, spec: SandboxSpec) -> DriverRequest:
            blocks = {self.name: next(iter(spec.driver_config.values()))}
            return super().select(dataclasses.replace(spec, driver_config=blocks))

    spec = SandboxSpec(gpu=GpuRequest(1), driver_config={"docker": {"gpu_device_ids": ["7"]}})
    with pytest.raises(UnknownGpuDevice, match=r"template\.driver_config\.reference"):
        ReadsAnyBlock(host, "s1").create(spec)
    assert host.leases.leases() == []
