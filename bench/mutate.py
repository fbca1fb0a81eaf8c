"""``python -m bench.mutate`` (``make mutate``): how many mutants of the code the catalogue kills.

A seeded sample of cosmic-ray's mutants (bench/mutants.py) of the reference driver and the
host layer's grant, lease, liveness, validation and uid modules, each run against the whole
catalogue on a simulated host (``pytest conformance --driver=reference ... -x -n 2``):

- killed: the catalogue failed (``-x``: it stops at the first failing test, named here);
- timed out: it ran past the per-mutant timeout (a multiple of the unmutated run's time);
- survived: it passed; each survivor is triaged in bench/mutants.yaml, as equivalent (with
  the reason) or as a hole (the requirement whose test should catch it, and the case it
  does not try); a survivor that is neither fails the run, and so does a score under
  ``--fail-under``.

The score is (killed + timed out) / (sampled - equivalent - not run). Each test that killed
a mutant is then run once more on the unmutated tree: a kill by a test that fails there too
is not counted.

Mutants are written to a copy of the tree (its git files: tracked, and untracked but not
ignored) in a directory of this process's own under the temporary directory, and the
catalogue runs there with that copy first on ``PYTHONPATH``: the catalogue's own process,
its holders (``python -m conformance.hold``, which hand their ``sys.path`` on) and every
other Python process it starts import the mutant. The tree itself is never written, so
that no interruption, not even SIGKILL, can leave a mutated file in it; the copy is removed
at the end, on SIGINT, SIGTERM and SIGHUP, and otherwise by the next run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from bench import mutants as mx
from bench.mutation_report import Result, print_report, score_failures
from gpuhost.liveness import process_start_time

ROOT = Path(__file__).resolve().parent.parent
MODULES = (
    "drivers/reference.py",
    "drivers/reference_sandbox.py",
    "gpuhost/grants.py",
    "gpuhost/leases.py",
    "gpuhost/liveness.py",
    "gpuhost/validation.py",
    "gpuhost/uids.py",
)
CATALOGUE = (
    "-m", "pytest", "conformance", "--driver=reference", "--sim-gpus=8",
    "--sim-mig=0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb", "--sim-dri=intel:1,amd:2",
    "-x", "-n", "2", "-p", "no:cacheprovider", "-q",
)  # fmt: skip
SEED = 42
PER_MODULE = 3
"""Sized so that ``make mutate`` ends within 40 minutes on 2 cores (docs/catalogue.md)."""
BUDGET_S = 40 * 60.0
"""No mutant is started once the run is this old, less one unmutated run's time."""
TIMEOUT_FACTOR = 3.0
MIN_TIMEOUT_S = 60.0
STOP_GRACE_S = 20.0
"""How long a stopped catalogue run has to end its sandboxes and simulated host after SIGINT."""
COPY_PREFIX = "gpu-sandbox-mutate."
REPORT = ROOT / "reports" / "mutate.json"
_NODE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
_GROUP = re.compile(r"@[\w.-]+$")


class Interrupted(BaseException):
    """A signal that ends the run: the copy is removed and the catalogue stopped first."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(frozen=True)
class Run:
    """One run of the test command: its exit status (None: timed out), time, output."""

    returncode: int | None
    seconds: float
    output: str
    failed: tuple[str, ...] = field(default=())


# -- the copy -----------------------------------------------------------------------------------


@contextlib.contextmanager
def copied(root: Path) -> Iterator[Path]:
    """The tree's git files, copied to a directory of this process's own, removed after."""
    remove_stale_copies()
    me = os.getpid()
    copy = Path(tempfile.mkdtemp(prefix=f"{COPY_PREFIX}{me}.{process_start_time(me)}."))
    try:
        git = ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others"]
        listed = subprocess.run([*git, "--exclude-standard"], capture_output=True, check=True)
        names = {n for n in listed.stdout.decode().split("\0") if n}
        for name in sorted(names):
            source = root / name
            if not source.exists() and not source.is_symlink():
                continue  # deleted in the work tree, not yet in git
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name, follow_symlinks=False)
        yield copy
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def remove_stale_copies() -> list[Path]:
    """Remove this user's copies of runs whose process is gone (a run killed by SIGKILL)."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{COPY_PREFIX}*"):
        pid, started, *_ = [*path.name.removeprefix(COPY_PREFIX).split("."), "", ""]
        try:
            alive = process_start_time(int(pid)) == started
        except (OSError, ValueError, IndexError):
            alive = False
        st = path.lstat()
        if not alive and stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def applied(copy: Path, made: mx.Made) -> Iterator[Path]:
    """``made`` written over its module in ``copy``, the original back after."""
    path = copy / made.mutant.module
    original = path.read_bytes()
    try:
        _drop_bytecode(path)
        path.write_text(made.source)
        yield path
    finally:
        path.write_bytes(original)
        _drop_bytecode(path)


