"""The pace that bounds each create, exec and close: what counts in it, and what does not."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from conformance.bounds import SLACK_S, SLOWEST_FACTOR, DriverPace, Pace
from conformance.hold import HeldSandbox


def test_a_call_past_its_bound_fails_naming_what_it_waited_for() -> None:
    pace = Pace("d", "create", grace_s=0.0)
    pace.call("create of a", lambda: time.sleep(0.05))
    pace.slowest_s = 0.0  # the bound is then the margin alone
    release = threading.Event()
    late: list[str] = []

    def made_once_released() -> str:
        release.wait()
        return "made"

    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"d driver's create of b did not return"):
        pace.call("create of b", made_once_released, if_late=late.append)
    assert SLACK_S <= time.monotonic() - start < SLACK_S + 2
    release.set()
    threading.Event().wait(0.2)
    assert late == ["made"], "what a create gives after the test gave up is handed back"


def test_calls_side_by_side_count_once_and_raise_each_others_bound() -> None:
    pace = Pace("d", "create", grace_s=1.0)
    barrier = threading.Barrier(4)

    def create() -> None:
        barrier.wait()
        time.sleep(0.4)

    threads = [threading.Thread(target=pace.call, args=("c", create)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert pace.slowest_s is not None
    assert pace.slowest_s < 0.2, "four side by side: each counts as a quarter of its time"
    pace.in_flight = 3
    assert pace.bound_s() == pytest.approx(SLOWEST_FACTOR * pace.slowest_s * 3 + 1.0 + SLACK_S)


def test_unpaced_and_late_calls_leave_the_pace_alone() -> None:
    pace = Pace("d", "create", grace_s=0.0)
    pace.call("c", lambda: None)
    fast = pace.slowest_s
    pace.call("c", lambda: time.sleep(0.3), paced=False)
    assert pace.slowest_s == fast
    pace.slowest_s = 0.0
    with pytest.raises(pytest.fail.Exception):
        pace.call("c", lambda: time.sleep(SLACK_S + 0.5))
    assert pace.abandoned == 1
    pace.call("c", lambda: time.sleep(0.3))  # beside a late call: may have waited on it
    assert pace.slowest_s == 0.0
    threading.Event().wait(1.0)
    assert pace.abandoned == 0


def test_an_exec_is_bounded_past_its_own_timeout_and_a_first_close_by_the_creates() -> None:
    pace = DriverPace("d", grace_s=2.0)
    pace.create.slowest_s = 1.0
    assert pace.exec.bound_s(own_timeout_s=10.0) == pytest.approx(10 + 3.0 + 2.0 + SLACK_S)
    assert pace.close.bound_s() == pytest.approx(3.0 + 2.0 + SLACK_S)
    pace.close.slowest_s = 2.0
    assert pace.close.bound_s() == pytest.approx(6.0 + 2.0 + SLACK_S)


def test_lanes_sharing_the_machine_multiply_the_pace_and_say_so() -> None:
    """Side by side (``conformance.lanes``), another lane may start and slow every call."""
    pace = DriverPace("d", grace_s=2.0, lanes_at_once=2)
    pace.create.slowest_s = 1.0
    assert pace.create.bound_s() == pytest.approx(SLOWEST_FACTOR * 2 + 2.0 + SLACK_S)
    assert pace.exec.bound_s(own_timeout_s=10.0) == pytest.approx(10 + 6.0 + 2.0 + SLACK_S)
    late = pace.create.late("create of a", 13.0, 0.0, "")
    assert late.endswith("; the slowest times the 2 lanes at once)")


def test_a_holders_bound_keeps_the_creates_that_were_in_flight_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four holders told to go at once: the last, read when the others replied, ran beside them.

    Its bound is not one create's alone (3 x 0.5 + 5 = 6.5 s), which it outlasts.
    """
    pace = Pace("d", "create", grace_s=0.0)
    pace.slowest_s = 0.5
    holders = []
    for seconds in (0.1, 0.1, 0.1, 8.0):
        process = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; sys.stdin.readline(); "
             f"time.sleep({seconds}); print('{{\"ok\": true}}', flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        holder = HeldSandbox(process, "create", pace)
        monkeypatch.setattr(holder, "_ready", True)
        holder.send_go()
        holders.append(holder)
    try:
        assert [holder.result() for holder in holders] == [{"ok": True}] * 4
    finally:
        for holder in holders:
            holder.kill()
