"""The catalogue a lane at a time, lanes side by side, their reports merged into one run's.

    python -m conformance.lanes [--jobs N] PYTEST_ARGS...

Where the run makes a simulated host of its own (``--sim-gpus``) and names no driver, each
built-in driver is a lane: a pytest run of its own (``--lane=NAME``) with a simulated host of
its own, up to ``--jobs`` at once, the longest first. Their JSON and JUnit reports are merged
into the paths the arguments name (``--conformance-json``, ``-html``, ``-markdown``,
``--junitxml``), as one run would have written them, and each lane's output is kept in
``NAME.log`` under ``--lane-dir``. On two cores, one lane's engine waits overlap another's
work (docs/benchmarks.md, "Lanes side by side").

The lane directory is the runner's own: made 0700 (or checked to be a directory of this
user's, through a descriptor, and made 0700), its files made new through that descriptor
(``gpuhost.private``), and only what the runner's own lanes wrote there is read back: a
lane's report that is not a regular file of this user's, or not a results document of that
lane's driver alone, fails the lane by name and is never merged.

Anywhere else it is one pytest run with the same arguments: real GPUs would be shared by the
lanes (each expects the host's free GPUs to be its own), and named drivers, ``--sim-root``,
``--reap`` or ``--collect-only`` ask for one run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from conformance.render import (
    NOTHING_RAN,
    matrix_lines,
    skip_lines,
    to_markdown,
    visible,
    write,
    write_new,
)
from conformance.report import MAX_REPORT_BYTES, InvalidResults, Results
from drivers import REGISTRY
from gpuhost.private import NotPrivate, create, private_directory, read_own
from gpuhost.strict import NotStrict, parse_json

DEFAULT_JOBS = 2
LONGEST_FIRST = ("kubernetes", "vm", "docker", "podman", "reference")
"""The built-in lanes by their wall time on the gate's layout (make bench-profile); a lane
not listed (a driver added since) starts first, its time unknown."""
ONE_RUN_OPTIONS = (
    "--driver", "--sim-root", "--reap", "--collect-only", "--co", "--lane", "--lanes-at-once",
)  # fmt: skip
STOP_WAIT_S = 300.0
"""How long an interrupted lane has to remove its sandboxes before it is killed."""


@dataclass
class Lane:
    name: str
    directory: Path
    fd: int
    """The lane directory, open: every file of the lane's is made and read through it."""
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    seconds: float = 0.0
    refused: str = ""
    """Why its report was not read back, when it was not."""
    _results: list[Results | None] = field(default_factory=list)

    @property
    def driver(self) -> str:
        """The one driver its run judges."""
        return self.name

    def options(self, at_once: int) -> list[str]:
        """What its pytest run is given beside the runner's arguments and its reports."""
        return [f"--lane={self.name}", f"--lanes-at-once={at_once}"]

    @property
    def log(self) -> Path:
        return self.directory / f"{self.name}.log"

    @property
    def json(self) -> Path:
        return self.directory / f"{self.name}.json"

    @property
    def junit(self) -> Path:
        return self.directory / f"{self.name}.xml"

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.returncode

    def start(self, pytest_args: Sequence[str], env: dict[str, str], at_once: int) -> None:
        for stale in (self.json, self.junit):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale.name, dir_fd=self.fd)
        command = [
            sys.executable, "-m", "pytest", *pytest_args, *self.options(at_once),
            f"--conformance-json={self.json}", f"--junitxml={self.junit}",
            "-o", f"junit_suite_name=conformance-{self.name}",
        ]  # fmt: skip
        log = create(self.fd, self.log.name, 0o644)
        try:
            # A session of its own: a Ctrl-C reaches this runner alone, which hands each lane
            # one SIGINT, so that no second one cuts its teardown short.
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        finally:
            os.close(log)
        self.started = time.monotonic()

    def results(self) -> Results | None:
        """Its report, read back once: None (and why, in ``refused``) when there is none."""
        if not self._results:
            self._results.append(self._read())
        return self._results[0]

    def _read(self) -> Results | None:
        try:
            data = read_own(self.fd, self.json.name, MAX_REPORT_BYTES)
            results = Results.checked(parse_json(data.decode(errors="replace")))
        except FileNotFoundError:
            return None
        except (NotPrivate, NotStrict, InvalidResults) as exc:
            self.refused = f"{self.json}: {exc}"
            return None
        others = sorted({*results.drivers, *(t["driver"] for t in results.tests)} - {self.driver})
        if others:
            self.refused = f"{self.json}: results of drivers not of this lane: {', '.join(others)}"
            return None
        return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.lanes",
        description="Run the catalogue a lane (a built-in driver) at a time, lanes side by "
        "side on simulated hosts of their own, and merge their reports. Other arguments "
        "are pytest's.",
        allow_abbrev=False,
    )
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="lanes at once")
    parser.add_argument(
        "--lanes",
        help="which built-in drivers, comma-separated (default: all); each is skipped, as in "
        "one run, where it cannot run here",
    )
    parser.add_argument("--lane-dir", type=Path, help="each lane's log and reports")
    parser.add_argument("--conformance-json", type=Path)
    parser.add_argument("--conformance-html", type=Path)
    parser.add_argument("--conformance-markdown", type=Path)
    parser.add_argument("--junitxml", "--junit-xml", dest="junitxml", type=Path)
    args, pytest_args = parser.parse_known_args(None if argv is None else list(argv))
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, not {args.jobs}")
    names = [name.strip() for name in (args.lanes or ",".join(REGISTRY)).split(",")]
    if not all(name in REGISTRY for name in names):
        parser.error(f"--lanes={args.lanes}: built-in drivers are {', '.join(REGISTRY)}")
    if not _splits(pytest_args):
        if args.lanes is not None:
            parser.error(
                "--lanes: lanes are runs of their own only on a simulated host of "
                "their own (--sim-gpus), without --driver"
            )
        return _one_run(pytest_args, args)
    directory = args.lane_dir or _default_lane_dir(args)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = private_directory(directory)
    except NotPrivate as exc:
        parser.error(f"--lane-dir: {exc}")
    lanes = [Lane(name, directory, fd) for name in names]
    _say(
        f"{len(lanes)} lanes, {min(args.jobs, len(lanes))} at a time, each on a simulated "
        f"host of its own; their output in {directory}/<lane>.log"
    )
    run_lanes(lanes, pytest_args, args.jobs)
    return _report(lanes, args)


