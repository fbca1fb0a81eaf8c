"""VFIO binding (gpuhost/vfio.py) on sysfs trees the tests construct, with a kernel stand-in.

No machine here has an IOMMU or a GPU, so the tree is made by the test: PCI functions with
their ids, ``driver`` links and ``driver_override``, drivers whose ``bind`` and ``unbind``
are FIFOs, IOMMU groups holding a GPU and its audio function. A thread plays the kernel's part:
it reads what is written to ``bind`` and ``unbind`` and moves the ``driver`` links as the
kernel would, refusing a bind that ``driver_override`` forbids. The binder under test only
reads and writes files, as it does on a real /sys.

``BindingNotRestored`` (tests/breakers/vms.py), the planted binder that gives nothing back,
fails the checks of restoring after close and after a crash.

The vm lane runs on such trees too, as on a real host (``VfioPassthrough``): its probe and
inventory, and a create whose QEMU is a stand-in process (``spawn_qemu``), with the binder
writing to the tree.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from drivers.vm import VmDriver
from drivers.vm.agent import GuestAgent
from drivers.vm.image import GuestImage
from drivers.vm.passthrough import VfioPassthrough
from gpuhost import vfio
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuAllocationError, SandboxStartError, UnknownGpuDevice
from gpuhost.host import GpuHost, HostConfig
from gpuhost.leases import Holder, LeaseRegistry
from gpuhost.spec import SandboxSpec
from gpuhost.vfio import (
    VFIO_DRIVER,
    BusGpu,
    VfioBinder,
    VfioError,
    VfioRecordCorrupt,
    VfioRefused,
)
from tests.breakers.vms import BindingNotRestored

GPU, AUDIO, OTHER_GPU, LONE = "0000:2a:00.0", "0000:2a:00.1", "0000:5d:00.0", "0000:9a:00.0"
ORIGINAL = {GPU: "nvidia", AUDIO: "snd_hda_intel", OTHER_GPU: "nvidia", LONE: None}
PREPARED = {**ORIGINAL, OTHER_GPU: VFIO_DRIVER}
"""A host whose admin bound one GPU to vfio-pci for passthrough (driverctl set-override)."""
GROUPS = {GPU: "17", AUDIO: "17", OTHER_GPU: "42", LONE: "51"}
IDS = {  # class, vendor, device: two H100s (3D controllers), an audio function, a NIC
    GPU: ("0x030200", "0x10de", "0x2330"),
    AUDIO: ("0x040300", "0x10de", "0x22a3"),
    OTHER_GPU: ("0x030200", "0x10de", "0x2330"),
    LONE: ("0x020000", "0x8086", "0x1572"),
}
DRIVERS = ("nvidia", "snd_hda_intel", "nouveau", VFIO_DRIVER)


class ConstructedSysfs:
    """A sysfs tree of PCI functions in IOMMU groups, and a thread acting as its kernel."""

    def __init__(self, root: Path, original: dict[str, str | None] = ORIGINAL) -> None:
        self.root = root
        self.original = original
        self.refused: list[str] = []
        self.asked: list[str] = []
        """Every ``bind`` and ``unbind`` written, as ``<action> <function> <driver>``."""
        self.hang_binds = False
        devices = root / "bus" / "pci" / "devices"
        for bdf, group in GROUPS.items():
            device = devices / bdf
            device.mkdir(parents=True)
            for name, value in zip(("class", "vendor", "device"), IDS[bdf], strict=True):
                (device / name).write_text(f"{value}\n")
            # driverctl set-override leaves driver_override set, as the binder's claims do.
            override = VFIO_DRIVER if original.get(bdf) == VFIO_DRIVER else "(null)"
            (device / "driver_override").write_text(f"{override}\n")
            members = root / "kernel" / "iommu_groups" / group / "devices"
            members.mkdir(parents=True, exist_ok=True)
            (members / bdf).symlink_to(f"../../../../bus/pci/devices/{bdf}")
            (device / "iommu_group").symlink_to(f"../../../../kernel/iommu_groups/{group}")
        self._selector = selectors.DefaultSelector()
        for driver in DRIVERS:
            directory = root / "bus" / "pci" / "drivers" / driver
            directory.mkdir(parents=True)
            for action in ("bind", "unbind"):
                os.mkfifo(directory / action)
                fd = os.open(directory / action, os.O_RDWR | os.O_NONBLOCK)
                self._selector.register(fd, selectors.EVENT_READ, (driver, action))
        for bdf, bound in original.items():
            if bound:
                self._link(bdf, bound)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._kernel, daemon=True)
        self._thread.start()

    def driver(self, bdf: str) -> str | None:
        link = self.root / "bus" / "pci" / "devices" / bdf / "driver"
        return Path(os.readlink(link)).name if link.is_symlink() else None

    def override(self, bdf: str) -> str:
        text = (self.root / "bus" / "pci" / "devices" / bdf / "driver_override").read_text()
        return text.strip()

    def _link(self, bdf: str, driver: str) -> None:
        link = self.root / "bus" / "pci" / "devices" / bdf / "driver"
        link.symlink_to(f"../../../../bus/pci/drivers/{driver}")

    def _kernel(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                driver, action = key.data
                data = os.read(key.fd, 4096).decode()
                for bdf in data.split():
                    self.asked.append(f"{action} {bdf} {driver}")
                    self._apply(driver, action, bdf)

    def _apply(self, driver: str, action: str, bdf: str) -> None:
        link = self.root / "bus" / "pci" / "devices" / bdf / "driver"
        if action == "unbind":
            if self.driver(bdf) != driver:
                self.refused.append(f"unbind {bdf} from {driver}: not bound to it (ENODEV)")
                return
            link.unlink()
            return
        override = self.override(bdf)
        if self.driver(bdf) is not None:
            self.refused.append(f"bind {bdf} to {driver}: already bound (EBUSY)")
        elif override not in ("", "(null)") and override != driver:
            self.refused.append(f"bind {bdf} to {driver}: driver_override is {override}")
        elif not self.hang_binds:
            self._link(bdf, driver)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for key in list(self._selector.get_map().values()):
            os.close(key.fd)
        self._selector.close()


@pytest.fixture
def sysfs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ConstructedSysfs]:
    """The tree; ``@pytest.mark.parametrize("sysfs", [PREPARED], indirect=True)`` binds it so."""
    tree = ConstructedSysfs(tmp_path / "sys", getattr(request, "param", ORIGINAL))
    yield tree
    tree.close()
    assert tree.refused == [], f"the binder asked the kernel for what it refuses: {tree.refused}"


MINORS = {GPU: 0, OTHER_GPU: 1}


def _binder(
    cls: type[VfioBinder], tmp_path: Path, sysfs: ConstructedSysfs, rebind: bool = True
) -> VfioBinder:
    """A binder of the constructed tree, asked to rebind (the tests of taking and giving back)."""
    proc = tmp_path / "proc"
    for bdf, minor in MINORS.items():
        gpu = proc / "driver" / "nvidia" / "gpus" / bdf
        gpu.mkdir(parents=True, exist_ok=True)
        (gpu / "information").write_text(
            f"Model: NVIDIA H100\nGPU UUID: {_uuid(minor)}\nDevice Minor: {minor}\n"
        )
    dev = tmp_path / "dev"
    return cls(tmp_path / "state", sysfs=sysfs.root, dev=dev, rebind=rebind, proc=proc)


def _uuid(index: int) -> str:
    return f"GPU-{index:08d}-0000-0000-0000-000000000000"


def _untouched(tmp_path: Path, sysfs: ConstructedSysfs) -> None:
    __tracebackhide__ = True
    _check_restored(sysfs)
    assert not list((tmp_path / "state").glob("vfio/*.json")), "a refused claim left a record"


def _dead_holder() -> Holder:
    """A process holder whose process has exited: what a crashed run leaves behind."""
    process = subprocess.Popen(["sleep", "60"])
    holder = Holder.process(process.pid)
    process.kill()
    process.wait()
    return holder


def _check_restored(sysfs: ConstructedSysfs) -> None:
    __tracebackhide__ = True
    for bdf, driver in sysfs.original.items():
        assert sysfs.driver(bdf) == driver, f"{bdf} is bound to {sysfs.driver(bdf)}, not {driver}"
        kept = (VFIO_DRIVER,) if driver == VFIO_DRIVER else ()
        assert sysfs.override(bdf) in ("", "(null)", *kept), f"{bdf} keeps driver_override"


def check_claim_then_release_restores(
    cls: type[VfioBinder], tmp_path: Path, sysfs: ConstructedSysfs
) -> None:
    """Claim binds the whole group, and nothing else; release gives each its own driver."""
    binder = _binder(cls, tmp_path, sysfs)
    claim = binder.claim(GPU, "sandbox-a", Holder.process(os.getpid()))
    assert claim.group == "17"
    assert claim.device == tmp_path / "dev" / "vfio" / "17"
    assert claim.functions == {GPU: "nvidia", AUDIO: "snd_hda_intel"}
    assert (sysfs.driver(GPU), sysfs.driver(AUDIO)) == (VFIO_DRIVER, VFIO_DRIVER)
    assert (sysfs.override(GPU), sysfs.override(AUDIO)) == (VFIO_DRIVER, VFIO_DRIVER)
    assert sysfs.driver(OTHER_GPU) == "nvidia", "a GPU of another group was taken"
    assert binder.claims() == {"17": "sandbox-a"}
    binder.release(claim.group)
    _check_restored(sysfs)
    assert binder.claims() == {}


def check_crashed_run_is_reconciled(
    cls: type[VfioBinder], tmp_path: Path, sysfs: ConstructedSysfs
) -> None:
    """A run that died with groups bound: a fresh binder gives back exactly those."""
    crashed = _binder(cls, tmp_path, sysfs)
    crashed.claim(GPU, "sandbox-dead", _dead_holder())
    alive = crashed.claim(LONE, "sandbox-alive", Holder.process(os.getpid()))
    del crashed  # the run is gone; its records stay
    fresh = _binder(cls, tmp_path, sysfs)
    assert fresh.reconcile() == ["17"]
    assert (sysfs.driver(GPU), sysfs.driver(AUDIO)) == ("nvidia", "snd_hda_intel")
    assert sysfs.driver(LONE) == VFIO_DRIVER, "a group of a live holder was given back"
    assert fresh.claims() == {"51": "sandbox-alive"}
    fresh.release(alive.group)
    _check_restored(sysfs)


CHECKS = (check_claim_then_release_restores, check_crashed_run_is_reconciled)


@pytest.mark.parametrize("check", CHECKS, ids=[check.__name__ for check in CHECKS])
def test_the_binder_restores(tmp_path: Path, sysfs: ConstructedSysfs, check: object) -> None:
    assert callable(check)
    check(VfioBinder, tmp_path, sysfs)


@pytest.mark.parametrize("check", CHECKS, ids=[check.__name__ for check in CHECKS])
def test_the_planted_binder_that_restores_nothing_fails(
    tmp_path: Path, sysfs: ConstructedSysfs, check: object
) -> None:
    assert callable(check)
    with pytest.raises(AssertionError):
        check(BindingNotRestored, tmp_path, sysfs)


def test_a_bound_group_cannot_be_claimed_again(tmp_path: Path, sysfs: ConstructedSysfs) -> None:
    binder = _binder(VfioBinder, tmp_path, sysfs)
    claim = binder.claim(GPU, "sandbox-a", Holder.process(os.getpid()))
    with pytest.raises(VfioError, match="bound for sandbox sandbox-a"):
        binder.claim(AUDIO, "sandbox-b", Holder.process(os.getpid()))
    binder.release(claim.group)
    _check_restored(sysfs)


CORRUPT = {
    "not JSON": ("{", "(document)", "is not valid JSON"),
    "a key twice": ('{"sandbox": "a", "sandbox": "b"}', "sandbox", "is given twice"),
    "no holder": ('{"sandbox": "a", "functions": {}, "uuids": {}}', "holder", "is required"),
    "a holder's kind a number": (
        '{"sandbox": "a", "holder": {"kind": 1, "ref": "1"}, "functions": {}, "uuids": {}}',
        "holder.kind",
        "must be a string, got 1",
    ),
    "a function's driver a list": (
        '{"sandbox": "a", "holder": {"kind": "process", "ref": "1"}, '
        '"functions": {"0000:2a:00.0": []}, "uuids": {}}',
        "functions['0000:2a:00.0']",
        "must be a string or null, got []",
    ),
}


@pytest.mark.parametrize(("text", "field", "problem"), CORRUPT.values(), ids=list(CORRUPT))
def test_a_corrupt_record_is_named_by_file_and_field(
    tmp_path: Path, sysfs: ConstructedSysfs, text: str, field: str, problem: str
) -> None:
    """What reads a claim's record back refuses one it did not write, naming where."""
    binder = _binder(VfioBinder, tmp_path, sysfs)
    binder.records.mkdir(parents=True)
    (binder.records / "17.json").write_text(text)
    for read in (binder.claims, binder.reconcile, lambda: binder.release("17")):
        with pytest.raises(VfioRecordCorrupt) as caught:
            read()
        assert (caught.value.source, caught.value.field) == (binder.records / "17.json", field)
        assert problem in str(caught.value)
    assert binder.recorded_uuids() == {}, "a corrupt record's UUIDs were taken"
    assert (sysfs.driver(GPU), sysfs.driver(AUDIO)) == ("nvidia", "snd_hda_intel")


