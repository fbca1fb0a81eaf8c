"""Exhaustion and exclusivity: more than is free fails promptly; no GPU is granted twice."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import SandboxFactory, Settings
from drivers.base import Driver, Sandbox
from drivers.errors import GpusExhausted
from drivers.hold import HeldSandbox
from drivers.spec import SandboxSpec
from drivers.testing import assert_all_gpus_grantable, uuids

EXHAUSTION_DEADLINE_S = 10.0
""""Promptly": an exhausted host must say so, not queue the request until a GPU frees up."""


def _expect_exhausted(sandboxes: SandboxFactory, count: int | None, available: int) -> None:
    __tracebackhide__ = True
    requested = 1 if count is None else count
    start = time.monotonic()
    with pytest.raises(GpusExhausted) as raised:
        sandboxes(SandboxSpec.with_gpus(count))
    elapsed = time.monotonic() - start
    assert elapsed < EXHAUSTION_DEADLINE_S, f"GpusExhausted took {elapsed:.1f} s"
    assert (raised.value.requested, raised.value.available) == (requested, available)


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-EXHAUST-01")
def test_more_than_free_fails_promptly_and_takes_nothing(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A request for more GPUs than are free MUST fail promptly with GpusExhausted."""
    total = len(driver.inventory())
    for _ in range(total - 1):
        sandboxes(SandboxSpec.with_gpus())
    if driver.capabilities.max_gpus_per_sandbox >= 2:
        _expect_exhausted(sandboxes, 2, available=1)
    # The failed request took nothing: the last free GPU is still there.
    sandboxes(SandboxSpec.with_gpus())
    _expect_exhausted(sandboxes, None, available=0)


def _assert_fair_outcome(granted: list[list[str]], errors: list[BaseException], total: int) -> None:
    __tracebackhide__ = True
    flat = [uuid for gpus in granted for uuid in gpus]
    assert len(flat) == len(set(flat)), f"a GPU was granted twice: {sorted(flat)}"
    assert len(granted) == total, f"{total} GPUs were free; {len(granted)} creates succeeded"
    wrong = [e for e in errors if not isinstance(e, GpusExhausted)]
    assert not wrong, f"losers must get GpusExhausted, got {wrong!r}"


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-CONCURRENT-01")
def test_concurrent_creates_from_threads_never_share(driver: Driver) -> None:
    """Concurrent creates from threads MUST never grant a GPU twice."""
    total = len(driver.inventory())
    contenders = 2 * total
    barrier = threading.Barrier(contenders)

    def create() -> Sandbox:
        barrier.wait()
        return driver.create(SandboxSpec.with_gpus())

    with ThreadPoolExecutor(contenders) as pool:
        futures = [pool.submit(create) for _ in range(contenders)]
    won = [f.result() for f in futures if f.exception() is None]
    try:
        lost = [e for f in futures if (e := f.exception()) is not None]
        _assert_fair_outcome([uuids(sandbox) for sandbox in won], lost, total)
    finally:
        for sandbox in won:
            sandbox.close()
    assert_all_gpus_grantable(driver, after="the concurrent creates closed")


@pytest.mark.exclusive
@pytest.mark.requirement("GPU-CONCURRENT-02")
def test_concurrent_creates_from_processes_never_share(driver: Driver, settings: Settings) -> None:
    """Concurrent creates from separate processes MUST never grant a GPU twice."""
    total = len(driver.inventory())
    holders = [
        HeldSandbox.start(driver, settings.host_config, SandboxSpec.with_gpus())
        for _ in range(2 * total)
    ]
    try:
        for holder in holders:
            holder.send_go()
        replies = [holder.result() for holder in holders]
    finally:
        for holder in holders:
            holder.close()
    granted = [reply["gpus"] for reply in replies if reply["ok"]]
    errors: list[BaseException] = [
        GpusExhausted(1, 0, total) if reply["error"] == "GpusExhausted" else RuntimeError(reply)
        for reply in replies
        if not reply["ok"]
    ]
    _assert_fair_outcome(granted, errors, total)
    assert_all_gpus_grantable(driver, after="the holder processes exited")
