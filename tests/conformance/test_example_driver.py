"""The example driver a driver author copies (examples/drivers/jail.py) passes the catalogue.

It runs as docs/writing-a-driver.md says a driver's own repository runs it: from a directory
outside this checkout, the driver found through PYTHONPATH, on the gate's host layout (the
simulated host of `make conformance`); and the page shows what that run prints.

Each jail runs as a host user of its own under the engines' system call filter, and only this
user's processes are jails: the helpers here hold the three example drivers to it (jail.py,
jsonl_jail.py, gosandbox).
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import re
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from conformance.observe import ways_to_run
from drivers import get_driver_class
from drivers.base import Driver, Sandbox
from gpuhost import simulated, uids
from gpuhost.host import GpuHost, HostConfig
from gpuhost.procfs import owner
from gpuhost.spec import SandboxSpec
from gpuhost.wait import wait_for
from tests.catalogue import run_catalogue
from tests.other_user import OTHER_USER, PYTHON, setpriv

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples" / "drivers"
EXAMPLE = EXAMPLES / "jail.py"
PAGE = ROOT / "docs" / "writing-a-driver.md"
DRIVER = "jail:JailDriver"
MAX_LINES = 220
"""A driver to read in one sitting: the example stays under this many lines."""
ONE_FOR_ALL = 1_999_000_000
"""The uid every example jail ran as, whichever sandbox it was."""
PEERS_AND_PRIVILEGES = "--requirement=SANDBOX-PEER-01,SANDBOX-PRIV-01"
COUNTS = re.compile(
    r"^=+ (\d+ passed(?:, \d+ [a-z]+)*) in [0-9.]+s(?: \([0-9:]+\))? =+$", re.MULTILINE
)
"""pytest's last line, e.g. ``97 passed, 5 skipped``, its timing (past a minute ``(0:01:22)``
too) left out."""


def gate_layout() -> list[str]:
    """The simulated host `make conformance` makes where it finds no GPU: the Makefile's own."""
    makefile = (ROOT / "Makefile").read_text()
    found = dict(re.findall(r"^(SIM_GPUS|SIM_MIG|SIM_DRI) \?= (\S+)$", makefile, re.MULTILINE))
    assert set(found) == {"SIM_GPUS", "SIM_MIG", "SIM_DRI"}, f"the Makefile's layout: {found}"
    return [
        f"--sim-gpus={found['SIM_GPUS']}",
        f"--sim-mig={found['SIM_MIG']}",
        f"--sim-dri={found['SIM_DRI']}",
    ]


def the_verdict(text: str) -> str:
    """The driver's verdict line in a run's output (or the page's copy of one)."""
    lines = [line for line in text.splitlines() if line.startswith(f"{DRIVER}: ")]
    assert len(lines) == 1, f"one verdict line of {DRIVER} expected, found {lines}"
    return lines[0]


def the_counts(text: str) -> str:
    counts = COUNTS.findall(text)
    assert len(counts) == 1, f"one pytest summary line expected, found {counts}"
    return str(counts[0])


def test_the_example_is_small_and_stands_alone() -> None:
    """Under MAX_LINES lines; of the built-in drivers it imports the contract and the filter."""
    source = EXAMPLE.read_text()
    assert len(source.splitlines()) < MAX_LINES, f"{EXAMPLE} has grown past {MAX_LINES} lines"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "drivers":
            imported.update(f"drivers.{alias.name}" for alias in node.names)  # modules of it
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    drivers = sorted(name for name in imported if name.split(".")[0] == "drivers")
    assert drivers == ["drivers.contract", "drivers.seccomp"], (
        f"{EXAMPLE} imports {drivers}: only the contract and the system call filter"
    )


def test_the_page_shows_the_gate_layout() -> None:
    """The page runs the catalogue on the gate's layout, not on --sim-gpus alone."""
    page = PAGE.read_text()
    for option in gate_layout():
        assert option in page, f"{PAGE.name} does not run the gate's layout ({option})"