def _drop_bytecode(path: Path) -> None:
    for cached in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        cached.unlink(missing_ok=True)


# -- running ------------------------------------------------------------------------------------


def environment(copy: Path) -> dict[str, str]:
    """The test command's environment: the copy first on ``PYTHONPATH``."""
    paths = [str(copy), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def imported_from(copy: Path, modules: Sequence[str]) -> dict[str, str]:
    """Where a process started as the test command is imports each of ``modules`` from."""
    names = [m.removesuffix(".py").replace("/", ".") for m in modules]
    code = (
        "import importlib, sys\nfor n in sys.argv[1:]: print(importlib.import_module(n).__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *names],
        cwd=copy, env=environment(copy), capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return dict(zip(modules, out, strict=True))


def run_tests(argv: Sequence[str], copy: Path, timeout_s: float) -> Run:
    """``argv`` in ``copy``, a process group of its own, stopped whole at ``timeout_s``."""
    with tempfile.TemporaryFile() as log:
        start = time.monotonic()
        process = subprocess.Popen(
            list(argv), cwd=copy, env=environment(copy), stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        returncode: int | None = None
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                returncode = process.wait(timeout_s)
        finally:
            stop(process)
        seconds = time.monotonic() - start
        log.seek(0)
        output = log.read().decode(errors="replace")
    failed = tuple(dict.fromkeys(_GROUP.sub("", n) for n in _NODE.findall(output)))
    return Run(returncode, seconds, output, failed)


def stop(process: subprocess.Popen[bytes]) -> None:
    """End ``process``'s group: SIGINT (pytest's teardown runs), then SIGKILL after a grace."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def outcome(run: Run) -> tuple[str, str]:
    """killed, timed out or survived, and what killed it."""
    if run.returncode is None:
        return "timed out", f"ran past {run.seconds:.0f} s"
    if run.returncode == 0:
        return "survived", ""
    if run.failed:
        return "killed", run.failed[0]
    return "killed", f"exit {run.returncode}, no test named: " + _last_line(run.output)


def _last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no output)"


# -- the run ------------------------------------------------------------------------------------


_ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise(signum: int, _frame: FrameType | None) -> None:
    # A second signal must not cut short the stop and the removal the first one began.
    for ending in _ENDING:
        signal.signal(ending, signal.SIG_IGN)
    raise Interrupted(signum)


def mutate(args: argparse.Namespace) -> int:
    root: Path = args.root
    modules: list[str] = args.modules
    enumerations = {m: mx.enumerate_mutants(root, m) for m in modules}
    verdicts = mx.read_triage(args.triage)
    sources = {m: (root / m).read_text() for m in modules}
    if args.only:
        named = [m for e in enumerations.values() for m in e.mutants if m.name in args.only]
        planned = [mx.make(m, sources[m.module]) for m in named]
        if len(planned) != len(set(args.only)):
            missing = set(args.only) - {m.name for m in named}
            print(f"no such mutant: {', '.join(sorted(missing))}")
            return 2
    else:
        planned = mx.interleaved(
            [mx.sample(enumerations[m], args.per_module, args.seed, sources[m]) for m in modules]
        )
    stale = mx.stale(verdicts, root, enumerations)
    for old in stale:
        print(f"stale triage ({old.kind}): {old.module} {old.function} {old.operator}: "
              f"{old.before!r} -> {old.after!r}")  # fmt: skip
    total = sum(len(e.mutants) for e in enumerations.values())
    annotations = sum(e.annotations for e in enumerations.values())
    drawn = "named" if args.only else f"seed {args.seed}, {args.per_module} a module:"
    print(f"{drawn} {len(planned)} mutants of {total} "
          f"({annotations} more in annotations, not run)")  # fmt: skip
    if args.list:
        for made in planned:
            print(f"{made.mutant.name} [{made.mutant.function}]: {made.before} -> {made.after}")
        return 0
    test_argv = [sys.executable, *CATALOGUE] if args.command is None else args.command
    started = time.monotonic()
    results: list[Result] = []
    with copied(root) as copy:
        imported = imported_from(copy, modules)
        wrong = {m: f for m, f in imported.items() if not f.startswith(f"{copy}/")}
        if wrong:
            print(f"the test command would not import the copy's modules: {wrong}")
            return 2
        baseline = run_tests(test_argv, copy, args.budget)
        print(f"unmutated: exit {baseline.returncode} in {baseline.seconds:.1f} s")
        if baseline.returncode != 0:
            print(baseline.output[-4000:])
            print("the unmutated tree fails its tests: no mutant run")
            return 2
        timeout_s = args.timeout or max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * baseline.seconds)
        print(f"per-mutant timeout {timeout_s:.0f} s")
        for index, made in enumerate(planned, 1):
            verdict = verdicts.get(made.key)
            head = f"[{index}/{len(planned)}] {made.mutant.name} [{made.mutant.function}]"
            if verdict is not None and verdict.kind == "equivalent":
                results.append(Result(made, "equivalent", 0.0, verdict.reason, verdict))
                print(f"{head}: equivalent (triaged)", flush=True)
                continue
            if time.monotonic() - started > args.budget - baseline.seconds:
                results.append(Result(made, "not run", 0.0, "the budget was spent", verdict))
                continue
            print(f"{head}: {made.before} -> {made.after}", flush=True)
            with applied(copy, made):
                run = run_tests(test_argv, copy, timeout_s)
            result, detail = outcome(run)
            results.append(Result(made, result, run.seconds, detail, verdict))
            print(f"    {result} in {run.seconds:.1f} s {detail}", flush=True)
        confirmation = _confirm(results, test_argv, copy, timeout_s)
    wall_s = time.monotonic() - started
    print_report(results, enumerations, confirmation, wall_s, baseline.seconds, timeout_s)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(
        {"seed": args.seed, "per_module": args.per_module, "wall_s": round(wall_s, 1),
         "baseline_s": round(baseline.seconds, 1), "timeout_s": round(timeout_s, 1),
         "results": [r.as_json() for r in results]}, indent=1) + "\n")  # fmt: skip
    print(f"wall time {wall_s / 60:.1f} min; each mutant in {args.report}")
    return 1 if score_failures(results, args.fail_under) or stale else 0


def _confirm(
    results: list[Result], argv: Sequence[str], copy: Path, timeout_s: float
) -> Run | None:
    """The tests that killed, run again on the unmutated copy.

    A kill by a test that fails there too is counted as a survivor (``unconfirmed``).
    """
    killers = sorted({r.detail for r in results if r.outcome == "killed" and "::" in r.detail})
    if not killers:
        return None
    run = run_tests([*argv, *killers], copy, timeout_s)
    print(f"the {len(killers)} tests that killed, on the unmutated tree: exit {run.returncode}")
    for i, result in enumerate(results):
        if result.outcome == "killed" and (run.returncode is None or result.detail in run.failed):
            results[i] = result.unconfirmed()
    return run


def _paths(text: str) -> list[str]:
    return [p for p in text.split(",") if p]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.mutate", description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    add = parser.add_argument
    add("--seed", type=int, default=SEED, help="the sample's seed (default: %(default)s)")
    add("--per-module", type=int, default=PER_MODULE, help="mutants a module (%(default)s)")
    add("--modules", type=_paths, default=list(MODULES), help="comma-separated, under the root")
    add("--timeout", type=float, default=0.0, help="seconds a mutant may run (default: 3 "
        "unmutated runs, 60 s at least)")  # fmt: skip
    add("--budget", type=float, default=BUDGET_S, help="seconds after which no mutant is "
        "started (default: %(default)s)")  # fmt: skip
    add("--fail-under", type=float, default=0.0, help="the least score, in %%")
    add("--list", action="store_true", help="list the sample; run nothing")
    only = "run this mutant (named as listed: 'gpuhost/grants.py:41 AddNot#3'), not the sample"
    add("--only", action="append", default=[], metavar="NAME", help=only)
    add("--triage", type=Path, default=mx.TRIAGE_FILE)
    add("--report", type=Path, default=REPORT)
    add("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    add("--command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    handlers = {s: signal.signal(s, _raise) for s in _ENDING}
    try:
        return mutate(args)
    except Interrupted as exc:
        print(f"interrupted ({exc}): the tree is as it was; its copy removed", flush=True)
        return 128 + exc.signum
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
