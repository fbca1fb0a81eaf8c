"""Which GPUs a request gets: free ones for defaults, exactly the named ones for exact IDs."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance import requirements
from conformance.dimensions import declared
from conformance.fixtures import Dropped, SandboxFactory, not_applicable
from conformance.forms import EXACT_FORMS, PCI_CASES, is_pci_address, pci_case
from conformance.hold import HeldSandbox
from conformance.observe import (
    create_side_by_side,
    describe_gpus,
    exact_ids,
    uuids,
    visible_gpu_uuids,
)
from conformance.settings import Settings
from drivers.base import Driver
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuBusy, GpusExhausted, UnsupportedGpuRequest
from gpuhost.spec import DEVICE_IDS_KEY, SHARED, SandboxSpec, parse_spec


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-DEFAULT-02")
def test_a_held_gpu_is_not_a_default_until_it_is_free(
    driver: Driver, sandboxes: SandboxFactory, host_gpus: tuple[str, ...]
) -> None:
    """A default request MUST NOT get a GPU a live sandbox holds; once freed, it gets it."""
    # The form of GPU-DEFAULT-02 a host of one GPU can check: every GPU held, then one freed.
    if driver.capabilities.max_gpus_per_sandbox >= len(host_gpus):
        held = [sandboxes(SandboxSpec.with_gpus(len(host_gpus)))]
    else:  # one sandbox per GPU at most (a VM): side by side
        held = create_side_by_side(sandboxes, [SandboxSpec.with_gpus()] * len(host_gpus))
    with pytest.raises(GpusExhausted):  # every GPU is held
        sandboxes(SandboxSpec.with_gpus())
    freed = held.pop()
    freed.close()
    again = uuids(sandboxes(SandboxSpec.with_gpus()))
    assert len(again) == 1, f"a default request got {again}"
    assert set(again) <= set(uuids(freed)), (
        f"{uuids(freed)} were the free GPUs; a default request got {again}"
    )


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-DEFAULT-02")
@pytest.mark.gpus(3)
def test_default_request_gets_a_free_gpu(
    driver: Driver, sandboxes: SandboxFactory, host_gpus: tuple[str, ...]
) -> None:
    """A default GPU request MUST get a free GPU, never one a live sandbox holds."""
    held = create_side_by_side(sandboxes, [SandboxSpec.with_gpus()] * (len(host_gpus) - 1))
    taken = [uuids(sandbox) for sandbox in held]
    assert all(len(gpus) == 1 for gpus in taken), f"default requests got {taken}"
    flat = [gpus[0] for gpus in taken]
    assert len(set(flat)) == len(flat), f"k live sandboxes share GPUs: {flat}"

    # Free one in the middle: the next two defaults must take exactly the two free GPUs.
    released = held.pop(len(held) // 2)
    released.close()
    still_held = {uuids(sandbox)[0] for sandbox in held}
    free = set(host_gpus) - still_held
    first = sandboxes(SandboxSpec.with_gpus())
    second = sandboxes(SandboxSpec.with_gpus())
    got = uuids(first) + uuids(second)
    assert set(got) == free, f"free GPUs were {sorted(free)}; the defaults got {got}"
    assert visible_gpu_uuids(first) == uuids(first)


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-DEFAULT-02")
@pytest.mark.gpus(2)
def test_default_request_avoids_gpus_held_by_another_process(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """A default GPU request MUST NOT get a GPU a sandbox of another process holds."""
    # Two other processes: the second's GPU stays held when the first closes its sandbox.
    with (
        HeldSandbox.start(driver, settings, SandboxSpec.with_gpus()) as first,
        HeldSandbox.start(driver, settings, SandboxSpec.with_gpus()) as second,
    ):
        replies = [first.go(), second.go()]
        assert all(reply["ok"] for reply in replies), f"the other processes got {replies}"
        theirs = {uuid for reply in replies for uuid in reply["gpus"]}
        if len(driver.inventory()) >= 3:
            mine = sandboxes(SandboxSpec.with_gpus())
            assert not set(uuids(mine)) & theirs, (
                f"this sandbox got {uuids(mine)}, which another process's sandbox holds"
            )
        first.close()
        held = set(replies[1]["gpus"])
        again = sandboxes(SandboxSpec.with_gpus())
        assert not set(uuids(again)) & held, (
            f"after another process closed its sandbox, this one got {uuids(again)}, which a "
            "third process's sandbox still holds"
        )
        if driver.capabilities.exact_ids:
            busy = driver.device_ids(next(g for g in driver.inventory() if g.uuid in held))[0]
            with pytest.raises(GpuBusy):
                sandboxes(SandboxSpec.with_gpus(driver=driver.name, device_ids=[busy]))


OTHER_DRIVERS = requirements.load().drivers
"""Every driver with a profile, present or planned: their blocks are not this driver's."""
SHARED_HOLDERS = ("a shared sandbox", "a shared sandbox of another process")
"""Who holds a GPU shared, with room for more sharers: an exclusive request is busy all the same."""
DIMENSIONS = {
    "GPU-DEFAULT-02": declared(
        held_by=("a sandbox of this process", "a sandbox of another process"),
        when=(
            "every GPU held, then one freed",
            "one in the middle freed",
            "after another process closes its sandbox",
        ),
        asked_by=("a default request", "an exact ID of the held GPU"),
    ),
    "GPU-EXACT-01": declared(
        form=(*EXACT_FORMS, "the host's CDI names"),
        pci_address_case=PCI_CASES,
        gpu=("every GPU, side by side", "two in mixed forms, in both orders"),
        other_blocks=("before its own", "after its own"),
    ),
    "GPU-BUSY-01": declared(
        form=("every form the driver lists",),
        beside=("alone", "a free device"),
        held_by=("a sandbox of this process", "a sandbox of another process", *SHARED_HOLDERS),
    ),
}


