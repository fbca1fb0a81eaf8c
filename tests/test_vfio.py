"""VFIO binding (gpuhost/vfio.py) on sysfs trees the tests construct, with a kernel stand-in.

No machine here has an IOMMU or a GPU, so the tree is made by the test: PCI functions with
their ``driver`` links and ``driver_override``, drivers whose ``bind`` and ``unbind`` are
FIFOs, IOMMU groups holding a GPU and its audio function. A thread plays the kernel's part:
it reads what is written to ``bind`` and ``unbind`` and moves the ``driver`` links as the
kernel would, refusing a bind that ``driver_override`` forbids. The binder under test only
reads and writes files, as it does on a real /sys.

``BindingNotRestored`` (tests/broken_vms.py), the planted binder that gives nothing back,
fails the checks of restoring after close and after a crash.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from drivers.vm.passthrough import VfioPassthrough
from gpuhost import vfio
from gpuhost.devices import GpuDevice
from gpuhost.leases import Holder
from gpuhost.vfio import VFIO_DRIVER, VfioBinder, VfioError, VfioRefused
from tests.broken_vms import BindingNotRestored

GPU, AUDIO, OTHER_GPU, LONE = "0000:2a:00.0", "0000:2a:00.1", "0000:5d:00.0", "0000:9a:00.0"
ORIGINAL = {GPU: "nvidia", AUDIO: "snd_hda_intel", OTHER_GPU: "nvidia", LONE: None}
GROUPS = {GPU: "17", AUDIO: "17", OTHER_GPU: "42", LONE: "51"}
DRIVERS = ("nvidia", "snd_hda_intel", VFIO_DRIVER)


class ConstructedSysfs:
    """A sysfs tree of PCI functions in IOMMU groups, and a thread acting as its kernel."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.refused: list[str] = []
        self.hang_binds = False
        devices = root / "bus" / "pci" / "devices"
        for bdf, group in GROUPS.items():
            device = devices / bdf
            device.mkdir(parents=True)
            (device / "vendor").write_text("0x10de\n")
            (device / "driver_override").write_text("(null)\n")
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
        for bdf, original in ORIGINAL.items():
            if original:
                self._link(bdf, original)
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
def sysfs(tmp_path: Path) -> Iterator[ConstructedSysfs]:
    tree = ConstructedSysfs(tmp_path / "sys")
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
        (gpu / "information").write_text(f"Model: NVIDIA H100\nDevice Minor: {minor}\n")
    dev = tmp_path / "dev"
    return cls(tmp_path / "state", sysfs=sysfs.root, dev=dev, rebind=rebind, proc=proc)


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
    for bdf, driver in ORIGINAL.items():
        assert sysfs.driver(bdf) == driver, f"{bdf} is bound to {sysfs.driver(bdf)}, not {driver}"
        assert sysfs.override(bdf) in ("", "(null)"), f"{bdf} keeps driver_override"


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


def _gpu(index: int, bdf: str) -> GpuDevice:
    return GpuDevice(index, f"GPU-{index:08d}-0000-0000-0000-000000000000", "H100", bdf)


def test_unasked_the_vm_lane_offers_only_gpus_bound_to_vfio_pci(
    tmp_path: Path, sysfs: ConstructedSysfs
) -> None:
    """On a real host, GPUs serving the nvidia driver are not the vm lane's to take."""
    gpus = (_gpu(0, GPU), _gpu(1, OTHER_GPU))
    unasked = VfioPassthrough(_binder(VfioBinder, tmp_path, sysfs, rebind=False))
    assert unasked.offered(gpus) == ()
    assert unasked.why_none(gpus) == (
        f"needed GPUs bound to vfio-pci (found: {GPU} bound to nvidia, {OTHER_GPU} bound to "
        "nvidia); to let VMs take GPUs from the nvidia driver, those no process holds open: "
        "--vm-rebind-gpus, or GPU_SANDBOX_VM_REBIND=1"
    )
    # One prepared for passthrough, as a VFIO host is: that one is offered, and only it.
    prepared = _binder(VfioBinder, tmp_path, sysfs)
    prepared.claim(OTHER_GPU, "prepared-by-the-admin", Holder.process(os.getpid()))
    assert unasked.offered(gpus) == (gpus[1],)
    asked = VfioPassthrough(_binder(VfioBinder, tmp_path, sysfs, rebind=True))
    assert asked.offered(gpus) == gpus
    prepared.release("42")
    _check_restored(sysfs)
