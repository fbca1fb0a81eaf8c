"""The vm lane on real QEMU: the catalogue, the planted variants, what is refused up front.

The catalogue runs against the vm driver on a simulated host, and against each of its
planted broken variants; requests the driver must refuse are refused before a VM boots.
QEMU and the guest image must be there (`make test` builds them: `make vm-image`); a
machine without them fails here with the reason, never skips. Catalogue runs boot many VMs:
they run in one xdist group, one after the other.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance import requirements
from drivers.vm import VmDriver
from drivers.vm.driver import _default_run_dir, _own_run_dir
from drivers.vm.qemu import qemu_processes
from gpuhost import simulated
from gpuhost.errors import SandboxStartError, UnknownGpuDevice, UnsupportedGpuRequest
from gpuhost.host import GpuHost, HostConfig
from gpuhost.simulated import pci_proxy
from gpuhost.spec import SHARED, SandboxSpec
from tests.breakers import vms
from tests.catalogue import (
    assert_fails_its_requirement,
    golden_ids,
    partial_by_what_it_dropped,
    run_catalogue,
    without_the_busybox_key_case,
)

pytestmark = pytest.mark.xdist_group("vm")
RECLAIM_TIMEOUT = "--reclaim-timeout=10"
"""A killed QEMU's leases come back once its main thread is gone; on a loaded machine its
teardown can take longer than the 2 s the reference driver's self-tests allow."""


@pytest.fixture
def vm_host(tmp_path: Path) -> Iterator[GpuHost]:
    """A simulated host of 4 GPUs, one of them in MIG mode (the vm driver passes 3)."""
    sim = simulated.setup(tmp_path / "sim", 4, mig={0: ["1g.10gb"] * 2})
    yield GpuHost.open(HostConfig(sim.root))
    simulated.teardown(sim.root)


@pytest.fixture
def vm_driver(vm_host: GpuHost) -> Iterator[VmDriver]:
    driver = VmDriver(vm_host, f"vm-{time.time_ns()}")
    availability = driver.probe()
    assert availability.ok, f"the vm driver cannot run here: {availability.reason}"
    yield driver
    driver.reap(driver.session_id)


