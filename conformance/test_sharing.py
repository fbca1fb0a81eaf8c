"""Shared GPUs: co-held by shared sandboxes only, up to a limit; exclusive after the last.

A sharer ends every way ``conformance.endings`` has, and its share comes back each way; an
exclusive holder of another client (a sandbox of another process, the lease protocol's sh
client) is never joined.
"""

from __future__ import annotations

import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance.dimensions import declared
from conformance.endings import CLOSE, CREATOR, ENDINGS, IDS, end
from conformance.fixtures import Dropped, SandboxFactory
from conformance.hold import HeldSandbox, close_all, held_by_the_sh_client
from conformance.observe import (
    create_side_by_side,
    expect_refusal,
    retake,
    specs_for_all_gpus,
    specs_for_gpus,
    uuids,
    visible_gpu_uuids,
)
from conformance.settings import Settings
from drivers.base import Driver, Sandbox
from gpuhost.errors import GpuBusy, GpusExhausted, UnsupportedGpuRequest
from gpuhost.spec import SHARED, SandboxSpec

SHARING_FIELD = "resource_requirements.gpu.sharing"
STRICTER_JOINS = "a process under a limit of 2 asking to join a GPU shared by more"
THIS_PROCESS, ANOTHER_PROCESS, ANOTHER_CLIENT = (
    "a sandbox of this process",
    "a sandbox of another process",
    "another client of the host registry (the lease protocol's sh client)",
)
EXCLUSIVE_HOLDERS = (THIS_PROCESS, ANOTHER_PROCESS, ANOTHER_CLIENT)
"""Who holds a GPU exclusively, that no shared request may join."""
DIMENSIONS = {
    "GPU-SHARED-01": declared(
        how_a_sharer_ends=ENDINGS,
        exclusive_holder=EXCLUSIVE_HOLDERS,
        request=("shared by default", "shared by every exact ID of the GPU"),
        sharers_made_by=("this process", "another process", "another process, a stricter limit"),
        stricter_limit=(STRICTER_JOINS,),
    ),
    "GPU-SHARED-02": declared(
        how_the_last_sharer_ends=(CLOSE, *ENDINGS),
        how_another_sharer_ends=(CLOSE, CREATOR),
        sharers_made_by=("this process", "another process"),
    ),
}


def _shared(driver: Driver, device_id: str | None = None) -> SandboxSpec:
    if device_id is None:
        return SandboxSpec.with_gpus(sharing=SHARED)
    return SandboxSpec.with_gpus(driver=driver.name, device_ids=[device_id], sharing=SHARED)


def _exclusive(driver: Driver, device_id: str) -> SandboxSpec:
    return SandboxSpec.with_gpus(driver=driver.name, device_ids=[device_id])


