"""Fixtures for the suite's own tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from gpuhost import simulated

pytest_plugins = ["pytester"]

# The property tests: `make test` runs a short pass, derandomized so that a red run is the
# same red run again; `make fuzz` (HYPOTHESIS_PROFILE=nightly) a long random one.
settings.register_profile(
    "ci",
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "nightly",
    max_examples=20_000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def sim_host(tmp_path: Path) -> Iterator[simulated.SimulatedHost]:
    """A fresh 8-GPU simulated host of this test's own."""
    host = simulated.setup(tmp_path / "sim", 8)
    yield host
    simulated.teardown(host.root)


LANE_GROUPS = {"engines", "kubernetes", "vm"}
"""The xdist groups of the tests that need dockerd and podman, a cluster, or QEMU."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fuzz: a property test of bad input (make fuzz runs these long)"
    )
    config.addinivalue_line(
        "markers",
        "lane: runs the catalogue in a subprocess, or needs an engine, a cluster or QEMU "
        '(set here, not by hand); `pytest tests -m "not lane"` is the quick loop',
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        groups = {mark.args[0] for mark in item.iter_markers("xdist_group") if mark.args}
        if groups & LANE_GROUPS or "pytester" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.lane)
