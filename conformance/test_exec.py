"""Commands in a sandbox: their environment, exit code and output, their timeout, and the end."""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from conformance.bounds import SLOWEST_FACTOR, kill_bound_s, round_trip_s
from conformance.dimensions import declared
from conformance.fixtures import Dropped, SandboxFactory
from conformance.observe import COMMAND_PATHS, ENDED_TIMEOUT_S, Run, ways_to_run
from conformance.settings import Settings
from drivers.base import KEPT_BYTES, Driver
from gpuhost.errors import ExecTimeout, SandboxExecError
from gpuhost.spec import SandboxSpec, parse_spec
from gpuhost.wait import wait_for

LONG = 1 << 20
"""A mebibyte on each stream: more than any pipe or stream buffer holds at once."""
BEYOND = (1 << 20) + 12345
"""How far past ``KEPT_BYTES`` a stream runs when exec must cut it: not a round size."""
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
SPEC_VALUE_BYTES = 64 << 10
"""A value of 64 KiB: past a page, a line buffer and a pipe's atomic write, under the 128 KiB
the kernel allows one variable."""
SPEC_VALUES: dict[str, tuple[str, str]] = {
    "a newline": ("SPEC_NEWLINE", "first line\nsecond line\n\nafter an empty one\n"),
    "a tab": ("SPEC_TAB", "\tcolumn\t\tcolumn\t"),
    "non-ASCII UTF-8": ("SPEC_UTF8", "caf\u00e9 \u65e5\u672c \U0001f680 \u00a0nbsp"),
    "a backslash": ("SPEC_BACKSLASH", "C:\\new\\table \\\\ \\n \\"),
    "a value starting with -": ("SPEC_DASH", "--help -e X=1"),
    "very long (64 KiB)": (
        "SPEC_LONG", "".join(f"{i:07d}," for i in range(SPEC_VALUE_BYTES // 8))
    ),
}  # fmt: skip
"""Every class of byte a value can hold, a variable each: what an env file, a command line, a
shell's quoting, an encoding or a fixed buffer on the way would change."""
SPEC_ENV.update(dict(SPEC_VALUES.values()))
SPEC_VALUE_CLASSES = tuple(SPEC_VALUES)
EXITS = {f"exit {code}": code for code in (1, 2, 126, 127, 128, 255)}
"""Exit codes as a command gives them: the common ones, the shell's "not executable" and "not
found" (an engine's own codes too), the first past 128, and the highest."""
SIGNALS = {
    f"killed by SIG{name}": signal.Signals[f"SIG{name}"] for name in ("INT", "KILL", "SEGV", "TERM")
}
"""Deaths by a signal: the command reports 128 + its number, as a shell does (or minus it, as
Python's subprocess does)."""
EXIT_KINDS = (*EXITS, *SIGNALS)


PROXIES = ("http_proxy", "https_proxy", "ftp_proxy", "no_proxy")
"""What podman forwards by default, in both cases: a proxy's URL carries its credentials."""
CREATOR_VARIABLES: dict[str, tuple[str, ...]] = {
    "a name of its own": ("GPU_SANDBOX_CANARY",),
    "CUDA's, NVIDIA's, NCCL's and the frameworks' knobs": (
        "CUDA_CACHE_PATH", "CUDA_LAUNCH_BLOCKING", "NVIDIA_DRIVER_CAPABILITIES", "NCCL_DEBUG",
        "TORCH_HOME", "CUPY_CACHE_DIR", "HF_TOKEN", "OMP_NUM_THREADS",
    ),
    "the loader's (LD_)": ("LD_GPU_SANDBOX_CANARY",),
    "Python's (PYTHON)": ("PYTHONGPU_SANDBOX_CANARY",),
    "the time zone, locale and terminal": ("TZ", "LC_ALL", "TERM"),
    "proxies, in lower case": PROXIES,
    "proxies, in upper case": tuple(name.upper() for name in PROXIES),
    "a client configuration it names, with proxies (DOCKER_CONFIG)": ("DOCKER_CONFIG",),
    "every other variable it has": (),
}  # fmt: skip
"""Variables set in the creating process only, by what a driver might forward: each class
under names of its own, and every variable the creating process has, its value marked."""
CREATOR_KINDS = tuple(CREATOR_VARIABLES)
RUN_READS = frozenset({"PATH", "HOME", "USER", "LOGNAME", "TMPDIR", "TMP", "TEMP", "KUBECONFIG"})
RUN_READS_PREFIXES = (
    "GPU_SANDBOX_", "PYTEST_", "PYTHON", "VIRTUAL_ENV", "CONDA_", "XDG_", "DOCKER_", "CONTAINER",
    "KUBE", "COV_", "LD_", "SSL_", "REQUESTS_CA", "CURL_CA", "GRPC_", "OPENSHELL",
)  # fmt: skip
"""What the run itself reaches its engines, cluster, tools and Python by: kept as it is."""
DIMENSIONS = {
    "SANDBOX-ENV-01": declared(
        path=COMMAND_PATHS,
        gpus=("none", "one GPU"),
        spec_variable=tuple(SPEC_ENV),
        spec_value=SPEC_VALUE_CLASSES,
        creator_variable=CREATOR_KINDS,
    ),
    "SANDBOX-EXEC-01": declared(
        path=COMMAND_PATHS,
        exit_code=EXIT_KINDS,
        output=(
            "exit codes 3 and 130", "stdout and stderr apart", "carriage returns",
            "UTF-8 across 4 KiB boundaries", "a mebibyte on each stream",
            "a stream of exactly KEPT_BYTES", "a stream past KEPT_BYTES (its end, the count cut)",
        ),
        timeout=(
            "a command deaf to every signal it may ignore, a setsid child beside",
            "a command that would end by itself past it",
            "a command beside it, not timed out",
        ),
        sandbox=("running", "killed", "closed"),
    ),
}  # fmt: skip


def _marked_environment(canary: str, config: Path) -> dict[str, str]:
    """The creating process's environment for the test: every class set, every other marked.

    Each value holds ``canary``; ``config`` is a docker client configuration with proxies.
    """
    proxy = f"http://gpu-sandbox:{canary}@proxy.invalid:3128"
    config.mkdir()
    proxies = {"httpProxy": proxy, "httpsProxy": proxy, "ftpProxy": proxy, "noProxy": canary}
    (config / "config.json").write_text(json.dumps({"proxies": {"default": proxies}}))
    marked = {
        name: f"{value}-{canary}"
        for name, value in os.environ.items()
        if name not in RUN_READS and not name.startswith(RUN_READS_PREFIXES)
    }
    for name in (name for names in CREATOR_VARIABLES.values() for name in names):
        marked[name] = f"{canary}-{name}-a-secret-of-the-creating-process"
    for name in (*PROXIES, *(name.upper() for name in PROXIES)):
        # Local addresses stay direct: the run's own clients read these too.
        marked[name] = (
            f"localhost,127.0.0.1,::1,{canary}.invalid" if name.lower() == "no_proxy" else proxy
        )
    marked["DOCKER_CONFIG"] = str(config)
    return marked


@pytest.mark.requirement("SANDBOX-ENV-01")
def test_commands_see_the_specs_env_and_nothing_of_the_creators(
    sandboxes: SandboxFactory,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    dropped: Dropped,
) -> None:
    """A command MUST see the spec's env exactly, and nothing of the creating process's env."""
    canary = f"gpu-sandbox-canary-{time.time_ns()}"
    own = {name for names in CREATOR_VARIABLES.values() for name in names}
    others = sorted(
        name
        for name in os.environ
        if name not in own and name not in RUN_READS and not name.startswith(RUN_READS_PREFIXES)
    )
    if not others:
        dropped(
            "every other variable it has",
            "the creating process has none but those the run reaches its engines and tools by",
        )
    for name, value in _marked_environment(canary, tmp_path / canary).items():
        monkeypatch.setenv(name, value)
    gpu_request: dict[str, Any] = {"resource_requirements": {"gpu": {}}}
    for request in ({}, gpu_request):
        spec = parse_spec({**request, "template": {"env": SPEC_ENV}})
        sandbox = sandboxes(spec)
        for way, run in ways_to_run(sandbox).items():
            # The kernel's own record, NUL apart: a value may hold a newline.
            entries = run(["cat", "/proc/self/environ"]).check().stdout.split("\0")
            seen = dict(entry.split("=", 1) for entry in entries if "=" in entry)
            wrong = {k: _abridged(seen.get(k)) for k, v in SPEC_ENV.items() if seen.get(k) != v}
            due = {k: _abridged(SPEC_ENV[k]) for k in wrong}
            assert not wrong, f"through {way}, the spec's env {due} arrived as {wrong}"
            leaked = [entry for entry in entries if canary in entry]
            assert not leaked, (
                f"through {way}, the creating process's variables are inside sandbox "
                f"{sandbox.id}: {leaked}"
            )


def _abridged(value: str | None) -> str | None:
    """A value for a message: a long one by its length, its head and its tail."""
    if value is None or len(value) <= 80:
        return value
    return f"{len(value)} characters: {value[:30]!r}...{value[-30:]!r}"


@pytest.mark.requirement("SANDBOX-EXEC-01")
def test_exec_reports_exit_code_and_output(sandboxes: SandboxFactory) -> None:
    """Exec MUST return the command's exit code, stdout and stderr, whole; so MUST exec_stream."""
    sandbox = sandboxes(SandboxSpec())
    for way, run in ways_to_run(sandbox).items():
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
def test_exec_returns_every_exit_code(sandboxes: SandboxFactory) -> None:
    """Exec MUST return every exit code, and a death by a signal, as the command gave it."""
    sandbox = sandboxes(SandboxSpec())
    commands = {kind: f"echo {kind}; exit {code}" for kind, code in EXITS.items()}
    commands.update(
        {kind: f"echo {kind}; kill -s {sig.name[3:]} $$" for kind, sig in SIGNALS.items()}
    )
    due = {kind: {code} for kind, code in EXITS.items()}
    due.update({kind: {128 + sig, -sig} for kind, sig in SIGNALS.items()})
    wrong: dict[str, str] = {}
    for way, run in ways_to_run(sandbox).items():
        for kind, script in commands.items():
            try:
                result = run(["sh", "-c", script])
            except SandboxExecError as error:
                wrong[f"{way}: {kind}"] = f"raised {error}"
                continue
            if result.returncode not in due[kind] or result.stdout != f"{kind}\n":
                wrong[f"{way}: {kind}"] = f"returned {result.returncode}, stdout {result.stdout!r}"
    assert not wrong, f"commands' exits not returned as they were: {wrong}"


@pytest.mark.requirement("SANDBOX-EXEC-01")
def test_exec_keeps_each_stream_whole_up_to_the_bound_and_its_end_beyond(
    sandboxes: SandboxFactory,
) -> None:
    """Exec MUST keep a stream whole to KEPT_BYTES, past it its end and the count cut."""
    sandbox = sandboxes(SandboxSpec())
    over = KEPT_BYTES + BEYOND
    text = _numbered(over)  # where each byte sits shows in it: a head is not a tail
    ways = ways_to_run(sandbox)
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
    for way, run in ways_to_run(sandbox).items():
        _fails_to_run(run, f"{way} in killed sandbox {sandbox.id}")
    sandbox.close()
    for way, run in ways_to_run(sandbox).items():
        _fails_to_run(run, f"{way} in closed sandbox {sandbox.id}")


def _fails_to_run(run: Run, where: str) -> None:
    """Not even `true` runs: a typed error, not an exit code of the engine's or nsenter's."""
    __tracebackhide__ = True
    try:
        outcome = run(["true"])
    except SandboxExecError:
        return
    pytest.fail(f"{where}: `true` ran ({outcome}); it must fail with SandboxExecError")


TIMEOUT_S = 0.5
"""Under a second: a fraction is a timeout too."""


def _timed_out(run: Run, argv: list[str]) -> float:
    """How long ``argv`` given ``TIMEOUT_S`` took to fail with ExecTimeout."""
    __tracebackhide__ = True
    start = time.monotonic()
    with pytest.raises(ExecTimeout):
        run(argv, timeout=TIMEOUT_S)
    return time.monotonic() - start


@pytest.mark.requirement("SANDBOX-EXEC-01")
def test_exec_kills_a_command_past_its_timeout(
    sandboxes: SandboxFactory, settings: Settings
) -> None:
    """Exec MUST kill a command past its timeout, with all it started; so MUST exec_stream."""
    sandbox = sandboxes(SandboxSpec())
    for number, (way, run) in enumerate(ways_to_run(sandbox).items()):
        # Unique arguments find these processes later; one escapes into a session of its own.
        # The command keeps printing for 12 s: the timeout bounds its whole run, not a silence.
        marker = f"{60 + number + time.time_ns() % 1000 / 1000:.3f}"
        chatty = f"i=0; while [ $i -lt 60 ]; do echo {marker}; sleep 0.2; i=$((i + 1)); done"
        # Deaf to every signal it may ignore, as are its children: only SIGKILL ends them.
        deaf = ["sh", "-c", f"trap '' HUP INT QUIT TERM; setsid sleep {marker} & {chatty}"]
        with ThreadPoolExecutor(1) as pool:
            # Another command of the sandbox, running meanwhile, is not the timeout's to kill.
            # (It ends by itself: a driver may run a sandbox's commands one after the other,
            # so this one may wait for it: how long it takes is not timed here.)
            neighbour = pool.submit(run, ["sh", "-c", "sleep 2; echo survived"], timeout=60)
            _timed_out(run, deaf)
            beside = neighbour.result()
        # Alone, it ends within what a kill at its timeout needs: about what a command that
        # does nothing takes there and back, a few times over. So does one that would end by
        # itself past its timeout: a timeout is not raised to a floor of the driver's.
        # The round trip is measured before and after the kills: the machine's load then.
        true = functools.partial(run, ["true"])
        for _ in range(3):
            before = round_trip_s(true, tries=5)
            took = {"deaf to every signal it may ignore": _timed_out(run, deaf)}
            took["plain"] = _timed_out(run, ["sleep", "3"])
            round_trip = max(before, round_trip_s(true, tries=5))
            bound = kill_bound_s(TIMEOUT_S, round_trip, 1, settings.lanes_at_once)
            if max(took.values()) < bound:
                break  # else a moment the machine was busy: again, measured afresh
        for what, spent in took.items():
            assert spent < bound, (
                f"through {way}, a command given {TIMEOUT_S:g} s ({what}) took {spent:.2f} s "
                f"to time out, three times; a kill at its timeout needs {bound:.2f} s (the "
                f"timeout, then {SLOWEST_FACTOR:g} round trips of `true` here, per lane)"
            )
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