def _splits(pytest_args: Sequence[str]) -> bool:
    def given(option: str) -> bool:
        return any(arg == option or arg.startswith(f"{option}=") for arg in pytest_args)

    return given("--sim-gpus") and not any(given(option) for option in ONE_RUN_OPTIONS)


def _one_run(pytest_args: Sequence[str], args: argparse.Namespace) -> int:
    reports = [
        f"{option}={path}"
        for option, path in (
            ("--conformance-json", args.conformance_json),
            ("--conformance-html", args.conformance_html),
            ("--conformance-markdown", args.conformance_markdown),
            ("--junitxml", args.junitxml),
        )
        if path is not None
    ]
    return subprocess.call([sys.executable, "-m", "pytest", *pytest_args, *reports])


def _default_lane_dir(args: argparse.Namespace) -> Path:
    beside: Path | None = args.conformance_json or args.junitxml
    if beside is not None:
        return beside.parent / "lanes"
    return Path(tempfile.mkdtemp(prefix="gpu-sandbox-lanes-"))


def _say(line: str) -> None:
    print(f"lanes: {line}", flush=True)  # noqa: T201


def run_lanes(lanes: list[Lane], pytest_args: Sequence[str], jobs: int) -> None:
    """Run the lanes, the longest first, ``jobs`` at a time; a signal stops them all."""
    env = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}  # the runner's
    order = sorted(lanes, key=lambda lane: _rank(lane.name))
    finished: queue.Queue[Lane] = queue.Queue()
    running: list[Lane] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while order or running:
            while order and len(running) < jobs:
                lane = order.pop(0)
                lane.start(pytest_args, env, min(jobs, len(lanes)))
                running.append(lane)
                threading.Thread(target=_wait, args=(lane, finished), daemon=True).start()
            lane = finished.get()
            running.remove(lane)
            _say(_finished_line(lane))
    except KeyboardInterrupt:
        _say(f"interrupted: stopping {', '.join(lane.name for lane in running)}")
        _stop(running)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _rank(name: str) -> int:
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else -1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _wait(lane: Lane, finished: queue.Queue[Lane]) -> None:
    assert lane.process is not None
    lane.process.wait()
    lane.seconds = time.monotonic() - lane.started
    finished.put(lane)


