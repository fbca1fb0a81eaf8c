"""Host-wide exclusivity: GPUs held through the host's lease registry by anyone are not free.

The holders are others than this run of the driver under test: the lease protocol's client
in POSIX sh (gpuhost/gpu-lease), a program of another language; a holder of a kind that is
not a process (as an engine's container is); a sandbox of the same driver made by another
process for another session; and a reference sandbox made by another process. A driver
with an allocator of its own passes every other requirement and fails this one; so does
one that takes other sessions' leases, or leases it cannot judge, for leftovers.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from pathlib import Path
from uuid import uuid4

import pytest

from conformance.fixtures import SandboxFactory
from conformance.hold import RUN_HOLDER, HeldSandbox, close_all, held_by_the_sh_client
from conformance.observe import create_side_by_side, uuids, visible_gpu_uuids
from conformance.settings import Settings
from drivers.base import Driver
from drivers.reference import ReferenceDriver
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuBusy, GpusExhausted
from gpuhost.host import GpuHost
from gpuhost.leases import (
    PROCESS,
    Holder,
    LeaseOwner,
    boot_id,
    process_start_time,
)
from gpuhost.spec import SandboxSpec


@contextmanager
def _held_under_a_kind_of_its_own(host: GpuHost, gpus: list[GpuDevice]) -> Iterator[None]:
    """A lease whose holder is no process: only the holder kind's own check may judge it."""
    if not gpus:
        yield
        return
    owner = LeaseOwner(
        driver="scheduler", sandbox_id=f"job-{time.time_ns()}", session_id=f"other-{uuid4().hex}",
        holder=Holder(RUN_HOLDER, Holder.process(os.getpid()).ref),
    )  # fmt: skip
    host.leases.acquire(gpus, owner, exact=gpus)
    try:
        yield
    finally:
        host.leases.release(owner.sandbox_id)


