"""Bounded waits: they give up with the last error, and say what they wait for when slow."""

from __future__ import annotations

import functools
import io

import pytest

from gpuhost.wait import Progress, wait_for, wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_quiet_for_short_waits_then_throttled() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress("dockerd to answer on /var/run/docker.sock", stream=out, clock=clock)
    for step in (0.5, 1.0, 1.9):
        clock.now = 100.0 + step
        progress.tick()
    assert out.getvalue() == ""
    for step in (2.0, 2.5, 4.0, 6.9, 7.0):
        clock.now = 100.0 + step
        progress.tick()
    assert out.getvalue().splitlines() == [
        "waiting for dockerd to answer on /var/run/docker.sock (2 s)",
        "waiting for dockerd to answer on /var/run/docker.sock (7 s)",
    ]


def test_wait_until_returns_the_first_success_quietly(capsys: pytest.CaptureFixture[str]) -> None:
    attempts = iter([ValueError("not yet"), ValueError("not yet"), None])

    def attempt() -> str:
        error = next(attempts)
        if error:
            raise error
        return "ready"

    ready = wait_until(
        attempt, retry_on=(ValueError,), timeout_s=5, what="the thing", interval_s=0.001
    )
    assert ready == "ready"
    assert capsys.readouterr().err == ""


def test_wait_until_reports_a_long_wait_and_gives_up_with_the_last_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("gpuhost.wait.Progress", functools.partial(Progress, after_s=0.0))

    def never() -> None:
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(TimeoutError) as excinfo:
        wait_until(
            never,
            retry_on=(ConnectionRefusedError,),
            timeout_s=0.05,
            what="the daemon",
            hint="is it running?",
            interval_s=0.01,
        )
    assert str(excinfo.value).startswith("gave up waiting for the daemon after 0.")
    assert "last error: ConnectionRefusedError: connection refused" in str(excinfo.value)
    assert str(excinfo.value).endswith(". Hint: is it running?")
    assert capsys.readouterr().err.splitlines()[0] == "waiting for the daemon (0 s)"


def test_wait_until_raises_an_error_it_was_not_told_to_retry_at_once() -> None:
    calls = []

    def broken() -> None:
        calls.append(1)
        raise KeyError("a bug, not a wait")

    with pytest.raises(KeyError):
        wait_until(broken, retry_on=(ConnectionError,), timeout_s=5, what="x", interval_s=0.001)
    assert len(calls) == 1


def test_wait_for_returns_the_observation_that_is_done() -> None:
    seen = iter([["a", "b"], ["a"], []])
    assert wait_for(lambda: next(seen), lambda left: not left, timeout_s=5, what="x") == []


def test_wait_for_gives_up_with_the_last_observation_and_a_hint() -> None:
    with pytest.raises(TimeoutError) as excinfo:
        wait_for(
            lambda: ["sandbox-1"],
            lambda left: not left,
            timeout_s=0.05,
            what="the sandboxes to exit",
            hint="kill them by hand",
            interval_s=0.01,
        )
    assert "(last seen: ['sandbox-1']). Hint: kill them by hand" in str(excinfo.value)


def test_a_wait_looks_again_after_a_millisecond_then_backs_off_to_its_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("gpuhost.wait.time.sleep", slept.append)
    looks = iter(range(10))
    assert wait_for(lambda: next(looks), lambda n: n == 9, timeout_s=60, what="n") == 9
    assert slept == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.05, 0.05, 0.05]
