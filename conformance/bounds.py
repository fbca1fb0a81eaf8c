"""Every create the catalogue makes is bounded: a driver that never returns fails by name.

A driver that waits for a GPU to free instead of refusing a request it cannot grant would
otherwise hold each test until the per-test bound (900 s), with no requirement named, and a
run of the catalogue would take hours. The bound follows the driver's own pace: a few times
the slowest create of its lane so far, plus the grace it declares for a refusal
(``Driver.exhaustion_grace_s``), times the creates in flight at once (side by side, they
share the host). A create past it fails the test, saying what it waited for; if it returns
later, what it made is closed at once, so that nothing it took is held behind the run's back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import pytest

from drivers.base import Driver, Sandbox
from gpuhost.spec import SandboxSpec

FIRST_CREATE_BOUND_S = 300.0
"""Before any create of a lane returned: a VM's first boot may build its template."""
SLOWEST_FACTOR = 3.0
SLACK_S = 5.0
"""For a loaded CI machine: a bound is never less than this over the slowest create."""


class CreateBound:
    """The pace of one driver's creates in this run, and the bound it gives the next one."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.slowest_s: float | None = None
        self.in_flight = 0
        self._lock = threading.Lock()

    def bound_s(self) -> float:
        with self._lock:
            if self.slowest_s is None:
                return FIRST_CREATE_BOUND_S
            each = SLOWEST_FACTOR * self.slowest_s + self.grace_s + SLACK_S
            return each * max(1, self.in_flight)

    def call(self, create: Callable[[Driver, SandboxSpec], Sandbox], driver: Driver,
             spec: SandboxSpec) -> Sandbox:  # fmt: skip
        """``create(driver, spec)``, failing the test once it runs past the bound."""
        __tracebackhide__ = True
        outcome: Future[Sandbox] = Future()
        abandoned = threading.Event()

        def run() -> None:
            try:
                sandbox = create(driver, spec)
            except BaseException as exc:
                outcome.set_exception(exc)
                return
            if abandoned.is_set():  # the test gave up on it: keep nothing it took
                sandbox.close()
            outcome.set_result(sandbox)

        with self._lock:
            self.in_flight += 1
        start = time.monotonic()
        try:
            threading.Thread(target=run, daemon=True, name="bounded-create").start()
            bound = self.bound_s()
            # The bound grows while other creates join: wait for it as it is now.
            while not outcome.done():
                waited = time.monotonic() - start
                if waited >= bound:
                    abandoned.set()
                    pytest.fail(
                        f"the {driver.name} driver's create of {spec.to_dict()} did not return "
                        f"within {bound:.1f} s ({SLOWEST_FACTOR:g} x its slowest create of "
                        f"this run, {self.slowest_s or 0:.1f} s, plus its grace of "
                        f"{self.grace_s:g} s and {SLACK_S:g} s, per create in flight): a "
                        "request it cannot grant must be refused, not waited on",
                        pytrace=False,
                    )
                try:
                    outcome.exception(timeout=min(bound - waited, 1.0))
                except TimeoutError:
                    bound = max(bound, self.bound_s())
            sandbox = outcome.result()
        finally:
            with self._lock:
                self.in_flight -= 1
        took = time.monotonic() - start
        with self._lock:
            self.slowest_s = max(self.slowest_s or 0.0, took)
        return sandbox