@pytest.mark.requirement("GPU-SHARED-01")
def test_shared_requests_share_up_to_the_limit_and_never_with_exclusive_ones(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped
) -> None:
    """Shared sandboxes MUST share a GPU up to the limit, never with exclusive ones, or fail."""
    if not driver.capabilities.shared:
        expect_refusal(
            driver, sandboxes, _shared(driver), UnsupportedGpuRequest,
            field=SHARING_FIELD, value=SHARED,
        )  # fmt: skip
        return
    if len(driver.inventory()) < 3:
        pytest.skip(f"needs 3 GPUs (host has {len(driver.inventory())})")
    limit = driver.host.share_limit
    sharers = [sandboxes(_shared(driver)) for _ in range(limit)]
    gpu = uuids(sharers[0])
    assert len(gpu) == 1, f"a shared request for one GPU got {gpu}"
    for sharer in sharers:
        assert uuids(sharer) == gpu, (
            f"{limit} shared requests may share one GPU; they got {[uuids(s) for s in sharers]}"
        )
    with ThreadPoolExecutor(len(sharers)) as pool:
        for seen in pool.map(visible_gpu_uuids, sharers):
            assert seen == gpu, f"a sharer of {gpu} sees {seen}"
    beyond = sandboxes(_shared(driver))
    assert uuids(beyond) != gpu, f"{gpu} already had {limit} sharers, the limit; it got one more"

    exclusive = sandboxes(SandboxSpec.with_gpus())
    assert not set(uuids(exclusive)) & set(gpu + uuids(beyond)), (
        f"an exclusive request got {uuids(exclusive)}, which shared sandboxes hold"
    )
    gpu_ids = driver.device_ids(next(g for g in sharers[0].gpus))
    for device_id in gpu_ids:
        with pytest.raises(GpuBusy):
            sandboxes(_exclusive(driver, device_id))
    for device_id in driver.device_ids(exclusive.gpus[0]):
        with pytest.raises(GpuBusy):
            sandboxes(_shared(driver, device_id))

    # The same from another process: it may join a GPU with room, not a full one.
    room = driver.device_ids(beyond.gpus[0])[0]
    joining = HeldSandbox.start(driver, settings, _shared(driver, room))
    crowding = HeldSandbox.start(driver, settings, _shared(driver, gpu_ids[0]))
    try:
        reply = joining.go()
        assert reply["ok"], f"another process could not join {room}, shared by one: {reply}"
        assert reply["visible"] == uuids(beyond), f"the other process's sharer sees {reply}"
        reply = crowding.go()
        assert reply == {"ok": False, "error": "GpuBusy", "message": reply.get("message")}, (
            f"{gpu} has {limit} sharers, the limit; another process got {reply}"
        )
        _a_stricter_limit_binds_every_sharer(driver, sandboxes, settings, exclusive, beyond)
        _a_stricter_limit_cannot_join_past_it(driver, settings, dropped, gpu_ids[0], limit)
    finally:
        close_all([joining, crowding])


def _a_stricter_limit_cannot_join_past_it(
    driver: Driver, settings: Settings, dropped: Dropped, device_id: str, sharers: int
) -> None:
    """A request of another process under a limit of 2 may not join a GPU shared by more."""
    if sharers <= 2:
        dropped(STRICTER_JOINS, f"the share limit is {sharers}: no GPU is shared by more than 2")
        return
    stricter = dataclasses.replace(settings.host_config, share_limit=2)
    with HeldSandbox.start(
        driver, dataclasses.replace(settings, host_config=stricter), _shared(driver, device_id)
    ) as other:
        reply = other.go()
        assert reply == {"ok": False, "error": "GpuBusy", "message": reply.get("message")}, (
            f"{sharers} sandboxes share the GPU {device_id!r} names, past a limit of 2; "
            f"a process whose limit is 2 joined it: {reply}"
        )


def _a_stricter_limit_binds_every_sharer(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, *taken: Sandbox
) -> None:
    """A sharer of another process taken under a limit of 2: this one's limit does not matter."""
    held = {uuid for sandbox in [*taken, *sandboxes.open] for uuid in uuids(sandbox)}
    free = [g for g in driver.inventory() if g.uuid not in held]
    if driver.host.share_limit <= 2 or not free:
        return
    device_id = driver.device_ids(free[0])[0]
    stricter = dataclasses.replace(settings.host_config, share_limit=2)
    with HeldSandbox.start(
        driver, dataclasses.replace(settings, host_config=stricter), _shared(driver, device_id)
    ) as other:
        reply = other.go()
        assert reply["ok"], f"another process could not share {device_id}: {reply}"
        sandboxes(_shared(driver, device_id))  # the second sharer: within both limits
        with pytest.raises(GpuBusy):  # the third: past the limit the first sharer took
            sandboxes(_shared(driver, device_id))


