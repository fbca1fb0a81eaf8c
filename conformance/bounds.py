"""Every create, exec and close the catalogue makes is bounded: a driver that hangs fails by name.

A driver that waits for a GPU to free instead of refusing a request it cannot grant, an exec
that outlives its own timeout, a close that never returns: each would otherwise hold its test
until the per-test bound (900 s), with no requirement named, and a run of the catalogue would
take hours. The bound follows the driver's own pace, one per operation: a few times the
slowest such call of its lane so far (each call's time divided by the calls in flight
beside it: side by side, they share the host), times the calls in flight now, times the
lanes sharing the machine (``--lanes-at-once``: one starting beside this one slows every
call), plus the grace the driver declares (``Driver.exhaustion_grace_s``) and a margin; an
exec's bound adds the command's own timeout. A call past its bound fails the test, saying
what it waited for; if a create returns later, what it made is closed
at once, so that nothing it took is held behind the run's back.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import NoReturn, TypeVar

FIRST_CALL_BOUND_S = 300.0
"""Before any call of a kind returned: a VM's first boot may build its template."""
SLOWEST_FACTOR = 3.0
SLACK_S = 5.0
"""For a loaded CI machine: a bound is never less than this over the slowest call."""

Result = TypeVar("Result")

_ALLOWANCE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "unpaced_allowance", default=None
)


@contextlib.contextmanager
def unpaced(allowance_s: float = 0.0) -> Iterator[None]:
    """Creates whose time is not the driver's pace, in this thread meanwhile.

    Those that may rightly wait for GPUs coming back (after a kill, a dead creator or a last
    sharer: ``allowance_s``, the reclaim timeout), and those the test expects refused: a
    driver that grants one late, once the test gave up on it, did not show its pace. Each is
    bounded by the pace and ``allowance_s`` more.
    """
    token = _ALLOWANCE.set(allowance_s)
    try:
        yield
    finally:
        _ALLOWANCE.reset(token)


def unpaced_allowance() -> float | None:
    """``unpaced``'s ``allowance_s`` where one is in force, else None."""
    return _ALLOWANCE.get()


def fail(message: str) -> NoReturn:
    """Fail the running test with ``message``, no traceback.

    pytest is imported here, not at the top: holder processes (``python -m conformance.hold``)
    import this module through ``conformance.observe``, and start 90 ms faster without it.
    """
    import pytest

    pytest.fail(message, pytrace=False)