def test_a_function_without_a_driver_stays_without_one(
    tmp_path: Path, sysfs: ConstructedSysfs
) -> None:
    binder = _binder(VfioBinder, tmp_path, sysfs)
    claim = binder.claim(LONE, "sandbox-a", Holder.process(os.getpid()))
    assert claim.functions == {LONE: None}
    assert sysfs.driver(LONE) == VFIO_DRIVER
    binder.release(claim.group)
    assert sysfs.driver(LONE) is None
    _check_restored(sysfs)


def test_no_iommu_group_says_how_to_enable_it(tmp_path: Path, sysfs: ConstructedSysfs) -> None:
    (sysfs.root / "bus" / "pci" / "devices" / LONE / "iommu_group").unlink()
    with pytest.raises(VfioError, match="intel_iommu=on"):
        _binder(VfioBinder, tmp_path, sysfs).claim(LONE, "sandbox-a", Holder.process(1))
    with pytest.raises(VfioError, match=r"no PCI device 0000:ff:00\.0"):
        _binder(VfioBinder, tmp_path, sysfs).claim("0000:ff:00.0", "x", Holder.process(1))


def test_a_bind_that_never_happens_fails_in_time_and_leaves_nothing_bound(
    tmp_path: Path, sysfs: ConstructedSysfs, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vfio, "BIND_TIMEOUT_S", 0.3)
    sysfs.hang_binds = True
    binder = _binder(VfioBinder, tmp_path, sysfs)
    with pytest.raises(TimeoutError, match="to be bound to vfio-pci"):
        binder.claim(LONE, "sandbox-a", Holder.process(os.getpid()))
    sysfs.hang_binds = False
    assert binder.claims() == {}, "a failed claim left its record"
    assert sysfs.driver(LONE) is None


