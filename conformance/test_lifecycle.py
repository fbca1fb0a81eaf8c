"""GPUs come back: on close, when a sandbox is killed, when its creator dies, on reap."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from conformance.fixtures import SandboxFactory
from conformance.hold import HeldSandbox, reap_from_a_fresh_process
from conformance.observe import (
    assert_all_gpus_grantable,
    kill_and_retake,
    retake,
    specs_for_all_gpus,
    specs_for_gpus,
    uuids,
    visible_gpu_uuids,
)
from conformance.settings import Settings
from drivers.base import DEFAULT_EXEC_TIMEOUT_S, KEPT_BYTES, Driver, ExecResult, Sandbox
from gpuhost.errors import ExecTimeout, GpusExhausted, SandboxExecError
from gpuhost.leases import Holder, LeaseOwner
from gpuhost.spec import SandboxSpec, parse_spec
from gpuhost.wait import wait_for

ENDED_TIMEOUT_S = 60.0
"""How long a killed sandbox may take to be gone, on a loaded machine too."""
LONG = 1 << 20
"""A mebibyte on each stream: more than any pipe or stream buffer holds at once."""
BEYOND = (1 << 20) + 12345
"""How far past ``KEPT_BYTES`` a stream runs when exec must cut it: not a round size."""


@pytest.mark.requirement("GPU-RELEASE-01")
def test_close_releases_and_is_idempotent(
    driver: Driver, sandboxes: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing a sandbox MUST release its GPUs; closing it again MUST change nothing."""
    # Released once it is gone, not while it still runs and could use them: where the driver
    # leases through the host registry, each release is checked as it happens.
    released_while_running: list[str] = []
    release = driver.host.leases.release

    def release_once_gone(sandbox_id: str) -> int:
        if sandbox_id in driver.sandboxes(driver.session_id):
            released_while_running.append(sandbox_id)
        return release(sandbox_id)

    monkeypatch.setattr(driver.host.leases, "release", release_once_gone)
    for _ in range(2):
        taken = [sandboxes(spec) for spec in specs_for_all_gpus(driver)]
        for sandbox in taken:
            sandbox.close()
            assert sandbox.id not in driver.sandboxes(driver.session_id), (
                f"close of sandbox {sandbox.id} returned while it still exists"
            )
            assert sandbox.id not in released_while_running, (
                f"close of sandbox {sandbox.id} released its GPUs {uuids(sandbox)} while the "
                "sandbox still ran"
            )
    monkeypatch.undo()
    first = sandboxes(SandboxSpec.with_gpus())
    first.close()
    second = sandboxes(SandboxSpec.with_gpus())
    first.close()  # again: must not release what `second` holds
    assert len(driver.inventory()) < 2 or not set(uuids(second)) & set(
        uuids(sandboxes(SandboxSpec.with_gpus()))
    ), "closing a sandbox twice released a GPU another sandbox holds"
    if len(driver.inventory()) == 1:
        with pytest.raises(GpusExhausted):
            sandboxes(SandboxSpec.with_gpus())


def _biggest_request(driver: Driver) -> SandboxSpec:
    return specs_for_all_gpus(driver)[0]


def _take_the_other_gpus(driver: Driver, sandboxes: SandboxFactory) -> None:
    """Hold every GPU still free: only the GPUs that come back can serve the next request.

    Nothing to take when the biggest request took them all; a driver that gives a sandbox
    fewer GPUs than the host has (a VM takes one) leaves the others free.
    """
    for _ in driver.inventory():
        try:
            sandboxes(SandboxSpec.with_gpus())
        except GpusExhausted:
            return