@pytest.mark.shares_gpus
@pytest.mark.requirement("GPU-SHARED-01")
def test_shared_requests_fail_when_every_gpu_is_full(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """Shared requests MUST get GpusExhausted once every GPU is held whole or has its limit."""
    total = len(driver.inventory())
    # All but two GPUs held whole; the two filled by shared requests made side by side,
    # which must fill each exactly to the limit, and never join a GPU held whole.
    shared_gpus = min(2, total)
    exclusive = create_side_by_side(sandboxes, specs_for_gpus(driver, total - shared_gpus))
    held_whole = {uuid for sandbox in exclusive for uuid in uuids(sandbox)}
    sharers = create_side_by_side(
        sandboxes, [_shared(driver)] * (shared_gpus * driver.host.share_limit)
    )
    held = [uuid for sandbox in sharers for uuid in uuids(sandbox)]
    counts = {uuid: held.count(uuid) for uuid in held}
    assert not set(counts) & held_whole, f"shared requests joined GPUs held whole: {counts}"
    assert set(counts.values()) == {driver.host.share_limit}, f"sharers per GPU: {counts}"
    with pytest.raises(GpusExhausted):
        sandboxes(_shared(driver))


@pytest.mark.shares_gpus
@pytest.mark.requirement("GPU-SHARED-02")
def test_a_shared_gpu_is_exclusive_again_only_after_its_last_sharer(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """A shared GPU MUST return to exclusive use only when its last sharer, of any process, ends."""
    if driver.host.share_limit < 3:
        pytest.skip(f"needs a share limit of 3 (--gpu-share-limit={driver.host.share_limit})")
    first = sandboxes(_shared(driver))
    assert len(first.gpus) == 1, f"a shared default request got {uuids(first)}"
    gpu = first.gpus[0]
    device_id = driver.device_ids(gpu)[0]
    second = sandboxes(_shared(driver, device_id))
    with HeldSandbox.start(driver, settings, _shared(driver, device_id)) as other:
        reply = other.go()
        assert reply["ok"], f"another process could not share {gpu.uuid}: {reply}"

        first.close()
        assert visible_gpu_uuids(second) == [gpu.uuid], "closing one sharer took the GPU away"
        with pytest.raises(GpuBusy):
            sandboxes(_exclusive(driver, device_id))

        other.kill()  # its creator dies: its share comes back, the others' stay
        with pytest.raises(GpuBusy):
            sandboxes(_exclusive(driver, device_id))
        assert visible_gpu_uuids(second) == [gpu.uuid], "a dead sharer took the GPU away"

    second.close()
    exclusive = retake(
        lambda: sandboxes(_exclusive(driver, device_id)),
        settings.reclaim_timeout_s,
        f"{gpu.uuid} to be exclusive again once its last sharer ended",
        retry_on=(GpuBusy,),
    )
    assert uuids(exclusive) == [gpu.uuid]
    assert visible_gpu_uuids(exclusive) == [gpu.uuid]


def _a_free_gpu_id(driver: Driver, sandboxes: SandboxFactory) -> tuple[str, str]:
    """A GPU no sandbox of this test holds: its UUID, and its first exact ID."""
    held = {uuid for sandbox in sandboxes.open for uuid in uuids(sandbox)}
    gpu = next(gpu for gpu in driver.inventory() if gpu.uuid not in held)
    return gpu.uuid, driver.device_ids(gpu)[0]


def _sharer(
    way: str, driver: Driver, sandboxes: SandboxFactory, settings: Settings, spec: SandboxSpec
) -> tuple[list[str], HeldSandbox | Sandbox]:
    """A sharer to be ended ``way``: of another process where its creator's death ends it."""
    __tracebackhide__ = True
    if way != CREATOR:
        sandbox = sandboxes(spec)
        return uuids(sandbox), sandbox
    holder = HeldSandbox.start(driver, settings, spec)
    reply = holder.go()
    assert reply["ok"], f"another process could not share {spec.to_dict()}: {reply}"
    return list(reply["gpus"]), holder


def _ended(
    way: str, victim: HeldSandbox | Sandbox, sandboxes: SandboxFactory, dropped: Dropped
) -> bool:
    """End the sharer ``way``; False where this host cannot (the case dropped, by name)."""
    __tracebackhide__ = True
    if isinstance(victim, HeldSandbox):
        victim.kill()
        return True
    return end(way, victim, sandboxes, dropped)


@pytest.mark.shares_gpus
@pytest.mark.requirement("GPU-SHARED-01")
@pytest.mark.parametrize("way", ENDINGS, ids=[IDS[way] for way in ENDINGS])
def test_a_sharer_that_ends_gives_its_share_back(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped, way: str
) -> None:
    """A sharer of a full GPU ended any way MUST leave room for one more, and only one."""
    uuid, device_id = _a_free_gpu_id(driver, sandboxes)
    limit = driver.host.share_limit
    others = [sandboxes(_shared(driver, device_id)) for _ in range(limit - 1)]
    gpus, victim = _sharer(way, driver, sandboxes, settings, _shared(driver, device_id))
    try:
        assert gpus == [uuid], f"a shared request for {device_id} got {gpus}"
        with pytest.raises(GpuBusy):  # full: the limit counts the victim
            sandboxes(_shared(driver, device_id))
        if not _ended(way, victim, sandboxes, dropped):
            return
        joined = retake(
            lambda: sandboxes(_shared(driver, device_id)),
            settings.reclaim_timeout_s,
            f"the share of {uuid} a sharer held to come back after {way}",
            retry_on=(GpuBusy,),
        )
    finally:
        if isinstance(victim, HeldSandbox):
            victim.close()
    assert uuids(joined) == [uuid]
    with pytest.raises(GpuBusy):  # full again: the victim's share was given back once
        sandboxes(_shared(driver, device_id))
    with pytest.raises(GpuBusy):
        sandboxes(_exclusive(driver, device_id))
    assert visible_gpu_uuids(others[0] if others else joined) == [uuid], (
        f"a sharer of {uuid} lost it when another sharer ended by {way}"
    )


@pytest.mark.shares_gpus
@pytest.mark.requirement("GPU-SHARED-01")
@pytest.mark.parametrize("holder", EXCLUSIVE_HOLDERS, ids=["here", "process", "sh-client"])
def test_shared_requests_never_join_a_gpu_held_whole(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, holder: str
) -> None:
    """No shared request MUST join a GPU another client holds exclusively, by ID or by default."""
    # The holder holds every GPU: a shared request by default has nowhere to go.
    specs = specs_for_all_gpus(driver)
    with contextlib.ExitStack() as held:
        if holder == THIS_PROCESS:
            create_side_by_side(sandboxes, specs)
        elif holder == ANOTHER_PROCESS:
            others = [HeldSandbox.start(driver, settings, spec) for spec in specs]
            held.callback(close_all, others)
            for other in others:
                other.send_go()
            replies = [other.result() for other in others]
            assert all(reply["ok"] for reply in replies), f"another process could not: {replies}"
        else:
            gpus = list(driver.inventory())
            held.enter_context(held_by_the_sh_client(driver.host, driver.session_id, gpus))
        gpu = driver.inventory()[0]
        why = f"{holder} holds every GPU whole"
        for device_id in driver.device_ids(gpu):
            _refused(sandboxes, _shared(driver, device_id), GpuBusy, why)
        _refused(sandboxes, _shared(driver), GpusExhausted, why)


def _refused(
    sandboxes: SandboxFactory, spec: SandboxSpec, error: type[Exception], why: str
) -> None:
    __tracebackhide__ = True
    try:
        got = sandboxes(spec)
    except error:
        return
    pytest.fail(f"{why}; {spec.to_dict()} got {uuids(got)}, not {error.__name__}", pytrace=False)


@pytest.mark.shares_gpus
@pytest.mark.requirement("GPU-SHARED-02")
@pytest.mark.parametrize("way", ENDINGS, ids=[IDS[way] for way in ENDINGS])
def test_a_gpu_whose_last_sharer_ends_is_exclusive_again(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped, way: str
) -> None:
    """A shared GPU MUST be exclusive again once its last sharer ends, whichever way it ends."""
    uuid, device_id = _a_free_gpu_id(driver, sandboxes)
    first = sandboxes(_shared(driver, device_id))
    gpus, last = _sharer(way, driver, sandboxes, settings, _shared(driver, device_id))
    try:
        assert gpus == [uuid], f"a shared request for {device_id} got {gpus}"
        first.close()
        with pytest.raises(GpuBusy):  # its last sharer still holds it
            sandboxes(_exclusive(driver, device_id))
        if not _ended(way, last, sandboxes, dropped):
            return
        exclusive = retake(
            lambda: sandboxes(_exclusive(driver, device_id)),
            settings.reclaim_timeout_s,
            f"{uuid} to be exclusive again once its last sharer ended by {way}",
            retry_on=(GpuBusy,),
        )
    finally:
        if isinstance(last, HeldSandbox):
            last.close()
    assert uuids(exclusive) == [uuid]