def test_unasked_a_gpu_bound_to_nvidia_is_refused_and_untouched(
    tmp_path: Path, sysfs: ConstructedSysfs
) -> None:
    binder = _binder(VfioBinder, tmp_path, sysfs, rebind=False)
    with pytest.raises(VfioRefused) as refused:
        binder.claim(GPU, "sandbox-a", Holder.process(os.getpid()))
    assert str(refused.value) == (
        f"IOMMU group 17 of {GPU} is bound to other drivers ({GPU} to nvidia, {AUDIO} to "
        "snd_hda_intel); only groups bound to vfio-pci are taken, unless rebinding is asked "
        "for (--vm-rebind-gpus, or GPU_SANDBOX_VM_REBIND=1)"
    )
    _untouched(tmp_path, sysfs)
    # A group of no driver, or of vfio-pci already, is taken unasked, and given back.
    claim = binder.claim(LONE, "sandbox-a", Holder.process(os.getpid()))
    binder.release(claim.group)
    _check_restored(sysfs)


def test_asked_a_gpu_whose_node_a_process_holds_is_refused_and_untouched(
    tmp_path: Path, sysfs: ConstructedSysfs
) -> None:
    binder = _binder(VfioBinder, tmp_path, sysfs)
    user = tmp_path / "proc" / "4242"
    (user / "fd").mkdir(parents=True)
    (user / "comm").write_text("nvidia-persistenced\n")
    (user / "fd" / "3").symlink_to(tmp_path / "dev" / "nvidia0")
    with pytest.raises(
        VfioRefused,
        match=rf"{GPU} \(IOMMU group 17\) is in use: .*/dev/nvidia0 "
        r"is open in pid 4242 \(nvidia-persistenced\); it is left bound to nvidia",
    ):
        binder.claim(GPU, "sandbox-a", Holder.process(os.getpid()))
    _untouched(tmp_path, sysfs)
    # The other GPU, whose node nobody holds, is taken.
    claim = binder.claim(OTHER_GPU, "sandbox-b", Holder.process(os.getpid()))
    assert sysfs.driver(OTHER_GPU) == VFIO_DRIVER
    binder.release(claim.group)
    _check_restored(sysfs)


