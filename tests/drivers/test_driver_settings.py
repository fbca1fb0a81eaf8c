"""Drivers refuse a setting of theirs from the environment naming the variable, at configure."""

from __future__ import annotations

from pathlib import Path

import pytest

from drivers.kubernetes import KubernetesDriver
from drivers.vm import MEMORY_ENV, VmDriver
from gpuhost import simulated
from gpuhost.environ import BadEnvironmentSetting
from gpuhost.host import GpuHost, HostConfig


def test_the_vm_driver_refuses_a_memory_size_it_cannot_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = simulated.setup(tmp_path / "sim", 1)
    try:
        monkeypatch.setenv(MEMORY_ENV, "2048M")
        with pytest.raises(BadEnvironmentSetting, match=f"^{MEMORY_ENV}='2048M': wanted a whole"):
            VmDriver(GpuHost.open(HostConfig(sim.root)), "settings")
    finally:
        simulated.teardown(sim.root)


def test_the_kubernetes_driver_refuses_a_timeout_it_cannot_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPU_SANDBOX_K8S_START_TIMEOUT_S", "2m")
    host = GpuHost.open(HostConfig(sim_root=None, state_dir=Path("/nonexistent")))
    with pytest.raises(BadEnvironmentSetting, match=r"^GPU_SANDBOX_K8S_START_TIMEOUT_S='2m'"):
        KubernetesDriver(host, "settings")
