"""The pytest plugin of the GPU sandbox conformance suite: options, drivers, fixtures, report.

``--driver`` picks the drivers (default: every built-in one). Each test that takes the
``driver`` fixture runs once per driver; a driver that cannot run here is skipped with what
it needed and what it found, unless it was named explicitly, in which case it is an error:
a release gate must never go green by skipping.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from drivers import REGISTRY, UnknownDriver, get_driver_class
from drivers.base import Driver, Sandbox
from drivers.host import GpuHost, HostConfig
from drivers.spec import SandboxSpec

ROOT = Path(__file__).parent
REQUIREMENTS_FILE = ROOT / "conformance" / "REQUIREMENTS.yaml"


@dataclass
class Settings:
    drivers: dict[str, type[Driver]]
    explicit: bool
    host_config: HostConfig
    session_id: str
    image: str | None
    reclaim_timeout_s: float

    @functools.cached_property
    def host(self) -> GpuHost:
        """The GPU host, discovered once per session (NVML is not free on a real host)."""
        return GpuHost.open(self.host_config)


settings_key = pytest.StashKey[Settings]()
_SESSION_KEY = "gpu_sandbox_session"


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
        help="Use the simulated GPU host under this directory (see python -m drivers.simgpu).",
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
        help="Write each test's requirement, driver and outcome to PATH as JSON.",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[settings_key] = _settings(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Give xdist workers the controller's session id, so that reap finds their sandboxes."""
    node.workerinput[_SESSION_KEY] = node.config.stash[settings_key].session_id


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
        host_config=HostConfig(config.getoption("--sim-root"), config.getoption("--gpu-state-dir")),
        session_id=getattr(config, "workerinput", {}).get(_SESSION_KEY) or uuid.uuid4().hex[:16],
        image=config.getoption("--image"),
        reclaim_timeout_s=config.getoption("--reclaim-timeout"),
    )


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    session = config.getoption("--reap")
    if session is None:
        return None
    settings = _settings(config)
    for name, cls in settings.drivers.items():
        removed = cls(settings.host, session, settings.image).reap(session)
        print(f"{name}: removed {len(removed)} sandbox(es) of session {session}")  # noqa: T201
    return 0


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
    applies = _applicability()
    for item in items:
        marker = item.get_closest_marker("requirement")
        params = getattr(item, "callspec", None)
        driver = params.params.get("driver") if params else None
        if marker:
            item.user_properties.append(("requirement", marker.args[0]))
        if driver:
            item.user_properties.append(("driver", driver))
            # Every GPU test shares the host's GPUs: under xdist they run in one worker.
            item.add_marker(pytest.mark.xdist_group("gpu-host"))
            if (
                marker
                and driver in REGISTRY
                and driver not in applies.get(marker.args[0], REGISTRY)
            ):
                item.add_marker(
                    pytest.mark.skip(reason=f"{marker.args[0]} does not apply to {driver}")
                )


def _select_requirements(config: pytest.Config, items: list[pytest.Item]) -> None:
    option = config.getoption("--requirement")
    if not option:
        return
    wanted = {name.strip() for name in option.split(",") if name.strip()}
    unknown = wanted - set(_applicability())
    if unknown:
        raise pytest.UsageError(f"--requirement: unknown requirement(s) {sorted(unknown)}")

    def selected(item: pytest.Item) -> bool:
        marker = item.get_closest_marker("requirement")
        return marker is not None and marker.args[0] in wanted

    config.hook.pytest_deselected(items=[item for item in items if not selected(item)])
    items[:] = [item for item in items if selected(item)]


@functools.cache
def _applicability() -> dict[str, list[str]]:
    if not REQUIREMENTS_FILE.exists():
        return {}
    entries = yaml.safe_load(REQUIREMENTS_FILE.read_text())["requirements"]
    return {entry["id"]: entry["drivers"] for entry in entries}


@pytest.fixture(scope="session")
def gpu_host(pytestconfig: pytest.Config) -> GpuHost:
    return pytestconfig.stash[settings_key].host


