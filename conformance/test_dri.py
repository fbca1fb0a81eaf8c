"""AMD and Intel GPUs: DRI card and render nodes paired by PCI address, leased as NVIDIA's."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance.dimensions import declared
from conformance.fixtures import Dropped, SandboxFactory
from conformance.hold import HeldSandbox, refused_to_another_client
from conformance.holders import HOLDERS, OTHER_USER_PYTHON, OTHER_USER_SH, CannotHold, Place
from conformance.observe import (
    device_nodes,
    foreign_gpu_nodes,
    kill_and_retake,
    probed_dri,
    refused_nodes,
    uuids,
    visible_dri,
    visible_gpu_uuids,
)
from conformance.settings import Settings
from drivers.base import Driver, Sandbox
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuBusy, GpusExhausted
from gpuhost.spec import SandboxSpec

DRI_HINT = "a simulated host gets some with --sim-dri=intel:1,amd:2"

HOSTS = (
    "one GPU of one vendor",
    "two GPUs of one vendor",
    "GPUs of two vendors",
    "a free GPU of another kind beside",
)
"""What of a host's AMD and Intel GPUs the tests try: a smaller one drops what it cannot show."""
ISOLATION_REQUESTS = ("one GPU of a vendor", "every GPU of a vendor", "two vendors, by exact IDs")
EXCLUSIVE_REQUESTS = (
    "every ID of the held GPU",
    "the held GPU beside a free one of another kind, either way round",
    "a count of the vendor's other GPUs",
    "one more of the vendor",
    "every GPU of the vendor, once given back",
)
OTHER_USERS = (OTHER_USER_PYTHON, OTHER_USER_SH)
"""Holders of a DRI GPU in another user's lease file (conformance/holders.py)."""
DIMENSIONS = {
    "DRI-ISOLATION-01": declared(
        vendor=("amd", "intel"), request=ISOLATION_REQUESTS, host=HOSTS[:3]
    ),
    "DRI-PAIRING-01": declared(
        form=("PCI address", "every other ID of the driver"),
        request=("every DRI GPU at once, each in its own sandbox",),
    ),
    "DRI-EXCLUSIVE-01": declared(
        **{
            "who holds": ("the driver's sandbox in another process", *OTHER_USERS),
            "who asks": ("the driver", "another client of the registry (the reference)"),
            "request": EXCLUSIVE_REQUESTS,
            "how the holder ends": ("closed", "its processes SIGKILLed"),
        },
        host=(HOSTS[0], HOSTS[1], HOSTS[3]),
    ),
}


def _dri_gpus(driver: Driver) -> tuple[GpuDevice, ...]:
    found = driver.host.dri_gpus
    if not found:
        pytest.skip(f"needs AMD or Intel GPUs (the host has none; {DRI_HINT})")
    return found


def _the_most_of_one_vendor(driver: Driver) -> list[GpuDevice]:
    """The DRI GPUs of the vendor the host has most of."""
    gpus = _dri_gpus(driver)
    vendor = max({gpu.vendor for gpu in gpus}, key=lambda v: sum(g.vendor == v for g in gpus))
    return [gpu for gpu in gpus if gpu.vendor == vendor]


def _layout(gpus: tuple[GpuDevice, ...]) -> str:
    """The host's AMD and Intel GPUs, in words: ``the host has 1 amd``."""
    counts = ", ".join(
        f"{sum(g.vendor == v for g in gpus)} {v}" for v in sorted({g.vendor for g in gpus})
    )
    return f"the host has {counts}"


def _vendor(driver: Driver, vendor: str, count: int = 1) -> SandboxSpec:
    return SandboxSpec.with_gpus(count, driver=driver.name, block={"vendor": vendor})


def _exact(driver: Driver, *device_ids: str) -> SandboxSpec:
    return SandboxSpec.with_gpus(driver=driver.name, device_ids=list(device_ids))


