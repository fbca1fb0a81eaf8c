"""The fixtures the catalogue's tests take: the host, each driver, sandboxes, the settings.

Every test that takes ``driver`` runs once per driver of the run; a driver that cannot run
here is skipped with what it needed, or fails the run if it was named. Whatever a test
leaves behind is closed and reaped after it, so that a failure points at its own
requirement, not at the tests after it.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, TextIO

import pytest

from conformance import requirements
from conformance.bounds import DriverPace, unpaced_allowance
from conformance.settings import Settings, settings_key
from drivers import watch
from drivers.base import Driver, Sandbox
from gpuhost.host import GpuHost
from gpuhost.leases import Lease, lock_holders
from gpuhost.spec import SandboxSpec
from gpuhost.wait import wait_for


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
def _gpu_test(request: pytest.FixtureRequest, settings: Settings) -> Iterator[None]:
    """Skip when the host has too few GPUs; after the test, leave nothing of it behind.

    Every sandbox the test created through this driver's class is closed, whatever the test
    body did, and the session is reaped. Then nothing of the test may be left: a lease it
    took, or a sandbox of the session. What is left fails this test (not the ones after
    it, which would find the GPUs held) and is released, so that each failure points at the
    requirement that was broken.
    """
    if "driver" not in request.fixturenames:
        yield
        return
    driver: Driver = request.getfixturevalue("driver")
    capabilities = driver.capabilities
    pools = capabilities.mig_profiles or set(capabilities.vendors) - {"nvidia"}
    for marker, declared, declaration, why in (
        ("exclusive", not capabilities.exclusive, "exclusive=False", "shares GPUs"),
        ("shares_gpus", not capabilities.shared, "shared=False", "never shares GPUs"),
        ("chooses_pools", not pools, "pools=none", "serves no MIG profile and no other vendor"),
    ):
        if declared and request.node.get_closest_marker(marker):
            _left_out(request.node, f"the {driver.name} driver {why} ({declaration})", declaration)
    marker = request.node.get_closest_marker("gpus")
    have = len(driver.inventory())
    if marker is not None and have < marker.args[0]:
        pytest.skip(f"needs {marker.args[0]} GPUs (host has {have})")
    before = {lease.sandbox_id for lease in driver.host.leases.leases()}
    grace = exhaustion_grace(driver, settings)
    pace = settings.paces.setdefault(
        driver.name, DriverPace(driver.name, grace, settings.lanes_at_once)
    )
    with _every_sandbox_created(type(driver), pace) as made:
        yield
    try:
        _close(made)
    finally:
        driver.reap(driver.session_id)
        _nothing_left(driver, before, settings.reclaim_timeout_s)


def exhaustion_grace(driver: Driver, settings: Settings) -> float:
    """How much longer than a create a refusal may take: --exhaustion-grace, or the driver's."""
    if settings.exhaustion_grace_s is not None:
        return settings.exhaustion_grace_s
    return driver.exhaustion_grace_s


@contextlib.contextmanager
def _every_sandbox_created(cls: type[Driver], pace: DriverPace) -> Iterator[list[Sandbox]]:
    """The sandboxes that drivers of ``cls`` create in this process meanwhile, any session.

    Each create, and each exec and close of what they made, within the driver's pace: one
    that runs past it fails the test that made it.
    """
    with watch.watched(_Paced(cls, pace)) as paced:
        yield paced.made


class _Paced(watch.Watch):
    """The contract's watch, set by the catalogue: the driver under test kept to its pace."""

    def __init__(self, cls: type[Driver], pace: DriverPace) -> None:
        self.cls, self.pace = cls, pace
        self.made: list[Sandbox] = []

    def create(self, driver: Driver, spec: SandboxSpec, call: Callable[[], Sandbox]) -> Sandbox:
        if not isinstance(driver, self.cls):
            return call()
        allowance = unpaced_allowance()
        sandbox = self.pace.create.call(
            f"create of {spec.to_dict()}",
            call,
            own_timeout_s=allowance or 0.0,
            if_late=Sandbox.close,
            expected="a request it cannot grant must be refused, not waited on",
            paced=allowance is None,
        )
        self.made.append(sandbox)
        return sandbox

    def exec(
        self, sandbox: Sandbox, argv: Sequence[str], timeout: float, call: Callable[[], int]
    ) -> int:
        if sandbox not in self.made:
            return call()
        return self.pace.exec.call(
            f"exec of {list(argv)!r} in sandbox {sandbox.id}",
            call,
            own_timeout_s=timeout,
            expected="a command past its timeout must be killed and the exec return",
        )

    def close(self, sandbox: Sandbox, call: Callable[[], None]) -> None:
        if sandbox not in self.made:
            return call()
        return self.pace.close.call(f"close of sandbox {sandbox.id}", call)


