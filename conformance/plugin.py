"""The pytest plugin of the GPU sandbox conformance suite: options, drivers, fixtures, report.

``--driver`` picks the drivers (default: every built-in one). Each test that takes the
``driver`` fixture runs once per driver; a driver that cannot run here is skipped with what
it needed and what it found, unless it was named explicitly, in which case it is an error:
a release gate must never go green by skipping.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fcntl
import functools
import io
import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn, TextIO

import pytest

from conformance import requirements
from conformance.report import Entry, Results, entry, text_table, to_markdown, write
from drivers import REGISTRY, UnknownDriver, get_driver_class, reap_session
from drivers.base import Driver, Sandbox, check_session_id
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.leases import DEFAULT_SHARE_LIMIT, Holder, lock_holders
from gpuhost.spec import SandboxSpec


@dataclass
class Settings:
    drivers: dict[str, type[Driver]]
    explicit: bool
    host_config: HostConfig
    session_id: str
    image: str | None
    reclaim_timeout_s: float
    exhaustion_grace_s: float | None
    """How much longer than a create an exhausted request may take to fail; None: the
    driver's own ``exhaustion_grace_s``."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Driver → why it cannot run here, once its probe said so (in this process)."""

    @functools.cached_property
    def host(self) -> GpuHost:
        """The GPU host, discovered once per session (NVML is not free on a real host)."""
        return GpuHost.open(self.host_config)


settings_key = pytest.StashKey[Settings]()
_SESSION_KEY = "gpu_sandbox_session"
_SIM_ROOT_KEY = "gpu_sandbox_sim_root"
SIM_RUN_DIR = Path("/run/gpu-sandbox-runs")
"""Where ``--sim-gpus`` makes each run's simulated host: a tmpfs, emptied at boot."""
CDI_RUN_DIR = Path("/var/run/cdi")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu-sandbox", "GPU sandbox conformance")
    group.addoption(
        "--driver",
        default=None,
        help="Run against these drivers, comma-separated: built-in names "
        f"({', '.join(REGISTRY)}) or module:Class import paths. Default: every built-in "
        "driver, skipping those that cannot run here; a driver named here must run.",
    )
    group.addoption(
        "--sim-root",
        type=Path,
        default=None,
        help="Use the simulated GPU host under this directory (see python -m gpuhost.simulated).",
    )
    group.addoption(
        "--sim-gpus",
        type=int,
        default=None,
        metavar="N",
        help="Make a simulated GPU host of N GPUs for this run only (needs root), register its "
        "CDI spec in /var/run/cdi for the container engines, and remove both at the end. "
        "Concurrent runs each have their own.",
    )
    group.addoption(
        "--sim-mig",
        default="",
        metavar="LAYOUT",
        help="With --sim-gpus: put GPUs in MIG mode, e.g. 0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb "
        "(GPU position:count x profile).",
    )
    group.addoption(
        "--sim-dri",
        default="",
        metavar="LAYOUT",
        help="With --sim-gpus: add AMD and Intel GPUs (DRI nodes), e.g. intel:1,amd:2.",
    )
    group.addoption(
        "--gpu-share-limit",
        type=int,
        default=DEFAULT_SHARE_LIMIT,
        metavar="N",
        help=f"How many shared sandboxes may co-hold one GPU (default {DEFAULT_SHARE_LIMIT}).",
    )
    group.addoption(
        "--gpu-state-dir",
        type=Path,
        default=None,
        help="Keep the host-wide GPU lease registry here (default: /run/gpu-sandbox).",
    )
    group.addoption("--image", default=None, help="Container image for the engine drivers.")
    group.addoption(
        "--requirement",
        default=None,
        metavar="IDS",
        help="Run only the tests of these requirements, comma-separated (e.g. GPU-DEFAULT-02).",
    )
    group.addoption(
        "--reclaim-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="How long a killed sandbox's GPUs may take to come back (default: 30; container "
        "engines can take seconds to report a killed container as gone).",
    )
    group.addoption(
        "--exhaustion-grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="How much longer than the driver's own create may a request for more GPUs than "
        "are free take to fail (default: the driver's exhaustion_grace_s, 1 s for local "
        "drivers).",
    )
    group.addoption(
        "--reap",
        metavar="SESSION",
        default=None,
        help="Remove every sandbox and GPU lease test session SESSION left, then exit.",
    )
    group.addoption(
        "--conformance-json",
        metavar="PATH",
        type=Path,
        default=None,
        help="Write each test's requirement, driver and outcome, the matrix and the "
        "verdicts to PATH as JSON (python -m conformance.report renders it again).",
    )
    group.addoption(
        "--conformance-html",
        metavar="PATH",
        type=Path,
        default=None,
        help="Write the conformance matrix to PATH as one self-contained HTML page.",
    )
    group.addoption(
        "--conformance-markdown",
        metavar="PATH",
        type=Path,
        default=None,
        help="Write a Markdown summary to PATH, and append it to $GITHUB_STEP_SUMMARY if set.",
    )