class Pace:
    """The pace of one driver's calls of one kind in this run, and the bound of the next."""

    def __init__(
        self,
        driver: str,
        operation: str,
        grace_s: float,
        first_from: Pace | None = None,
        lanes_at_once: int = 1,
    ) -> None:
        self.driver = driver
        self.operation = operation
        self.grace_s = grace_s
        self.first_from = first_from
        """Whose pace bounds a first call of this kind: an exec's or a close's, the creates'."""
        self.lanes_at_once = lanes_at_once
        """Runs sharing the machine (``conformance.lanes --jobs``): as they start and end, a
        call may be that many times slower than the slowest so far."""
        self.slowest_s: float | None = None
        """The slowest call so far, its time divided by the calls in flight beside it."""
        self.in_flight = 0
        self.entered = 0
        """Calls begun so far: those begun during a call were beside it."""
        self.abandoned = 0
        """Calls given up on that have not returned yet: while one is pending, a call's time
        is not the driver's pace (it may have waited on what the abandoned call took)."""
        self._lock = threading.Lock()

    def bound_s(self, own_timeout_s: float = 0.0) -> float:
        with self._lock:
            slowest, in_flight = self.slowest_s, max(1, self.in_flight)
        if slowest is None and self.first_from is not None:
            slowest = self.first_from.slowest_s
        if slowest is None:
            return own_timeout_s + FIRST_CALL_BOUND_S
        factor = SLOWEST_FACTOR * in_flight * self.lanes_at_once
        return own_timeout_s + factor * slowest + self.grace_s + SLACK_S

    def call(
        self,
        what: str,
        call: Callable[[], Result],
        *,
        own_timeout_s: float = 0.0,
        if_late: Callable[[Result], object] | None = None,
        expected: str = "",
        paced: bool = True,
    ) -> Result:
        """``call()``, failing the test once it runs past the bound.

        ``what`` names the call in the failure; ``if_late`` is given the result of a call
        that returns after the test gave up on it; ``expected`` says what the driver should
        have done instead. A call that is not ``paced`` is bounded, but its time does not
        count in the pace.
        """
        __tracebackhide__ = True
        outcome: Future[Result] = Future()
        abandoned, returned = threading.Event(), threading.Event()

        def run() -> None:
            try:
                result = call()
            except BaseException as exc:
                with self._lock:
                    late = self._settle(abandoned, returned)
                outcome.set_exception(exc)
                return
            with self._lock:
                late = self._settle(abandoned, returned)
            if late and if_late is not None:
                if_late(result)
            outcome.set_result(result)

        with self._lock:
            self.in_flight += 1
            self.entered += 1
            clean = paced and self.abandoned == 0
            beside, entered = self.in_flight, self.entered
        start = time.monotonic()
        try:
            threading.Thread(target=run, daemon=True, name=f"bounded-{self.operation}").start()
            bound = self.bound_s(own_timeout_s)
            # The bound grows while other calls join: wait for it as it is now.
            while not outcome.done():
                waited = time.monotonic() - start
                with self._lock:
                    give_up = waited >= bound and not returned.is_set()
                    if give_up:
                        self.abandoned += 1
                        abandoned.set()
                if give_up:
                    fail(self.late(what, bound, own_timeout_s, expected))
                try:
                    outcome.exception(timeout=min(bound - waited, 1.0))
                except TimeoutError:
                    bound = max(bound, self.bound_s(own_timeout_s))
            result = outcome.result()
        finally:
            with self._lock:
                self.in_flight -= 1
        took = time.monotonic() - start
        with self._lock:
            if clean and self.abandoned == 0:
                beside += self.entered - entered  # those begun while it ran
                self.slowest_s = max(self.slowest_s or 0.0, took / beside)
        return result

    def started(self) -> None:
        """A call of this kind runs elsewhere (another process) from now: it shares the host."""
        with self._lock:
            self.in_flight += 1
            self.entered += 1

    def finished(self) -> None:
        with self._lock:
            self.in_flight -= 1

    def _settle(self, abandoned: threading.Event, returned: threading.Event) -> bool:
        """Under the lock: a call has returned; whether the test had given up on it."""
        returned.set()
        if abandoned.is_set():
            self.abandoned -= 1
            return True
        return False

    def late(self, what: str, bound: float, own_timeout_s: float, expected: str) -> str:
        paced = self if self.slowest_s is not None or self.first_from is None else self.first_from
        if paced.slowest_s is None:
            how = f"the bound of a first {self.operation}, {FIRST_CALL_BOUND_S:g} s"
        else:
            how = (
                f"{SLOWEST_FACTOR:g} x its slowest {paced.operation} of this run, "
                f"{paced.slowest_s:.1f} s, per {self.operation} in flight, plus its grace of "
                f"{self.grace_s:g} s and {SLACK_S:g} s"
            )
            if self.lanes_at_once > 1:
                how = f"{how}; the slowest times the {self.lanes_at_once} lanes at once"
        if own_timeout_s:
            how = f"the command's own timeout of {own_timeout_s:g} s, plus {how}"
        return f"the {self.driver} driver's {what} did not return within {bound:.1f} s ({how})" + (
            f": {expected}" if expected else ""
        )


def round_trip_s(run: Callable[[], object], tries: int = 3) -> float:
    """The slowest of ``tries`` calls of ``run``: a command that does nothing, there and back."""
    slowest = 0.0
    for _ in range(tries):
        start = time.monotonic()
        run()
        slowest = max(slowest, time.monotonic() - start)
    return slowest


def kill_bound_s(
    timeout_s: float, round_trip: float, in_flight: int = 1, lanes_at_once: int = 1
) -> float:
    """How long an exec whose command outlives ``timeout_s`` may take to return.

    Its timeout, then the kill and the return, which cost about what a command that does
    nothing costs there and back (``round_trip``, measured on the same sandbox and path):
    ``SLOWEST_FACTOR`` of them, per call in flight and per lane sharing the machine. No
    fixed slack: a driver that sends SIGTERM and waits seconds for the command to end is
    past it.
    """
    factor = SLOWEST_FACTOR * max(1, in_flight) * max(1, lanes_at_once)
    return timeout_s + factor * round_trip


@dataclass
class DriverPace:
    """One driver's pace in this run: its creates, its execs and its closes, each apart."""

    driver: str
    grace_s: float
    lanes_at_once: int = 1
    create: Pace = field(init=False)
    exec: Pace = field(init=False)
    close: Pace = field(init=False)

    def __post_init__(self) -> None:
        lanes = self.lanes_at_once
        self.create = Pace(self.driver, "create", self.grace_s, lanes_at_once=lanes)
        self.exec = Pace(
            self.driver, "exec", self.grace_s, first_from=self.create, lanes_at_once=lanes
        )
        self.close = Pace(
            self.driver, "close", self.grace_s, first_from=self.create, lanes_at_once=lanes
        )
