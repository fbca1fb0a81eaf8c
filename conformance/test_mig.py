"""MIG: a GPU in MIG mode is handed out by instance, and it and its instances exclude each other."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest

from conformance.dimensions import declared
from conformance.fixtures import Dropped, SandboxFactory
from conformance.hold import HeldSandbox, held_by_the_sh_client, refused_to_another_client
from conformance.holders import MIG_INSTANCE_HOLDERS, MIG_WHOLE_HOLDERS
from conformance.observe import (
    device_nodes,
    exact_ids,
    expect_refusal,
    foreign_gpu_nodes,
    nvidia_gpu_nodes,
    refused_nodes,
    uuids,
    visible_gpu_uuids,
    visible_mig_uuids,
)
from conformance.settings import Settings
from drivers.base import Driver, Sandbox
from gpuhost.devices import GpuDevice
from gpuhost.errors import (
    DriverError,
    DuplicateGpuDevice,
    GpuBusy,
    GpusExhausted,
    UnsupportedGpuRequest,
)
from gpuhost.spec import SandboxSpec, block_field

MIG_HINT = "a simulated host gets some with --sim-mig=0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb"

EXACT_GROUPS = (
    "one instance, in every ID form",
    "two instances of one GPU",
    "instances of two GPUs, their forms mixed",
)
PROFILE_REQUESTS = (
    "one instance of each profile",
    "more of a profile than any one GPU has",
    "more while one is held",
    "one more than are free, spread over GPUs",
    "every free one, then none",
    "a profile the host lacks",
    "the start of a profile",
)
WITHOUT_A_PROFILE = ("default", "vendor nvidia", "a count")
ISOLATION_GROUPS = ("one instance", "instances of two GPUs", "one instance by profile")
INSTANCE_HOLDERS = MIG_INSTANCE_HOLDERS
WHOLE_HOLDERS = MIG_WHOLE_HOLDERS
HOSTS = ("one GPU in MIG mode, one instance", "a GPU of two instances", "two GPUs in MIG mode")
"""What of a host's MIG layout the tests try: a smaller one drops what it cannot show."""

DIMENSIONS = {
    "MIG-EXACT-01": declared(request=EXACT_GROUPS, host=HOSTS),
    "MIG-PROFILE-01": declared(
        **{"request": PROFILE_REQUESTS, "request without a profile": WITHOUT_A_PROFILE},
        host=HOSTS,
    ),
    "MIG-ISOLATION-01": declared(request=ISOLATION_GROUPS, host=HOSTS),
    "MIG-EXCLUSIVE-01": declared(
        **{
            "who holds an instance": INSTANCE_HOLDERS,
            "who holds the GPU whole": WHOLE_HOLDERS,
            "who asks": ("the driver", "another client of the registry (the reference)"),
        },
        host=HOSTS[:2],
    ),
}


def _instances(driver: Driver) -> tuple[GpuDevice, ...]:
    """The host's MIG instances, in GPU then instance order; skip on a host without any."""
    found = driver.host.mig_devices
    if not found:
        pytest.skip(f"needs MIG instances (the host has none; {MIG_HINT})")
    return found


def _by_gpu(instances: tuple[GpuDevice, ...]) -> dict[str, list[GpuDevice]]:
    grouped: dict[str, list[GpuDevice]] = collections.defaultdict(list)
    for mig in instances:
        assert mig.parent_uuid is not None
        grouped[mig.parent_uuid].append(mig)
    return dict(grouped)


def _form(driver: Driver, device: GpuDevice, which: int) -> str:
    """One of the device's native IDs, the forms taken in turn."""
    ids = driver.device_ids(device)
    return ids[which % len(ids)]


def _exact(driver: Driver, *device_ids: str) -> SandboxSpec:
    return SandboxSpec.with_gpus(driver=driver.name, device_ids=list(device_ids))


def _profile(driver: Driver, profile: str, count: int = 1) -> SandboxSpec:
    return SandboxSpec.with_gpus(count, driver=driver.name, block={"mig_profile": profile})


