"""Fixtures for the suite's own tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuhost import simulated

pytest_plugins = ["pytester"]


@pytest.fixture
def sim_host(tmp_path: Path) -> Iterator[simulated.SimulatedHost]:
    """A fresh 8-GPU simulated host of this test's own."""
    host = simulated.setup(tmp_path / "sim", 8)
    yield host
    simulated.teardown(host.root)
