"""``kill_group``: the one way a process group is ended, with or without a grace."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from gpuhost.procfs import marked_processes
from gpuhost.spawn import kill_group


def group(tmp_path: Path, script: str) -> tuple[subprocess.Popen[bytes], bytes]:
    """A shell running ``script`` in a group of its own, marked; once its child has started."""
    ready = tmp_path / "ready"
    env = {"PATH": os.environ["PATH"], "KILL_GROUP_TEST": tmp_path.name}
    process = subprocess.Popen(
        ["sh", "-c", script.format(ready=ready)], start_new_session=True, env=env
    )
    deadline = time.monotonic() + 10
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists(), "the group never started"
    return process, f"KILL_GROUP_TEST={tmp_path.name}".encode()


def test_without_a_grace_every_member_is_killed_at_once(tmp_path: Path) -> None:
    process, needle = group(tmp_path, "trap '' TERM; sleep 60 & touch {ready}; wait")
    start = time.monotonic()
    kill_group(process.pid)
    assert process.wait(5) == -9
    _none_left(needle)
    assert time.monotonic() - start < 1


def test_a_group_that_goes_on_sigterm_is_not_waited_for(tmp_path: Path) -> None:
    process, needle = group(tmp_path, "sleep 60 & touch {ready}; wait")
    start = time.monotonic()
    kill_group(process.pid, grace_s=10, wait=process.wait)
    assert process.returncode == -15
    assert time.monotonic() - start < 5
    _none_left(needle)


def test_what_ignores_sigterm_gets_sigkill_after_the_grace(tmp_path: Path) -> None:
    process, needle = group(tmp_path, "trap '' TERM; sleep 60 & touch {ready}; wait")
    start = time.monotonic()
    kill_group(process.pid, grace_s=0.5)
    took = time.monotonic() - start
    assert process.wait(5) == -9
    assert 0.5 <= took < 5
    _none_left(needle)


def test_the_group_is_killed_after_its_leader_went(tmp_path: Path) -> None:
    """The leader ends on SIGTERM; a member that ignores it is still killed."""
    script = "(trap '' TERM; exec sleep 60) & touch {ready}; wait"
    process, needle = group(tmp_path, script)
    kill_group(process.pid, grace_s=10, wait=process.wait)
    assert process.returncode == -15
    _none_left(needle)


@pytest.mark.parametrize("grace_s", [0.0, 0.5])
def test_a_group_already_gone_is_no_error(tmp_path: Path, grace_s: float) -> None:
    process, _ = group(tmp_path, "touch {ready}")
    process.wait(5)
    kill_group(process.pid, grace_s)


def _none_left(needle: bytes) -> None:
    deadline = time.monotonic() + 5
    while marked_processes(needle) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert marked_processes(needle) == []
