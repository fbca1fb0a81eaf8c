"""bench/mutate.py: mutants seen by every process the tests start; the tree never written."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench import mutate
from gpuhost.liveness import process_start_time

ROOT = Path(__file__).resolve().parent.parent.parent
MODULE = (
    "from __future__ import annotations\n\n\ndef f(x: int | None = None) -> int:\n"
    "    return 2 + 3\n"
)
# The test command imports nothing of the tree: only the process it starts does.
IN_A_CHILD = (
    "import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', "
    "'import sys, pkg.m; sys.exit(pkg.m.f() != 5)']))"
)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A git tree of one module, ``pkg/m.py``."""
    root = tmp_path / "tree"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "m.py").write_text(MODULE)
    (root / ".gitignore").write_text("ignored/\n")
    (root / "ignored").mkdir()
    (root / "ignored" / "big").write_text("not copied")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "pkg", ".gitignore"], check=True)
    who = ["-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "-C", str(root), *who, "commit", "-qm", "m"], check=True)
    return root


@pytest.fixture
def tmpdir_of_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory the runs copy the tree to, this test's own."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".git" not in p.parts
    }


def _main(tree: Path, tmp_path: Path, *args: str, command: str = IN_A_CHILD) -> dict[str, object]:
    report = tmp_path / "report.json"
    argv = ["--root", str(tree), "--modules", "pkg/m.py", "--report", str(report), *args]
    code = mutate.main([*argv, "--command", sys.executable, "-c", command])
    result: dict[str, object] = json.loads(report.read_text()) if report.exists() else {}
    result["exit"] = code
    return result


def test_a_mutant_is_seen_by_the_processes_the_test_command_starts(
    tree: Path, tmp_path: Path, tmpdir_of_runs: Path
) -> None:
    before = _files(tree)
    result = _main(tree, tmp_path, "--per-module", "100")
    outcomes = [(r["after"], r["outcome"]) for r in result["results"]]  # type: ignore[attr-defined]
    # 2 + 3 in 15 ways (the annotation's | left out): each gives another number, seen only by
    # the process the test command started, which fails.
    assert len(outcomes) == 15
    assert {o for _, o in outcomes} == {"killed"}, outcomes
    assert result["exit"] == 0
    assert _files(tree) == before
    assert list(tmpdir_of_runs.iterdir()) == []


def test_survivors_untriaged_fail_the_run_and_a_hung_mutant_times_out(
    tree: Path, tmp_path: Path, tmpdir_of_runs: Path
) -> None:
    hangs_on_six = (
        "import sys, time, pkg.m; v = pkg.m.f(); time.sleep(60) if v == 6 else sys.exit(v == 1)"
    )
    started = time.monotonic()
    result = _main(tree, tmp_path, "--per-module", "100", "--timeout", "2", command=hangs_on_six)
    assert time.monotonic() - started < 40, "the hung mutant was not stopped at its timeout"
    outcomes = {r["after"]: r["outcome"] for r in result["results"]}  # type: ignore[attr-defined]
    assert outcomes["return 2 * 3"] == "timed out"
    assert outcomes["return 2 ^ 3"] == "killed"
    assert outcomes["return 2 - 3"] == "survived"
    assert result["exit"] == 1


def test_a_triaged_equivalent_is_reported_apart_and_not_run(
    tree: Path, tmp_path: Path, tmpdir_of_runs: Path
) -> None:
    triage = tmp_path / "mutants.yaml"
    triage.write_text(
        "equivalent:\n  - {module: pkg/m.py, function: f, operator: core/NumberReplacer, "
        "before: 'return 2 + 3', after: 'return 2 + 4', reason: 'a test command blind to it'}\n"
        "holes:\n  - {module: pkg/m.py, function: f, operator: core/NumberReplacer, "
        "before: 'return 2 + 3', after: 'return 2 + 2', requirement: X-01, missing: a case}\n"
    )
    result = _main(tree, tmp_path, "--per-module", "100", "--triage", str(triage), command="pass")
    by_after = {r["after"]: r for r in result["results"]}  # type: ignore[attr-defined]
    assert by_after["return 2 + 4"]["outcome"] == "equivalent"
    assert by_after["return 2 + 4"]["seconds"] == 0
    assert (by_after["return 2 + 2"]["outcome"], by_after["return 2 + 2"]["triage"]) == (
        "survived",
        "hole",
    )
    assert result["exit"] == 1  # the other eleven survived untriaged


