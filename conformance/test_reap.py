"""Reap: a session's sandboxes and leases, gone, from any process; nothing of another's."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from conformance.dimensions import declared
from conformance.fixtures import Dropped
from conformance.hold import HeldSandbox, reap_from_a_fresh_process
from conformance.observe import (
    SIDE_BY_SIDE,
    assert_all_gpus_grantable,
    specs_for_gpus,
    uuids,
    visible_gpu_uuids,
)
from conformance.settings import Settings
from drivers.base import SESSION_ID, Driver, Sandbox
from gpuhost.devices import GpuDevice
from gpuhost.leases import SHARED, Holder, LeaseOwner
from gpuhost.spec import SandboxSpec

NEIGHBOURS: dict[str, Callable[[str], str]] = {
    "id0": lambda session: f"{session}0",
    "id.1": lambda session: f"{session}.1",
    "id-retry": lambda session: f"{session}-retry",
    "id_2": lambda session: f"{session}_2",
    "ID": str.upper,
    "pre-id": lambda session: f"pre-{session}",
    "id with its '.' another character": lambda session: session.replace(".", "x"),
    "id cut at its last '.'": lambda session: session.rpartition(".")[0],
}
"""The ids of sessions beside a reaped one (``id``) that a matcher could take for it: one it
begins (a prefix, then a digit), one of a word boundary after it (``\\bid\\b``: '.', '-'),
one of '_' after it (a word character), the same in another case (label values are
case-sensitive), one it ends, one a pattern reading its '.' as any character matches, and
one it begins with. Session ids are Kubernetes label values: each of these is one."""
NEIGHBOUR_FORMS = tuple(NEIGHBOURS)


def reaped_session(prefix: str) -> str:
    """A session id of its own, with lower-case letters and a '.' for the neighbours to vary."""
    return f"{prefix}-{time.time_ns()}.a"


DIMENSIONS = {
    "SANDBOX-REAP-01": declared(
        reaped_from=(
            "the creating process",
            "a fresh process, its creator stopped",
            "a fresh process, its creator killed",
        ),
        of_the_session=(
            "a sandbox with a GPU",
            "a sandbox without",
            "the lease of a creator stopped between taking a GPU and starting its sandbox",
        ),
        neighbour_session=NEIGHBOUR_FORMS,
        kept=(
            "each neighbour's sandbox",
            "each neighbour's lease of the driver's",
            "a neighbour's GPU, in use",
            "another registry client's lease in the reaped session",
        ),
    )
}


class _Neighbours:
    """A sandbox in each neighbour session of ``session``, and, where asked, a lease of each."""

    def __init__(self, driver: Driver, session: str) -> None:
        self.ids = {form: make(session) for form, make in NEIGHBOURS.items()}
        bad = {form: nid for form, nid in self.ids.items() if not SESSION_ID.fullmatch(nid)}
        assert not bad, f"neighbours of session {session} that are no session ids: {bad}"
        assert len({session, *self.ids.values()}) == len(self.ids) + 1, self.ids
        self.drivers = {
            form: type(driver)(driver.host, nid, driver.image) for form, nid in self.ids.items()
        }
        self.made: dict[str, Sandbox] = {}
        self.with_gpu: str | None = None
        self.gpu_leases: list[str] = []
        self.leases: dict[str, str] = {}
        """form → the sandbox id of the lease planted for its session in the driver's name."""

    def create(self, gpu_for: str | None) -> None:
        """One sandbox per neighbour session, ``gpu_for``'s with a GPU, side by side."""

        def make(form: str) -> Sandbox:
            spec = SandboxSpec.with_gpus() if form == gpu_for else SandboxSpec()
            return self.drivers[form].create(spec)

        with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
            tried = {form: pool.submit(make, form) for form in self.ids}
        for form, attempt in tried.items():
            if attempt.exception() is None:
                self.made[form] = attempt.result()
        for attempt in tried.values():
            attempt.result()
        if gpu_for is not None:
            self.with_gpu = gpu_for
            self.gpu_leases = _leases_of(self.drivers[gpu_for], self.made[gpu_for].id)

    def plant_leases(self, driver: Driver, gpu: GpuDevice) -> None:
        """A lease in the driver's name in each neighbour session, all sharing one GPU.

        As another process's sandbox of that session holds it: alive, and the driver's.
        """
        for form, nid in self.ids.items():
            sandbox_id = f"{nid}-planted"
            owner = LeaseOwner(driver.name, sandbox_id, nid, Holder.process(os.getpid()))
            driver.host.leases.acquire(
                [gpu], owner, exact=[gpu], mode=SHARED, share_limit=len(self.ids) + 1
            )
            self.leases[form] = sandbox_id

    def taken(self, driver: Driver) -> list[str]:
        """What a reap of another session took of the neighbours: a line per form."""
        held = {lease.sandbox_id for lease in driver.host.leases.leases()}
        found = []
        for form, nid in self.ids.items():
            lost = []
            if form in self.made and self.drivers[form].sandboxes(nid) != [self.made[form].id]:
                lost.append(f"its sandbox {self.made[form].id}")
            if form in self.leases and self.leases[form] not in held:
                lost.append(f"its lease {self.leases[form]}")
            if form == self.with_gpu:
                kept = self.made[form]
                if _leases_of(driver, kept.id) != self.gpu_leases:
                    lost.append(f"the leases of sandbox {kept.id}")
                if visible_gpu_uuids(kept) != uuids(kept):
                    lost.append(f"the GPU of sandbox {kept.id}")
            if lost:
                found.append(f"{form} (session {nid}): {', '.join(lost)}")
        return found

    def end(self, driver: Driver) -> None:
        for sandbox_id in self.leases.values():
            driver.host.leases.release(sandbox_id)
        for sandbox in self.made.values():
            sandbox.close()  # harmless after a reap took it
        for form, each in self.drivers.items():
            each.reap(self.ids[form])


