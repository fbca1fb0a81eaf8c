"""Races of every kind of request: what only some racers can get, no two of them get.

Requests of one kind race for what fewer of them can have than ask: the last free default
GPU, the last two for counts of two, one device by one exact ID in each form the driver
takes, one device by all its IDs at once, the last instance of a MIG profile, the last GPU
of a vendor, one GPU shared past its limit or against an exclusive request. The racers are
threads of this process (GPU-CONCURRENT-01) or processes (GPU-CONCURRENT-02). The kinds and
the forms are the enumerations tests/breakers/exhaustion.py generates its breakers from.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from conformance.dimensions import declared
from conformance.fixtures import Dropped, SandboxFactory
from conformance.hold import created_at_once
from conformance.observe import create_side_by_side, exact_ids, specs_for_gpus
from conformance.settings import Settings
from drivers.base import Driver, Sandbox
from gpuhost.devices import GpuDevice
from gpuhost.errors import DriverError, GpuBusy, GpusExhausted, UnsupportedGpuRequest
from gpuhost.spec import SHARED, SandboxSpec

THREADS, PROCESSES = "threads of one process", "processes"
DEFAULT, COUNT, EXACT, EVERY_ID = (
    "a default request", "a count of two", "an exact ID", "every ID of one device at once",
)  # fmt: skip
PROFILE, VENDOR, SHARING = "a MIG profile", "a vendor", "a shared request"
KINDS = (DEFAULT, COUNT, EXACT, EVERY_ID, PROFILE, VENDOR, SHARING)
"""The kinds of request raced."""
FORMS = (
    "index", "UUID", "CDI name by index", "CDI name by UUID", "PCI address", "DRI node",
    "MIG UUID", "MIG CDI name by index", "MIG CDI name by UUID",
)  # fmt: skip
"""The forms of an exact ID raced, those of them the driver takes (``form_of``)."""
KIND_IDS = {DEFAULT: "default", COUNT: "count", EXACT: "exact", EVERY_ID: "every-id",
            PROFILE: "profile", VENDOR: "vendor", SHARING: "shared"}  # fmt: skip
DIMENSIONS = {
    requirement: declared(racers=(racers,), kind=KINDS, form=FORMS)
    for requirement, racers in (("GPU-CONCURRENT-01", THREADS), ("GPU-CONCURRENT-02", PROCESSES))
}


def form_of(device: GpuDevice, device_id: str) -> str:
    """Which of ``FORMS`` ``device_id``, one of ``device``'s IDs, is; "another form" if none."""
    mig = "MIG " if device.is_mig else ""
    if device_id == device.uuid:
        return f"{mig}UUID"
    if device_id in device.cdi_names:
        return f"{mig}CDI name by {'index' if device_id == device.cdi_names[0] else 'UUID'}"
    if device.vendor == "nvidia" and device_id == str(device.index) and not device.is_mig:
        return "index"
    if device_id.lower() == device.pci_bus_id.lower():
        return "PCI address"
    if device_id in device.dri_paths:
        return "DRI node"
    return "another form"


@dataclass(frozen=True)
class Race:
    """Racers' requests, and how many may win: those past it must get ``refusal``."""

    what: str
    specs: tuple[SandboxSpec, ...]
    winners: int
    refusal: type[DriverError]
    shared_or_not: bool = False
    """The winners are an exclusive request alone, or sharers alone (as many as may share)."""


Outcome = tuple[str, list[str]]
"""A racer's outcome: ("won", its GPUs), or (the error's name, [its message])."""


def _races(kind: str, driver: Driver, sandboxes: SandboxFactory) -> list[Race] | str:
    """The races of ``kind`` on this host (what is held meanwhile, held), or why none."""
    total = len(driver.inventory())
    name = driver.name
    if kind == DEFAULT:
        create_side_by_side(sandboxes, specs_for_gpus(driver, total - 1))
        return [Race("the last free GPU", (SandboxSpec.with_gpus(),) * 3, 1, GpusExhausted)]
    if kind == COUNT:
        if driver.capabilities.max_gpus_per_sandbox < 2:  # refused to every racer
            spec = SandboxSpec.with_gpus(2)
            return [
                Race("two GPUs, past the most a sandbox has", (spec,) * 3, 0, UnsupportedGpuRequest)
            ]
        if total < 2:
            return f"needs 2 GPUs (the host has {total})"
        create_side_by_side(sandboxes, specs_for_gpus(driver, total - 2))
        return [Race("the last two free GPUs", (SandboxSpec.with_gpus(2),) * 3, 1, GpusExhausted)]
    if kind in (EXACT, EVERY_ID):
        # A driver that takes no exact ID refuses every racer.
        won, lost = (1, GpuBusy) if driver.capabilities.exact_ids else (0, UnsupportedGpuRequest)
        races = []
        for device in _one_of_each_kind(driver):
            ids = exact_ids(driver, device)
            if kind == EVERY_ID:
                specs = tuple(SandboxSpec.with_gpus(driver=name, device_ids=[i]) for i in ids)
                what = f"{device.describe()} by {', '.join(ids)}"
                races.append(Race(what, specs, won, lost))
                continue
            for device_id in ids:
                spec = SandboxSpec.with_gpus(driver=name, device_ids=[device_id])
                what = f"{device.describe()} by its {form_of(device, device_id)} {device_id}"
                races.append(Race(what, (spec, spec), won, lost))
        return races
    if kind in (PROFILE, VENDOR):
        return _pool_race(kind, driver, sandboxes)
    limit = driver.host.share_limit
    gpu = driver.inventory()[0]
    shared = SandboxSpec.with_gpus(
        driver=name, device_ids=[driver.device_ids(gpu)[0]], sharing=SHARED
    )
    exclusive = SandboxSpec.with_gpus(driver=name, device_ids=[driver.device_ids(gpu)[0]])
    return [
        Race(f"{gpu.describe()}, shared past its limit", (shared,) * (limit + 1), limit, GpuBusy),
        Race(
            f"{gpu.describe()}, shared and exclusive", (exclusive, *(shared,) * limit), limit,
            GpuBusy, shared_or_not=True,
        ),
    ]  # fmt: skip


