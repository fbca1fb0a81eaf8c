"""``python -m bench.stress`` (``make test-stress``): the self-tests, again and again, under load.

Runs ``make test`` ``--runs`` times, each in a fresh clone of this checkout with ``CI=true``
(as CI does) unless ``--in-place``, while the machine is loaded by a CPU hog per core and
by a loop of conformance runs against the container engines, each on a simulated host of
its own (``--sim-gpus``). It reports how many runs passed, the tests that failed, by name
and count, and how many of the loop's runs passed, and exits non-zero when any run failed.

The engines must already run (``make engines``); the loop is left out without them. So must
the local cluster (``make cluster``): a ``make test`` stops the engines and the cluster it
started itself, and runs side by side must not stop what the others still use.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lane import ROOT

HOG = "import os, sys\nwhile os.getppid() == int(sys.argv[1]): pass"
"""Burns a core until stopped, or until the stress run that started it (argv[1]) is gone."""


@dataclass
class LoadLoop:
    """Conformance runs against the engines, one after the other, until halted."""

    python: str
    outcomes: list[int] = field(default_factory=list)
    _halted: bool = False
    _current: subprocess.Popen[bytes] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self) -> None:
        argv = [
            self.python, "-m", "pytest", str(ROOT / "conformance"), "--driver=docker,podman",
            "--sim-gpus=8", "-p", "no:cacheprovider", "-q", "--no-header",
        ]  # fmt: skip
        while True:
            with self._lock:
                if self._halted:
                    return
                self._current = start_group(argv, cwd=ROOT, stdout=subprocess.DEVNULL)
            code = self._current.wait()
            if not self._halted:
                self.outcomes.append(code)

    def halt(self) -> None:
        """Stop the loop, interrupting the run in progress."""
        with self._lock:
            self._halted = True
            current = self._current
        if current is not None:
            stop_group(current)


@contextlib.contextmanager
def load(hogs: int, engines: bool) -> Iterator[LoadLoop | None]:
    """CPU hogs, and the conformance loop when ``engines``; all stopped on the way out."""
    burners = [subprocess.Popen([sys.executable, "-c", HOG, str(os.getpid())]) for _ in range(hogs)]
    loop = LoadLoop(sys.executable) if engines else None
    thread = threading.Thread(target=loop.run, daemon=True) if loop else None
    if thread:
        thread.start()
    try:
        yield loop
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
        if loop and thread:
            loop.halt()
            thread.join()


def failed_tests(junit: Path) -> list[str]:
    """Test ids that failed or errored in a JUnit XML report; [] when there is none."""
    if not junit.is_file():
        return ["(no JUnit report: the run ended before pytest wrote it)"]
    names = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            names.append(f"{case.get('classname')}::{case.get('name')}")
    return names


def one_run(number: int, workdir: Path, in_place: bool) -> tuple[int, float, list[str]]:
    """``make test`` once; returns its exit code, its wall time and the failed tests."""
    tree = ROOT
    if not in_place:
        tree = workdir / f"clone-{number}"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(tree)], check=True)
    junit = workdir / f"run-{number}.xml"
    log = workdir / f"run-{number}.log"
    env = {**os.environ, "CI": "true", "PYTEST_ARGS": f"--junitxml={junit}"}
    start = time.monotonic()
    with log.open("wb") as out:
        code = run_as_group(["make", "test"], cwd=tree, env=env, stdout=out)
    elapsed = time.monotonic() - start
    if not in_place and code == 0:
        shutil.rmtree(tree, ignore_errors=True)
    failed = failed_tests(junit) if code else []
    if code and not failed:
        failed = [f"(make test exited {code} outside pytest: see {log})"]
    return code, elapsed, failed


def start_group(argv: list[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a process group of its own, its stderr with its stdout."""
    return subprocess.Popen(argv, start_new_session=True, stderr=subprocess.STDOUT, **popen)


def run_as_group(argv: list[str], **popen: Any) -> int:
    """Run ``argv`` in a process group of its own; the group is stopped on an exception."""
    process = start_group(argv, **popen)
    try:
        return process.wait()
    except BaseException:
        stop_group(process)
        raise


def stop_group(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Interrupt a process group as Ctrl-C does, then kill what is left after ``grace_s``.

    Interrupted, pytest tears its fixtures down: the sandboxes of the run are closed.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def engines_answer() -> bool:
    try:
        return all(
            subprocess.run(argv, capture_output=True, check=False).returncode == 0
            for argv in (["docker", "info"], ["podman", "--remote", "info"])
        )
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stress", description=__doc__)
    parser.add_argument("--runs", type=int, default=10, help="make test runs (default 10)")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="CPU hogs")
    parser.add_argument("--no-loop", action="store_true", help="no conformance loop")
    parser.add_argument("--in-place", action="store_true", help="run in this checkout")
    parser.add_argument("--workdir", type=Path, help="keep clones, logs and reports here")
    args = parser.parse_args(argv)
    # Terminated, it stops its load and the run in progress, as on Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-sandbox-stress-"))
    workdir.mkdir(parents=True, exist_ok=True)
    engines = not args.no_loop and engines_answer()
    print(
        f"{args.runs} runs of `CI=true make test` "
        f"({'in place' if args.in_place else 'each in a fresh clone'}), beside {args.hogs} CPU "
        f"hogs{' and a conformance loop against docker and podman' if engines else ''}; "
        f"logs in {workdir}",
        flush=True,
    )
    results = []
    flaky: collections.Counter[str] = collections.Counter()
    with load(args.hogs, engines) as loop:
        for number in range(1, args.runs + 1):
            code, elapsed, failed = one_run(number, workdir, args.in_place)
            results.append(code)
            flaky.update(failed)
            verdict = "passed" if code == 0 else f"FAILED ({len(failed)} tests)"
            print(f"run {number}: {verdict} in {elapsed:.0f} s", flush=True)
            for name in failed:
                print(f"    {name}", flush=True)
    passed = results.count(0)
    print(f"make test: {passed}/{len(results)} runs passed")
    if loop is not None:
        print(
            f"conformance loop (docker, podman): {loop.outcomes.count(0)}/{len(loop.outcomes)} "
            "runs passed"
        )
    if flaky:
        print("tests that failed, with the number of runs they failed in:")
        for name, count in flaky.most_common():
            print(f"  {count}  {name}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
