"""A container exec's timeout bounds a command the engine starts only after it fired.

Under load, an engine may start an exec's process later than a short timeout: the timeout
must still kill it, not find nothing once and let it run (seen with podman, a 0.5 s timeout
on a 12 s command, under `make test-stress`).
"""

from __future__ import annotations

import os
import subprocess
import time

from drivers.container.sandbox import ExecTimer
from gpuhost.procfs import EXEC_MARKER_ENV, exec_marker


def test_a_fired_timeout_kills_what_starts_after_it() -> None:
    marker, needle = exec_marker()
    timer = ExecTimer(0.1, needle)
    timer.start()
    try:
        time.sleep(0.5)  # fired, and found nothing to kill
        assert timer.fired
        late = subprocess.Popen(["sleep", "30"], env={**os.environ, EXEC_MARKER_ENV: marker})
        try:
            assert late.wait(timeout=5) == -9, "the late command was not killed"
        finally:
            late.kill()
            late.wait()
    finally:
        timer.cancel()
        timer.join(5)
    assert not timer.is_alive(), "the timeout kept scanning after the exec returned"
