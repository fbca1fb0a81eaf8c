"""Host-wide exclusivity: GPUs held through the host's lease registry by anyone are not free.

Who holds is a dimension of its own (conformance/holders.py): the lease protocol's client
in POSIX sh; a holder of a kind that is no process (as an engine's container is); a sandbox
another process made; the driver's own sandbox of another session; another user's lease
file, written by the Python client and by the sh client; a holder of a kind nobody can
judge. Each holds GPUs on its own, on the smallest host it can (one GPU: held, asked for,
refused); beside free GPUs where the host has them. Holders that are gone hold nothing: a
zombie, a process of an earlier boot, a pid another process has now. And while another
client holds the registry's lock, however long, nothing is granted.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from pathlib import Path
from uuid import uuid4

import pytest

from conformance.bounds import unpaced
from conformance.dimensions import declared
from conformance.fixtures import Dropped, SandboxFactory
from conformance.holders import (
    GONE,
    GONE_HOLDERS,
    HOLDERS,
    LOCK_HOLDERS,
    MUST_HOLD,
    CannotHold,
    Place,
)
from conformance.observe import create_side_by_side, uuids, visible_gpu_uuids
from conformance.settings import Settings
from drivers.base import Driver, Sandbox
from gpuhost.devices import GpuDevice
from gpuhost.errors import DriverError, GpuAllocationError, GpuBusy, GpusExhausted
from gpuhost.leases import PROCESS, Holder, boot_id
from gpuhost.spec import SandboxSpec

REQUESTS = ("default", "a count", "exact", "exact beside a free GPU")
"""What is asked while a holder holds: each is refused what is held, and gets what is free."""
GONE_REQUESTS = ("default", "a count of every GPU", "exact")
"""What is asked while every GPU is leased to a holder that is gone: each is granted."""
HOSTS = ("one GPU: held, then asked for", "free GPUs beside held ones")
"""What of the host the holders' test tries: a one-GPU host shows the first only."""
CUT_SHORT = (
    "cut short, last written before this boot: holds nothing",
    "cut short, written in this boot: stops every grant, naming the file",
)
"""A lease file a writer left half written (a power loss, a kill in the middle of a write)."""
LEASE_FILES = ("version 4, every client's", "version 1, an older client's (no boot_id)", *CUT_SHORT)
LOCK_WAIT_BOUND_S = 60.0
"""The longest a client may wait for the registry's lock before it gives up
(docs/lease-protocol.md): the create that waits for it is bounded by its pace and this."""

DIMENSIONS = {
    "GPU-HOSTWIDE-01": declared(
        **{
            "who holds": MUST_HOLD,
            "who held, now gone": GONE,
            "who holds the lock": LOCK_HOLDERS,
            "request": REQUESTS,
            "request, the holder gone": GONE_REQUESTS,
            "lease file": LEASE_FILES,
            "host": HOSTS,
        }
    )
}


def _exact(driver: Driver, *gpus: GpuDevice) -> SandboxSpec:
    ids = [driver.device_ids(gpu)[0] for gpu in gpus]
    return SandboxSpec.with_gpus(len(ids), driver=driver.name, device_ids=ids)


def _refused(
    sandboxes: SandboxFactory, spec: SandboxSpec, error: type[Exception], asked: str
) -> None:
    """``spec`` is refused with ``error``; granted, the test fails saying what ``asked`` got."""
    __tracebackhide__ = True
    try:
        sandbox = sandboxes(spec)
    except error:
        return
    pytest.fail(f"{asked} got {uuids(sandbox)}, not {error.__name__}", pytrace=False)


def _close(sandboxes: SandboxFactory) -> None:
    for sandbox in list(sandboxes.open):
        sandbox.close()


@pytest.mark.exclusive
@pytest.mark.gpus(1)
@pytest.mark.requirement("GPU-HOSTWIDE-01")
@pytest.mark.parametrize("who", MUST_HOLD)
def test_gpus_held_through_the_host_registry_are_never_granted(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped, who: str
) -> None:
    """GPUs held by any other client of the host registry MUST never be granted, by any request."""
    inventory = driver.inventory()
    # Every other GPU (not only the lowest), one free at least where there are two.
    wanted = list(inventory[::2]) if len(inventory) > 1 else list(inventory)
    with ExitStack() as holding:
        try:
            held = holding.enter_context(HOLDERS[who](Place(settings, driver), wanted))
        except CannotHold as exc:
            dropped(who, str(exc))
            return
        held_ids = {gpu.uuid for gpu in held}
        free = [gpu for gpu in inventory if gpu.uuid not in held_ids]
        if not free:
            dropped(HOSTS[1], f"needs 2 GPUs; the host has {len(inventory)}")
        for request in REQUESTS:
            _ask(request, driver, sandboxes, held, free, who)
            _close(sandboxes)