def _exact(driver: Driver, device_ids: list[str], count: int | None = None) -> SandboxSpec:
    return SandboxSpec.with_gpus(count, driver=driver.name, device_ids=device_ids)


def _every_spelling(driver: Driver, gpu: GpuDevice) -> list[str]:
    """The IDs to ask ``gpu`` by (``exact_ids``), a PCI address among them in either case."""
    ids = exact_ids(driver, gpu)
    cases = [pci_case(i, case) for i in ids if is_pci_address(i) for case in PCI_CASES]
    return list(dict.fromkeys([*ids, *cases]))


@pytest.mark.requirement("GPU-EXACT-01")
def test_exact_ids_get_exactly_those_devices(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped
) -> None:
    """A request naming exact device IDs MUST give exactly those devices, in every form."""
    inventory = driver.inventory()
    if not driver.capabilities.exact_ids:
        with pytest.raises(UnsupportedGpuRequest):
            sandboxes(_exact(driver, [driver.device_ids(inventory[0])[0]]))
        return

    def one(gpu: GpuDevice, device_id: str) -> None:
        with sandboxes(_exact(driver, [device_id])) as sandbox:
            assert uuids(sandbox) == [gpu.uuid], f"asked for {device_id!r} ({gpu.uuid})"
            seen = visible_gpu_uuids(sandbox)
            assert seen == [gpu.uuid], (
                f"asked for {device_id!r}, the sandbox sees {seen}: {describe_gpus(sandbox)}"
            )

    def every_form(gpu: GpuDevice) -> None:
        for device_id in _every_spelling(driver, gpu):
            one(gpu, device_id)

    def mixed(pair: tuple[GpuDevice, GpuDevice], form: int) -> None:
        first, second = pair
        forms = min(len(driver.device_ids(first)), len(driver.device_ids(second)))
        ids = [
            driver.device_ids(first)[form % forms],
            driver.device_ids(second)[(form + 1) % forms],
        ]
        with sandboxes(_exact(driver, ids, count=2)) as sandbox:
            assert sorted(uuids(sandbox)) == sorted([first.uuid, second.uuid]), f"asked {ids}"
            assert sorted(visible_gpu_uuids(sandbox)) == sorted([first.uuid, second.uuid])

    # Every GPU at once, each named in every form in turn: sandboxes held side by side.
    with ThreadPoolExecutor(len(inventory)) as pool:
        list(pool.map(every_form, inventory))
    if len(inventory) < 2:
        dropped("two GPUs in mixed forms", "the host has one")
    elif driver.capabilities.max_gpus_per_sandbox >= 2:
        # Two GPUs named in mixed forms: each form beside each other one. The pairs (last and
        # second, then inwards) side by side, each taking its forms in turn, the later GPU
        # first in one pair and second in the next. The first GPU is named by none of them
        # where there are three: the lowest free GPU, which a fallback takes, is never right.
        forms = min(len(driver.device_ids(gpu)) for gpu in (inventory[0], inventory[-1]))
        if len(inventory) >= 3:
            inward = [(inventory[-1 - i], inventory[i + 1]) for i in range(len(inventory) // 2)]
            pairs = [pair if k % 2 == 0 else pair[::-1] for k, pair in enumerate(inward)]
            pairs = [(a, b) for a, b in pairs if a != b]
        else:
            pairs = [(inventory[-1], inventory[0])]

        def pair_forms(k: int) -> None:
            for form in range(k, forms, len(pairs)):
                mixed(pairs[k], form)

        with ThreadPoolExecutor(len(pairs)) as pool:
            list(pool.map(pair_forms, range(len(pairs))))


@pytest.mark.requirement("GPU-EXACT-01")
def test_only_the_drivers_own_block_is_read(driver: Driver, sandboxes: SandboxFactory) -> None:
    """Other drivers' blocks beside its own MUST change nothing, wherever they stand."""
    if not driver.capabilities.exact_ids or len(driver.inventory()) < 2:
        pytest.skip(f"needs exact IDs and 2 GPUs ({driver.name}, {len(driver.inventory())})")
    mine, theirs = driver.inventory()[-1], driver.inventory()[0]
    others = {name: {DEVICE_IDS_KEY: [driver.device_ids(theirs)[0]]} for name in OTHER_DRIVERS}
    others.pop(driver.name, None)
    config = {**others, driver.name: {DEVICE_IDS_KEY: [driver.device_ids(mine)[0]]}, **others}
    spec = parse_spec({"resource_requirements": {"gpu": {}}, "template": {"driver_config": config}})
    with sandboxes(spec) as sandbox:
        assert uuids(sandbox) == [mine.uuid], f"its own block names {mine.uuid}: {config}"
        assert visible_gpu_uuids(sandbox) == [mine.uuid]


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-BUSY-01")
def test_exact_id_held_by_another_sandbox_is_busy(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped
) -> None:
    """A request naming a device another sandbox holds MUST fail with GpuBusy, not share it."""
    if not driver.capabilities.exact_ids:
        pytest.skip(f"{driver.name} takes no exact IDs")
    inventory = driver.inventory()
    target = inventory[-1]
    holder = sandboxes(_exact(driver, [driver.device_ids(target)[0]]))
    before = driver.sandboxes(driver.session_id)
    for device_id in driver.device_ids(target):  # every form names the busy GPU
        with pytest.raises(GpuBusy) as busy:
            sandboxes(_exact(driver, [device_id]))
        assert target.uuid in str(busy.value) or device_id in str(busy.value), str(busy.value)
    if len(inventory) < 2:
        dropped("beside a free device", "one GPU: no other is free beside the held one")
    elif driver.capabilities.max_gpus_per_sandbox >= 2:
        # Beside a free device: refused whole, and the free one is still free.
        free = driver.device_ids(inventory[0])[0]
        with pytest.raises(GpuBusy):
            sandboxes(_exact(driver, [free, driver.device_ids(target)[0]], count=2))
        assert driver.sandboxes(driver.session_id) == before
        with sandboxes(_exact(driver, [free])) as alone:
            assert uuids(alone) == [inventory[0].uuid], "the refused request took a GPU"
    assert driver.sandboxes(driver.session_id) == before
    assert visible_gpu_uuids(holder) == [target.uuid]
    holder.close()
    # Held by another process's sandbox: busy all the same.
    spec = _exact(driver, [driver.device_ids(target)[0]])
    with HeldSandbox.start(driver, settings, spec) as other:
        assert other.go()["ok"], "another process could not take the GPU"
        with pytest.raises(GpuBusy):
            sandboxes(spec)


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-BUSY-01")
@pytest.mark.parametrize("held_by", SHARED_HOLDERS)
def test_exact_id_held_shared_is_busy_to_an_exclusive_request(
    driver: Driver,
    sandboxes: SandboxFactory,
    settings: Settings,
    dropped: Dropped,
    held_by: str,
    request: pytest.FixtureRequest,
) -> None:
    """An exclusive request naming a device held shared MUST fail with GpuBusy, in every form."""
    if not driver.capabilities.exact_ids or not driver.capabilities.shared:  # declared
        not_applicable(request.node, f"{driver.name} takes no exact IDs or shares no GPU")
    with sandboxes(SandboxSpec.with_gpus(sharing=SHARED)) as probe:
        target = probe.gpus[0]  # a GPU the driver shares
    ids = driver.device_ids(target)
    held = SandboxSpec.with_gpus(driver=driver.name, device_ids=[ids[0]], sharing=SHARED)
    others = [
        gpu
        for gpu in driver.inventory()
        if gpu.uuid != target.uuid and gpu.vendor == target.vendor and gpu.parent_uuid is None
        and not gpu.mig_enabled
    ]  # fmt: skip
    if held_by == "a shared sandbox":
        holder: contextlib.AbstractContextManager[object] = sandboxes(held)
    else:
        holder = HeldSandbox.start(driver, settings, held)
    with holder as sharer:
        if isinstance(sharer, HeldSandbox):
            assert sharer.go()["ok"], f"another process could not share {target.uuid}"
        before = driver.sandboxes(driver.session_id)
        for device_id in ids:  # one sharer, room for more: busy to an exclusive request
            with pytest.raises(GpuBusy) as busy:
                sandboxes(_exact(driver, [device_id]))
            assert target.uuid in str(busy.value) or device_id in str(busy.value), (
                f"{busy.value} names neither {target.uuid} nor {device_id!r}"
            )
        if not others:
            dropped("beside a free device", "one GPU: no other is free beside the shared one")
        elif driver.capabilities.max_gpus_per_sandbox >= 2:
            free = driver.device_ids(others[0])[0]
            with pytest.raises(GpuBusy):
                sandboxes(_exact(driver, [free, ids[0]], count=2))
            assert driver.sandboxes(driver.session_id) == before, "a refused request left one"
            with sandboxes(_exact(driver, [free])) as alone:
                assert uuids(alone) == [others[0].uuid], "the refused request took a GPU"
        assert driver.sandboxes(driver.session_id) == before, "a refused request left a sandbox"
