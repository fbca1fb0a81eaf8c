"""The pytest plugin of the GPU sandbox conformance suite: its options and hooks.

``--driver`` picks the drivers (default: every built-in one). Each test that takes the
``driver`` fixture runs once per driver; a driver that cannot run here is skipped with what
it needed and what it found, unless it was named explicitly, in which case it is an error:
a release gate must never go green by skipping.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from conformance import requirements
from conformance.recorder import Recorder
from conformance.settings import (
    SESSION_KEY,
    SIM_ROOT_KEY,
    driver_of,
    gpu_properties,
    settings_from,
    settings_key,
)
from drivers import REGISTRY, reap_session
from drivers.base import check_session_id
from gpuhost import simulated
from gpuhost.leases import DEFAULT_SHARE_LIMIT, Holder
from gpuhost.vfio import REBIND_ENV

pytest_plugins = ["conformance.fixtures"]
"""The fixtures the catalogue takes (conformance/fixtures.py)."""

SIM_RUN_DIR = Path("/run/gpu-sandbox-runs")
"""Where ``--sim-gpus`` makes each run's simulated host: a tmpfs, emptied at boot."""
CDI_RUN_DIR = Path("/var/run/cdi")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpu-sandbox", "GPU sandbox conformance")
    group.addoption(
        "--driver",
        action="append",
        default=None,
        help="Run against these drivers, comma-separated or repeated: built-in names "
        f"({', '.join(REGISTRY)}), module:Class import paths or exec:MANIFEST. Default: every "
        "built-in driver, skipping those that cannot run here; a driver named here must run.",
    )
    group.addoption(
        "--lane",
        default=None,
        metavar="NAME",
        help="Run one built-in driver as the default run would (skipped, with what it "
        "needed, where it cannot run), as one lane of a run that python -m conformance.lanes "
        "splits by driver: whether anything ran at all is judged over the whole run.",
    )
    group.addoption(
        "--lanes-at-once",
        type=int,
        default=1,
        metavar="N",
        help="How many runs share this machine (set by python -m conformance.lanes): each "
        "create, exec and close is bounded by N times the pace of its driver's so far.",
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
        "--vm-rebind-gpus",
        action="store_true",
        help=f"Let the vm driver take GPUs from the nvidia driver for its VMs, those no "
        f"process holds open (or set {REBIND_ENV}=1); by default, on a real host, it uses only "
        "GPUs already bound to vfio-pci.",
    )
    group.addoption(
        "--require-complete",
        action="store_true",
        help="A release run: a mandatory requirement that was not fully checked here (its "
        "tests skipped for what the host lacks, or not selected) fails the gate, named with "
        "what was missing.",
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
    if config.getoption("--vm-rebind-gpus"):
        os.environ[REBIND_ENV] = "1"  # what the vm driver reads, in this process and workers
    settings = settings_from(config)
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
    config.pluginmanager.register(Recorder(), "gpu-sandbox-recorder")


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
    node.workerinput[SESSION_KEY] = settings.session_id
    if settings.host_config.sim_root is not None:
        node.workerinput[SIM_ROOT_KEY] = str(settings.host_config.sim_root)


def pytest_cmdline_main(config: pytest.Config) -> int | None:
    session = config.getoption("--reap")
    if session is None:
        return None
    try:
        check_session_id(session)
    except ValueError as exc:
        raise pytest.UsageError(f"--reap: {exc}") from None
    settings = settings_from(config)
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
        driver = driver_of(item)
        if marker:
            item.user_properties.append(("requirement", marker.args[0]))
        if driver:
            item.user_properties.append(("driver", driver))
            # Every GPU test shares the host's GPUs: under xdist they run in one worker.
            item.add_marker(pytest.mark.xdist_group("gpu-host"))
        if marker and driver:
            # The JUnit test case's properties: what was checked, on what, and how it counts.
            level = golden.level(marker.args[0], driver)
            gpus = gpu_properties(config.stash[settings_key].host)
            item.user_properties += [("level", level), *gpus.items()]
            if level == "not applicable":
                item.add_marker(
                    pytest.mark.skip(reason=f"{marker.args[0]} does not apply to {driver}")
                )


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
