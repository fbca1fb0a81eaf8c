"""Exhaustion and exclusivity: more than is free fails promptly; no GPU is granted twice."""

from __future__ import annotations

import re
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance.bad_requests import COUNT, EXHAUSTED_FIELDS
from conformance.bounds import unpaced
from conformance.dimensions import declared
from conformance.fixtures import Dropped, SandboxFactory, exhaustion_grace, not_applicable
from conformance.hold import created_at_once
from conformance.observe import (
    SIDE_BY_SIDE,
    assert_all_gpus_grantable,
    create_side_by_side,
    specs_for_gpus,
    uuids,
    visible_gpu_uuids,
)
from conformance.settings import Settings
from drivers.base import Driver, Sandbox
from gpuhost.devices import GpuDevice
from gpuhost.errors import DriverError, GpusExhausted, UnsupportedGpuRequest
from gpuhost.spec import SHARED, SandboxSpec


def _create_within(
    sandboxes: SandboxFactory, spec: SandboxSpec, deadline_s: float
) -> tuple[Sandbox | BaseException, float]:
    """Create in a thread of its own, so that a driver that never returns fails by name."""
    outcome: list[Sandbox | BaseException] = []

    def create() -> None:
        try:
            with unpaced():  # a request that must be refused: if granted late, not a pace
                outcome.append(sandboxes(spec))
        except BaseException as exc:
            outcome.append(exc)

    start = time.monotonic()
    worker = threading.Thread(target=create, daemon=True)
    worker.start()
    worker.join(deadline_s)
    elapsed = time.monotonic() - start
    if not outcome:
        pytest.fail(
            f"a request for more GPUs than are free had not returned after {elapsed:.1f} s; "
            "it must fail promptly with GpusExhausted, not wait for a GPU to come free",
            pytrace=False,
        )
    return outcome[0], elapsed


def _expect_exhausted(
    sandboxes: SandboxFactory, count: int | None, available: int, total: int, bound_s: float
) -> None:
    __tracebackhide__ = True
    requested = 1 if count is None else count
    outcome, elapsed = _create_within(sandboxes, SandboxSpec.with_gpus(count), bound_s + 5)
    assert isinstance(outcome, GpusExhausted), (
        f"{requested} GPUs asked, {available} free: expected GpusExhausted, got {outcome!r}"
    )
    assert elapsed <= bound_s, (
        f"GpusExhausted took {elapsed:.2f} s, more than a create plus the grace ({bound_s:.2f} s)"
    )
    _assert_says(outcome, requested, available, total)