MARKERS = (
    "requirement(id): the conformance requirement (conformance/REQUIREMENTS.yaml) a test checks",
    "gpus(n): needs at least n GPUs on the host; skipped with the count found otherwise",
    "exclusive: checks that GPUs are not shared; not applicable to a driver that declares "
    "exclusive=False",
    "shares_gpus: checks how shared GPUs are held; not applicable to a driver that declares "
    "shared=False (GPU-SHARED-01 checks that it refuses them)",
    "chooses_pools: checks requests by MIG profile or by vendor; not applicable to a driver "
    "that serves neither (no mig_profiles, NVIDIA alone among its vendors)",
    "workload: runs compute kernels inside the sandbox",
)
TEST_TIMEOUT_S = 900.0
"""The per-test bound when none is configured: a driver that hangs fails the requirement of
the test it hangs in (pytest-timeout, signal method), and the reports are still written."""


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout reads its settings
def pytest_configure(config: pytest.Config) -> None:
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    if (
        config.getoption("timeout", None) is None
        and not os.environ.get("PYTEST_TIMEOUT")
        and not config.getini("timeout")
    ):
        config.option.timeout = TEST_TIMEOUT_S
    settings = _settings(config)
    count = config.getoption("--sim-gpus")
    if count is not None and not hasattr(config, "workerinput"):
        if settings.host_config.sim_root is not None:
            raise pytest.UsageError("--sim-gpus makes a simulated host: give it or --sim-root")
        sim = _simulated_host_for_this_run(
            settings.session_id, count, config.getoption("--sim-mig"), config.getoption("--sim-dri")
        )
        config.add_cleanup(lambda: simulated.teardown(sim.root))
        settings.host_config = dataclasses.replace(settings.host_config, sim_root=sim.root)
    config.stash[settings_key] = settings


def _one_run_at_a_time(config: pytest.Config, state_dir: Path) -> None:
    """Wait for any other run on this real host: the catalogue takes every GPU in turn.

    Taken by the first test that uses the host (under xdist, GPU tests all run in one
    worker), so runs that never touch it (the suite's self-tests) never wait. Simulated
    hosts need no such lock: each run has its own.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW  # never through a link
    fd = os.open(state_dir / "run.lock", flags, 0o666)
    config.add_cleanup(lambda: os.close(fd))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        # Another run may take many minutes: wait, saying who holds the host.
        holders = lock_holders(fd) or "a process not seen here"
        sys.stderr.write(
            f"waiting for another conformance run on this host ({state_dir}): {holders}\n"
        )
        fcntl.flock(fd, fcntl.LOCK_EX)


def _simulated_host_for_this_run(
    session_id: str, count: int, mig: str, dri: str
) -> simulated.SimulatedHost:
    """A simulated host of the run's own under /run (a tmpfs), registered with the engines."""
    base = SIM_RUN_DIR if os.access(SIM_RUN_DIR.parent, os.W_OK) else Path(tempfile.gettempdir())
    registry = CDI_RUN_DIR if os.access(CDI_RUN_DIR.parent, os.W_OK) else None
    for gone in simulated.sweep(base):
        sys.stderr.write(f"removed {gone}: the simulated host of a run that ended without it\n")
    try:
        return simulated.setup(
            base / f"run-{session_id}",
            count,
            registry,
            simulated.parse_mig_layout(mig),
            simulated.parse_dri_layout(dri),
            owner=Holder.process(os.getpid()),
        )
    except simulated.SimulatedHostError as exc:
        raise pytest.UsageError(
            f"--sim-gpus={count} --sim-mig={mig!r} --sim-dri={dri!r}: {exc}"
        ) from None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Give xdist workers the controller's session id and simulated host."""
    settings = node.config.stash[settings_key]
    node.workerinput[_SESSION_KEY] = settings.session_id
    if settings.host_config.sim_root is not None:
        node.workerinput[_SIM_ROOT_KEY] = str(settings.host_config.sim_root)


