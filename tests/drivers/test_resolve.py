"""Exact IDs resolved to a host's GPUs: the messages a driver author reads when one is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from drivers.base import Driver
from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.devices import GpuDevice
from gpuhost.errors import UnknownGpuDevice
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec, select


class WholeGpusOnly(ReferenceDriver):
    """Takes exact IDs of the GPUs it hands out whole, as a driver written first does."""

    name = "whole-only"

    def exact_devices(self) -> tuple[GpuDevice, ...]:
        return self.inventory()


def _refusal(driver: Driver, device_id: str) -> str:
    spec = SandboxSpec.with_gpus(1, driver=driver.name, device_ids=[device_id])
    with pytest.raises(UnknownGpuDevice) as refused:
        driver.plan(select(spec, driver.name))
    return str(refused.value)


def test_an_id_of_a_gpu_in_mig_mode_says_why_it_is_unknown(tmp_path: Path) -> None:
    mig = simulated.parse_mig_layout("1:7x1g.10gb,2:3x2g.20gb")
    host = simulated.setup(tmp_path / "sim", 4, mig=mig)
    try:
        driver = WholeGpusOnly(GpuHost.open(HostConfig(sim_root=host.root)), "resolve")
        message = _refusal(driver, "1")
        assert "this host has 2 GPUs, and GPU 1, 2 in MIG mode: not whole GPUs" in message
        assert "name one of their MIG instances instead (gpu-sandbox gpus lists" in message
        # A driver that takes them whole has nothing to explain.
        reference = ReferenceDriver(GpuHost.open(HostConfig(sim_root=host.root)), "resolve")
        assert "MIG mode" not in _refusal(reference, "7")
    finally:
        simulated.teardown(host.root)


def test_a_pci_address_names_its_gpu_in_either_letter_case_and_nothing_else_does(
    tmp_path: Path,
) -> None:
    """GPU-VALIDATE-03: as the kernel writes it and as NVML does; no other spelling."""
    host = simulated.setup(tmp_path / "sim", 2, dri=simulated.parse_dri_layout("amd:2"))
    try:
        driver = ReferenceDriver(GpuHost.open(HostConfig(sim_root=host.root)), "resolve")
        amd = driver.host.dri_gpus[-1]
        assert amd.pci_bus_id == "0000:c3:00.0"
        for spelled in ("0000:c3:00.0", "0000:C3:00.0"):
            spec = SandboxSpec.with_gpus(driver=driver.name, device_ids=[spelled])
            plan = driver.plan(select(spec, driver.name))
            assert plan is not None, spelled
            assert plan.gpus == (amd,), spelled
        for near in ("0000:C3:00.0 ", "0000:c3:00.0\n", "0000:C3:00", "PCI-0000:C3:00.0"):
            assert repr(near) in _refusal(driver, near)
    finally:
        simulated.teardown(host.root)