def _close(made: list[Sandbox]) -> None:
    """Close every sandbox still open, all at once (engines take a while each)."""
    still_open = [sandbox for sandbox in made if not sandbox.closed]
    with ThreadPoolExecutor(max(1, len(still_open))) as pool:
        for closing in [pool.submit(sandbox.close) for sandbox in still_open]:
            closing.result()


def _nothing_left(driver: Driver, before: set[str], timeout_s: float) -> None:
    """Fail the test that leaves a lease it took, or a sandbox of the session, once reaped.

    A killed holder's leases go when the registry sees it dead, so this waits as long as
    GPU-RECLAIM-01 allows before it judges; then it releases what is left.
    """
    __tracebackhide__ = True

    def left() -> tuple[list[Lease], list[str]]:
        leases = [lease for lease in driver.host.leases.leases() if lease.sandbox_id not in before]
        return leases, driver.sandboxes(driver.session_id)

    leases, sandboxes = left()
    if not leases and not sandboxes:
        return
    with contextlib.suppress(TimeoutError):
        wait_for(left, lambda found: not any(found), timeout_s=timeout_s, what="leftovers to go")
    leases, sandboxes = left()
    if not leases and not sandboxes:
        return
    for sandbox_id in {lease.sandbox_id for lease in leases}:
        driver.host.leases.release(sandbox_id)
    held = "; ".join(lease.describe() for lease in leases) or "none"
    pytest.fail(
        f"this test left behind, once its sandboxes were closed and session "
        f"{driver.session_id} reaped: sandboxes {sandboxes or 'none'}; leases: {held}",
        pytrace=False,
    )


def _left_out(item: pytest.Item, why: str, declaration: str) -> NoReturn:
    """Not applicable by a driver's declaration, where the profiles accept it; else a failure.

    A declaration no profile accepts (exclusive=False: an allocator that hands one GPU to
    two racing sandboxes would pass by it) fails the requirement, naming the declaration.
    """
    if declaration in requirements.load().accepted_declarations:
        item.user_properties.append(("declared", declaration))
        not_applicable(item, why)
    pytest.fail(
        f"{why}, which would leave this requirement out; no profile accepts the declaration "
        f"{declaration} (accepted_declarations in REQUIREMENTS.yaml)",
        pytrace=False,
    )


def not_applicable(item: pytest.Item, why: str) -> NoReturn:
    """Skip ``item`` as not applicable: its requirement's cell leaves it out."""
    item.user_properties[:] = [(k, v) for k, v in item.user_properties if k != "level"]
    item.user_properties.append(("level", "not applicable"))
    pytest.skip(f"not applicable: {why}")


class SandboxFactory:
    """Creates sandboxes for one test and closes whatever the test left open.

    (Any sandbox a test creates is closed after it, however made: this closes its own first.)
    """

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.open: list[Sandbox] = []

    def __call__(self, spec: SandboxSpec) -> Sandbox:
        sandbox = self.driver.create(spec)
        self.open.append(sandbox)
        return sandbox

    def close_all(self) -> None:
        """Close every sandbox the test left open, all at once (engines take a while each)."""
        _close(self.open)
        self.open.clear()


@pytest.fixture
def sandboxes(driver: Driver) -> Iterator[SandboxFactory]:
    factory = SandboxFactory(driver)
    try:
        yield factory
    finally:
        factory.close_all()


Dropped = Callable[[str, str], None]


@pytest.fixture
def dropped(request: pytest.FixtureRequest) -> Dropped:
    """``dropped(case, why)``: a case of the test's requirement this host cannot show.

    The test goes on with the rest; its requirement's cell is then partial, never passed,
    naming the case and why (a one-GPU host cannot hold one GPU while granting another).
    """

    def drop(case: str, why: str) -> None:
        request.node.user_properties.append(("dropped", f"{case} ({why})"))

    return drop


@pytest.fixture
def settings(pytestconfig: pytest.Config) -> Settings:
    return pytestconfig.stash[settings_key]


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