def test_asked_a_gpu_whose_node_cannot_be_told_is_refused(
    tmp_path: Path, sysfs: ConstructedSysfs
) -> None:
    binder = _binder(VfioBinder, tmp_path, sysfs)
    (tmp_path / "proc" / "driver" / "nvidia" / "gpus" / GPU / "information").unlink()
    with pytest.raises(VfioRefused, match=f"cannot tell whether {GPU} is in use"):
        binder.claim(GPU, "sandbox-a", Holder.process(os.getpid()))
    _untouched(tmp_path, sysfs)


def _nvml(*buses: str) -> tuple[GpuDevice, ...]:
    """What NVML lists of the tree: the GPUs bound to nvidia (never one bound to vfio-pci)."""
    return tuple(
        GpuDevice(index, _uuid(MINORS[bdf]), "NVIDIA H100 80GB HBM3", bdf, minor=MINORS[bdf])
        for index, bdf in enumerate(buses)
    )


def _never_reached(sysfs: ConstructedSysfs, *buses: str) -> None:
    """No ``bind``, ``unbind`` or ``driver_override`` write reached any of ``buses``."""
    __tracebackhide__ = True
    asked = [line for line in sysfs.asked if line.split()[1] in buses]
    assert asked == [], f"the kernel was asked to move functions it was not given: {asked}"
    for bdf in buses:
        assert sysfs.override(bdf) == "(null)", f"{bdf}'s driver_override was written"
        assert sysfs.driver(bdf) == sysfs.original[bdf], f"{bdf} was moved"