def _settings(config: pytest.Config) -> Settings:
    option = config.getoption("--driver")
    names = [name.strip() for name in option.split(",") if name.strip()] if option else []
    try:
        drivers = {name: get_driver_class(name) for name in names or REGISTRY}
    except UnknownDriver as exc:
        raise pytest.UsageError(str(exc)) from None
    return Settings(
        drivers=drivers,
        explicit=bool(names),
        host_config=HostConfig(
            _worker_sim_root(config) or config.getoption("--sim-root"),
            config.getoption("--gpu-state-dir"),
            config.getoption("--gpu-share-limit"),
        ),
        session_id=getattr(config, "workerinput", {}).get(_SESSION_KEY) or uuid.uuid4().hex[:16],
        image=config.getoption("--image"),
        reclaim_timeout_s=config.getoption("--reclaim-timeout"),
        exhaustion_grace_s=config.getoption("--exhaustion-grace"),
    )


def _worker_sim_root(config: pytest.Config) -> Path | None:
    root = getattr(config, "workerinput", {}).get(_SIM_ROOT_KEY)
    return Path(root) if root else None


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    session = config.getoption("--reap")
    if session is None:
        return None
    try:
        check_session_id(session)
    except ValueError as exc:
        raise pytest.UsageError(f"--reap: {exc}") from None
    settings = _settings(config)
    results = reap_session(settings.host, session, settings.drivers, settings.image)
    for result in results:
        print(result.line)  # noqa: T201
    # A driver that could not reap is an error when it was named, e.g. an engine not running.
    return 1 if settings.explicit and any(result.error for result in results) else 0


def pytest_report_header(config: pytest.Config) -> list[str]:
    settings = config.stash[settings_key]
    host = settings.host
    lines = [
        f"gpu-sandbox session: {settings.session_id} (clean up after a crash: pytest --reap="
        f"{settings.session_id})",
        f"gpu host: {host.describe()}",
        f"drivers: {', '.join(settings.drivers)}",
    ]
    if host.simulated:
        lines.append("NOTE: this run used SIMULATED GPUs; no CUDA device was exercised.")
    return lines


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "driver" in metafunc.fixturenames:
        names = list(metafunc.config.stash[settings_key].drivers)
        metafunc.parametrize("driver", names, ids=names, indirect=True, scope="session")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _select_requirements(config, items)
    golden = requirements.load()
    for item in items:
        marker = item.get_closest_marker("requirement")
        driver = _driver_of(item)
        if marker:
            item.user_properties.append(("requirement", marker.args[0]))
        if driver:
            item.user_properties.append(("driver", driver))
            # Every GPU test shares the host's GPUs: under xdist they run in one worker.
            item.add_marker(pytest.mark.xdist_group("gpu-host"))
        if marker and driver:
            # The JUnit test case's properties: what was checked, on what, and how it counts.
            level = golden.level(marker.args[0], driver)
            gpus = _gpu_properties(config.stash[settings_key].host)
            item.user_properties += [("level", level), *gpus.items()]
            if level == "not applicable":
                item.add_marker(
                    pytest.mark.skip(reason=f"{marker.args[0]} does not apply to {driver}")
                )


def _driver_of(item: pytest.Item) -> str | None:
    params = getattr(item, "callspec", None)
    return params.params.get("driver") if params else None


def _gpu_properties(host: GpuHost) -> dict[str, Any]:
    return {
        "gpu_model": ", ".join(sorted({gpu.name for gpu in host.gpus})),
        "gpu_count": len(host.gpus),
        "simulated": "true" if host.simulated else "false",
    }


def _select_requirements(config: pytest.Config, items: list[pytest.Item]) -> None:
    option = config.getoption("--requirement")
    if not option:
        return
    wanted = {name.strip() for name in option.split(",") if name.strip()}
    unknown = wanted - set(requirements.load().by_id)
    if unknown:
        raise pytest.UsageError(f"--requirement: unknown requirement(s) {sorted(unknown)}")

    def selected(item: pytest.Item) -> bool:
        marker = item.get_closest_marker("requirement")
        return marker is not None and marker.args[0] in wanted

    config.hook.pytest_deselected(items=[item for item in items if not selected(item)])
    items[:] = [item for item in items if selected(item)]


@pytest.fixture(scope="session")
def gpu_host(pytestconfig: pytest.Config) -> GpuHost:
    settings = pytestconfig.stash[settings_key]
    if settings.host_config.sim_root is None:
        with _shown(pytestconfig):
            _one_run_at_a_time(pytestconfig, settings.host_config.state_directory())
    return settings.host


