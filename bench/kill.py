"""``python -m bench.kill`` (``make bench-kill``): how long a kill at an exec's timeout takes.

SANDBOX-EXEC-01 bounds an exec whose command outlives its timeout by the timeout plus
``SLOWEST_FACTOR`` round trips of ``true`` on the same sandbox, with no fixed slack. Here,
for each driver, in one sandbox: a command deaf to every signal it may ignore (its child
escaped into a session of its own, as the catalogue's is) given 0.5 s, and ``true``, in
turn run by run so that both see the same machine load. Printed per driver: the median and
slowest time past the timeout, the median round trip, and the room the bound leaves
(3 round trips less the slowest kill: below zero, the requirement fails on this machine
whenever its round trip is measured in a quiet moment).

``--driver`` (repeatable) names drivers as ``--driver`` does for pytest; by default the
reference driver and the example drivers behind the jsonl protocol in Python and in Go
(where ``make gosandbox`` built it). Runs on a simulated 1-GPU host of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from drivers import get_driver_class
from drivers.contract import ExecTimeout, SandboxSpec
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig

ROOT = Path(__file__).parent.parent
EXAMPLES = ROOT / "examples" / "drivers"
TIMEOUT_S = 0.5
ROUND_TRIPS_ALLOWED = 3
"""What SANDBOX-EXEC-01 allows a kill past the timeout, alone on the machine
(conformance.bounds.kill_bound_s; a bench stands below the catalogue's floor)."""
DEAF = [
    "sh", "-c",
    "trap '' HUP INT QUIT TERM; setsid sleep 61.25 & while :; do echo x; sleep 0.2; done",
]  # fmt: skip


def default_drivers() -> list[str]:
    drivers = ["reference", f"exec:{EXAMPLES / 'jsonl-jail.yaml'}"]
    if (EXAMPLES / "gosandbox" / "gosandbox").is_file():
        drivers.append(f"exec:{EXAMPLES / 'gosandbox' / 'driver.yaml'}")
    return drivers


def timed(call: Callable[[], object]) -> float:
    start = time.monotonic()
    with contextlib.suppress(ExecTimeout):
        call()
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kill", description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--driver", action="append", dest="drivers", metavar="NAME")
    args = parser.parse_args(argv)
    names = args.drivers or default_drivers()
    kills: dict[str, list[float]] = {name: [] for name in names}
    trips: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        sim = simulated.setup(Path(tmp) / "sim", 1)
        try:
            host = GpuHost.open(HostConfig(sim.root))
            drivers = {name: get_driver_class(name)(host, "bench-kill") for name in names}
            sandboxes = {name: driver.create(SandboxSpec()) for name, driver in drivers.items()}
            try:
                for _ in range(args.runs):
                    for name, sandbox in sandboxes.items():
                        deaf = functools.partial(sandbox.exec, DEAF, timeout=TIMEOUT_S)
                        kills[name].append(timed(deaf) - TIMEOUT_S)
                        trips[name].append(timed(functools.partial(sandbox.exec, ["true"])))
            finally:
                for sandbox in sandboxes.values():
                    sandbox.close()
        finally:
            simulated.teardown(sim.root)
    print(f"a deaf command given {TIMEOUT_S:g} s, {args.runs} runs; ms")
    print(f"{'driver':40}{'past, median':>14}{'slowest':>9}{'true':>7}{'room':>7}")
    for name in names:
        room = ROUND_TRIPS_ALLOWED * statistics.median(trips[name]) - max(kills[name])
        label = name if len(name) <= 38 else "..." + name[-35:]
        print(
            f"{label:40}{statistics.median(kills[name]) * 1000:14.1f}"
            f"{max(kills[name]) * 1000:9.1f}{statistics.median(trips[name]) * 1000:7.1f}"
            f"{room * 1000:7.1f}"
        )
    print("(room: the bound with the median round trip, less the slowest kill)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