def _assert_holds_exactly(driver: Driver, sandbox: Sandbox, given: list[GpuDevice]) -> None:
    """Both DRI nodes of each GPU given, and no other GPU's node of any kind."""
    __tracebackhide__ = True
    assert sorted(uuids(sandbox)) == sorted(gpu.uuid for gpu in given), (
        f"asked for {[gpu.describe() for gpu in given]}; the driver reports {uuids(sandbox)}"
    )
    nodes = device_nodes(sandbox)
    seen = visible_dri(driver, nodes)
    wanted = {gpu.pci_bus_id: {"card", "render"} for gpu in given}
    assert seen == wanted, f"given {sorted(wanted)}, the sandbox holds the DRI nodes of {seen}"
    # Every other node a given GPU needs too (AMD's /dev/kfd for ROCm compute), by number.
    held = {(node.major, node.minor) for node in nodes}
    missing = sorted(
        {node.path for gpu in given for node in gpu.nodes if (node.major, node.minor) not in held}
    )
    assert not missing, f"given {sorted(wanted)}, the sandbox lacks their nodes {missing}"
    ours = {(n.major, n.minor) for gpu in given for n in gpu.nodes}
    refused = refused_nodes(sandbox, [n.path for n in nodes if (n.major, n.minor) in ours])
    assert not refused, f"given {sorted(wanted)}, the sandbox may not open {refused}"
    probed = probed_dri(sandbox)
    if driver.host.simulated:
        assert probed == wanted, f"given {sorted(wanted)}, the probe inside reports {probed}"
    foreign = foreign_gpu_nodes(sandbox, driver, nodes)
    assert foreign == [], f"a sandbox given {sorted(wanted)} also holds {foreign}"
    if all(gpu.vendor != "nvidia" for gpu in given):
        assert visible_gpu_uuids(sandbox) == [], "a sandbox with no NVIDIA GPU sees one"


@pytest.mark.requirement("DRI-ISOLATION-01")
def test_only_the_given_dri_gpus_nodes_are_inside(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped
) -> None:
    """A sandbox given AMD or Intel GPUs MUST hold their nodes and no other GPU's."""
    gpus = _dri_gpus(driver)
    if all(sum(g.vendor == gpu.vendor for g in gpus) < 2 for gpu in gpus):
        dropped(ISOLATION_REQUESTS[1], f"needs two GPUs of one vendor; {_layout(gpus)}")
    for vendor in sorted({gpu.vendor for gpu in gpus}):
        of_vendor = [gpu for gpu in gpus if gpu.vendor == vendor]
        for count in sorted({1, len(of_vendor)}):
            sandbox = sandboxes(_vendor(driver, vendor, count))
            _assert_holds_exactly(driver, sandbox, list(sandbox.gpus))
            assert {gpu.vendor for gpu in sandbox.gpus} == {vendor}, (
                f"{count} {vendor} GPUs asked for; got {[g.describe() for g in sandbox.gpus]}"
            )
            sandbox.close()
    # Two vendors at once, by exact IDs: still only theirs.
    vendors = {gpu.vendor: gpu for gpu in reversed(gpus)}
    if len(vendors) < 2:
        dropped(ISOLATION_REQUESTS[2], f"needs GPUs of two vendors; {_layout(gpus)}")
        return
    pair = list(vendors.values())[:2]
    sandbox = sandboxes(_exact(driver, *(driver.device_ids(gpu)[0] for gpu in pair)))
    _assert_holds_exactly(driver, sandbox, pair)