def _ask(
    request: str,
    driver: Driver,
    sandboxes: SandboxFactory,
    held: list[GpuDevice],
    free: list[GpuDevice],
    who: str,
) -> None:
    """Ask for GPUs by ``request`` while ``who`` holds ``held``: refused those, given ``free``."""
    __tracebackhide__ = True
    held_ids = sorted(gpu.uuid for gpu in held)
    holds = f"{who} holds {held_ids}"
    most = driver.capabilities.max_gpus_per_sandbox
    if request == "default":  # side by side, every free GPU, then none is left
        got: list[str] = []
        for sandbox in create_side_by_side(sandboxes, [SandboxSpec.with_gpus()] * len(free)):
            got += uuids(sandbox)
            seen = visible_gpu_uuids(sandbox)
            assert not set(seen) & set(held_ids), f"{holds}; a default sandbox sees {seen}"
        assert not set(got) & set(held_ids), f"{holds}; default requests got {got}"
        _refused(sandboxes, SandboxSpec.with_gpus(), GpusExhausted, f"{holds}; a default request")
    elif request == "a count":  # every free GPU at once; one more than are free is refused
        if count := min(len(free), most):
            together = uuids(sandboxes(SandboxSpec.with_gpus(count)))
            assert not set(together) & set(held_ids), f"{holds}; a count of {count} got {together}"
            _close(sandboxes)
        if len(free) < most:
            more = SandboxSpec.with_gpus(len(free) + 1)
            _refused(sandboxes, more, GpusExhausted, f"{holds}; a count of {len(free) + 1}")
    elif not driver.capabilities.exact_ids:
        return
    elif request == "exact":
        for gpu in held:
            _refused(sandboxes, _exact(driver, gpu), GpuBusy, f"{holds}; {gpu.describe()} asked")
    elif free:  # exact beside a free one: refused whole, taking nothing
        if most >= 2:
            for gpu in held:
                pair = f"{holds}; {gpu.describe()} asked beside {free[0].describe()}"
                _refused(sandboxes, _exact(driver, free[0], gpu), GpuBusy, pair)
        still = uuids(sandboxes(_exact(driver, free[0])))
        assert still == [free[0].uuid], f"{holds}; {free[0].describe()} alone got {still}"


@pytest.mark.gpus(1)
@pytest.mark.requirement("GPU-HOSTWIDE-01")
@pytest.mark.parametrize("who", GONE)
def test_leases_of_holders_that_are_gone_hold_nothing(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, who: str
) -> None:
    """A registry lease whose holder is gone MUST hold nothing: every request is granted."""
    inventory = list(driver.inventory())
    for request in GONE_REQUESTS:
        # Every GPU leased to the holder that is gone, afresh for each request: the first
        # grant that judges them drops them all.
        with GONE_HOLDERS[who](Place(settings, driver), inventory):
            try:
                _granted(request, driver, sandboxes, inventory)
            except GpuAllocationError as exc:
                pytest.fail(
                    f"every GPU is leased to {who}, who holds nothing; a request ({request}) "
                    f"was refused: {exc}",
                    pytrace=False,
                )
        _close(sandboxes)


def _granted(
    request: str, driver: Driver, sandboxes: SandboxFactory, inventory: list[GpuDevice]
) -> None:
    """``request`` is granted, every GPU being leased to a holder that is gone."""
    __tracebackhide__ = True
    if request == "default":
        got = uuids(sandboxes(SandboxSpec.with_gpus()))
        assert len(got) == 1, f"a default request got {got}"
    elif request == "a count of every GPU":
        count = min(len(inventory), driver.capabilities.max_gpus_per_sandbox)
        got = uuids(sandboxes(SandboxSpec.with_gpus(count)))
        assert len(set(got)) == count, f"a count of {count} got {got}"
    elif driver.capabilities.exact_ids:
        last = inventory[-1]  # not the lowest
        got = uuids(sandboxes(_exact(driver, last)))
        assert got == [last.uuid], f"{last.describe()} asked for; got {got}"