@pytest.mark.requirement("GPU-RECLAIM-01")
def test_killed_sandbox_gpus_are_reclaimed(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """The GPUs of a sandbox whose processes were SIGKILLed MUST go to the next request."""
    spec = _biggest_request(driver)
    victim = sandboxes(spec)
    _take_the_other_gpus(driver, sandboxes)
    successor = kill_and_retake(sandboxes, victim, spec, settings.reclaim_timeout_s)
    assert set(uuids(successor)) & set(uuids(victim)), (
        f"the killed sandbox held {uuids(victim)}; the next request got {uuids(successor)}"
    )
    assert victim.id not in driver.sandboxes(driver.session_id), (
        f"the killed sandbox {victim.id} still exists, yet its GPUs were handed out again"
    )
    # Closing the dead sandbox gives back nothing of what its successor now holds.
    victim.close()
    with pytest.raises(GpusExhausted):
        sandboxes(SandboxSpec.with_gpus())


@pytest.mark.requirement("GPU-RECLAIM-02")
def test_gpus_of_a_dead_creator_are_reclaimed(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """The GPUs of a sandbox whose creating process died MUST go to the next request."""
    spec = _biggest_request(driver)
    with HeldSandbox.start(driver, settings, spec) as creator:
        reply = creator.go()
        assert reply["ok"], f"the creating process could not take GPUs: {reply}"
        _take_the_other_gpus(driver, sandboxes)
        creator.kill()
    successor = retake(
        lambda: sandboxes(spec),
        settings.reclaim_timeout_s,
        "the GPUs of a sandbox whose creator was killed to come back",
    )
    assert set(uuids(successor)) & set(reply["gpus"])
    assert reply["sandbox"] not in driver.sandboxes(driver.session_id), (
        f"sandbox {reply['sandbox']} outlived its creator, yet its GPUs were handed out again"
    )


@pytest.mark.requirement("SANDBOX-REAP-01")
def test_reap_leaves_nothing_of_the_session(driver: Driver) -> None:
    """Reaping a session MUST leave none of its sandboxes and leases, and all of the others'."""
    # Not even of a session whose id starts with the reaped one's: run "1" is not run "10".
    session = f"reap-{time.time_ns()}"
    other = type(driver)(driver.host, session, driver.image)
    neighbour = type(driver)(driver.host, f"{session}0", driver.image)
    # Another client of the host registry, in the same session: not the driver's to reap.
    client = LeaseOwner("gpu-lease", f"{session}-client", session, Holder.process(os.getpid()))
    made: list[Sandbox] = []
    try:
        # With a GPU where the host has one to spare for the reaped session's own.
        kept = neighbour.create(
            SandboxSpec.with_gpus() if len(driver.inventory()) >= 2 else SandboxSpec()
        )
        made.append(kept)
        kept_leases = _leases_of(driver, kept.id)
        made += [other.create(SandboxSpec.with_gpus()), other.create(SandboxSpec())]
        assert len(other.sandboxes(session)) == 2
        free = driver.host.leases.free(driver.inventory())
        theirs = driver.host.leases.acquire(free, client, count=1) if free else ()
        other.reap(session)
        assert other.sandboxes(session) == []
        assert neighbour.sandboxes(neighbour.session_id) == [kept.id], (
            f"reaping session {session} took the sandbox of session {neighbour.session_id}"
        )
        assert _leases_of(driver, kept.id) == kept_leases, (
            f"reaping session {session} took the leases of session {neighbour.session_id}"
        )
        assert visible_gpu_uuids(kept) == uuids(kept), f"reaping session {session} took a GPU"
        still = {lease.gpu_uuid for lease in driver.host.leases.leases()}
        assert {gpu.uuid for gpu in theirs} <= still, (
            f"reaping the {driver.name} sandboxes of session {session} dropped the lease of "
            f"another client of the host registry in that session ({client.driver})"
        )
        driver.host.leases.release(client.sandbox_id)
        kept.close()
        assert_all_gpus_grantable(driver, after=f"reaping session {session}")
    finally:
        # Whatever failed above, nothing of this test's is left to fail the tests after it.
        driver.host.leases.release(client.sandbox_id)
        for sandbox in made:
            sandbox.close()  # harmless after reap or close
        for each in (other, neighbour):
            each.reap(each.session_id)


def _leases_of(driver: Driver, sandbox_id: str) -> list[str]:
    """A sandbox's leases in the host registry (none, for a driver that leases elsewhere)."""
    return sorted(
        lease.describe() for lease in driver.host.leases.leases() if lease.sandbox_id == sandbox_id
    )


@pytest.mark.requirement("SANDBOX-REAP-01")
@pytest.mark.parametrize("creator", ["stopped", "killed"])
def test_reap_from_a_fresh_process_after_the_creator_crashed(
    driver: Driver, settings: Settings, creator: str
) -> None:
    """Reap MUST find a session's sandboxes from a process that created none of them."""
    session = f"reap-fresh-{time.time_ns()}"
    theirs = type(driver)(driver.host, session, driver.image)
    # All GPUs but one: the one left for what a creator stopped half-way leaves.
    spec = specs_for_gpus(driver, max(1, len(driver.inventory()) - 1))[0]
    with HeldSandbox.start(theirs, settings, spec) as held:
        reply = held.go()
        assert reply["ok"], f"the creating process could not make its sandbox: {reply}"
        if creator == "stopped":
            _half_made(driver, session, held.process.pid, reply["gpus"])
            held.stop()
        else:
            held.kill()
        try:
            reap_from_a_fresh_process(driver, settings.host_config, session)
            left = driver.sandboxes(session)
            assert left == [], f"reaped from a fresh process, session {session} still has {left}"
            leases = driver.host.leases.leases()
            kept = [lease.describe() for lease in leases if lease.session_id == session]
            assert kept == [], f"reaped from a fresh process, session {session} still has {kept}"
            assert_all_gpus_grantable(driver, after=f"reaping session {session} afresh")
        finally:
            held.kill()


def _half_made(driver: Driver, session: str, creator_pid: int, gpus: list[str]) -> None:
    """The lease a creator stopped between taking a GPU and starting its sandbox leaves.

    Only for a driver that leases through the host registry (its sandbox's leases, on
    ``gpus``, are there: they must name the session, or no reap finds such a lease), and
    where a GPU is still free.
    """
    taken = [lease for lease in driver.host.leases.leases() if lease.gpu_uuid in gpus]
    for lease in taken:
        assert lease.session_id == session, (
            f"the lease of {lease.describe()} names session {lease.session_id!r}, not "
            f"{session!r}: a reap of the session after a crash cannot find it"
        )
    free = driver.host.leases.free(driver.inventory())
    if not taken or not free:
        return
    owner = LeaseOwner(
        taken[0].driver, f"{session}-half-made", session, Holder.process(creator_pid)
    )
    driver.host.leases.acquire(free, owner, count=1)


SPEC_ENV = {
    "SPEC_PLAIN": "x",
    "SPEC_SPACES": " a b  c ",
    "SPEC_EQUALS": "k=v=w",
    "SPEC_QUOTES": 'it\'s "q" $HOME `id` \\ ; *',
    "SPEC_EMPTY": "",
    # Variables a driver sets itself, or might drop or set "for safety": the spec's win.
    "PATH": "/spec/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
    "HOME": "/spec-home",
    "LANG": "C",
    "LD_LIBRARY_PATH": "/spec/lib",
    "CUDA_VISIBLE_DEVICES": "0",
}
"""Values a shell or a command line would change, were they passed through one unquoted, and
variables a driver sets itself (the spec's values win)."""


CREATOR_ONLY = (
    "CUDA_CACHE_PATH", "CUDA_LAUNCH_BLOCKING", "NVIDIA_DRIVER_CAPABILITIES", "NCCL_DEBUG",
    "TORCH_HOME", "CUPY_CACHE_DIR", "HF_TOKEN", "OMP_NUM_THREADS", "LD_GPU_SANDBOX_CANARY",
    "PYTHONGPU_SANDBOX_CANARY", "TZ",
)  # fmt: skip
"""Variables set in the creating process only: GPU and framework knobs, a loader's and
Python's prefixes, the time zone."""


@pytest.mark.requirement("SANDBOX-ENV-01")
def test_commands_see_the_specs_env_and_nothing_of_the_creators(
    driver: Driver, sandboxes: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command MUST see the spec's env exactly, and nothing of the creating process's env."""
    canary = f"GPU_SANDBOX_CANARY_{time.time_ns()}"
    # Under a name of its own, and under the names and prefixes a driver might forward "for
    # the GPU" (CUDA's, NVIDIA's, NCCL's, the frameworks' knobs): none of it may reach inside.
    for name in (canary, *CREATOR_ONLY):
        monkeypatch.setenv(name, f"{canary}-{name}-a-secret-of-the-creating-process")
    gpu_request: dict[str, Any] = {"resource_requirements": {"gpu": {}}}
    for request in ({}, gpu_request):
        spec = parse_spec({**request, "template": {"env": SPEC_ENV}})
        sandbox = sandboxes(spec)
        listing = sandbox.exec(["env"]).check().stdout
        seen = dict(line.split("=", 1) for line in listing.splitlines() if "=" in line)
        wrong = {k: seen.get(k) for k, v in SPEC_ENV.items() if seen.get(k) != v}
        assert not wrong, f"the spec's env {SPEC_ENV} arrived as {wrong}"
        leaked = [line for line in listing.splitlines() if canary in line]
        assert not leaked, f"the creating process's variables are inside: {leaked}"


Run = Callable[..., ExecResult]


def _ways_to_run(sandbox: Sandbox) -> dict[str, Run]:
    """``exec``, and ``exec_stream`` (what `gpu-sandbox run` uses) read back from its files."""

    def streamed(argv: Sequence[str], timeout: float = DEFAULT_EXEC_TIMEOUT_S) -> ExecResult:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            returncode = sandbox.exec_stream(argv, out.fileno(), err.fileno(), timeout)
            out.seek(0)
            err.seek(0)
            text = (out.read().decode(errors="replace"), err.read().decode(errors="replace"))
        return ExecResult(tuple(argv), returncode, *text)

    return {"exec": sandbox.exec, "exec_stream": streamed}


@pytest.mark.requirement("SANDBOX-EXEC-01")
def test_exec_reports_exit_code_and_output(sandboxes: SandboxFactory) -> None:
    """Exec MUST return the command's exit code, stdout and stderr, whole; so MUST exec_stream."""
    sandbox = sandboxes(SandboxSpec())
    for way, run in _ways_to_run(sandbox).items():
        result = run(["sh", "-c", "echo out; echo err >&2; exit 3"])
        assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n"), way
        # Byte for byte: carriage returns (progress bars, CRLF logs) are not newlines.
        crlf = run(["sh", "-c", "printf 'o\\r\\nu\\rt'; printf 'e\\r\\nr\\rr' >&2"])
        assert (crlf.stdout, crlf.stderr) == ("o\r\nu\rt", "e\r\nr\rr"), f"{way} rewrote it"
        # Exit codes past 128 as the command gave them.
        assert run(["sh", "-c", "exit 130"]).returncode == 130, way
        # UTF-8 whole: "a" then 3000 two-byte characters, split at every 4 KiB boundary.
        utf8 = "printf a; i=0; while [ $i -lt 3000 ]; do printf '\\303\\251'; i=$((i + 1)); done"
        assert run(["sh", "-c", utf8]).stdout == "a" + "\u00e9" * 3000, f"{way} cut UTF-8"
        # Long output, on both streams at once, comes back whole and apart.
        script = f"head -c {LONG} /dev/zero | tr '\\0' o; head -c {LONG} /dev/zero | tr '\\0' e >&2"
        long = run(["sh", "-c", script])
        assert (len(long.stdout), len(long.stderr)) == (LONG, LONG), f"{way} cut the output short"
        assert set(long.stdout) == {"o"}, way
        assert set(long.stderr) == {"e"}, way


@pytest.mark.requirement("SANDBOX-EXEC-01")
def test_exec_keeps_each_stream_whole_up_to_the_bound_and_its_end_beyond(
    sandboxes: SandboxFactory,
) -> None:
    """Exec MUST keep a stream whole to KEPT_BYTES, past it its end and the count cut."""
    sandbox = sandboxes(SandboxSpec())
    over = KEPT_BYTES + BEYOND
    text = _numbered(over)  # where each byte sits shows in it: a head is not a tail
    ways = _ways_to_run(sandbox)
    # One stream exactly at the bound, the other past it, in one command; then the other way
    # round. exec_stream keeps nothing: its descriptors MUST get all of both (once is enough).
    runs = [("exec", "stdout", "stderr"), ("exec", "stderr", "stdout")]
    for way, at, past in [*runs, ("exec_stream", "stdout", "stderr")]:
        script = f"{_NUMBERED} {_head(KEPT_BYTES)} >&{_FD[at]}; {_head(over)} >&{_FD[past]}"
        result = ways[way](["sh", "-c", script], timeout=600)
        assert result.returncode == 0, f"{way}: exit {result.returncode}"
        got = {"stdout": result.stdout, "stderr": result.stderr}
        cut = {"stdout": result.stdout_cut, "stderr": result.stderr_cut}
        end, cut_past = (text[-KEPT_BYTES:], BEYOND) if way == "exec" else (text, 0)
        for stream, want, want_cut in ((at, text[:KEPT_BYTES], 0), (past, end, cut_past)):
            problem = _differs(got[stream], want)
            assert not problem, f"{way}: {stream} ({len(want)} bytes due): {problem}"
            assert cut[stream] == want_cut, (
                f"{way} says {cut[stream]} bytes of {stream} were cut, not {want_cut}"
            )


_NUMBERED = "b=$(seq 20000);"
"""The numbers to 20,000 a line each: 108,894 bytes, under the 128 KiB of one argument."""
_FD = {"stdout": 1, "stderr": 2}


def _head(size: int) -> str:
    """A command writing the first ``size`` bytes of ``_numbered``'s text.

    ``yes`` repeats the numbers in bulk: ``seq`` or a shell loop would take a minute in an
    emulated VM.
    """
    return f'yes "$b" | head -c {size}'


def _numbered(size: int) -> str:
    """What ``_head(size)`` writes: the numbers to 20,000, a line each, again and again.

    ``BEYOND`` is no multiple of their length: the end of the text is not its beginning.
    """
    block = "".join(f"{i}\n" for i in range(1, 20001))
    assert BEYOND % len(block)
    return (block * (size // len(block) + 1))[:size]


def _differs(got: str, want: str) -> str:
    """Where ``got`` is not ``want`` (both long), for a message; empty when it is."""
    if got == want:
        return ""
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if at is None:
        return f"{len(got)} characters, the same as far as both go"
    return (
        f"{len(got)} characters, the first difference at {at}: "
        f"{got[max(0, at - 20) : at + 20]!r} where {want[max(0, at - 20) : at + 20]!r} was due"
    )


@pytest.mark.requirement("SANDBOX-EXEC-01")
def test_exec_in_an_ended_sandbox_fails(
    driver: Driver, sandboxes: SandboxFactory, settings: Settings
) -> None:
    """Exec MUST fail with SandboxExecError in a sandbox that was killed, or closed."""
    sandbox = sandboxes(SandboxSpec())
    sandbox.kill()
    # How soon it ends is not this test's: GPU-RECLAIM-01 bounds that.
    wait_for(
        lambda: driver.sandboxes(driver.session_id),
        lambda listed: sandbox.id not in listed,
        timeout_s=max(settings.reclaim_timeout_s, ENDED_TIMEOUT_S),
        what=f"killed sandbox {sandbox.id} to end",
    )
    for way, run in _ways_to_run(sandbox).items():
        _fails_to_run(run, f"{way} in killed sandbox {sandbox.id}")
    sandbox.close()
    for way, run in _ways_to_run(sandbox).items():
        _fails_to_run(run, f"{way} in closed sandbox {sandbox.id}")


def _fails_to_run(run: Run, where: str) -> None:
    """Not even `true` runs: a typed error, not an exit code of the engine's or nsenter's."""
    __tracebackhide__ = True
    try:
        outcome = run(["true"])
    except SandboxExecError:
        return
    pytest.fail(f"{where}: `true` ran ({outcome}); it must fail with SandboxExecError")


@pytest.mark.requirement("SANDBOX-EXEC-01")
def test_exec_kills_a_command_past_its_timeout(sandboxes: SandboxFactory) -> None:
    """Exec MUST kill a command past its timeout, with all it started; so MUST exec_stream."""
    sandbox = sandboxes(SandboxSpec())
    for number, (way, run) in enumerate(_ways_to_run(sandbox).items()):
        # Unique arguments find these processes later; one escapes into a session of its own.
        # The command keeps printing for 12 s: the timeout bounds its whole run, not a silence.
        marker = f"{60 + number + time.time_ns() % 1000 / 1000:.3f}"
        chatty = f"i=0; while [ $i -lt 60 ]; do echo {marker}; sleep 0.2; i=$((i + 1)); done"
        # Deaf to every signal it may ignore, as are its children: only SIGKILL ends them.
        script = f"trap '' HUP INT QUIT TERM; setsid sleep {marker} & {chatty}"
        with ThreadPoolExecutor(1) as pool:
            # Another command of the sandbox, running meanwhile, is not the timeout's to kill.
            # (It ends by itself: a driver may run a sandbox's commands one after the other.)
            neighbour = pool.submit(run, ["sh", "-c", "sleep 2; echo survived"], timeout=60)
            start = time.monotonic()
            with pytest.raises(ExecTimeout):  # under a second: a fraction is a timeout too
                run(["sh", "-c", script], timeout=0.5)
            assert time.monotonic() - start < 10, f"{way} let the command run past its timeout"
            # One that would end by itself, past its timeout but well within that bound: a
            # timeout is not raised to a floor of the driver's.
            with pytest.raises(ExecTimeout):
                run(["sleep", "3"], timeout=0.5)
            beside = neighbour.result()
        assert (beside.returncode, beside.stdout.strip()) == (0, "survived"), (
            f"a command running beside the one that timed out ({way}) was ended too: {beside}"
        )
        # A zombie's cmdline is empty: only processes still running are listed.
        listing = (
            "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done 2>/dev/null; true"
        )
        survivors = [
            line
            for line in sandbox.exec(["sh", "-c", listing]).stdout.splitlines()
            if f"sleep {marker}" in line
        ]
        assert not survivors, f"the timed-out command ({way}) left processes running: {survivors}"
        assert sandbox.exec(["true"]).returncode == 0
