"""A pytest plugin for ``bench.profile``: when each test began and ended, one JSON line each.

Loaded with ``-p bench.timeline``; writes to the file ``GPU_SANDBOX_TIMELINE`` names.
"""

from __future__ import annotations

import json
import os
import time

TIMELINE_ENV = "GPU_SANDBOX_TIMELINE"
_began: dict[str, float] = {}


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _began[nodeid] = time.time()


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    path = os.environ.get(TIMELINE_ENV)
    if path and nodeid in _began:
        with open(path, "a", encoding="utf-8") as timeline:
            line = {"nodeid": nodeid, "start": _began.pop(nodeid), "end": time.time()}
            timeline.write(json.dumps(line) + "\n")