def test_only_runs_the_mutants_named_and_refuses_a_name_of_none(
    tree: Path, tmp_path: Path, tmpdir_of_runs: Path
) -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "bench.mutate", "--root", str(tree), "--modules", "pkg/m.py",
         "--per-module", "100", "--list"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    named = [line.split(" [")[0] for line in listed if "-> return 2 * 3" in line]
    assert len(named) == 1, listed
    result = _main(tree, tmp_path, "--only", named[0])
    assert [(r["after"], r["outcome"]) for r in result["results"]] == [  # type: ignore[attr-defined]
        ("return 2 * 3", "killed")
    ]
    assert result["exit"] == 0
    assert _main(tree, tmp_path / "none", "--only", "pkg/m.py:5 Nothing#0") == {"exit": 2}


def test_an_unmutated_tree_that_fails_runs_no_mutant(
    tree: Path, tmp_path: Path, tmpdir_of_runs: Path
) -> None:
    result = _main(tree, tmp_path, command="raise SystemExit(1)")
    assert result == {"exit": 2}
    assert list(tmpdir_of_runs.iterdir()) == []


SLEEPS_WHEN_MUTATED = (
    "import os, pathlib, time, pkg.m\n"
    "if pkg.m.f() != 5:\n"
    "    pathlib.Path(os.environ['MUTANT_RUNNING']).write_text(str(os.getpid()))\n"
    "    time.sleep(120)\n"
)


@pytest.mark.parametrize(
    "signum",
    [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL],
    ids=lambda s: signal.Signals(s).name,
)
def test_an_interrupted_run_leaves_the_tree_as_it_was(
    tree: Path, tmp_path: Path, tmpdir_of_runs: Path, signum: signal.Signals
) -> None:
    before = _files(tree)
    running = tmp_path / "running"
    argv = [
        sys.executable, "-m", "bench.mutate", "--root", str(tree), "--modules", "pkg/m.py",
        "--per-module", "1", "--timeout", "100", "--report", str(tmp_path / "r.json"),
        "--command", sys.executable, "-c", SLEEPS_WHEN_MUTATED,
    ]  # fmt: skip
    env = {**os.environ, "MUTANT_RUNNING": str(running)}
    runner = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True)
    mutant_pid = 0
    try:
        deadline = time.monotonic() + 60
        while not running.exists() or not running.read_text():
            assert runner.poll() is None, "the run ended before its mutant ran"
            assert time.monotonic() < deadline, "no mutant ran"
            time.sleep(0.05)
        mutant_pid = int(running.read_text())
        assert _files(tree) == before, "the tree itself was written"
        (copy,) = tmpdir_of_runs.iterdir()
        assert (copy / "pkg" / "m.py").read_text() != MODULE, "the copy holds no mutant"
        os.kill(runner.pid, signum)
        code = runner.wait(60)
    finally:
        if runner.poll() is None:
            runner.kill()
        if mutant_pid:
            _end(mutant_pid)
    assert _files(tree) == before
    assert not subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain"], capture_output=True, check=True
    ).stdout
    if signum == signal.SIGKILL:
        # Nothing ran to remove the copy: the next run does.
        assert [p.name for p in tmpdir_of_runs.iterdir()] == [copy.name]
        assert mutate.remove_stale_copies() == [copy]
    else:
        assert list(tmpdir_of_runs.iterdir()) == [], "the copy was left behind"
        assert not Path(f"/proc/{mutant_pid}").exists(), "the mutant's test run outlived it"
        assert code == 128 + signum
    assert list(tmpdir_of_runs.iterdir()) == []


def _end(pid: int) -> None:
    """End the mutant's test command, had its runner been killed before it could."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_only_this_users_copies_of_runs_that_are_gone_are_removed(tmpdir_of_runs: Path) -> None:
    me = os.getpid()
    live = tmpdir_of_runs / f"{mutate.COPY_PREFIX}{me}.{process_start_time(me)}.x"
    gone = tmpdir_of_runs / f"{mutate.COPY_PREFIX}{2**22 + 1}.1.x"
    elsewhere = tmpdir_of_runs / "elsewhere"
    planted = tmpdir_of_runs / f"{mutate.COPY_PREFIX}{2**22 + 2}.1.x"
    for path in (live, gone, elsewhere):
        path.mkdir()
        (path / "file").write_text("")
    planted.symlink_to(elsewhere)
    assert mutate.remove_stale_copies() == [gone]
    assert (live / "file").exists()
    assert (elsewhere / "file").exists()
