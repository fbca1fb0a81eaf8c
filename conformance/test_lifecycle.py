"""GPUs come back: on close, when a sandbox is killed, from outside too, when its creator dies.

Every way a sandbox ends is ``conformance.endings``'s.
"""

from __future__ import annotations

import pytest

from conformance.dimensions import declared
from conformance.endings import CLOSE, CREATOR, IDS, KILLED, end
from conformance.fixtures import Dropped, SandboxFactory
from conformance.hold import HeldSandbox
from conformance.observe import retake, specs_for_all_gpus, uuids
from conformance.settings import Settings
from drivers.base import Driver
from gpuhost.errors import GpusExhausted
from gpuhost.spec import SandboxSpec

BIGGEST = "the biggest request, every other GPU held meanwhile"
DIMENSIONS = {
    "GPU-RELEASE-01": declared(
        how_it_ends=(CLOSE, "its close() again, once another sandbox holds its GPUs"),
        what_it_held=("every GPU, in as few sandboxes as the driver allows", "one GPU"),
    ),
    "GPU-RECLAIM-01": declared(how_it_ends=KILLED, what_it_held=(BIGGEST,)),
    "GPU-RECLAIM-02": declared(how_it_ends=(CREATOR,), what_it_held=(BIGGEST,)),
}


@pytest.mark.requirement("GPU-RELEASE-01")
def test_close_releases_and_is_idempotent(
    driver: Driver, sandboxes: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing a sandbox MUST release its GPUs; closing it again MUST change nothing."""
    # Released once it is gone, not while it still runs and could use them: where the driver
    # leases through the host registry, each release is checked as it happens.
    released_while_running: list[str] = []
    release = driver.host.leases.release

    def release_once_gone(sandbox_id: str) -> int:
        if sandbox_id in driver.sandboxes(driver.session_id):
            released_while_running.append(sandbox_id)
        return release(sandbox_id)

    monkeypatch.setattr(driver.host.leases, "release", release_once_gone)
    for _ in range(2):
        taken = [sandboxes(spec) for spec in specs_for_all_gpus(driver)]
        for sandbox in taken:
            sandbox.close()
            assert sandbox.id not in driver.sandboxes(driver.session_id), (
                f"close of sandbox {sandbox.id} returned while it still exists"
            )
            assert sandbox.id not in released_while_running, (
                f"close of sandbox {sandbox.id} released its GPUs {uuids(sandbox)} while the "
                "sandbox still ran"
            )
    monkeypatch.undo()
    first = sandboxes(SandboxSpec.with_gpus())
    first.close()
    second = sandboxes(SandboxSpec.with_gpus())
    first.close()  # again: must not release what `second` holds
    assert len(driver.inventory()) < 2 or not set(uuids(second)) & set(
        uuids(sandboxes(SandboxSpec.with_gpus()))
    ), "closing a sandbox twice released a GPU another sandbox holds"
    if len(driver.inventory()) == 1:
        with pytest.raises(GpusExhausted):
            sandboxes(SandboxSpec.with_gpus())


def _biggest_request(driver: Driver) -> SandboxSpec:
    return specs_for_all_gpus(driver)[0]


def _take_the_other_gpus(driver: Driver, sandboxes: SandboxFactory) -> None:
    """Hold every GPU still free: only the GPUs that come back can serve the next request.

    Nothing to take when the biggest request took them all; a driver that gives a sandbox
    fewer GPUs than the host has (a VM takes one) leaves the others free.
    """
    for _ in driver.inventory():
        try:
            sandboxes(SandboxSpec.with_gpus())
        except GpusExhausted:
            return


@pytest.mark.requirement("GPU-RECLAIM-01")
@pytest.mark.parametrize("way", KILLED, ids=[IDS[way] for way in KILLED])
def test_killed_sandbox_gpus_are_reclaimed(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings, dropped: Dropped, way: str
) -> None:
    """The GPUs of a sandbox SIGKILLed by its driver or from outside MUST go to the next request."""
    # From outside: the host kills its init, or its outermost host process, or the kernel's
    # OOM killer its init; its driver is told nothing of it.
    spec = _biggest_request(driver)
    victim = sandboxes(spec)
    _take_the_other_gpus(driver, sandboxes)
    if not end(way, victim, sandboxes, dropped):
        return
    successor = retake(
        lambda: sandboxes(spec),
        settings.reclaim_timeout_s,
        f"the GPUs of sandbox {victim.id} ({', '.join(uuids(victim))}) to come back after {way}",
    )
    assert set(uuids(successor)) & set(uuids(victim)), (
        f"the sandbox ended by {way} held {uuids(victim)}; the next request got {uuids(successor)}"
    )
    assert victim.id not in driver.sandboxes(driver.session_id), (
        f"the sandbox {victim.id} ended by {way} still exists, yet its GPUs were handed out again"
    )
    # Closing the dead sandbox gives back nothing of what its successor now holds.
    victim.close()
    with pytest.raises(GpusExhausted):
        sandboxes(SandboxSpec.with_gpus())


@pytest.mark.requirement("GPU-RECLAIM-02")
def test_gpus_of_a_dead_creator_are_reclaimed(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """The GPUs of a sandbox whose creating process died MUST go to the next request."""
    spec = _biggest_request(driver)
    with HeldSandbox.start(driver, settings, spec) as creator:
        reply = creator.go()
        assert reply["ok"], f"the creating process could not take GPUs: {reply}"
        _take_the_other_gpus(driver, sandboxes)
        creator.kill()
    successor = retake(
        lambda: sandboxes(spec),
        settings.reclaim_timeout_s,
        "the GPUs of a sandbox whose creator was killed to come back",
    )
    assert set(uuids(successor)) & set(reply["gpus"])
    assert reply["sandbox"] not in driver.sandboxes(driver.session_id), (
        f"sandbox {reply['sandbox']} outlived its creator, yet its GPUs were handed out again"
    )