def test_catalogue_passes_the_vm_driver(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Every requirement of the vm profile passes on QEMU; the rest is not applicable."""
    result, run = run_catalogue(pytester, tmp_path, "vm", 8, RECLAIM_TIMEOUT)
    verdicts = without_the_busybox_key_case(result, "vm")
    # A VM runs on a kernel of its own: the host sees none of its processes to kill.
    partial_by_what_it_dropped(verdicts, result, "GPU-RECLAIM-01")
    profile = requirements.load().profile("vm")
    expected = {
        req: "not applicable" if profile[req] == "not applicable" else "passed"
        for req in golden_ids() - {"SANDBOX-PEER-01", "GPU-RECLAIM-01"}
    }
    assert {req: verdicts.get(req) for req in expected} == expected
    assert (
        "TCG" in result["drivers"]["vm"]["version"] or "KVM" in result["drivers"]["vm"]["version"]
    )
    run.stdout.fnmatch_lines(["vm: PASS (*mandatory passed*; 0 optional failed)"])
    assert run.ret == pytest.ExitCode.OK


@pytest.mark.parametrize("broken", vms.ALL, ids=[cls.__name__ for cls in vms.ALL])
def test_catalogue_fails_the_broken_vm_driver(
    pytester: pytest.Pytester, tmp_path: Path, broken: type[vms.BrokenVmDriver]
) -> None:
    assert_fails_its_requirement(pytester, tmp_path, broken, 4, RECLAIM_TIMEOUT)


def _nothing_taken(driver: VmDriver) -> None:
    __tracebackhide__ = True
    assert driver.sandboxes(driver.session_id) == [], "a VM was left behind"
    assert driver.host.leases.leases() == [], "a lease was left behind"


def test_more_than_one_gpu_is_refused_before_anything_is_taken(vm_driver: VmDriver) -> None:
    """Count 2, two exact IDs (with and without a count): UnsupportedGpuRequest, no VM."""
    gpus = vm_driver.inventory()
    ids_field = "template.driver_config.vm.gpu_device_ids"
    two = [vm_driver.device_ids(gpus[0])[0], vm_driver.device_ids(gpus[1])[1]]
    for spec, field in (
        (SandboxSpec.with_gpus(2), "resource_requirements.gpu.count"),
        (SandboxSpec.with_gpus(driver="vm", device_ids=two), ids_field),
        (SandboxSpec.with_gpus(2, driver="vm", device_ids=two), "resource_requirements.gpu.count"),
    ):
        with pytest.raises(UnsupportedGpuRequest) as refused:
            vm_driver.create(spec)
        assert refused.value.field == field
        assert "VM GPU sandboxes support only one GPU" in str(refused.value)
        assert f"this host has {len(gpus)} GPUs" in str(refused.value)
        _nothing_taken(vm_driver)
    with pytest.raises(UnsupportedGpuRequest) as shared:
        vm_driver.create(SandboxSpec.with_gpus(sharing=SHARED))
    assert shared.value.field == "resource_requirements.gpu.sharing"
    assert "'shared'" in str(shared.value)
    _nothing_taken(vm_driver)


@pytest.mark.parametrize(
    ("device_id", "message"),
    [
        ("0000:2a:0.0", "invalid PCI BDF address: '0000:2a:0.0'"),
        ("GPU-123", "invalid PCI BDF address: 'GPU-123'"),
        ("4", "GPU index '4' out of range (have 4 GPUs)"),
        ("0", "GPU index '0' (0000:18:00.0) in template.driver_config.vm.gpu_device_ids is in MIG"),
        ("0000:ee:00.0", "no GPU that passes through is at PCI address 0000:ee:00.0"),
        ("1\n", "invalid PCI BDF address: '1\\n'"),
        ("01", "invalid PCI BDF address: '01'"),
        ("0001", "invalid PCI BDF address: '0001'"),
        ("٣", "invalid PCI BDF address: '٣'"),
        (" 0000:2a:00.0", "invalid PCI BDF address: ' 0000:2a:00.0'"),
        ("0000:2a:00.0\t", "invalid PCI BDF address: '0000:2a:00.0\\t'"),
        ("00000:2a:00.0", "invalid PCI BDF address: '00000:2a:00.0'"),
        ("0000000:2A:00.0", "invalid PCI BDF address: '0000000:2A:00.0'"),
        pytest.param("9" * 5000, "GPU index '99999", id="5000-nines"),
    ],
)
def test_bad_exact_ids_name_the_value(vm_driver: VmDriver, device_id: str, message: str) -> None:
    with pytest.raises(UnknownGpuDevice) as refused:
        vm_driver.create(SandboxSpec.with_gpus(driver="vm", device_ids=[device_id]))
    assert refused.value.field == "template.driver_config.vm.gpu_device_ids"
    assert refused.value.value == device_id
    assert message in str(refused.value)
    _nothing_taken(vm_driver)


def test_it_lists_every_form_of_a_pci_address_it_takes(vm_host: GpuHost) -> None:
    """The kernel's, NVML's and lspci's, in either letter case: IDs (GPU-VALIDATE-03)."""
    gpu = VmDriver(vm_host, "forms").inventory()[0]
    domain, _, rest = gpu.pci_bus_id.partition(":")
    index = VmDriver(vm_host, "forms").device_index()
    for form in (gpu.pci_bus_id, f"0000{domain}:{rest}", rest):
        assert index[form] == index[form.upper()] == (gpu,), form
    assert f"0{gpu.pci_bus_id}" not in index


def test_a_gpu_in_mig_mode_is_not_offered(vm_driver: VmDriver, vm_host: GpuHost) -> None:
    in_mig = next(gpu for gpu in vm_host.gpus if gpu.mig_enabled)
    assert in_mig not in vm_driver.inventory()
    with pytest.raises(UnknownGpuDevice):
        vm_driver.create(SandboxSpec.with_gpus(driver="vm", device_ids=[in_mig.pci_bus_id]))


def test_one_gpu_sees_its_own_address_and_a_second_vm_cannot_open_it(
    vm_driver: VmDriver,
) -> None:
    """The guest finds an NVIDIA function at the host's own address, and only there.

    The GPU's function refuses a second VM (EBUSY) while the first lives, and serves the
    next once it ends.
    """
    gpu = vm_driver.inventory()[-1]
    with vm_driver.create(SandboxSpec.with_gpus(driver="vm", device_ids=[gpu.pci_bus_id])) as vm:
        found = vm.exec(["sh", "-c", "cat /sys/bus/pci/devices/*/uevent | grep PCI_ID="]).check()
        assert "PCI_ID=10DE:2330" in found.stdout
        slots = vm.exec(["sh", "-c", "grep -l 10de /sys/bus/pci/devices/*/vendor"]).check()
        assert slots.stdout.split() == [f"/sys/bus/pci/devices/{gpu.pci_bus_id}/vendor"]
        assert vm_driver.host.simulated is not None
        locks = vm_driver.host.simulated.root / "vfio-groups"
        with pytest.raises(pci_proxy.GpuFunctionBusy):
            pci_proxy.GpuFunction.claim(locks, gpu.pci_bus_id)
    pci_proxy.GpuFunction.claim(locks, gpu.pci_bus_id).handed_over()


def test_qemu_runs_under_its_seccomp_filter(vm_driver: VmDriver) -> None:
    """Before: no ``-sandbox``: QEMU, a large attack surface facing the guest, unfiltered."""
    with vm_driver.create(SandboxSpec()) as vm:
        ((sandbox, pid),) = qemu_processes(vm_driver.session_id)
        assert sandbox == vm.id
        status = Path(f"/proc/{pid}/status").read_text()
        assert "\nSeccomp:\t2\n" in status, status  # 2: a filter
        assert vm.exec(["true"]).returncode == 0


def test_version_names_the_acceleration_and_the_simulation(vm_driver: VmDriver) -> None:
    version = vm_driver.version()
    accel, why = vm_driver.acceleration()
    assert version.startswith("qemu "), version
    assert accel.upper() in version
    assert why
    assert "simulated" in version


def test_probe_without_the_image_says_what_to_run(
    vm_host: GpuHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_SANDBOX_VM_IMAGE", str(tmp_path / "none"))
    availability = VmDriver(vm_host, "probe").probe()
    assert not availability.ok
    assert "make vm-image" in availability.reason
    assert availability.reason.startswith("needed ")


# -- the run directory of a user other than root ---------------------------------------------


@pytest.fixture
def shared_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A /tmp of the test's own (sticky, all may write), as a user other than root sees it."""
    base = Path(tempfile.mkdtemp(prefix="gpu-sandbox-vm-test-"))
    base.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    monkeypatch.delenv("GPU_SANDBOX_VM_RUN_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    yield base
    shutil.rmtree(base)


def as_uid(monkeypatch: pytest.MonkeyPatch, uid: int) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    monkeypatch.setattr(os, "getuid", lambda: uid)


@pytest.mark.parametrize("planted", ["another user's directory", "a link"])
def test_a_predictable_run_directory_another_user_took_first_is_refused_by_name(
    vm_host: GpuHost, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    """/tmp/gpu-sandbox-vm-<uid>: any user can make it before the one whose name it bears."""
    path = shared_tmp / "gpu-sandbox-vm-65534"
    target = shared_tmp / "elsewhere"
    target.mkdir()
    if planted == "a link":
        path.symlink_to(target)
    else:
        path.mkdir()  # root's, not 65534's
    as_uid(monkeypatch, 65534)
    driver = VmDriver(vm_host, "run-dir")
    availability = driver.probe()
    assert not availability.ok
    said = "is a link" if planted == "a link" else "is uid 0's directory, not this user's"
    assert f"{path}: {said}" in availability.reason, availability.reason
    assert availability.reason.startswith("needed a run directory of this user's own")
    with pytest.raises(SandboxStartError, match="needed a run directory"):
        driver.acceleration()
    assert list(target.iterdir()) == []


def test_a_users_run_directory_is_under_its_runtime_directory_when_it_has_one(
    vm_host: GpuHost, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = shared_tmp / "run-user"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    as_uid(monkeypatch, 1000)
    assert _default_run_dir() == runtime / "gpu-sandbox-vm"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert _default_run_dir() == shared_tmp / "gpu-sandbox-vm-1000"


def test_a_run_directory_of_the_users_own_is_made_private(
    shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = shared_tmp / "gpu-sandbox-vm-0"
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    assert _own_run_dir(path) == ""
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    fresh = shared_tmp / "fresh"
    assert _own_run_dir(fresh) == ""
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700


def _qemu_message(cmd: int, payload: bytes) -> bytes:
    return struct.pack("=i4xQ", cmd, len(payload)) + payload


def test_the_pci_function_answers_qemus_protocol() -> None:
    """Config reads and writes, BAR sizing and a memory map with descriptors, as QEMU sends."""
    ours, qemu = socket.socketpair()
    server = threading.Thread(target=pci_proxy.serve, args=(ours,), daemon=True)
    server.start()

    def config(cmd: int, addr: int, value: int, length: int) -> int:
        qemu.sendall(_qemu_message(cmd, struct.pack("=IIi", addr, value, length)))
        reply = qemu.recv(24, socket.MSG_WAITALL)
        answer, size, value = struct.unpack("=i4xQQ", reply)
        assert (answer, size) == (pci_proxy.RET, 8)
        return int(value)

    read, write = pci_proxy.PCI_CFGREAD, pci_proxy.PCI_CFGWRITE
    assert config(read, 0x00, 0, 2) == 0x10DE
    assert config(read, 0x02, 0, 2) == 0x2330
    assert config(read, 0x08, 0, 4) >> 8 == 0x030200
    # A memory map arrives with a descriptor; no answer is due, and the descriptor is closed.
    memfd = os.memfd_create("guest-ram")
    socket.send_fds(qemu, [_qemu_message(pci_proxy.SYNC_SYSMEM, bytes(192))], [memfd])
    os.close(memfd)
    config(write, 0x10, 0xFFFFFFFF, 4)
    assert config(read, 0x10, 0, 4) == (~(pci_proxy.BAR0_SIZE - 1)) & 0xFFFFFFF0
    assert config(read, 0x3D, 0, 1) == 1
    qemu.close()
    server.join(5)
    assert not server.is_alive(), "the server outlived QEMU's end of the socket"