def _gpus_of(instances: tuple[GpuDevice, ...], profile: str) -> set[str | None]:
    """The GPUs that have instances of ``profile``."""
    return {mig.parent_uuid for mig in instances if mig.profile == profile}


def _smaller(by_gpu: dict[str, list[GpuDevice]]) -> str:
    """What the host has, where a case needs more: its MIG layout, in words."""
    sizes = ", ".join(str(len(migs)) for migs in by_gpu.values())
    gpus = "GPU" if len(by_gpu) == 1 else "GPUs"
    return f"the host has {len(by_gpu)} {gpus} in MIG mode, of {sizes} instances"


def _assert_sees_exactly(given: list[GpuDevice], sandbox: Sandbox, asked: str) -> None:
    """The driver reports ``given``; nvidia-smi lists those instances, under their GPUs."""
    __tracebackhide__ = True
    wanted = sorted(gpu.uuid for gpu in given)
    assert sorted(uuids(sandbox)) == wanted, f"{asked}: the driver reports {uuids(sandbox)}"
    seen = visible_mig_uuids(sandbox)
    assert sorted(seen) == wanted, f"{asked}: nvidia-smi -L lists the MIG instances {seen}"
    parents = sorted({gpu.parent_uuid for gpu in given if gpu.parent_uuid})
    listed = visible_gpu_uuids(sandbox)
    assert sorted(set(listed)) == parents, f"{asked}: nvidia-smi lists the GPUs {listed}"