def test_the_example_passes_the_catalogue_as_its_page_shows(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PASS, no mandatory requirement failed; the page's verdict and counts are this run's."""
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))  # pytester runs it from a directory of its own
    report = pytester.path / "conformance.json"
    run = pytester.runpytest_subprocess(
        "--pyargs",
        "conformance",
        f"--driver={DRIVER}",
        *gate_layout(),
        "-p",
        "no:cacheprovider",
        f"--conformance-json={report}",
        timeout=600,
    )
    output = run.stdout.str()
    assert run.ret == 0, output[-4000:] + run.stderr.str()[-2000:]
    result = json.loads(report.read_text())
    assert result["verdicts"][DRIVER]["status"] == "PASS", the_verdict(output)
    failed = sorted(
        {
            test["requirement"]
            for test in result["tests"]
            if test["level"] == "mandatory" and test["outcome"] in ("failed", "error")
        }
    )
    assert failed == [], f"{DRIVER} failed mandatory requirements {failed}"
    assert the_verdict(output).startswith(f"{DRIVER}: PASS (")
    page = PAGE.read_text()
    assert the_verdict(page) == the_verdict(output), (
        f"{PAGE.name} shows another verdict than the run's: run examples/drivers/output.sh "
        "and put its output on the page"
    )
    assert the_counts(page) == the_counts(output), (
        f"{PAGE.name} shows other counts than the run's: run examples/drivers/output.sh"
    )


def test_the_pages_excerpts_are_the_examples_own() -> None:
    """Each Python excerpt on the page stands in jail.py as shown: the walk-through is current."""
    source = EXAMPLE.read_text()
    excerpts = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), re.MULTILINE | re.DOTALL)
    assert excerpts, f"{PAGE.name} quotes nothing of {EXAMPLE.name}"
    for excerpt in excerpts:
        assert excerpt in source, (
            f"{PAGE.name} quotes lines {EXAMPLE.name} no longer has:\n{excerpt}"
        )


# -- each jail a user of its own, filtered; only this user's processes are jails -------------

_WHO = "id -u; id -g; grep -h '^Seccomp:' /proc/self/status /proc/1/status"
"""The command's uid and gid, and Seccomp of the command and of the sandbox's first process."""
SECCOMP_FILTER = "2"


def assert_users_of_their_own(sandboxes: Sequence[Sandbox]) -> list[int]:
    """Each sandbox's host uid: one of ``uids.SANDBOX_UIDS``, no other's, and filtered.

    Through exec and exec_stream alike, the command and the first process run under the system
    call filter, the command as a uid (and gid of the same number) that no other sandbox has.
    """
    __tracebackhide__ = True
    users: dict[int, str] = {}
    for sandbox in sandboxes:
        for way, run in ways_to_run(sandbox).items():
            uid, gid, *seccomp = run(["sh", "-c", _WHO]).check().stdout.split()
            statuses = [value for value in seccomp if value != "Seccomp:"]
            assert statuses == [SECCOMP_FILTER] * 2, (
                f"in sandbox {sandbox.id} (through {way}) the command and the first process run "
                f"with Seccomp {statuses}, not under the system call filter ({SECCOMP_FILTER})"
            )
            assert int(uid) in uids.SANDBOX_UIDS, (
                f"sandbox {sandbox.id} runs as uid {uid}, not a sandbox uid of its own "
                f"({uids.SANDBOX_UIDS.start}..{uids.SANDBOX_UIDS.stop - 1})"
            )
            assert gid == uid, f"sandbox {sandbox.id} runs as uid {uid} but gid {gid}"
            assert users.setdefault(int(uid), sandbox.id) == sandbox.id, (
                f"sandboxes {users[int(uid)]} and {sandbox.id} both run as uid {uid}: they share "
                "its keyrings and its process limit"
            )
    assert ONE_FOR_ALL not in users
    return list(users)


def claimed(uid: int) -> bool:
    """Whether a process holds the host-wide claim of ``uid`` (the lock of ``gpuhost.uids``)."""
    fd = os.open(uids.UID_DIR / str(uid), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def assert_sandboxes_of_users_of_their_own(driver: Driver) -> None:
    """Two sandboxes of ``driver``, one with a GPU: each of a uid of its own, filtered.

    Each uid is claimed host-wide (``gpuhost.uids``) while its sandbox runs, and free again
    once it closed.
    """
    __tracebackhide__ = True
    sandboxes = [driver.create(SandboxSpec.with_gpus(1)), driver.create(SandboxSpec())]
    try:
        users = assert_users_of_their_own(sandboxes)
        unclaimed = [uid for uid in users if not claimed(uid)]
        assert not unclaimed, f"uids {unclaimed} run sandboxes but nobody holds their claims"
    finally:
        for sandbox in sandboxes:
            sandbox.close()
    kept = [uid for uid in users if claimed(uid)]
    assert not kept, f"uids {kept} are still claimed after their sandboxes closed"


@contextlib.contextmanager
def impostor(stamp: str, session: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process of another user that looks like a jail of ``session`` to a command line.

    Its name is bwrap and its arguments carry the session's stamp, ``<stamp> <session>/impostor``
    (any user can read session ids: they are in the lease files).
    """
    script = "import time; time.sleep(600)"
    looks = ["-c", script, "--setenv", stamp, f"{session}/impostor", "-"]
    process = subprocess.Popen(
        [*setpriv(), "bash", "-c", 'exec -a bwrap "$0" "$@"', PYTHON, *looks],
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: Path(f"/proc/{process.pid}/cmdline").read_bytes(),
            lambda cmdline: cmdline.split(b"\0")[0] == b"bwrap",
            timeout_s=10,
            what=f"another user's bwrap of session {session} to start",
        )
        assert owner(process.pid) == OTHER_USER
        yield process
    finally:
        process.kill()
        process.wait()


def assert_impostor_is_no_sandbox(driver: Driver, stamp: str, session: str) -> None:
    """Another user's bwrap with ``session``'s stamp: not listed by ``sandboxes``, nor reaped.

    The session's own sandbox beside it is both.
    """
    __tracebackhide__ = True
    with impostor(stamp, session) as other:
        sandbox = driver.create(SandboxSpec())
        listed = driver.sandboxes(session)
        assert listed == [sandbox.id], (
            f"the sandboxes of session {session} are {listed}: another user's process named "
            f"bwrap, carrying {stamp} {session}/impostor, counted as one of them"
        )
        assert driver.reap(session) == [sandbox.id]
        assert other.poll() is None, f"reap of session {session} killed another user's process"
        sandbox.close()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[GpuHost]:
    sim = simulated.setup(tmp_path / "sim", 2)
    yield GpuHost.open(HostConfig(sim.root))
    simulated.teardown(sim.root)


@pytest.fixture
def jail_driver(monkeypatch: pytest.MonkeyPatch) -> type[Driver]:
    """jail.py's JailDriver, imported as the catalogue does it from a driver's repository."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return get_driver_class(DRIVER)


def test_each_jail_runs_as_a_user_of_its_own_under_the_filter(
    host: GpuHost, jail_driver: type[Driver]
) -> None:
    assert_sandboxes_of_users_of_their_own(jail_driver(host, "jail-users"))


def test_another_users_bwrap_with_the_sessions_stamp_is_not_a_jail(
    host: GpuHost, jail_driver: type[Driver]
) -> None:
    assert_impostor_is_no_sandbox(
        jail_driver(host, "jail-impostor"), "JAIL_SANDBOX", "jail-impostor"
    )


def test_the_example_passes_the_peer_and_privilege_requirements(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(EXAMPLES))
    result, run = run_catalogue(pytester, tmp_path, DRIVER, 4, PEERS_AND_PRIVILEGES, full=False)
    verdicts = {
        req: result["matrix"][req][DRIVER] for req in ("SANDBOX-PEER-01", "SANDBOX-PRIV-01")
    }
    assert verdicts == {"SANDBOX-PEER-01": "passed", "SANDBOX-PRIV-01": "passed"}, run.stdout.str()[
        -3000:
    ]