@pytest.fixture(scope="session")
def driver(request: pytest.FixtureRequest, gpu_host: GpuHost) -> Iterator[Driver]:
    settings = request.config.stash[settings_key]
    name: str = request.param
    instance = settings.drivers[name](gpu_host, settings.session_id, settings.image)
    availability = instance.probe()
    if not availability.ok:
        settings.unavailable[name] = availability.reason
        if settings.explicit:
            pytest.fail(
                f"{name} was named in --driver but cannot run: {availability.reason}",
                pytrace=False,
            )
        pytest.skip(f"{name}: {availability.reason}")
    # Held from the first test of the lane to its last, reaped before it is given back:
    # runs that share what the driver hands out (a cluster) take turns; others never wait.
    with contextlib.ExitStack() as turn:
        with _shown(request.config):
            turn.enter_context(instance.catalogue_turn())
        yield instance
        instance.reap(settings.session_id)


@contextlib.contextmanager
def _shown(config: pytest.Config) -> Iterator[None]:
    """Output on the terminal, not captured: a run waiting for its turn says so.

    On a line of its own, not after the progress dots of ``-q``.
    """
    capture = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    with contextlib.ExitStack() as shown:
        if capture is not None:
            shown.enter_context(capture.global_and_fixture_disabled())
        if reporter is not None:
            shown.enter_context(contextlib.redirect_stderr(_OnNewLine(sys.stderr, reporter)))
        yield


class _OnNewLine(io.TextIOBase):
    """``stream``, where the first write ends the reporter's current line first."""

    def __init__(self, stream: TextIO, reporter: Any) -> None:
        self._stream = stream
        self._reporter = reporter
        self._started = False

    def write(self, text: str) -> int:
        if not self._started:
            self._started = True
            self._reporter.ensure_newline()
            # -q writes its dots without a file name, which ensure_newline goes by.
            if self._reporter._tw.width_of_current_line:
                self._reporter._tw.line()
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()


@pytest.fixture
def host_gpus(driver: Driver) -> tuple[str, ...]:
    """UUIDs of the GPUs the driver can hand out, in PCI order."""
    return tuple(gpu.uuid for gpu in driver.inventory())


@pytest.fixture(autouse=True)
def _gpu_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """Skip when the host has too few GPUs; reap whatever the test left behind.

    Reaping after each test keeps one broken test from failing every test after it, so
    each failure points at the requirement that was broken.
    """
    if "driver" not in request.fixturenames:
        yield
        return
    driver: Driver = request.getfixturevalue("driver")
    if request.node.get_closest_marker("exclusive") and not driver.capabilities.exclusive:
        not_applicable(request.node, f"the {driver.name} driver shares GPUs (exclusive=False)")
    if request.node.get_closest_marker("shares_gpus") and not driver.capabilities.shared:
        not_applicable(request.node, f"the {driver.name} driver never shares GPUs (shared=False)")
    pools = driver.capabilities.mig_profiles or set(driver.capabilities.vendors) - {"nvidia"}
    if request.node.get_closest_marker("chooses_pools") and not pools:
        not_applicable(
            request.node, f"the {driver.name} driver serves no MIG profile and no other vendor"
        )
    marker = request.node.get_closest_marker("gpus")
    have = len(driver.inventory())
    if marker is not None and have < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} GPUs (host has {have})")
    yield
    driver.reap(driver.session_id)


def not_applicable(item: pytest.Item, why: str) -> NoReturn:
    """Skip ``item`` as not applicable: its requirement's cell leaves it out."""
    item.user_properties[:] = [(k, v) for k, v in item.user_properties if k != "level"]
    item.user_properties.append(("level", "not applicable"))
    pytest.skip(f"not applicable: {why}")