@pytest.mark.requirement("MIG-EXACT-01")
def test_exact_mig_instances_are_given_exactly(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped
) -> None:
    """A request naming MIG instances MUST give exactly those, in every native ID form."""
    instances = _instances(driver)
    by_gpu = _by_gpu(instances)
    last = instances[-1]  # not only the first instance of the first GPU
    for device_id in exact_ids(driver, last):
        sandbox = sandboxes(_exact(driver, device_id))
        _assert_sees_exactly([last], sandbox, f"asked for {device_id}")
        sandbox.close()
    # Two instances of one GPU, and one of each of two GPUs, their ID forms mixed.
    crowded = max(by_gpu.values(), key=len)
    groups = {
        EXACT_GROUPS[1]: crowded[-2:] if len(crowded) >= 2 else [],
        EXACT_GROUPS[2]: [migs[len(migs) // 2] for migs in list(by_gpu.values())[:2]],
    }
    for name, group in groups.items():
        if len(group) < 2:
            dropped(name, _smaller(by_gpu))
            continue
        forms = [_form(driver, mig, i) for i, mig in enumerate(group)]
        sandbox = sandboxes(_exact(driver, *forms))
        _assert_sees_exactly(group, sandbox, f"asked for {forms}")
        sandbox.close()


@pytest.mark.exclusive
@pytest.mark.requirement("MIG-PROFILE-01")
def test_profile_counts_get_free_instances_of_the_profile(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped
) -> None:
    """A count with a MIG profile MUST give that many distinct free instances of it."""
    instances = _instances(driver)
    profiles = collections.Counter(mig.profile for mig in instances)
    spread = {mig.profile for mig in instances if len(_gpus_of(instances, mig.profile)) >= 2}
    if not spread:
        dropped(PROFILE_REQUESTS[1], f"needs a profile on two GPUs; {_smaller(_by_gpu(instances))}")
    if max(profiles.values()) < 2:
        dropped(PROFILE_REQUESTS[2], "needs two instances of one profile; the host has one each")
    for profile, total in profiles.most_common():
        of_profile = {mig.uuid for mig in instances if mig.profile == profile}
        # More than any one GPU has of the profile: the instances of several GPUs together.
        per_gpu = collections.Counter(m.parent_uuid for m in instances if m.profile == profile)
        wide = max(per_gpu.values()) + 1
        if len(per_gpu) >= 2 and wide <= driver.capabilities.max_gpus_per_sandbox:
            sandbox = sandboxes(_profile(driver, profile, wide))
            got = uuids(sandbox)
            asked = f"{wide} {profile} instances asked for, of {dict(per_gpu)} on their GPUs"
            assert len(set(got)) == wide, f"{asked}; got {got}"
            assert set(got) <= of_profile, f"{asked}; got {got}"
            _assert_sees_exactly(list(sandbox.gpus), sandbox, asked)
            sandbox.close()
        held = sandboxes(_profile(driver, profile))
        assert len(held.gpus) == 1, f"one {profile} instance asked for; got {held.gpus}"
        assert uuids(held)[0] in of_profile, f"not a {profile} instance: {held.gpus}"
        taken = set(uuids(held))
        if total > 1:
            count = min(2, total - 1)
            more = sandboxes(_profile(driver, profile, count))
            got = uuids(more)
            asked = f"{count} free {profile} instances asked for while {sorted(taken)} is held"
            assert len(set(got)) == count, f"{asked}; the driver reports {got}"
            assert set(got) <= of_profile - taken, f"{asked}; the driver reports {got}"
            _assert_sees_exactly(list(more.gpus), more, f"{count} x {profile}")
            taken |= set(got)
        if left := len(of_profile - taken):
            if left + 1 <= driver.capabilities.max_gpus_per_sandbox:
                # One more than are free, spread over GPUs: refused whole, taking nothing.
                leases = driver.host.leases.leases()
                with pytest.raises(GpusExhausted):
                    sandboxes(_profile(driver, profile, left + 1))
                assert driver.host.leases.leases() == leases, (
                    f"{left + 1} {profile} instances asked for, {left} free: the refusal took some"
                )
            sandboxes(_profile(driver, profile, left))
        with pytest.raises(GpusExhausted):
            sandboxes(_profile(driver, profile))
        for sandbox in list(sandboxes.open):
            sandbox.close()
    # A profile the host lacks, and the start of one it has: profiles are names, not prefixes.
    for missing in ("9g.999gb", instances[0].profile.split(".")[0]):
        expect_refusal(
            driver,
            sandboxes,
            _profile(driver, missing),
            UnsupportedGpuRequest,
            field=block_field(driver.name, "mig_profile"),
            value=missing,
        )


@pytest.mark.exclusive
@pytest.mark.requirement("MIG-PROFILE-01")
def test_requests_without_a_profile_never_get_a_gpu_in_mig_mode(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """Default and count requests MUST never get a GPU in MIG mode (nor one of its instances)."""
    instances = _instances(driver)
    in_mig_mode = {mig.parent_uuid for mig in instances}
    whole = [gpu for gpu in driver.host.gpus if not gpu.mig_enabled]
    # Plain, and naming NVIDIA as the vendor: in MIG mode a GPU is no NVIDIA GPU to count.
    # Where every GPU is in MIG mode, each is refused (below).
    nvidia = SandboxSpec.with_gpus(driver=driver.name, block={"vendor": "nvidia"})
    requests = dict(zip(WITHOUT_A_PROFILE, [SandboxSpec.with_gpus(), nvidia], strict=False))
    got = [uuids(sandboxes(spec)) for spec in list(requests.values())[: len(whole)]]
    left = len(whole) - len(got)
    while left > 0:
        count = min(left, driver.capabilities.max_gpus_per_sandbox)
        got.append(uuids(sandboxes(SandboxSpec.with_gpus(count))))
        left -= count
    flat = [uuid for gpus in got for uuid in gpus]
    wrong = sorted(set(flat) & (in_mig_mode | {mig.uuid for mig in instances}))
    assert not wrong, f"requests without a MIG profile got {wrong}, which are MIG devices"
    assert len(set(flat)) == len(flat), f"a GPU was granted twice: {flat}"
    assert set(flat) == {gpu.uuid for gpu in whole}, (
        f"every GPU not in MIG mode was asked for; the requests got {sorted(flat)}"
    )
    if whole:
        with pytest.raises(GpusExhausted):
            sandboxes(SandboxSpec.with_gpus())
        return
    # Every NVIDIA GPU is in MIG mode: each request is refused, or gets another vendor's GPU.
    for request, spec in [*requests.items(), (WITHOUT_A_PROFILE[2], SandboxSpec.with_gpus(1))]:
        try:
            got_now = uuids(sandboxes(spec))
        except DriverError:
            continue
        wrong = sorted(set(got_now) & (in_mig_mode | {mig.uuid for mig in instances}))
        assert not wrong, f"every NVIDIA GPU is in MIG mode; a request ({request}) got {wrong}"


@pytest.mark.requirement("MIG-ISOLATION-01")
def test_only_its_own_instances_capabilities_are_inside(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped
) -> None:
    """A sandbox MUST hold its own instances' nvidia-caps nodes, open, and no other's."""
    instances = _instances(driver)
    by_gpu = _by_gpu(instances)
    requests = [[instances[-1]]]
    if len(by_gpu) >= 2:
        requests.append([migs[0] for migs in by_gpu.values()][:2])
    else:
        dropped(ISOLATION_GROUPS[1], _smaller(by_gpu))
    for group in requests:
        sandbox = sandboxes(_exact(driver, *(driver.device_ids(mig)[0] for mig in group)))
        seen = device_nodes(sandbox)
        foreign = foreign_gpu_nodes(sandbox, driver, seen)
        assert foreign == [], f"a sandbox given {[m.uuid for m in group]} also holds {foreign}"
        minors = sorted({mig.minor for mig in group if mig.minor is not None})
        nodes = sorted({node.minor for node in nvidia_gpu_nodes(seen)})
        assert nodes == minors, f"{[m.uuid for m in group]}'s GPU minors: {minors}, inside {nodes}"
        # Its instances' nodes there, and open: CUDA attaches to an instance through its
        # capability nodes.
        own = {(node.major, node.minor) for mig in group for node in mig.nodes}
        missing = sorted(own - {(node.major, node.minor) for node in seen})
        assert not missing, (
            f"a sandbox given {[m.uuid for m in group]} lacks its nodes (major, minor) {missing}"
        )
        refused = refused_nodes(sandbox, [n.path for n in seen if (n.major, n.minor) in own])
        assert not refused, f"a sandbox given {[m.uuid for m in group]} may not open {refused}"
        sandbox.close()
    if driver.capabilities.mig_profiles:  # asked by profile, not by name: the same nodes
        sandbox = sandboxes(_profile(driver, instances[-1].profile))
        foreign = foreign_gpu_nodes(sandbox, driver, device_nodes(sandbox))
        assert foreign == [], f"a sandbox given {uuids(sandbox)} by profile also holds {foreign}"


def _busy(sandboxes: SandboxFactory, spec: SandboxSpec, asked: str) -> None:
    """``spec`` is refused with ``GpuBusy``; granted, the test fails saying what it got."""
    __tracebackhide__ = True
    try:
        sandbox = sandboxes(spec)
    except GpuBusy:
        return
    pytest.fail(f"{asked}: got {uuids(sandbox)}, not GpuBusy", pytrace=False)


def _most_split(driver: Driver) -> tuple[GpuDevice, list[GpuDevice]]:
    """The GPU in MIG mode with the most instances, and its instances."""
    parent_uuid, migs = max(_by_gpu(_instances(driver)).items(), key=lambda item: len(item[1]))
    return next(gpu for gpu in driver.host.gpus if gpu.uuid == parent_uuid), migs


@contextmanager
def _instance_held(
    who: str, driver: Driver, settings: Settings, instance: GpuDevice
) -> Iterator[None]:
    """``instance`` held by ``who`` (``INSTANCE_HOLDERS``) for as long as the block runs."""
    if who == INSTANCE_HOLDERS[0]:
        spec = _exact(driver, driver.device_ids(instance)[0])
        with HeldSandbox.start(driver, settings, spec) as other:
            reply = other.go()
            assert reply["ok"], f"another process could not take {instance.uuid}: {reply}"
            assert reply["gpus"] == [instance.uuid], f"another process got {reply['gpus']}"
            yield
    else:
        with held_by_the_sh_client(settings.host, driver.session_id, [instance]):
            yield


@pytest.mark.exclusive
@pytest.mark.requirement("MIG-EXCLUSIVE-01")
@pytest.mark.parametrize("who", INSTANCE_HOLDERS)
def test_a_held_instance_excludes_its_gpu_and_nothing_else(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped, who: str
) -> None:
    """An instance anyone holds MUST be busy in every form, and its GPU whole too, in every process."""
    # Its siblings stay free, and closing one of them leaves it held.
    parent, migs = _most_split(driver)
    instance = migs[-1]
    holds = f"{who} holds {instance.describe()}"
    with _instance_held(who, driver, settings, instance):
        for device_id in driver.device_ids(instance):
            _busy(sandboxes, _exact(driver, device_id), f"{holds}; {device_id} asked for")
        for device_id in driver.device_ids(parent):
            _busy(sandboxes, _exact(driver, device_id), f"{holds}; its GPU {device_id} asked for")
        refused = refused_to_another_client(settings.host, settings.session_id, parent)
        assert isinstance(refused, GpuBusy), (
            f"{instance.uuid} of {parent.uuid} is held by {who}; the host registry's other "
            f"clients were told {refused!r} for the GPU whole"
        )
        siblings = [mig for mig in migs if mig != instance]
        if not siblings:
            dropped(HOSTS[1], f"its sibling instances: {_smaller(_by_gpu(_instances(driver)))}")
            return
        sibling = sandboxes(_exact(driver, driver.device_ids(siblings[0])[0]))
        assert uuids(sibling) == [siblings[0].uuid]
        sibling.close()
        # Closing a sibling gives back its instance alone: the held one stays held.
        again = _exact(driver, driver.device_ids(instance)[0])
        _busy(sandboxes, again, f"{holds}; asked for after its sibling {siblings[0].uuid} closed")
        refused = refused_to_another_client(settings.host, settings.session_id, instance)
        assert isinstance(refused, GpuBusy), (
            f"closing {siblings[0].uuid} gave back {instance.uuid}, which {who} holds: the "
            f"host registry's other clients were told {refused!r}"
        )


@pytest.mark.exclusive
@pytest.mark.requirement("MIG-EXCLUSIVE-01")
@pytest.mark.parametrize("who", WHOLE_HOLDERS)
def test_a_gpu_held_whole_excludes_its_instances(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, who: str
) -> None:
    """A GPU in MIG mode held whole MUST exclude each of its instances, in every form."""
    parent, migs = _most_split(driver)
    instance, profile = migs[-1], migs[0].profile
    every = sum(mig.profile == profile for mig in driver.host.mig_devices)
    holding: AbstractContextManager[object]
    if who == WHOLE_HOLDERS[0]:
        # The GPU whole and one of its own instances, in one request: the GPU twice.
        both = _exact(driver, driver.device_ids(parent)[0], driver.device_ids(instance)[0])
        expect_refusal(
            driver, sandboxes, both, DuplicateGpuDevice,
            field=block_field(driver.name, "gpu_device_ids"), value=driver.device_ids(instance)[0],
        )  # fmt: skip
        whole = sandboxes(_exact(driver, driver.device_ids(parent)[0]))
        assert uuids(whole) == [parent.uuid]
        holding = whole
    else:
        holding = held_by_the_sh_client(settings.host, driver.session_id, [parent])
    holds = f"{who} holds {parent.describe()} whole"
    with holding:
        for mig in migs:
            for device_id in driver.device_ids(mig):
                _busy(sandboxes, _exact(driver, device_id), f"{holds}; {device_id} asked for")
        every_one = _profile(driver, profile, every)
        try:
            got = uuids(sandboxes(every_one))
        except GpusExhausted:
            pass
        else:
            pytest.fail(f"{holds}; every {profile} instance ({every}) asked for got {got}")
    again = sandboxes(_exact(driver, driver.device_ids(instance)[0]))
    assert uuids(again) == [instance.uuid], (
        f"{parent.uuid} given back, its instance did not come back"
    )
