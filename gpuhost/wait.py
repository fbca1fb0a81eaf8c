"""Bounded waiting with a diagnostic: every wait in the suite goes through ``wait_until``.

A wait that lasts says so: after ``PROGRESS_AFTER_S`` a line on stderr names what it is
waiting for and for how long, repeated at most every ``PROGRESS_EVERY_S``. Short waits,
which are nearly all of them, print nothing.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO, TypeVar

T = TypeVar("T")

PROGRESS_AFTER_S = 2.0
"""Creating, reaping and probing take milliseconds; two seconds means something is slow."""
PROGRESS_EVERY_S = 5.0
"""Often enough to show the run is alive, rarely enough not to flood a CI log."""
FIRST_INTERVAL_S = 0.001
"""A wait looks again after a millisecond, then twice as late each time, up to its interval:
most things waited for are done within milliseconds, and a fixed 50 ms would wait out most
of an interval each time for nothing."""


def intervals(cap_s: float) -> Iterator[float]:
    """How long a wait sleeps between looks: from a millisecond, doubling, up to ``cap_s``."""
    interval = min(FIRST_INTERVAL_S, cap_s)
    while True:
        yield interval
        interval = min(interval * 2, cap_s)


class Progress:
    """Prints ``waiting for <what> (<n> s)`` to stderr once a wait has lasted, throttled.

    Call ``tick()`` on each round of a wait; it prints only when a line is due.
    """

    def __init__(
        self,
        what: str,
        *,
        after_s: float = PROGRESS_AFTER_S,
        every_s: float = PROGRESS_EVERY_S,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.every_s = every_s
        self.stream = stream
        self.clock = clock
        self.start = clock()
        self.due = self.start + after_s

    def tick(self) -> None:
        now = self.clock()
        if now < self.due:
            return
        stream = self.stream or sys.stderr  # looked up late: pytest swaps sys.stderr
        print(f"waiting for {self.what} ({now - self.start:.0f} s)", file=stream, flush=True)
        self.due = now + self.every_s


def wait_until(
    attempt: Callable[[], T],
    *,
    retry_on: tuple[type[BaseException], ...],
    timeout_s: float,
    what: str,
    hint: str = "",
    interval_s: float = 0.05,
) -> T:
    """Call ``attempt`` until it returns without raising one of ``retry_on``.

    Only the errors named are retried: any other is raised at once. ``what`` completes
    "waiting for ...". Raises ``TimeoutError`` naming ``what``, the time waited, the last
    error and ``hint`` (what to look at); says on stderr what it waits for once it lasts.
    ``interval_s`` is the longest sleep between attempts (``intervals``).
    """
    progress = Progress(what)
    sleeps = intervals(interval_s)
    while True:
        try:
            return attempt()
        except retry_on as exc:
            elapsed = progress.clock() - progress.start
            if elapsed >= timeout_s:
                raise TimeoutError(
                    f"gave up waiting for {what} after {elapsed:.1f} s "
                    f"(last error: {type(exc).__name__}: {exc})"
                    + (f". Hint: {hint}" if hint else "")
                ) from exc
        progress.tick()
        time.sleep(next(sleeps))


def wait_for(
    observe: Callable[[], T],
    done: Callable[[T], bool],
    *,
    timeout_s: float,
    what: str,
    hint: str = "",
    interval_s: float = 0.05,
) -> T:
    """Observe until ``done(observed)``; return what was observed last.

    Raises ``TimeoutError`` naming ``what``, the time waited, the last observation and
    ``hint``. Errors of ``observe`` are not retried: they are raised at once. ``interval_s``
    is the longest sleep between looks (``intervals``).
    """
    progress = Progress(what)
    sleeps = intervals(interval_s)
    while True:
        observed = observe()
        if done(observed):
            return observed
        elapsed = progress.clock() - progress.start
        if elapsed >= timeout_s:
            raise TimeoutError(
                f"gave up waiting for {what} after {elapsed:.1f} s (last seen: {observed!r})"
                + (f". Hint: {hint}" if hint else "")
            )
        progress.tick()
        time.sleep(next(sleeps))