@contextlib.contextmanager
def _beside(driver: Driver, session: str) -> Iterator[_Neighbours]:
    neighbours = _Neighbours(driver, session)
    try:
        yield neighbours
    finally:
        neighbours.end(driver)


@pytest.mark.requirement("SANDBOX-REAP-01")
def test_reap_leaves_nothing_of_the_session(driver: Driver, dropped: Dropped) -> None:
    """Reaping a session MUST leave none of its sandboxes and leases, and all of the others'."""
    # Nor of a session whose id is another form of the reaped one's: "1" is not "10", "1.1",
    # "1-retry" or "pre-1"; nor another registry client's lease in the reaped session itself.
    session = reaped_session("reap")
    other = type(driver)(driver.host, session, driver.image)
    client = LeaseOwner("gpu-lease", f"{session}-client", session, Holder.process(os.getpid()))
    gpus = len(driver.inventory())
    made: list[Sandbox] = []
    with _beside(driver, session) as neighbours:
        try:
            made += [other.create(SandboxSpec.with_gpus()), other.create(SandboxSpec())]
            assert len(other.sandboxes(session)) == 2
            # The neighbours' leases, and the client's, share one GPU; one neighbour holds
            # another whole, in use. Each where the host has a GPU to spare for it.
            free = driver.host.leases.free(driver.inventory())
            if free:
                neighbours.plant_leases(driver, free[0])
                driver.host.leases.acquire(
                    [free[0]], client, exact=[free[0]], mode=SHARED, share_limit=len(NEIGHBOURS) + 1
                )
            else:
                dropped(
                    "a lease of the driver's in each neighbour session, and another client's "
                    "in the reaped session",
                    f"{_gpus(gpus)}: none to spare beside the reaped session's",
                )
            if len(free) >= 2:
                neighbours.create(gpu_for=NEIGHBOUR_FORMS[0])
            else:
                dropped(
                    "a neighbour session's sandbox holding a GPU, in use",
                    f"{_gpus(gpus)}: none left for it beside the reaped session's and the leases",
                )
                neighbours.create(gpu_for=None)
            other.reap(session)
            assert other.sandboxes(session) == []
            taken = neighbours.taken(driver)
            assert not taken, (
                f"reaping session {session} took what sessions of other ids hold: "
                + "; ".join(taken)
            )
            if free:
                still = {lease.sandbox_id for lease in driver.host.leases.leases()}
                assert client.sandbox_id in still, (
                    f"reaping the {driver.name} sandboxes of session {session} dropped the "
                    f"lease of another client of the host registry in that session "
                    f"({client.driver})"
                )
        finally:
            # Whatever failed above, nothing of this test's is left to fail the tests after it.
            driver.host.leases.release(client.sandbox_id)
            for sandbox in made:
                sandbox.close()  # harmless after reap or close
            other.reap(session)
    assert_all_gpus_grantable(driver, after=f"reaping session {session}")


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


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
    session = reaped_session("reap-fresh")
    theirs = type(driver)(driver.host, session, driver.image)
    # All GPUs but one: the one left for what a creator stopped half-way leaves.
    spec = specs_for_gpus(driver, max(1, len(driver.inventory()) - 1))[0]
    with (
        _beside(driver, session) as neighbours,
        HeldSandbox.start(theirs, settings, spec) as held,
    ):
        # A process that never knew them must not take the sessions beside either.
        neighbours.create(gpu_for=None)
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
            taken = neighbours.taken(driver)
            assert not taken, (
                f"reaping session {session} from a fresh process took what sessions of other "
                "ids hold: " + "; ".join(taken)
            )
        finally:
            held.kill()
    assert_all_gpus_grantable(driver, after=f"reaping session {session} afresh")


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