@pytest.mark.gpus(1)
@pytest.mark.requirement("GPU-HOSTWIDE-01")
def test_a_lease_file_of_an_older_client_holds_its_gpus(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A version-1 lease file (no boot_id) is the running boot's: its live leases MUST hold."""
    # Written over the registry's file, so only on a simulated host, whose registry is the
    # run's own; a real host's registry is never written but through the protocol.
    if driver.host.simulated is None:
        pytest.skip("needs a simulated host: it writes the lease registry's file itself")
    inventory = driver.inventory()
    # Every GPU but the first; on a one-GPU host, that one.
    held = inventory[1:] or inventory
    free = [gpu for gpu in inventory if gpu not in held]
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
            v1 = f"a version-1 file holds {gpu.describe()}; asked for by its ID"
            _refused(sandboxes, _exact(driver, gpu), GpuBusy, v1)
        got = [
            uuids(sandbox)
            for sandbox in create_side_by_side(sandboxes, [SandboxSpec.with_gpus()] * len(free))
        ]
        assert sorted(uuid for gpus in got for uuid in gpus) == sorted(gpu.uuid for gpu in free), (
            f"a version-1 lease file holds {[gpu.uuid for gpu in held]} for a live process; "
            f"defaults got {got}"
        )
        v1 = "a version-1 file holds every GPU the defaults did not get; one default more"
        _refused(sandboxes, SandboxSpec.with_gpus(), GpusExhausted, v1)
    finally:
        driver.host.leases.release(sandbox_id)


@pytest.mark.gpus(1)
@pytest.mark.requirement("GPU-HOSTWIDE-01")
@pytest.mark.parametrize("when", CUT_SHORT)
def test_a_lease_file_cut_short_is_judged_by_when_it_was_written(
    driver: Driver, sandboxes: SandboxFactory, when: str
) -> None:
    """A lease file cut short MUST hold nothing if written before this boot, else stop grants."""
    if driver.host.simulated is None:
        pytest.skip("needs a simulated host: it writes the lease registry's file itself")
    inventory = list(driver.inventory())
    holder = {"kind": PROCESS, "ref": Holder.process(os.getpid()).ref}
    document = json.dumps({
        "version": 4, "boot_id": boot_id(), "leases": [
            {"gpu_uuid": gpu.uuid, "driver": "a-writer-cut-short", "sandbox_id": "cut",
             "session_id": "", "holder": holder, "mode": "exclusive", "acquired_at": 0.0}
            for gpu in inventory
        ],
    }).encode()  # fmt: skip
    path = driver.host.leases.path
    driver.host.leases.leases()  # makes this user's file, with the protocol's mode
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if (text := os.read(fd, 1 << 20).strip()) and json.loads(text).get("leases"):
            pytest.skip("the registry holds leases already")
        os.ftruncate(fd, os.pwrite(fd, document[: len(document) // 2], 0))
        if when == CUT_SHORT[0]:
            # An hour before this boot, told by /proc/uptime, not by the driver's host layer.
            earlier = time.time() - float(Path("/proc/uptime").read_text().split()[0]) - 3600
            os.utime(fd, (earlier, earlier))
    finally:
        os.close(fd)
    try:
        if when == CUT_SHORT[0]:
            for request in GONE_REQUESTS:
                try:
                    _granted(request, driver, sandboxes, inventory)
                except GpuAllocationError as exc:
                    pytest.fail(f"{path}, {when}; a request ({request}) was refused: {exc}")
                _close(sandboxes)
        else:
            # Granted, it fails as DID NOT RAISE; refused without naming the file, unmatched.
            with pytest.raises((RuntimeError, DriverError), match=re.escape(str(path))):
                sandboxes(SandboxSpec.with_gpus())
    finally:
        os.truncate(path, 0)  # an empty file holds nothing


@contextmanager
def _locked_directory(path: Path) -> Iterator[None]:
    """``flock(LOCK_EX)`` on the registry's directory, as another client takes it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@pytest.mark.gpus(1)
@pytest.mark.requirement("GPU-HOSTWIDE-01")
@pytest.mark.parametrize("who", LOCK_HOLDERS)
def test_nothing_is_granted_while_another_client_holds_the_registry_lock(
    driver: Driver, sandboxes: SandboxFactory, who: str
) -> None:
    """Every grant MUST hold flock on the registry's directory: none while another client does."""
    # The lock is held until the create gives up, however long it waits: a client that takes
    # the lock from its holder after any time grants meanwhile. The protocol's clients wait
    # 30 s, then fail naming the holder.
    # flock and POSIX record locks (lockf, fcntl F_SETLK) do not see each other on Linux: a
    # driver that locks the file another way races every other client of the protocol.
    directory = driver.host.leases.directory
    driver.host.leases.leases()  # makes the registry's directory, with the protocol's mode

    def create() -> Sandbox:
        with unpaced(LOCK_WAIT_BOUND_S):  # it waits for the lock; bounded all the same
            return sandboxes(SandboxSpec.with_gpus())

    with ThreadPoolExecutor(1) as pool:
        with _locked_directory(directory):
            start = time.monotonic()
            creating = pool.submit(create)
            wait([creating])
            held_s = time.monotonic() - start
        refusal = creating.exception()
        if refusal is not None and not isinstance(refusal, Exception):
            raise refusal  # past its bound: the failure says so
        assert refusal is not None, (
            f"a GPU was granted ({creating.result()!r}) while another client held the "
            f"registry's flock on {directory}, {held_s:.1f} s into its hold (who holds the "
            f"lock: {who})"
        )
    assert len(sandboxes(SandboxSpec.with_gpus()).gpus) == 1, "the lock given back, none granted"