class ConstructedVmDriver(VmDriver):
    """The vm driver on a constructed real host: its guest image is two empty files."""

    def guest_image(self) -> GuestImage:
        return GuestImage(Path(os.devnull), Path(os.devnull), "constructed")


def _vm_driver(
    tmp_path: Path, sysfs: ConstructedSysfs, listed: tuple[GpuDevice, ...], rebind: bool
) -> VmDriver:
    """The vm driver on the tree as a real host: NVML ``listed``, /dev/vfio/vfio present."""
    state = tmp_path / "state"
    host = GpuHost(HostConfig(state_dir=state), listed, (), LeaseRegistry(state / "leases"))
    driver = ConstructedVmDriver(host, "constructed")
    driver.passthrough = VfioPassthrough(_binder(VfioBinder, tmp_path, sysfs, rebind))
    (tmp_path / "dev" / "vfio").mkdir(parents=True, exist_ok=True)
    (tmp_path / "dev" / "vfio" / "vfio").touch()
    return driver


@pytest.fixture
def qemu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """QEMU stood in for at its spawn: a process that sleeps; each argv is kept."""
    argvs: list[list[str]] = []

    def spawn_qemu(argv: list[str], directory: Path, fds: object) -> subprocess.Popen[bytes]:
        argvs.append(argv)
        return subprocess.Popen(["sleep", "60"])

    monkeypatch.setattr("drivers.vm.driver.spawn_qemu", spawn_qemu)
    monkeypatch.setattr(GuestAgent, "wait_ready", lambda *args: None)
    monkeypatch.setenv("GPU_SANDBOX_VM_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("GPU_SANDBOX_VM_BOOT", raising=False)
    return argvs


def test_the_bus_shows_every_nvidia_gpu_whichever_driver_has_it(
    tmp_path: Path, sysfs: ConstructedSysfs
) -> None:
    binder = _binder(VfioBinder, tmp_path, sysfs)
    assert binder.bus_gpus() == [
        BusGpu(GPU, "17", {GPU: "nvidia", AUDIO: "snd_hda_intel"}),
        BusGpu(OTHER_GPU, "42", {OTHER_GPU: "nvidia"}),
    ]
    # One taken from nvidia keeps the UUID nvidia gave it, which NVML no longer lists.
    claim = binder.claim(OTHER_GPU, "sandbox-a", Holder.process(os.getpid()))
    taken = BusGpu(OTHER_GPU, "42", {OTHER_GPU: VFIO_DRIVER}, _uuid(1))
    assert binder.bus_gpus()[1] == taken
    assert taken.passes_through
    (named,) = VfioPassthrough(binder).gpus(_nvml(GPU))[1:]
    assert (named.uuid, named.index, named.pci_bus_id) == (_uuid(1), 1, OTHER_GPU)
    binder.release(claim.group)
    _check_restored(sysfs)


def test_unasked_the_vm_lane_on_gpus_bound_to_nvidia_is_skipped_and_writes_nothing(
    tmp_path: Path, sysfs: ConstructedSysfs, qemu: list[list[str]]
) -> None:
    """Without the opt-in no write reaches a GPU bound to nvidia, whatever is asked."""
    driver = _vm_driver(tmp_path, sysfs, _nvml(GPU, OTHER_GPU), rebind=False)
    availability = driver.probe()
    assert not availability.ok
    assert availability.reason == (
        f"needed NVIDIA GPUs bound to vfio-pci (found: {GPU} bound to nvidia (IOMMU group 17 "
        f"also: {AUDIO} bound to snd_hda_intel), {OTHER_GPU} bound to nvidia); bind each "
        "GPU's IOMMU group to vfio-pci beforehand (driverctl set-override <BDF> vfio-pci), "
        "or let VMs take GPUs from the nvidia driver, those no process holds open: "
        "--vm-rebind-gpus, or GPU_SANDBOX_VM_REBIND=1"
    )
    assert driver.inventory() == ()
    for device_ids in ([GPU], ["1"], None):
        spec = (
            SandboxSpec.with_gpus(driver="vm", device_ids=device_ids)
            if device_ids
            else SandboxSpec.with_gpus()
        )
        with pytest.raises((GpuAllocationError, UnknownGpuDevice), match=r"GPUs|needed NVIDIA"):
            driver.create(spec)
    with pytest.raises(VfioRefused):
        driver.passthrough.claim(driver.host.gpus[0], "sandbox-a")
    assert qemu == [], "a VM was started"
    _never_reached(sysfs, GPU, AUDIO, OTHER_GPU)
    assert driver.host.leases.leases() == []
    # Asked, the lane runs on them.
    asked = _vm_driver(tmp_path, sysfs, _nvml(GPU, OTHER_GPU), rebind=True)
    assert asked.probe().ok
    assert [gpu.pci_bus_id for gpu in asked.inventory()] == [GPU, OTHER_GPU]


@pytest.mark.parametrize("sysfs", [PREPARED], indirect=True)
def test_the_vm_lane_runs_on_the_one_gpu_bound_to_vfio_pci(
    tmp_path: Path, sysfs: ConstructedSysfs, qemu: list[list[str]]
) -> None:
    """NVML lists only the GPU of nvidia; the lane finds the other on the bus and uses it."""
    driver = _vm_driver(tmp_path, sysfs, _nvml(GPU), rebind=False)
    binder = _binder(VfioBinder, tmp_path, sysfs)
    assert driver.probe().ok, driver.probe().reason
    (gpu,) = driver.inventory()
    assert (gpu.index, gpu.uuid, gpu.pci_bus_id) == (1, f"PCI-{OTHER_GPU}", OTHER_GPU)
    assert driver.device_ids(gpu) == (OTHER_GPU, "1")
    with pytest.raises(UnknownGpuDevice, match="is not one VMs are given here: needed NVIDIA"):
        driver.create(SandboxSpec.with_gpus(driver="vm", device_ids=["0"]))
    with driver.create(SandboxSpec.with_gpus()) as sandbox:
        assert sandbox.gpus == (gpu,)
        ((argv),) = qemu
        assert f"vfio-pci,id=gpu0,host={OTHER_GPU},bus=port0,addr=0x0" in argv
        assert binder.claims() == {"42": sandbox.id}
        assert [lease.gpu_uuid for lease in driver.host.leases.leases()] == [gpu.uuid]
    assert driver.host.leases.leases() == []
    _check_restored(sysfs)  # the GPU stays bound to vfio-pci, as the admin left it
    _never_reached(sysfs, GPU, AUDIO)


def test_asked_the_vm_lane_refuses_a_gpu_a_process_holds(
    tmp_path: Path, sysfs: ConstructedSysfs, qemu: list[list[str]]
) -> None:
    driver = _vm_driver(tmp_path, sysfs, _nvml(GPU, OTHER_GPU), rebind=True)
    user = tmp_path / "proc" / "4242"
    (user / "fd").mkdir(parents=True)
    (user / "comm").write_text("python3\n")
    (user / "fd" / "7").symlink_to(tmp_path / "dev" / "nvidia0")
    with pytest.raises(SandboxStartError) as refused:
        driver.create(SandboxSpec.with_gpus(driver="vm", device_ids=[GPU]))
    assert isinstance(refused.value.__cause__, VfioRefused)
    assert str(refused.value.__cause__) == (
        f"{GPU} (IOMMU group 17) is in use: {tmp_path}/dev/nvidia0 is open in pid 4242 "
        "(python3); it is left bound to nvidia"
    )
    assert qemu == []
    assert driver.host.leases.leases() == []
    _never_reached(sysfs, GPU, AUDIO)
    _untouched(tmp_path, sysfs)


def test_asked_a_gpu_of_another_driver_than_nvidia_is_refused(
    tmp_path: Path, sysfs: ConstructedSysfs
) -> None:
    (sysfs.root / "bus" / "pci" / "devices" / GPU / "driver").unlink()
    sysfs._link(GPU, "nouveau")
    sysfs.original = {**ORIGINAL, GPU: "nouveau"}
    binder = _binder(VfioBinder, tmp_path, sysfs)
    with pytest.raises(VfioRefused, match=f"{GPU} .* is bound to nouveau; a GPU is taken only"):
        binder.claim(GPU, "sandbox-a", Holder.process(os.getpid()))
    _never_reached(sysfs, GPU, AUDIO)
    _untouched(tmp_path, sysfs)