@pytest.fixture(scope="session")
def driver(request: pytest.FixtureRequest, gpu_host: GpuHost) -> Iterator[Driver]:
    settings = request.config.stash[settings_key]
    name: str = request.param
    instance = settings.drivers[name](gpu_host, settings.session_id, settings.image)
    availability = instance.probe()
    if not availability.ok:
        if settings.explicit:
            pytest.fail(
                f"{name} was named in --driver but cannot run: {availability.reason}",
                pytrace=False,
            )
        pytest.skip(f"{name}: {availability.reason}")
    yield instance
    instance.reap(settings.session_id)


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
        pytest.skip(f"not applicable: the {driver.name} driver shares GPUs (exclusive=False)")
    marker = request.node.get_closest_marker("gpus")
    have = len(driver.inventory())
    if marker is not None and have < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} GPUs (host has {have})")
    yield
    driver.reap(driver.session_id)


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
        for sandbox in reversed(self.open):
            sandbox.close()
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


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    props = dict(report.user_properties)
    if "requirement" not in props or "driver" not in props:
        return
    if report.when != "call" and not (report.failed or report.skipped):
        return
    outcome = "error" if report.failed and report.when != "call" else report.outcome
    _REPORTS.append(
        {
            "nodeid": report.nodeid,
            "requirement": str(props["requirement"]),
            "driver": str(props["driver"]),
            "outcome": outcome,
            "message": _message(report),
        }
    )


_REPORTS: list[dict[str, str]] = []


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = getattr(crash, "message", None) or str(report.longrepr).strip()
        return str(message).splitlines()[0][:300]
    return ""


def requirement_matrix(
    reports: list[dict[str, str]], requirements: list[str], drivers: list[str]
) -> dict[str, dict[str, str]]:
    """Requirement → driver → one verdict over its tests.

    ``failed`` if any failed; ``passed`` if all passed; ``partial`` if some passed and the
    rest were skipped (e.g. for want of GPUs); ``skipped`` if all were; ``not run`` for a
    requirement of the golden list that no selected test covered.
    """
    outcomes: dict[tuple[str, str], set[str]] = {}
    for entry in reports:
        outcome = "failed" if entry["outcome"] == "error" else entry["outcome"]
        outcomes.setdefault((entry["requirement"], entry["driver"]), set()).add(outcome)
    matrix: dict[str, dict[str, str]] = {}
    for requirement in sorted({*requirements, *(req for req, _ in outcomes)}):
        row = matrix[requirement] = {}
        for driver in drivers:
            seen = outcomes.get((requirement, driver), set())
            if not seen:
                row[driver] = "not run"
            elif "failed" in seen:
                row[driver] = "failed"
            elif seen == {"passed"}:
                row[driver] = "passed"
            elif "passed" in seen:
                row[driver] = "partial"
            else:
                row[driver] = "skipped"
    return matrix


def _nothing_ran(reports: list[dict[str, str]]) -> bool:
    return bool(reports) and all(entry["outcome"] == "skipped" for entry in reports)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    # A run in which every driver was skipped checked nothing: it must not pass.
    passing = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
    worker = hasattr(session.config, "workerinput")
    if not worker and session.exitstatus in passing and _nothing_ran(_REPORTS):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    config = terminalreporter.config
    if hasattr(config, "workerinput") or not _REPORTS:
        return
    settings = config.stash[settings_key]
    drivers = [name for name in settings.drivers if any(e["driver"] == name for e in _REPORTS)]
    matrix = requirement_matrix(_REPORTS, list(_applicability()), drivers)
    terminalreporter.section("conformance by requirement")
    host = settings.host
    terminalreporter.write_line(f"GPU host: {host.describe()}")
    if host.simulated:
        terminalreporter.write_line("These results used SIMULATED GPUs.")
    if _nothing_ran(_REPORTS):
        terminalreporter.write_line(
            "FAIL: no driver could run here; every conformance test was skipped.", red=True
        )
    width = max(len(req) for req in matrix) + 2
    terminalreporter.write_line("requirement".ljust(width) + "".join(d.ljust(12) for d in drivers))
    for req in sorted(matrix):
        cells = "".join(matrix[req].get(name, "-").ljust(12) for name in drivers)
        terminalreporter.write_line(req.ljust(width) + cells)
    path = config.getoption("--conformance-json")
    if path:
        path.write_text(
            json.dumps(
                {
                    "session": settings.session_id,
                    "simulated": host.simulated is not None,
                    "host": host.describe(),
                    "tests": _REPORTS,
                    "matrix": matrix,
                },
                indent=2,
            )
        )
