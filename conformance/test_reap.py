"""Reap: a session's sandboxes and leases, gone, from any process; nothing of another's."""

from __future__ import annotations

import os
import time

import pytest

from conformance.hold import HeldSandbox, reap_from_a_fresh_process
from conformance.observe import (
    assert_all_gpus_grantable,
    specs_for_gpus,
    uuids,
    visible_gpu_uuids,
)
from conformance.settings import Settings
from drivers.base import Driver, Sandbox
from gpuhost.leases import Holder, LeaseOwner
from gpuhost.spec import SandboxSpec


@pytest.mark.requirement("SANDBOX-REAP-01")
def test_reap_leaves_nothing_of_the_session(driver: Driver) -> None:
    """Reaping a session MUST leave none of its sandboxes and leases, and all of the others'."""
    # Not even of a session whose id starts with the reaped one's: run "1" is not run "10".
    session = f"reap-{time.time_ns()}"
    other = type(driver)(driver.host, session, driver.image)
    neighbour = type(driver)(driver.host, f"{session}0", driver.image)
    # Another client of the host registry, in the same session: not the driver's to reap.
    client = LeaseOwner("gpu-lease", f"{session}-client", session, Holder.process(os.getpid()))
    made: list[Sandbox] = []
    try:
        # With a GPU where the host has one to spare for the reaped session's own.
        kept = neighbour.create(
            SandboxSpec.with_gpus() if len(driver.inventory()) >= 2 else SandboxSpec()
        )
        made.append(kept)
        kept_leases = _leases_of(driver, kept.id)
        made += [other.create(SandboxSpec.with_gpus()), other.create(SandboxSpec())]
        assert len(other.sandboxes(session)) == 2
        free = driver.host.leases.free(driver.inventory())
        theirs = driver.host.leases.acquire(free, client, count=1) if free else ()
        other.reap(session)
        assert other.sandboxes(session) == []
        assert neighbour.sandboxes(neighbour.session_id) == [kept.id], (
            f"reaping session {session} took the sandbox of session {neighbour.session_id}"
        )
        assert _leases_of(driver, kept.id) == kept_leases, (
            f"reaping session {session} took the leases of session {neighbour.session_id}"
        )
        assert visible_gpu_uuids(kept) == uuids(kept), f"reaping session {session} took a GPU"
        still = {lease.gpu_uuid for lease in driver.host.leases.leases()}
        assert {gpu.uuid for gpu in theirs} <= still, (
            f"reaping the {driver.name} sandboxes of session {session} dropped the lease of "
            f"another client of the host registry in that session ({client.driver})"
        )
        driver.host.leases.release(client.sandbox_id)
        kept.close()
        assert_all_gpus_grantable(driver, after=f"reaping session {session}")
    finally:
        # Whatever failed above, nothing of this test's is left to fail the tests after it.
        driver.host.leases.release(client.sandbox_id)
        for sandbox in made:
            sandbox.close()  # harmless after reap or close
        for each in (other, neighbour):
            each.reap(each.session_id)


def _leases_of(driver: Driver, sandbox_id: str) -> list[str]:
    """A sandbox's leases in the host registry (none, for a driver that leases elsewhere)."""
    return sorted(
        lease.describe() for lease in driver.host.leases.leases() if lease.sandbox_id == sandbox_id
    )


@pytest.mark.requirement("SANDBOX-REAP-01")
@pytest.mark.parametrize("creator", ["stopped", "killed"])
def test_reap_from_a_fresh_process_after_the_creator_crashed(
    driver: Driver, settings: Settings, creator: str
) -> None:
    """Reap MUST find a session's sandboxes from a process that created none of them."""
    session = f"reap-fresh-{time.time_ns()}"
    theirs = type(driver)(driver.host, session, driver.image)
    # All GPUs but one: the one left for what a creator stopped half-way leaves.
    spec = specs_for_gpus(driver, max(1, len(driver.inventory()) - 1))[0]
    with HeldSandbox.start(theirs, settings, spec) as held:
        reply = held.go()
        assert reply["ok"], f"the creating process could not make its sandbox: {reply}"
        if creator == "stopped":
            _half_made(driver, session, held.process.pid, reply["gpus"])
            held.stop()
        else:
            held.kill()
        try:
            reap_from_a_fresh_process(driver, settings.host_config, session)
            left = driver.sandboxes(session)
            assert left == [], f"reaped from a fresh process, session {session} still has {left}"
            leases = driver.host.leases.leases()
            kept = [lease.describe() for lease in leases if lease.session_id == session]
            assert kept == [], f"reaped from a fresh process, session {session} still has {kept}"
            assert_all_gpus_grantable(driver, after=f"reaping session {session} afresh")
        finally:
            held.kill()


def _half_made(driver: Driver, session: str, creator_pid: int, gpus: list[str]) -> None:
    """The lease a creator stopped between taking a GPU and starting its sandbox leaves.

    Only for a driver that leases through the host registry (its sandbox's leases, on
    ``gpus``, are there: they must name the session, or no reap finds such a lease), and
    where a GPU is still free.
    """
    taken = [lease for lease in driver.host.leases.leases() if lease.gpu_uuid in gpus]
    for lease in taken:
        assert lease.session_id == session, (
            f"the lease of {lease.describe()} names session {lease.session_id!r}, not "
            f"{session!r}: a reap of the session after a crash cannot find it"
        )
    free = driver.host.leases.free(driver.inventory())
    if not taken or not free:
        return
    owner = LeaseOwner(
        taken[0].driver, f"{session}-half-made", session, Holder.process(creator_pid)
    )
    driver.host.leases.acquire(free, owner, count=1)