def _one_of_each_kind(driver: Driver) -> list[GpuDevice]:
    """A whole NVIDIA GPU, a MIG instance and an AMD or Intel GPU, of those the driver takes."""
    devices = driver.exact_devices()
    kinds: list[Callable[[GpuDevice], bool]] = [
        lambda d: d.vendor == "nvidia" and not d.is_mig and not d.mig_enabled,
        lambda d: d.is_mig,
        lambda d: d.vendor != "nvidia",
    ]
    return [found for of_kind in kinds if (found := next(filter(of_kind, devices), None))]


def _pool_race(kind: str, driver: Driver, sandboxes: SandboxFactory) -> list[Race] | str:
    """The last free device of the smallest MIG profile, or of a vendor, raced for."""
    if kind == PROFILE:
        pools = {m.profile: {"mig_profile": m.profile} for m in driver.host.mig_devices}
        pools = pools if driver.capabilities.mig_profiles else {}
    else:
        vendors = set(driver.capabilities.vendors) - {"nvidia"}
        pools = {
            g.vendor: {"vendor": g.vendor} for g in driver.host.dri_gpus if g.vendor in vendors
        }
    if not pools:
        return f"the host has no device of {kind} the {driver.name} driver serves"
    name, block = min(pools.items(), key=lambda item: len(driver.host.pool(**item[1])))
    size = len(driver.host.pool(**block))
    if size > 1:
        if size - 1 > driver.capabilities.max_gpus_per_sandbox:
            return f"needs {size - 1} of {name} in one sandbox"
        sandboxes(SandboxSpec.with_gpus(size - 1, driver=driver.name, block=block))
    spec = SandboxSpec.with_gpus(driver=driver.name, block=block)
    return [Race(f"the last free device of {name}", (spec,) * 3, 1, GpusExhausted)]


def _race_threads(driver: Driver, race: Race) -> list[Outcome]:
    barrier = threading.Barrier(len(race.specs))

    def create(spec: SandboxSpec) -> Sandbox:
        barrier.wait()
        return driver.create(spec)

    with ThreadPoolExecutor(len(race.specs)) as pool:
        attempts = [pool.submit(create, spec) for spec in race.specs]
    won = [a.result() for a in attempts if a.exception() is None]
    try:
        return [
            ("won", [g.uuid for g in a.result().gpus])
            if (exc := a.exception()) is None
            else (type(exc).__name__, [str(exc)])
            for a in attempts
        ]
    finally:
        with ThreadPoolExecutor(max(1, len(won))) as pool:
            list(pool.map(lambda sandbox: sandbox.close(), won))


def _race_processes(driver: Driver, settings: Settings, race: Race) -> list[Outcome]:
    replies = created_at_once(driver, settings, race.specs)
    return [
        ("won", list(reply["gpus"])) if reply["ok"] else (reply["error"], [reply["message"]])
        for reply in replies
    ]


def _judge(race: Race, outcomes: Sequence[Outcome], racers: str) -> None:
    __tracebackhide__ = True
    said = f"{len(race.specs)} {racers} raced for {race.what}; they got {list(outcomes)}"
    won = [gpus for how, gpus in outcomes if how == "won"]
    lost = [how for how, _ in outcomes if how != "won"]
    if race.shared_or_not and outcomes[0][0] == "won":
        assert len(won) == 1, f"{said}: the exclusive request won, and sharers beside it"
    elif race.winners > 1:
        assert len(won) == race.winners, f"{said}: exactly {race.winners} must share it"
    else:
        flat = [uuid for gpus in won for uuid in gpus]
        assert len(flat) == len(set(flat)), f"{said}: a device was granted twice"
        assert len(won) == race.winners, f"{said}: exactly {race.winners} must win"
    assert set(lost) <= {race.refusal.__name__}, (
        f"{said}: the others must get {race.refusal.__name__}"
    )


def _race_every(kind: str, racers: str, driver: Driver, sandboxes: SandboxFactory,
                settings: Settings, dropped: Dropped) -> None:  # fmt: skip
    __tracebackhide__ = True
    races = _races(kind, driver, sandboxes)
    if isinstance(races, str):
        dropped(kind, races)
        return
    for race in races:
        if racers == THREADS:
            outcomes = _race_threads(driver, race)
        else:
            outcomes = _race_processes(driver, settings, race)
        _judge(race, outcomes, racers)


KIND_PARAMS = [
    pytest.param(
        kind,
        id=KIND_IDS[kind],
        marks=[pytest.mark.shares_gpus] if kind == SHARING
        else [pytest.mark.chooses_pools] if kind in (PROFILE, VENDOR) else [],
    )
    for kind in KINDS
]  # fmt: skip


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-CONCURRENT-01")
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_racing_threads_never_get_what_only_some_may(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped, kind: str
) -> None:
    """Requests of every kind racing from threads MUST never grant a device twice."""
    _race_every(kind, THREADS, driver, sandboxes, settings, dropped)


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-CONCURRENT-02")
@pytest.mark.parametrize("kind", KIND_PARAMS)
def test_racing_processes_never_get_what_only_some_may(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped, kind: str
) -> None:
    """Requests of every kind racing from processes MUST never grant a device twice."""
    _race_every(kind, PROCESSES, driver, sandboxes, settings, dropped)
