"""MIG: a GPU in MIG mode is handed out by instance, and it and its instances exclude each other."""

from __future__ import annotations

import collections

import pytest

from conformance.fixtures import SandboxFactory
from conformance.hold import HeldSandbox, held_by_the_sh_client, refused_to_another_client
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
from gpuhost.errors import DuplicateGpuDevice, GpuBusy, GpusExhausted, UnsupportedGpuRequest
from gpuhost.spec import SandboxSpec, block_field

MIG_HINT = "a simulated host gets some with --sim-mig=0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb"


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
def test_exact_mig_instances_are_given_exactly(driver: Driver, sandboxes: SandboxFactory) -> None:
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
    groups = [crowded[-2:]] if len(crowded) >= 2 else []
    if len(by_gpu) >= 2:
        groups.append([migs[len(migs) // 2] for migs in list(by_gpu.values())[:2]])
    for group in groups:
        forms = [_form(driver, mig, i) for i, mig in enumerate(group)]
        sandbox = sandboxes(_exact(driver, *forms))
        _assert_sees_exactly(group, sandbox, f"asked for {forms}")
        sandbox.close()


@pytest.mark.exclusive
@pytest.mark.requirement("MIG-PROFILE-01")
def test_profile_counts_get_free_instances_of_the_profile(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A count with a MIG profile MUST give that many distinct free instances of it."""
    instances = _instances(driver)
    profiles = collections.Counter(mig.profile for mig in instances)
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
    if not whole:
        pytest.skip("needs a GPU not in MIG mode beside those in MIG mode")
    # Plain, and naming NVIDIA as the vendor: in MIG mode a GPU is no NVIDIA GPU to count.
    nvidia = SandboxSpec.with_gpus(driver=driver.name, block={"vendor": "nvidia"})
    got = [uuids(sandboxes(spec)) for spec in [SandboxSpec.with_gpus(), nvidia][: len(whole)]]
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
    with pytest.raises(GpusExhausted):
        sandboxes(SandboxSpec.with_gpus())


@pytest.mark.requirement("MIG-ISOLATION-01")
def test_only_its_own_instances_capabilities_are_inside(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A sandbox MUST hold its own instances' nvidia-caps nodes, open, and no other's."""
    instances = _instances(driver)
    by_gpu = _by_gpu(instances)
    requests = [[instances[-1]], [migs[0] for migs in by_gpu.values()][:2]]
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


@pytest.mark.exclusive
@pytest.mark.requirement("MIG-EXCLUSIVE-01")
def test_a_gpu_and_its_instances_exclude_each_other(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """A GPU in MIG mode and its instances MUST exclude each other, in every process."""
    instances = _instances(driver)
    by_gpu = _by_gpu(instances)
    parent_uuid, migs = next(iter(by_gpu.items()))
    parent = next(gpu for gpu in driver.host.gpus if gpu.uuid == parent_uuid)
    instance = migs[-1]
    with HeldSandbox.start(
        driver, settings, _exact(driver, driver.device_ids(instance)[0])
    ) as other:
        reply = other.go()
        assert reply["ok"], f"another process could not take {instance.uuid}: {reply}"
        assert reply["gpus"] == [instance.uuid], f"another process got {reply['gpus']}"
        for device_id in driver.device_ids(instance):
            with pytest.raises(GpuBusy):
                sandboxes(_exact(driver, device_id))
        for device_id in driver.device_ids(parent):
            with pytest.raises(GpuBusy):
                sandboxes(_exact(driver, device_id))
        refused = refused_to_another_client(settings.host, settings.session_id, parent)
        assert isinstance(refused, GpuBusy), (
            f"{instance.uuid} of {parent.uuid} is held; the host registry's other clients were "
            f"told {refused!r} for the GPU whole"
        )
        siblings = [mig for mig in migs if mig != instance]
        if siblings:  # the GPU's other instances stay free
            sibling = sandboxes(_exact(driver, driver.device_ids(siblings[0])[0]))
            assert uuids(sibling) == [siblings[0].uuid]
            sibling.close()
            # Closing a sibling gives back its instance alone: the held one stays held.
            with pytest.raises(GpuBusy):
                sandboxes(_exact(driver, driver.device_ids(instance)[0]))
            refused = refused_to_another_client(settings.host, settings.session_id, instance)
            assert isinstance(refused, GpuBusy), (
                f"closing {siblings[0].uuid} gave back {instance.uuid}, which another process "
                f"holds: the host registry's other clients were told {refused!r}"
            )
    # The GPU whole and one of its own instances, in one request: the GPU twice.
    both = _exact(driver, driver.device_ids(parent)[0], driver.device_ids(instance)[0])
    expect_refusal(
        driver, sandboxes, both, DuplicateGpuDevice,
        field=block_field(driver.name, "gpu_device_ids"), value=driver.device_ids(instance)[0],
    )  # fmt: skip
    # And the other way: the GPU whole, then none of its instances.
    whole = sandboxes(_exact(driver, driver.device_ids(parent)[0]))
    assert uuids(whole) == [parent.uuid]
    for mig in migs:
        with pytest.raises(GpuBusy):
            sandboxes(_exact(driver, driver.device_ids(mig)[0]))
    every = sum(mig.profile == migs[0].profile for mig in instances)
    assert migs[0].profile is not None
    with pytest.raises(GpusExhausted):
        sandboxes(_profile(driver, migs[0].profile, every))
    whole.close()
    again = sandboxes(_exact(driver, driver.device_ids(instance)[0]))
    assert uuids(again) == [instance.uuid], "the instance did not come back"
    again.close()
    # The GPU whole, held by another client of the host's registry: none of its instances.
    with held_by_the_sh_client(settings.host, driver.session_id, [parent]):
        for mig in migs:
            for device_id in driver.device_ids(mig):
                with pytest.raises(GpuBusy):
                    sandboxes(_exact(driver, device_id))
        with pytest.raises(GpusExhausted):
            sandboxes(_profile(driver, migs[0].profile, every))
