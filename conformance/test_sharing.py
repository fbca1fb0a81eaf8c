"""Shared GPUs: co-held by shared sandboxes only, up to a limit; exclusive after the last."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance.fixtures import Dropped, SandboxFactory
from conformance.hold import HeldSandbox, close_all
from conformance.observe import (
    create_side_by_side,
    expect_refusal,
    retake,
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