@pytest.mark.requirement("DRI-PAIRING-01")
def test_card_and_render_nodes_are_paired_by_pci_address(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """Each DRI GPU MUST get its own card and render nodes, by PCI address, in every ID form."""
    gpus = _dri_gpus(driver)
    for gpu in gpus:
        assert gpu.pci_bus_id in driver.device_ids(gpu), (
            f"{gpu.describe()} cannot be named by its PCI address: {driver.device_ids(gpu)}"
        )

    def every_form(gpu: GpuDevice) -> None:
        for device_id in driver.device_ids(gpu):
            with sandboxes(_exact(driver, device_id)) as sandbox:
                _assert_holds_exactly(driver, sandbox, [gpu])

    # Every DRI GPU at once, each named in every form in turn: sandboxes held side by side.
    with ThreadPoolExecutor(len(gpus)) as pool:
        list(pool.map(every_form, gpus))


@pytest.mark.exclusive
@pytest.mark.requirement("DRI-EXCLUSIVE-01")
def test_a_held_dri_gpu_is_never_granted_again(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped
) -> None:
    """A DRI GPU held by any process MUST never be granted again, and MUST come back."""
    of_vendor = _the_most_of_one_vendor(driver)
    vendor = of_vendor[0].vendor
    held = of_vendor[-1]
    with HeldSandbox.start(driver, settings, _exact(driver, held.pci_bus_id)) as other:
        reply = other.go()
        assert reply["ok"], f"another process could not take {held.describe()}: {reply}"
        for device_id in driver.device_ids(held):
            with pytest.raises(GpuBusy):
                sandboxes(_exact(driver, device_id))
        refused = refused_to_another_client(settings.host, settings.session_id, held)
        assert isinstance(refused, GpuBusy), (
            f"{held.describe()} is held; the host registry's other clients were told {refused!r}"
        )
        # Beside a free GPU of another kind, either way round: refused whole, taking nothing.
        free = next((gpu for gpu in driver.inventory() if gpu.vendor != held.vendor), None)
        if free is None:
            dropped(EXCLUSIVE_REQUESTS[1], "needs a GPU of another kind than the held one's")
        elif driver.capabilities.max_gpus_per_sandbox >= 2:
            pair = (driver.device_ids(free)[0], driver.device_ids(held)[0])
            for ids in (pair, pair[::-1]):
                leases = driver.host.leases.leases()
                with pytest.raises(GpuBusy):
                    sandboxes(_exact(driver, *ids))
                assert driver.host.leases.leases() == leases, f"the refused {ids} left a lease"
            with sandboxes(_exact(driver, pair[0])) as alone:
                assert uuids(alone) == [free.uuid], f"the refused {pair} took {free.describe()}"
        rest = len(of_vendor) - 1
        if not rest:
            dropped(
                EXCLUSIVE_REQUESTS[2], f"needs two GPUs of one vendor; {_layout(_dri_gpus(driver))}"
            )
        else:
            others = sandboxes(_vendor(driver, vendor, rest))
            assert held.uuid not in uuids(others), (
                f"{held.describe()} is held by another process; a count of {rest} got it"
            )
        with pytest.raises(GpusExhausted):
            sandboxes(_vendor(driver, vendor))
    for sandbox in list(sandboxes.open):
        sandbox.close()
    again = sandboxes(_vendor(driver, vendor, len(of_vendor)))
    assert sorted(uuids(again)) == sorted(gpu.uuid for gpu in of_vendor), (
        f"every {vendor} GPU should be free again; a count of {len(of_vendor)} got {uuids(again)}"
    )


@pytest.mark.exclusive
@pytest.mark.requirement("DRI-EXCLUSIVE-01")
@pytest.mark.parametrize("who", OTHER_USERS)
def test_a_dri_gpu_in_another_users_lease_file_is_never_granted(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped, who: str
) -> None:
    """A DRI GPU another user's lease holds MUST never be granted, by an ID or by a count."""
    of_vendor = _the_most_of_one_vendor(driver)
    vendor, held = of_vendor[0].vendor, of_vendor[-1]
    with contextlib.ExitStack() as holding:
        try:
            holding.enter_context(HOLDERS[who](Place(settings, driver), [held]))
        except CannotHold as exc:
            dropped(who, str(exc))
            return
        holds = f"{who} holds {held.describe()}"
        for device_id in driver.device_ids(held):
            with pytest.raises(GpuBusy):
                sandboxes(_exact(driver, device_id))
        if rest := len(of_vendor) - 1:
            others = uuids(sandboxes(_vendor(driver, vendor, rest)))
            assert held.uuid not in others, f"{holds}; a count of {rest} of {vendor} got {others}"
        with pytest.raises(GpusExhausted):
            sandboxes(_vendor(driver, vendor))


@pytest.mark.requirement("DRI-EXCLUSIVE-01")
def test_a_killed_sandboxs_dri_gpus_come_back(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """The DRI GPUs of a sandbox whose processes were SIGKILLed MUST go to the next request."""
    of_vendor = _the_most_of_one_vendor(driver)
    count = min(len(of_vendor), driver.capabilities.max_gpus_per_sandbox)
    spec = _vendor(driver, of_vendor[0].vendor, count)
    victim = sandboxes(spec)
    if count < len(of_vendor):
        sandboxes(_vendor(driver, of_vendor[0].vendor, len(of_vendor) - count))
    successor = kill_and_retake(sandboxes, victim, spec, settings.reclaim_timeout_s)
    assert sorted(uuids(successor)) == sorted(uuids(victim)), (
        f"the killed sandbox held {uuids(victim)}; the next request got {uuids(successor)}"
    )
