"""Time a catalogue lane: ``pytest conformance`` in a fresh process, as a user runs it."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parent.parent


@dataclass(frozen=True)
class LaneRun:
    seconds: float
    returncode: int
    output: str

    def verdict(self, driver: str) -> str:
        """The verdict line of ``driver``, or the end of the output when there is none."""
        lines = [line for line in self.output.splitlines() if line.startswith(f"{driver}: ")]
        return lines[-1] if lines else self.output[-800:]


def time_lane(*options: str) -> LaneRun:
    """One run of the catalogue with ``options`` (``--driver=vm``, ``--sim-root=...``)."""
    argv = [
        sys.executable, "-m", "pytest", str(ROOT / "conformance"), "-q", "-p", "no:cacheprovider",
        *options,
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    return LaneRun(time.perf_counter() - start, done.returncode, done.stdout)