class SandboxFactory:
    """Creates sandboxes for one test and closes whatever the test left open."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.open: list[Sandbox] = []

    def __call__(self, spec: SandboxSpec) -> Sandbox:
        sandbox = self.driver.create(spec)
        self.open.append(sandbox)
        return sandbox

    def close_all(self) -> None:
        """Close every sandbox the test left open, all at once (engines take a while each)."""
        with ThreadPoolExecutor(max(1, len(self.open))) as pool:
            for closing in [pool.submit(sandbox.close) for sandbox in self.open]:
                closing.result()
        self.open.clear()


@pytest.fixture
def sandboxes(driver: Driver) -> Iterator[SandboxFactory]:
    factory = SandboxFactory(driver)
    try:
        yield factory
    finally:
        factory.close_all()


@pytest.fixture
def settings(pytestconfig: pytest.Config) -> Settings:
    return pytestconfig.stash[settings_key]


# -- the per-requirement report ---------------------------------------------------------

_ENTRIES: list[Entry] = []
results_key = pytest.StashKey[Results]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Mark the tests of a driver that could not run with the reason, for the report."""
    try:
        return (yield)
    finally:
        reason = item.config.stash[settings_key].unavailable.get(_driver_of(item) or "")
        if reason is not None:
            item.user_properties.append(("unavailable", reason))


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    found = entry(report)
    if found is not None:
        _ENTRIES.append(found)


def _results(config: pytest.Config) -> Results:
    settings = config.stash[settings_key]
    host = settings.host
    golden = requirements.load()
    gpus = _gpu_properties(host)
    return Results(
        header={
            "session": settings.session_id,
            "simulated": host.simulated is not None,
            "host": host.describe(),
            "hostname": socket.gethostname(),
            "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "gpu_model": gpus["gpu_model"],
            "gpu_count": gpus["gpu_count"],
        },
        drivers={
            name: {"version": _version(cls, settings), "explicit": settings.explicit}
            for name, cls in settings.drivers.items()
        },
        requirements=[
            {
                "id": req.id,
                "statement": req.statement,
                "levels": {name: golden.level(req.id, name) for name in settings.drivers},
            }
            for req in golden.requirements
        ],
        tests=list(_ENTRIES),
    )


def _version(cls: type[Driver], settings: Settings) -> str:
    try:
        return cls(settings.host, settings.session_id, settings.image).version()
    except Exception as exc:  # a report must not be lost to a driver's bug
        return f"unknown ({type(exc).__name__}: {exc})"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput") or not _ENTRIES:
        return
    results = config.stash[results_key] = _results(config)
    if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        # A run in which every driver was skipped checked nothing: it must not pass.
        if results.nothing_ran or results.gate_fails():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif (
        session.exitstatus == pytest.ExitCode.TESTS_FAILED
        and not results.gate_fails()
        and session.testsfailed == results.optional_failures()
    ):
        # Only optional requirements failed: reported, but they do not gate.
        session.exitstatus = pytest.ExitCode.OK
    markdown = config.getoption("--conformance-markdown")
    write(
        results,
        config.getoption("--conformance-json"),
        config.getoption("--conformance-html"),
        markdown,
    )
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if markdown and step_summary:
        with open(step_summary, "a", encoding="utf-8") as summary:
            summary.write(to_markdown(results))


def _skips_by_reason(terminalreporter: pytest.TerminalReporter) -> None:
    """Skipped tests grouped by reason with a count, instead of a line per test.

    Requirements that do not apply to a driver are left to the matrix, which shows them.
    """
    reasons: collections.Counter[str] = collections.Counter()
    not_applicable = 0
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else ""
        reason = reason.removeprefix("Skipped: ")
        if " does not apply to " in reason or reason.startswith("not applicable: "):
            not_applicable += 1
        else:
            reasons[reason] += 1
    if not reasons and not not_applicable:
        return
    terminalreporter.section("skipped, by reason")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:4d}  {reason}")
    if not_applicable:
        terminalreporter.write_line(f"{not_applicable:4d}  not applicable (n/a in the matrix)")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> Iterator[None]:
    """The matrix and the verdicts, last: after pytest's failures and short summary."""
    yield
    results = terminalreporter.config.stash.get(results_key, None)
    if results is None:
        return
    write_line = terminalreporter.write_line
    _skips_by_reason(terminalreporter)
    terminalreporter.section("conformance by requirement")
    write_line(f"GPU host: {results.header['host']}")
    if results.header["simulated"]:
        write_line("These results used SIMULATED GPUs.")
    versions = [
        f"{name} ({info['version']})" if info["version"] else name
        for name, info in results.drivers.items()
    ]
    write_line(f"drivers: {', '.join(versions)}")
    for line in text_table(results):
        write_line(line)
    terminalreporter.section("verdict")
    if results.nothing_ran:
        write_line("FAIL: no driver could run here; every conformance test was skipped.", red=True)
    for verdict in results.verdicts:
        write_line(verdict.line, red=verdict.status != "PASS", green=verdict.status == "PASS")