@contextmanager
def _held_by_other_processes(
    settings: Settings, holder: Driver, gpus: list[GpuDevice]
) -> Iterator[None]:
    """Sandboxes of ``holder``, each made by another process, hold ``gpus``."""
    if not gpus or not holder.probe().ok:
        yield  # the other holders carry the check alone
        return
    specs = [
        SandboxSpec.with_gpus(driver=holder.name, device_ids=[holder.device_ids(gpu)[0]])
        for gpu in gpus
    ]
    others = [HeldSandbox.start(holder, settings, spec) for spec in specs]
    try:
        for other in others:
            other.send_go()
        for gpu, other in zip(gpus, others, strict=True):
            reply = other.result()
            assert reply["ok"], f"a {holder.name} sandbox could not take {gpu.describe()}: {reply}"
        yield
    finally:
        close_all(others)
        if holder.session_id != settings.session_id:  # another run's: reaped as it would be
            holder.reap(holder.session_id)


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-HOSTWIDE-01")
def test_gpus_held_through_the_host_registry_are_never_granted(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """GPUs held by other drivers and processes MUST never be granted, by any kind of request."""
    inventory = driver.inventory()
    # Holders: the sh client, a kind of its own, reference sandboxes, and the same driver in
    # another session (another run) when it takes exact IDs.
    kinds = 4 if driver.capabilities.exact_ids else 3
    # Every other GPU (not only the lowest ones), a GPU for each kind of holder at least,
    # and one GPU free at least.
    wanted = min(max(len(inventory[::2]), kinds), len(inventory) - 1)
    held = [*inventory[::2], *inventory[1::2][::-1]][: max(wanted, 1)]
    free = [gpu for gpu in inventory if gpu not in held]
    held_ids = {gpu.uuid for gpu in held}
    share = [held[i::kinds] for i in range(kinds)]
    with ExitStack() as holders:
        # The host's own registry, whatever the driver under test made of it.
        holders.enter_context(held_by_the_sh_client(settings.host, driver.session_id, share[0]))
        holders.enter_context(_held_under_a_kind_of_its_own(settings.host, share[1]))
        reference = ReferenceDriver(settings.host, driver.session_id)
        holders.enter_context(_held_by_other_processes(settings, reference, share[2]))
        if kinds == 4:
            same = type(driver)(settings.host, f"other-{uuid4().hex}", driver.image)
            holders.enter_context(_held_by_other_processes(settings, same, share[3]))

        # Default requests, side by side, until none is left.
        got = []
        for sandbox in create_side_by_side(sandboxes, [SandboxSpec.with_gpus()] * len(free)):
            got += uuids(sandbox)
            assert not set(visible_gpu_uuids(sandbox)) & held_ids
        assert not set(got) & held_ids, f"defaults got {got}; others hold {sorted(held_ids)}"
        with pytest.raises(GpusExhausted):
            sandboxes(SandboxSpec.with_gpus())
        for sandbox in list(sandboxes.open):
            sandbox.close()

        # A count of every free GPU, at once.
        count = min(len(free), driver.capabilities.max_gpus_per_sandbox)
        if count:
            together = sandboxes(SandboxSpec.with_gpus(count))
            assert not set(uuids(together)) & held_ids, f"a count of {count} got {uuids(together)}"
            together.close()

        # Exact devices: each held one is busy, alone or beside a free one, and takes nothing.
        if driver.capabilities.exact_ids:
            for gpu in held:
                device = driver.device_ids(gpu)[0]
                with pytest.raises(GpuBusy):
                    sandboxes(SandboxSpec.with_gpus(driver=driver.name, device_ids=[device]))
                if free and driver.capabilities.max_gpus_per_sandbox >= 2:
                    pair = [driver.device_ids(free[0])[0], device]
                    with pytest.raises(GpuBusy):
                        sandboxes(SandboxSpec.with_gpus(2, driver=driver.name, device_ids=pair))
            if free:
                first_free = driver.device_ids(free[0])[0]
                still = sandboxes(
                    SandboxSpec.with_gpus(driver=driver.name, device_ids=[first_free])
                )
                assert uuids(still) == [free[0].uuid], "a refused exact request took a GPU"


@pytest.mark.requirement("GPU-HOSTWIDE-01")
def test_leases_of_holders_that_are_gone_hold_nothing(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A registry lease whose process is gone (its pid reused, another boot) MUST hold nothing."""
    me, start = os.getpid(), process_start_time(os.getpid())
    gone = {
        "whose pid another process now has": Holder(PROCESS, f"{boot_id()}:{me}:{int(start) + 1}"),
        "of an earlier boot": Holder(PROCESS, f"{uuid4()}:{me}:{start}"),
    }
    inventory = driver.inventory()
    leased = dict(zip(gone, inventory, strict=False))
    owners = {
        why: LeaseOwner("gpu-lease", f"gone-{uuid4().hex}", f"other-{uuid4().hex}", holder)
        for why, holder in gone.items()
        if why in leased
    }
    for why, owner in owners.items():
        driver.host.leases.acquire([leased[why]], owner, exact=[leased[why]])
    try:
        if driver.capabilities.exact_ids:
            specs = [
                SandboxSpec.with_gpus(driver=driver.name, device_ids=[driver.device_ids(gpu)[0]])
                for gpu in leased.values()
            ]
        else:
            specs = [SandboxSpec.with_gpus()] * len(inventory)
        got = {uuid for sandbox in create_side_by_side(sandboxes, specs) for uuid in uuids(sandbox)}
        kept = {why: gpu.uuid for why, gpu in leased.items() if gpu.uuid not in got}
        assert not kept, f"leases of holders that are gone still hold GPUs: {kept}"
    finally:
        for owner in owners.values():
            driver.host.leases.release(owner.sandbox_id)


@pytest.mark.requirement("GPU-HOSTWIDE-01")
def test_a_lease_file_of_an_older_client_holds_its_gpus(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A version-1 lease file (no boot_id) is the running boot's: its live leases MUST hold."""
    # Written over the registry's file, so only on a simulated host, whose registry is the
    # run's own; a real host's registry is never written but through the protocol.
    if driver.host.simulated is None:
        pytest.skip("needs a simulated host: it writes the lease registry's file itself")
    free, *held = driver.inventory()
    sandbox_id = f"v1-{uuid4().hex}"
    holder = {"kind": PROCESS, "ref": Holder.process(os.getpid()).ref}
    leases = [
        {
            "gpu_uuid": gpu.uuid,
            "driver": "an-older-client",
            "sandbox_id": sandbox_id,
            "session_id": "",
            "holder": holder,
            "mode": "exclusive",
            "acquired_at": time.time(),
        }
        for gpu in held
    ]
    driver.host.leases.leases()  # makes this user's file, with the protocol's mode
    fd = os.open(driver.host.leases.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if (text := os.read(fd, 1 << 20).strip()) and json.loads(text).get("leases"):
            pytest.skip("the registry holds leases already")
        written = os.pwrite(fd, json.dumps({"version": 1, "leases": leases}).encode(), 0)
        os.ftruncate(fd, written)
    finally:
        os.close(fd)
    try:
        for gpu in held if driver.capabilities.exact_ids else ():
            exact = SandboxSpec.with_gpus(
                driver=driver.name, device_ids=[driver.device_ids(gpu)[0]]
            )
            with pytest.raises(GpuBusy):
                sandboxes(exact)
        assert uuids(sandboxes(SandboxSpec.with_gpus())) == [free.uuid], (
            "a version-1 lease file holds every GPU but one for a live process"
        )
        with pytest.raises(GpusExhausted):
            sandboxes(SandboxSpec.with_gpus())
    finally:
        driver.host.leases.release(sandbox_id)


@contextmanager
def _opened_directory(path: Path) -> Iterator[int]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


LOCK_HELD_S = 1.0
"""How long the test holds the registry's lock while a create waits for it."""


@pytest.mark.requirement("GPU-HOSTWIDE-01")
def test_a_create_waits_while_another_client_holds_the_registry_lock(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """Every grant MUST hold flock on the registry's directory: none while another client does."""
    # flock and POSIX record locks (lockf, fcntl F_SETLK) do not see each other on Linux: a
    # driver that locks the file another way races every other client of the protocol.
    driver.host.leases.leases()  # makes the registry's directory, with the protocol's mode
    with (
        _opened_directory(driver.host.leases.directory) as registry,
        ThreadPoolExecutor(1) as pool,
    ):
        fcntl.flock(registry, fcntl.LOCK_EX)
        creating = pool.submit(sandboxes, SandboxSpec.with_gpus())
        done, _ = wait([creating], timeout=LOCK_HELD_S)
        fcntl.flock(registry, fcntl.LOCK_UN)
        assert not done, (
            f"a GPU was granted ({creating.result()!r}) while another client held the "
            f"registry's flock on {driver.host.leases.directory}"
        )
        assert len(creating.result().gpus) == 1