def _stop(lanes: list[Lane]) -> None:
    """One SIGINT each (pytest then tears its sandboxes down), then a kill past the wait."""
    for lane in lanes:
        if lane.process is not None and lane.process.poll() is None:
            lane.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_WAIT_S
    for lane in lanes:
        assert lane.process is not None
        try:
            lane.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            lane.process.kill()
            _say(f"{lane.name}: killed after {STOP_WAIT_S:.0f} s; see {lane.log}")


def _finished_line(lane: Lane) -> str:
    results = lane.results()
    took = f"in {lane.seconds:.1f} s"
    if results is None:
        without = f"its report refused ({lane.refused})" if lane.refused else "without a report"
        return visible(f"{lane.name}: exit {lane.returncode} {without} {took}; see {lane.log}")
    outcomes = collections.Counter(test["outcome"] for test in results.tests)
    counts = ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items()))
    (verdict,) = results.verdicts
    return f"{lane.name}: {verdict.status} [{counts}, exit {lane.returncode}] {took}"


def _report(lanes: list[Lane], args: argparse.Namespace) -> int:
    """Merge the lanes' reports, print what one run prints at its end; the run's exit status."""
    parts = [(lane, lane.results()) for lane in lanes]
    for lane, results in parts:
        if lane.returncode != 0 or results is None:
            _print_failures(lane)
        if lane.refused:
            _say(visible(f"{lane.name}: FAILED: its report is refused, not merged: {lane.refused}"))
    reported = [results for _, results in parts if results is not None]
    merged = Results.merged(reported) if reported else None
    if merged is not None:
        write(merged, args.conformance_json, args.conformance_html, args.conformance_markdown)
        step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if args.conformance_markdown and step_summary:
            with open(step_summary, "a", encoding="utf-8") as summary:
                summary.write(to_markdown(merged))
        _print_summary(merged, reported)
    if args.junitxml:
        _merge_junit([lane for lane in lanes if not lane.refused], args.junitxml)
    codes = [lane.returncode or 0 for lane in lanes]
    if any(code not in (0, 1) for code in codes):  # interrupted, internal or usage errors
        return next(code for code in codes if code not in (0, 1))
    if any(codes) or len(reported) < len(lanes) or merged is None or merged.nothing_ran:
        return 1
    return 0


def _print_failures(lane: Lane) -> None:
    """The lane's short test summary (its failures, one a line), or its log's last lines."""
    try:
        text = read_own(lane.fd, lane.log.name, MAX_REPORT_BYTES).decode(errors="replace")
    except OSError:
        return
    lines = [visible(line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if "short test summary info" in line]
    shown = lines[starts[-1] + 1 :] if starts else lines[-30:]
    ends = [i for i, line in enumerate(shown) if line.startswith("=")] if starts else []
    shown = shown[: ends[0]] if ends else shown
    print(f"\n--- {lane.name} (exit {lane.returncode}), from {lane.log}")  # noqa: T201
    print("\n".join(shown[:60]), flush=True)  # noqa: T201


def _print_summary(results: Results, parts: list[Results]) -> None:
    # Skips by reason across the lanes: a reason that names a lane's host names it in general.
    skipped = skip_lines(
        test["message"].replace(str(part.header["host"]), "its lane's host")
        for part in parts
        for test in part.tests
        if test["outcome"] == "skipped"
    )
    lines = ["", "=== skipped, by reason ===", *skipped] if skipped else []
    lines += ["", "=== conformance by requirement ===", *matrix_lines(results)]
    lines += ["", "=== verdict ==="]
    if results.nothing_ran:
        lines.append(NOTHING_RAN)
    lines += [verdict.line for verdict in results.verdicts]
    print("\n".join(lines), flush=True)  # noqa: T201


def _merge_junit(lanes: list[Lane], path: Path) -> None:
    """One ``<testsuites>`` holding each lane's ``<testsuite>``: those its lane wrote.

    A lane's JUnit XML is read as its JSON is (a regular file of this user's in the lane
    directory), without a document type (no entity is expanded); one that is not is left
    out, named.
    """
    merged = ET.Element("testsuites", name="conformance")
    for lane in lanes:
        try:
            data = read_own(lane.fd, lane.junit.name, MAX_REPORT_BYTES)
            if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
                raise ValueError("has a document type")
            merged.extend(ET.fromstring(data).iter("testsuite"))
        except FileNotFoundError:
            continue
        except (NotPrivate, ValueError, ET.ParseError) as exc:
            _say(visible(f"{lane.name}: its JUnit XML {lane.junit} is refused: {exc}"))
    write_new(path, ET.tostring(merged, encoding="utf-8", xml_declaration=True))


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