def _assert_says(exc: GpusExhausted, requested: int, available: int, total: int) -> None:
    __tracebackhide__ = True
    said = (exc.requested, exc.available, exc.total)
    assert said == (requested, available, total), (
        f"GpusExhausted says {said} (requested, available, total), "
        f"not {(requested, available, total)}: {exc}"
    )
    for number in (requested, available, total):
        assert re.search(rf"\b{number}\b", str(exc)), f"the message does not say {number}: {exc}"


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-EXHAUST-01")
def test_more_than_free_fails_promptly_and_takes_nothing(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """A request for more GPUs than are free MUST fail promptly with GpusExhausted."""
    total = len(driver.inventory())
    # Three creates one by one measure what a create takes here; the rest of the host, but
    # one GPU, is filled side by side.
    took = []
    for _ in range(min(3, max(total - 1, 1))):
        start = time.monotonic()
        sandbox = sandboxes(SandboxSpec.with_gpus())
        took.append(time.monotonic() - start)
    if total == 1:
        sandbox.close()
    create_side_by_side(sandboxes, specs_for_gpus(driver, total - 1 - len(took)))
    # "Promptly": within what a create takes here, plus a grace the driver declares.
    bound_s = statistics.median(took) + exhaustion_grace(driver, settings)
    if driver.capabilities.max_gpus_per_sandbox >= 2:
        _expect_exhausted(sandboxes, 2, available=1, total=total, bound_s=bound_s)
    # The failed request took nothing: the last free GPU is still there.
    sandboxes(SandboxSpec.with_gpus())
    _expect_exhausted(sandboxes, None, available=0, total=total, bound_s=bound_s)


@pytest.mark.exclusive
@pytest.mark.chooses_pools
@pytest.mark.requirement("GPU-EXHAUST-01")
def test_each_pool_says_its_own_numbers(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """GpusExhausted MUST count the pool asked of: a MIG profile's instances, a vendor's GPUs."""
    limit = driver.capabilities.max_gpus_per_sandbox
    pools = {name: found for name, found in _pools(driver).items() if 2 <= len(found[0]) <= limit}
    if not pools:
        pytest.skip("needs MIG instances or AMD/Intel GPUs, two of a kind at least")
    for name, (pool, block) in pools.items():
        start = time.monotonic()
        held = sandboxes(SandboxSpec.with_gpus(driver=driver.name, block=block))
        bound_s = time.monotonic() - start + exhaustion_grace(driver, settings)
        asked = SandboxSpec.with_gpus(len(pool), driver=driver.name, block=block)
        outcome, _ = _create_within(sandboxes, asked, bound_s + 5)
        assert isinstance(outcome, GpusExhausted), (
            f"all {len(pool)} of {name} asked for while one is held: expected GpusExhausted, "
            f"got {outcome!r}"
        )
        _assert_says(outcome, len(pool), len(pool) - 1, len(pool))
        held.close()


POOLS = ("the default GPUs", "a MIG profile's instances", "a vendor's GPUs")
FIELDS = EXHAUSTED_FIELDS
CO_HELD = "a GPU of the pool co-held by two sharers"
"""A state where counting leases, not GPUs, gets ``available`` wrong: two leases, one GPU."""
DIMENSIONS = {
    "GPU-EXHAUST-01": declared(
        pool=POOLS,
        request=(
            "a count of 2, 1 free",
            "a default request, none free",
            "a count of every GPU",
        ),
        field=FIELDS,
        bound=("a create here plus the driver's grace", "a create that never returns"),
        state=("every GPU but one held exclusive", CO_HELD),
    ),
    "GPU-EXHAUST-02": declared(
        pool=POOLS,
        field=FIELDS,
        state=("one of the pool held: available is not total", CO_HELD),
        refusal=("GpusExhausted, each field by value", "UnsupportedGpuRequest at the count"),
    ),
}


def _co_held(driver: Driver, sandboxes: SandboxFactory, request: pytest.FixtureRequest) -> float:
    """A GPU of the default pool held by two shared sandboxes; what the first create took."""
    if not driver.capabilities.shared:  # declared: no GPU of its is ever co-held
        not_applicable(request.node, f"{driver.name} shares no GPU (capabilities.shared)")
    if driver.host.share_limit < 2:
        pytest.skip(f"the host's share limit is {driver.host.share_limit}: no GPU is co-held")
    start = time.monotonic()
    first = sandboxes(SandboxSpec.with_gpus(sharing=SHARED))
    took = time.monotonic() - start
    device_id = driver.device_ids(first.gpus[0])[0]
    second = sandboxes(
        SandboxSpec.with_gpus(driver=driver.name, device_ids=[device_id], sharing=SHARED)
    )
    assert uuids(second) == uuids(first), f"two sharers of {uuids(first)}: {uuids(second)}"
    return took


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-EXHAUST-01")
def test_a_gpu_co_held_by_sharers_counts_once(
    driver: Driver,
    sandboxes: SandboxFactory,
    settings: Settings,
    dropped: Dropped,
    request: pytest.FixtureRequest,
) -> None:
    """GpusExhausted MUST count a GPU two sharers hold as one GPU not free, each field by value."""
    total = len(driver.inventory())
    took = _co_held(driver, sandboxes, request)
    if driver.capabilities.max_gpus_per_sandbox < total:
        dropped(f"{CO_HELD}, a count of every GPU", f"{driver.name} gives fewer to a sandbox")
        return
    bound_s = took + exhaustion_grace(driver, settings)
    _expect_exhausted(sandboxes, total, available=total - 1, total=total, bound_s=bound_s)


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-EXHAUST-02")
def test_more_than_exist_counts_a_co_held_gpu_once(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped, request: pytest.FixtureRequest
) -> None:
    """A refusal of more GPUs than exist MUST count a GPU two sharers co-hold once, by value."""
    total = len(driver.inventory())
    _co_held(driver, sandboxes, request)
    leases = driver.host.leases.leases()
    try:
        made = sandboxes(SandboxSpec.with_gpus(total + 1))
    except DriverError as exc:
        outcome = exc
    else:
        pytest.fail(f"{total + 1} of {total} GPUs asked for: it was granted {uuids(made)}")
    if isinstance(outcome, GpusExhausted):
        _assert_says(outcome, total + 1, total - 1, total)
    elif isinstance(outcome, UnsupportedGpuRequest):  # beyond a per-sandbox maximum
        assert (outcome.field, outcome.value) == (COUNT, total + 1), repr(outcome)
        dropped(CO_HELD, f"{driver.name} refuses {total + 1} at the count: no available to check")
    else:
        pytest.fail(f"expected GpusExhausted or UnsupportedGpuRequest, got {outcome!r}")
    assert driver.host.leases.leases() == leases, "the refusal took some"


def _more_than_exist(
    driver: Driver, sandboxes: SandboxFactory, pool: str, block: dict[str, str], total: int
) -> None:
    """One of ``pool`` held, ``total + 1`` of it asked: refused, saying how many exist."""
    __tracebackhide__ = True
    held = sandboxes(SandboxSpec.with_gpus(driver=driver.name, block=block))
    requested, available = total + 1, total - len(held.gpus)
    leases = driver.host.leases.leases()
    asked = f"{requested} of {pool} asked for, {available} free of {total}"
    spec = SandboxSpec.with_gpus(requested, driver=driver.name, block=block)
    try:
        made = sandboxes(spec)
    except DriverError as exc:
        outcome = exc
    else:
        pytest.fail(f"{asked}: it was granted {uuids(made)}")
    if isinstance(outcome, GpusExhausted):
        _assert_says(outcome, requested, available, total)
    elif isinstance(outcome, UnsupportedGpuRequest):
        # Beyond a per-sandbox maximum: refused at the count, saying how many exist.
        assert (outcome.field, outcome.value) == (COUNT, requested), f"{asked}: {outcome!r}"
        assert re.search(rf"\b{total}\b", str(outcome)), f"{asked}: it does not say {total}"
    else:
        pytest.fail(f"{asked}: expected GpusExhausted or UnsupportedGpuRequest, got {outcome!r}")
    assert driver.host.leases.leases() == leases, f"{asked}: the refusal took some"
    held.close()


@pytest.mark.requirement("GPU-EXHAUST-02")
def test_more_gpus_than_exist_says_how_many_exist(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A request for more GPUs than exist MUST fail saying how many exist, taking nothing."""
    # One held: the numbers differ, and each must be the right one (not merely appear).
    _more_than_exist(driver, sandboxes, POOLS[0], {}, len(driver.inventory()))
    assert_all_gpus_grantable(driver, after="asking for more GPUs than exist")


@pytest.mark.chooses_pools
@pytest.mark.requirement("GPU-EXHAUST-02")
def test_more_than_a_pool_has_says_how_many_it_has(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """More of a MIG profile or a vendor than the host has MUST fail saying how many it has."""
    pools = _pools(driver)
    if not pools:
        pytest.skip("needs MIG instances or AMD/Intel GPUs")
    for name, (pool, block) in pools.items():
        which = POOLS[1] if "mig_profile" in block else POOLS[2]
        _more_than_exist(driver, sandboxes, f"{which} ({name})", block, len(pool))


def _pools(driver: Driver) -> dict[str, tuple[tuple[GpuDevice, ...], dict[str, str]]]:
    """The MIG profiles and vendors (but NVIDIA's) the driver chooses among, with their block."""
    pools: dict[str, tuple[tuple[GpuDevice, ...], dict[str, str]]] = {}
    if driver.capabilities.mig_profiles:
        for profile in sorted({mig.profile for mig in driver.host.mig_devices}):
            of_profile = tuple(m for m in driver.host.mig_devices if m.profile == profile)
            pools[profile] = (of_profile, {"mig_profile": profile})
    for vendor in sorted({gpu.vendor for gpu in driver.host.dri_gpus}):
        if vendor in driver.capabilities.vendors:
            of_vendor = tuple(g for g in driver.host.dri_gpus if g.vendor == vendor)
            pools[vendor] = (of_vendor, {"vendor": vendor})
    return pools


def _assert_fair_outcome(granted: list[list[str]], errors: list[BaseException], total: int) -> None:
    __tracebackhide__ = True
    flat = [uuid for gpus in granted for uuid in gpus]
    assert len(flat) == len(set(flat)), f"a GPU was granted twice: {sorted(flat)}"
    assert len(granted) == total, f"{total} GPUs were free; {len(granted)} creates succeeded"
    wrong = [e for e in errors if not isinstance(e, GpusExhausted)]
    assert not wrong, f"losers must get GpusExhausted, got {wrong!r}"


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-CONCURRENT-01")
def test_concurrent_creates_from_threads_never_share(driver: Driver) -> None:
    """Concurrent creates from threads MUST never grant a GPU twice, nor a part of a request."""
    total = len(driver.inventory())
    contenders = 2 * total
    barrier = threading.Barrier(contenders)

    def create() -> Sandbox:
        barrier.wait()
        return driver.create(SandboxSpec.with_gpus())

    with ThreadPoolExecutor(contenders) as pool:
        futures = [pool.submit(create) for _ in range(contenders)]
    won = [f.result() for f in futures if f.exception() is None]
    try:
        lost = [e for f in futures if (e := f.exception()) is not None]
        _assert_fair_outcome([uuids(sandbox) for sandbox in won], lost, total)
        # What each winner holds is what it sees, not only what the driver says it gave.
        with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
            seen_by = list(pool.map(visible_gpu_uuids, won))
        for sandbox, seen in zip(won, seen_by, strict=True):
            assert sorted(seen) == sorted(uuids(sandbox)), (
                f"sandbox {sandbox.id} was given {uuids(sandbox)}; nvidia-smi inside lists {seen}"
            )
    finally:
        with ThreadPoolExecutor(contenders) as pool:
            list(pool.map(lambda sandbox: sandbox.close(), won))
    if driver.capabilities.max_gpus_per_sandbox >= 2 and total >= 3:
        _race_bigger_requests(driver, total)
    assert_all_gpus_grantable(driver, after="the concurrent creates closed")


def _race_bigger_requests(driver: Driver, total: int, rounds: int = 3) -> None:
    """Requests of more than half the GPUs, racing: one gets them all, whole; none gets a part.

    An allocator that checks what is free and then takes GPUs one by one lets two of them
    both start, each with a part of what it asked for.
    """
    __tracebackhide__ = True
    count = min(total // 2 + 1, driver.capabilities.max_gpus_per_sandbox)
    if 2 * count <= total:
        return  # two would fit: no race to lose

    def create(barrier: threading.Barrier) -> Sandbox:
        barrier.wait()
        return driver.create(SandboxSpec.with_gpus(count))

    for _ in range(rounds):
        barrier = threading.Barrier(3)
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(create, barrier) for _ in range(3)]
        won = [f.result() for f in futures if f.exception() is None]
        try:
            got = [uuids(sandbox) for sandbox in won]
            raced = f"three requests of {count} of {total} free GPUs raced; the winners got {got}"
            assert len(won) == 1, f"{raced}: one must win, the others get GpusExhausted"
            assert len(set(got[0])) == count, f"{raced}: the winner must get {count}"
            lost = [e for f in futures if (e := f.exception()) is not None]
            wrong = [e for e in lost if not isinstance(e, GpusExhausted)]
            assert not wrong, f"losers must get GpusExhausted, got {wrong!r}"
        finally:
            for sandbox in won:
                sandbox.close()


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-CONCURRENT-02")
def test_concurrent_creates_from_processes_never_share(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """Concurrent creates from separate processes MUST never grant a GPU twice."""
    # Half the GPUs held here first, so the race is for the rest, beside GPUs held.
    kept = len(driver.inventory()) // 2
    mine = create_side_by_side(sandboxes, specs_for_gpus(driver, kept))
    held_here = {uuid for sandbox in mine for uuid in uuids(sandbox)}
    total = len(driver.inventory()) - kept
    # Two more processes than free GPUs: enough to race and to lose.
    replies = created_at_once(driver, settings, [SandboxSpec.with_gpus()] * (total + 2))
    granted = [reply["gpus"] for reply in replies if reply["ok"]]
    for reply in replies:
        if reply["ok"]:
            assert sorted(reply["visible"]) == sorted(reply["gpus"]), (
                f"sandbox {reply['sandbox']} was given {reply['gpus']}; nvidia-smi inside lists "
                f"{reply['visible']}; inside: {reply.get('seen', '?')}"
            )
    errors: list[BaseException] = [
        GpusExhausted(1, 0, total) if reply["error"] == "GpusExhausted" else RuntimeError(reply)
        for reply in replies
        if not reply["ok"]
    ]
    _assert_fair_outcome(granted, errors, total)
    taken = {uuid for gpus in granted for uuid in gpus}
    assert not taken & held_here, f"processes were granted {sorted(taken & held_here)}, held here"
    for sandbox in mine:
        sandbox.close()
    assert_all_gpus_grantable(driver, after="the holder processes exited")
