"""The vm driver: a QEMU micro-VM per sandbox, holding at most one GPU, passed through.

Host needs: ``qemu-system-x86_64`` (Debian's ``qemu-system-x86``, 7.2 or newer), util-linux
``setpriv``, and a guest image: a kernel and a busybox initramfs carrying the exec agent,
which ``make vm-image`` (``scripts/vm-image.sh``) builds from Debian's cloud kernel into
``/var/cache/gpu-sandbox/vm``. Each sandbox is a VM of its own: ``-M q35``, no network
device, no disk, a root that is the initramfs, read-only once the guest's init has set it
up (``/tmp`` is a tmpfs). Commands run through a small agent on two virtio-serial ports,
each connected to this process by a socketpair: no network and no vsock needed.

GPUs: at most one per VM, whole and exclusive, an NVIDIA GPU not in MIG mode (passthrough is
of a PCI device; the instances of a GPU in MIG mode belong to the host's driver). Exact IDs
are the GPU's PCI address (``0000:2a:00.0``, any form nvidia-smi or lspci prints) or its
host index. The GPU's PCI function appears in the guest at its own host address: a
``pxb-pcie`` expander and a ``pcie-root-port`` whose bus number puts it there.

- On a real host it is passed through with VFIO (``-device vfio-pci,host=<BDF>``): its
  IOMMU group is bound to vfio-pci before the VM starts and given back to its drivers when
  the VM ends (``gpuhost.vfio``), and groups a crashed run left bound are given back when a
  sandbox starts or a session is reaped. The guest image must bring the NVIDIA driver.
- On a simulated host (``gpuhost.simulated``) there is no device to pass through: QEMU's
  multi-process device (``x-pci-proxy-dev``) presents a PCI function with NVIDIA's ids,
  served by ``gpuhost.simulated.pci_proxy`` from this process, and the guest's init makes a
  ``/dev/nvidia<minor>`` node for each NVIDIA function whose address the simulated host's
  inventory lists, as the NVIDIA driver makes one per GPU it probes. The simulated host's
  share (inventory, the ``nvidia-smi`` stand-in) reaches the guest at ``/run/gpu-sim``, in
  an initramfs overlay or through the agent. This is a simulation, and ``version()`` says so.

Boots: a VM either boots (``cold``: its GPU on QEMU's command line from the start; the
default on real hosts) or resumes a template (``snapshot``, the default on simulated hosts):
one VM per guest image and layout of the host's GPU buses is booted once, with a root port
at every GPU's bus, and saved with QEMU's migration, its memory in a file of its own; each
sandbox's QEMU maps that file copy-on-write, loads the small rest (``-incoming``), and gets
its GPU hot-plugged into the root port at the GPU's bus (``device_add``, pciehp in the
guest). A resume costs a fifth of a boot's CPU under TCG.

Leases come from the host-wide registry and are held by the QEMU process (pid and start
time): SIGKILL of QEMU frees its GPU. QEMU dies with its creator (``setpriv --pdeathsig``,
forked from a long-lived thread). Every QEMU process carries ``-name
gpu-sandbox/<session>/<sandbox>``, which is how ``reap`` finds a session's VMs from any
process.

Acceleration: KVM when a short boot probe under KVM reaches the guest's init, TCG otherwise;
the verdict is kept per boot of the host under the run directory. Options, from the
environment (README: "The vm driver"): ``GPU_SANDBOX_VM_IMAGE`` (an image directory),
``GPU_SANDBOX_VM_KERNEL`` and ``GPU_SANDBOX_VM_INITRD`` (a kernel and initramfs of your own),
``GPU_SANDBOX_VM_ACCEL`` (``kvm``, ``tcg`` or ``auto``), ``GPU_SANDBOX_VM_BOOT`` (``snapshot``
or ``cold``), ``GPU_SANDBOX_VM_MEMORY_MIB``, ``GPU_SANDBOX_VM_RUN_DIR``.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from drivers.base import Availability, Command, CommandTimedOut, Driver, Launch, Output, Sandbox
from gpuhost.devices import GpuDevice, normalize_pci_bus_id
from gpuhost.errors import (
    GpuBusy,
    GpusExhausted,
    SandboxExecError,
    SandboxStartError,
    UnknownGpuDevice,
    UnsupportedGpuRequest,
    shown,
)
from gpuhost.host import GpuHost
from gpuhost.leases import Holder, LeaseRegistry, boot_id
from gpuhost.procfs import each_process
from gpuhost.simulated import SANDBOX_SHARE
from gpuhost.simulated.pci_proxy import GpuFunction, GpuFunctionBusy
from gpuhost.spawn import spawn, stop_process
from gpuhost.spec import DEVICE_IDS_KEY, DriverCapabilities, DriverRequest, GpuPlan
from gpuhost.vfio import VfioBinder, VfioClaim, VfioError
from gpuhost.wait import wait_for, wait_until

QEMU = "qemu-system-x86_64"
SECCOMP = ("-sandbox", "on,obsolete=deny,elevateprivileges=deny,resourcecontrol=deny")
"""QEMU's own seccomp filter: no obsolete system calls, no setuid or capability changes, no
scheduling or affinity changes. Spawning stays allowed: a template's state is saved and
loaded through ``exec:cat``, which QEMU 7.2 (Debian 12's) has no other file transport for."""
IMAGE_ENV = "GPU_SANDBOX_VM_IMAGE"
KERNEL_ENV = "GPU_SANDBOX_VM_KERNEL"
INITRD_ENV = "GPU_SANDBOX_VM_INITRD"
ACCEL_ENV = "GPU_SANDBOX_VM_ACCEL"
MEMORY_ENV = "GPU_SANDBOX_VM_MEMORY_MIB"
RUN_DIR_ENV = "GPU_SANDBOX_VM_RUN_DIR"
DEFAULT_IMAGE_DIR = Path("/var/cache/gpu-sandbox/vm/current")
DEFAULT_RUN_DIR = Path("/run/gpu-sandbox-vm")
DEFAULT_MEMORY_MIB = 256
"""Enough for the busybox guest and a mebibyte of output twice over; a guest that runs CUDA
workloads needs several GiB (GPU_SANDBOX_VM_MEMORY_MIB)."""
NAME_PREFIX = "gpu-sandbox"
EXEC_PORT, CONTROL_PORT = "gpu-sandbox.exec", "gpu-sandbox.ctl"
KERNEL_ARGS = (
    "console=ttyS0 quiet panic=-1 mitigations=off nokaslr tsc=reliable no_timer_check "
    "i8042.noaux i8042.nokbd i8042.nopnp random.trust_cpu=on cryptomgr.notests"
)
"""A quiet serial console, and no work a guest without a keyboard or secrets needs: about a
fifth less boot time under TCG (3.3 s of CPU instead of 4.2 s, measured here)."""
BOOT_ENV = "GPU_SANDBOX_VM_BOOT"
SNAPSHOT, COLD = "snapshot", "cold"
ROOT_PORT_MEMORY = "32M"
"""What each root port reserves for a hot-plugged GPU's BARs: the simulated GPU's is 16 MiB."""
BOOT_TIMEOUT_S = 180.0
"""A guest boots in ~2.5 s of one core under TCG; on a loaded 2-core machine with eight
booting at once (a test that takes every GPU) a boot has taken 40 s. Minutes mean it hangs."""
TEMPLATE_FORMAT = 2
"""Version of how templates are saved (2: memory in a file of its own, x-ignore-shared)."""
TEMPLATE_SAVE_TIMEOUT_S = 120.0
"""Saving a booted guest's state (~70 MB of touched memory) to a tmpfs takes a few seconds."""
HOTPLUG_TIMEOUT_S = 60.0
"""A hot-plugged function shows in the guest within a second or two (pciehp), under TCG."""
PROBE_TIMEOUT_S = 30.0
"""The KVM probe boots to the guest's init and powers off: a second or two under working
KVM; a nested hypervisor that crawls (a guest still in early boot after minutes) is no use."""
KILL_TIMEOUT_S = 10.0
"""After SIGKILL a process is gone in milliseconds; seconds mean it is stuck in the kernel."""
AGENT_KILL_TIMEOUT_S = 20.0
"""How long the guest agent may take to kill a timed-out command and answer, under TCG."""
TRANSFER_TIMEOUT_S = 120.0
"""For a command's output to cross the virtio-serial port once it has ended (MB/s)."""
REAP_TIMEOUT_S = 10.0
CPIO_TIMEOUT_S = 30.0
"""Packing a few files (the simulated host's share) takes milliseconds."""
UNUSED_AFTER_S = 3600.0
"""Templates and combined initramfs files unused this long are removed (they live in /run,
in memory); simulated hosts come and go with each run."""
VERSION_TIMEOUT_S = 10.0
_BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_ENV = {"PATH": _BASE_PATH, "LANG": "C.UTF-8"}
GUEST_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
_NAME = re.compile(rf"^{NAME_PREFIX}/(?P<session>[^/]+)/(?P<sandbox>[^/]+)$")
# "invalid PCI BDF address" for anything that is neither an index nor a PCI address.
_INDEX = re.compile(r"0|[1-9][0-9]*")


@dataclasses.dataclass(frozen=True)
class GuestImage:
    """The kernel and initramfs the VMs boot, and what they are."""

    kernel: Path
    initrd: Path
    description: str


class VmDriver(Driver):
    name = "vm"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        super().__init__(host, session_id, image)
        self.run_dir = Path(os.environ.get(RUN_DIR_ENV) or _default_run_dir())
        self.memory_mib = int(os.environ.get(MEMORY_ENV) or DEFAULT_MEMORY_MIB)
        self.vfio = VfioBinder(host.config.state_directory())
        self._accel: tuple[str, str] | None = None
        self._initrd_lock = threading.Lock()
        self._share_archive: bytes | None = None

    @property
    def capabilities(self) -> DriverCapabilities:
        return DriverCapabilities(
            max_gpus_per_sandbox=1,
            exact_ids=True,
            exact_id_forms="a PCI address (0000:2a:00.0) or a host index",
            exclusive=True,
            shared=False,
            mig_profiles=False,
            vendors=("nvidia",),
        )

    # -- what the host offers -------------------------------------------------------------

    def inventory(self) -> tuple[GpuDevice, ...]:
        """NVIDIA's whole GPUs not in MIG mode: what passes through to a VM."""
        return tuple(gpu for gpu in self.host.gpus if not gpu.mig_enabled)

    def device_ids(self, gpu: GpuDevice) -> tuple[str, ...]:
        return (gpu.pci_bus_id, str(gpu.index))

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        try:
            return super().plan(request)
        except UnsupportedGpuRequest as exc:
            # The per-sandbox maximum, in the words users of VM drivers know.
            if exc.field == "resource_requirements.gpu.count" or exc.field.endswith(DEVICE_IDS_KEY):
                raise UnsupportedGpuRequest(
                    exc.field,
                    exc.value,
                    f"VM GPU sandboxes support only one GPU ({exc.field} = {shown(exc.value)}; "
                    f"this host has {len(self.inventory())} GPUs: one VM each)",
                ) from None
            raise

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        """A PCI address in any form, or a host index; one GPU (the plan allows no more).

        Written exactly: no white space around it, an index in ASCII digits without leading
        zeros, as the other drivers take their IDs.
        """
        inventory = self.inventory()
        chosen = []
        for device_id in plan.device_ids:
            if _INDEX.fullmatch(device_id):
                chosen.append(self._by_index(plan.field, device_id, inventory))
                continue
            try:
                if device_id != device_id.strip():
                    raise ValueError(device_id)
                bus = normalize_pci_bus_id(device_id)
            except ValueError:
                raise UnknownGpuDevice(
                    plan.field,
                    device_id,
                    f"invalid PCI BDF address: {shown(device_id)} (in {plan.field}; the vm "
                    f"driver accepts {self.capabilities.exact_id_forms})",
                ) from None
            found = [gpu for gpu in inventory if gpu.pci_bus_id == bus]
            if not found:
                buses = ", ".join(gpu.pci_bus_id for gpu in inventory) or "none"
                raise UnknownGpuDevice(
                    plan.field,
                    device_id,
                    f"{plan.field} names {shown(device_id)}, but no GPU that passes through is "
                    f"at PCI address {bus} (this host's: {buses})",
                )
            chosen.append(found[0])
        return tuple(chosen)

    def _by_index(self, field: str, device_id: str, inventory: tuple[GpuDevice, ...]) -> GpuDevice:
        """The host's index, as nvidia-smi numbers GPUs: GPUs in MIG mode count too."""
        gpus = self.host.gpus
        if len(device_id) > len(str(len(gpus))) or int(device_id) >= len(gpus):
            raise UnknownGpuDevice(
                field,
                device_id,
                f"GPU index {shown(device_id)} out of range (have {len(gpus)} GPUs) in {field}",
            )
        gpu = gpus[int(device_id)]
        if gpu not in inventory:
            raise UnknownGpuDevice(
                field,
                device_id,
                f"GPU index {shown(device_id)} ({gpu.pci_bus_id}) in {field} is in MIG mode; a "
                f"VM takes a whole GPU (this host's: {', '.join(g.pci_bus_id for g in inventory)})",
            )
        return gpu

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().allocate(sandbox_id, plan)
        except GpuBusy as exc:
            gpu = plan.gpus[0]
            raise GpuBusy(f"{gpu.pci_bus_id} ({gpu.uuid})", exc.holder) from None
        except GpusExhausted as exc:
            if exc.available:
                raise
            raise GpusExhausted(
                exc.requested,
                exc.available,
                exc.total,
                "all GPUs are currently assigned to other sandboxes",
            ) from None

    # -- can it run here --------------------------------------------------------------------

    def probe(self) -> Availability:
        missing = [tool for tool in (QEMU, "setpriv") if not shutil.which(tool, path=_BASE_PATH)]
        if missing:
            return Availability(
                False,
                f"needed {', '.join(missing)} (found none in {_BASE_PATH}; `make vm-image` "
                "installs qemu-system-x86 as root, or: apt-get install qemu-system-x86)",
            )
        try:
            self.guest_image()
        except SandboxStartError as exc:
            return Availability(False, str(exc))
        if self.host.simulated is not None and not shutil.which("cpio", path=_BASE_PATH):
            return Availability(False, "needed cpio (found none; apt-get install cpio)")
        if not self.inventory():
            return Availability(
                False,
                "needed NVIDIA GPUs not in MIG mode (found none through NVML or nvidia-smi; "
                "use --sim-gpus=N for a simulated GPU host)",
            )
        if self.host.simulated is None and not Path("/dev/vfio/vfio").exists():
            return Availability(
                False,
                "needed VFIO (found no /dev/vfio/vfio: modprobe vfio-pci, and enable the "
                "IOMMU with intel_iommu=on or amd_iommu=on)",
            )
        return Availability(True)

    def guest_image(self) -> GuestImage:
        """The kernel and initramfs to boot: the user's own, or ``make vm-image``'s."""
        kernel, initrd = os.environ.get(KERNEL_ENV), os.environ.get(INITRD_ENV)
        if kernel or initrd:
            if not (kernel and initrd and Path(kernel).is_file() and Path(initrd).is_file()):
                raise SandboxStartError(
                    f"needed both {KERNEL_ENV} and {INITRD_ENV} naming files (found "
                    f"{KERNEL_ENV}={kernel!r}, {INITRD_ENV}={initrd!r})"
                )
            return GuestImage(Path(kernel), Path(initrd), f"kernel {Path(kernel).name}")
        directory = Path(os.environ.get(IMAGE_ENV) or DEFAULT_IMAGE_DIR)
        try:
            meta = json.loads((directory / "image.json").read_text())
        except (OSError, ValueError) as exc:
            raise SandboxStartError(
                f"needed the guest image in {directory} (found none: {exc}; build it with "
                "`make vm-image`, or point GPU_SANDBOX_VM_KERNEL and GPU_SANDBOX_VM_INITRD at "
                "a kernel and an initramfs of your own)"
            ) from None
        return GuestImage(
            directory / meta["kernel"],
            directory / meta["initramfs"],
            f"{meta['kernel_package']} {meta['kernel_version']}",
        )

    def version(self) -> str:
        qemu = shutil.which(QEMU, path=_BASE_PATH)
        if qemu is None:
            return ""
        try:
            done = subprocess.run(
                [qemu, "--version"],
                capture_output=True,
                text=True,
                check=False,
                env=HOST_ENV,
                timeout=VERSION_TIMEOUT_S,
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        found = re.search(r"version (\S+)", done.stdout)
        accel, _ = self.acceleration()
        gpus = "simulated GPUs (x-pci-proxy-dev)" if self.host.simulated else "VFIO"
        return f"qemu {found[1] if found else '?'}, {accel.upper()}, {gpus}"

    # -- acceleration ---------------------------------------------------------------------

    def acceleration(self) -> tuple[str, str]:
        """``("kvm" | "tcg", why)``: asked for, or decided by a probe once per host boot."""
        if self._accel is None:
            self._accel = self._decide_acceleration()
        return self._accel

    def _decide_acceleration(self) -> tuple[str, str]:
        wanted = (os.environ.get(ACCEL_ENV) or "auto").lower()
        if wanted in ("kvm", "tcg"):
            return wanted, f"{ACCEL_ENV}={wanted}"
        if not os.access("/dev/kvm", os.R_OK | os.W_OK):
            return "tcg", "/dev/kvm cannot be opened"
        image = self.guest_image()
        key = hashlib.sha256(f"{boot_id()} {image.kernel} {QEMU}".encode()).hexdigest()[:16]
        cache = self.run_dir / f"accel-{key}.json"
        with contextlib.suppress(OSError, ValueError, KeyError):
            verdict = json.loads(cache.read_text())
            return str(verdict["accel"]), str(verdict["why"])
        accel, why = _probe_kvm(image)
        with contextlib.suppress(OSError):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            partial = cache.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"accel": accel, "why": why}))
            partial.rename(cache)
        return accel, why

    # -- starting a VM ----------------------------------------------------------------------

    def start(self, launch: Launch) -> VmSandbox:
        image = self.guest_image()
        accel, _ = self.acceleration()
        snapshot = self.boot_mode() == SNAPSHOT
        template = self.template(image, accel) if snapshot else None
        directory = self.sandbox_dir(self.session_id, launch.sandbox_id)
        directory.mkdir(parents=True, exist_ok=True)
        exec_ours, exec_theirs = socket.socketpair()
        control_ours, control_theirs = socket.socketpair()
        qmp_ours, qmp_theirs = socket.socketpair()
        ends = (exec_ours, exec_theirs, control_ours, control_theirs, qmp_ours, qmp_theirs)
        functions: list[GpuFunction] = []
        claims: list[VfioClaim] = []
        devices: list[tuple[str, str, str]] = []
        process: subprocess.Popen[bytes] | None = None
        try:
            initrd = self.guest_initrd(image) if snapshot else self.initrd(image)
            memory = (
                f"memory-backend-file,mem-path={template.with_suffix('.ram')},share=off"
                if template is not None
                else "memory-backend-memfd,share=on"
            )
            argv = self.qemu_argv(launch.sandbox_id, image, initrd, accel, directory, memory)
            fds = [exec_theirs.fileno(), control_theirs.fileno(), qmp_theirs.fileno()]
            argv += _chardev("exec", exec_theirs.fileno(), EXEC_PORT)
            argv += _chardev("ctl", control_theirs.fileno(), CONTROL_PORT)
            argv += ["-chardev", f"socket,id=qmp,fd={qmp_theirs.fileno()}"]
            argv += ["-mon", "chardev=qmp,mode=control"]
            layout = self.layout() if snapshot else tuple(gpu.pci_bus_id for gpu in launch.gpus)
            argv += _root_ports(layout)
            for position, gpu in enumerate(launch.gpus):
                if self.host.simulated is not None:
                    function = self._claim_simulated(gpu)
                    functions.append(function)
                    fds += function.fds()
                    driver, option = "x-pci-proxy-dev", f"fd={function.qemu_socket.fileno()}"
                else:
                    claim = self._claim_vfio(gpu, launch.sandbox_id)
                    claims.append(claim)
                    driver, option = "vfio-pci", f"host={gpu.pci_bus_id}"
                port = f"port{layout.index(gpu.pci_bus_id)}"
                devices.append((f"gpu{position}", driver, f"{option},bus={port},addr=0x0"))
            if template is not None:
                argv += ["-incoming", "defer"]
            else:
                argv += [arg for id_, driver, rest in devices for arg in
                         ("-device", f"{driver},id={id_},{rest}")]  # fmt: skip
            with open(directory / "qemu.log", "wb") as log:
                process = spawn(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    pass_fds=fds,
                    env=HOST_ENV,
                )
            for function in functions:
                function.handed_over()
            for end in (exec_theirs, control_theirs, qmp_theirs):
                end.close()
            holder = Holder.process(process.pid)
            for claim in claims:
                self.vfio.set_holder(claim, launch.sandbox_id, holder)
            channel = _Channel(exec_ours)
            sandbox = VmSandbox(
                launch.sandbox_id,
                self.name,
                launch.gpus,
                process,
                holder,
                channel,
                _Channel(control_ours),
                self.sandbox_env(launch.env),
                self.host.leases,
                tuple(claim.group for claim in claims),
                self.vfio,
            )
            deadline = time.monotonic() + BOOT_TIMEOUT_S
            alive = sandbox.running
            if template is None:
                self._wait_until_ready(launch.sandbox_id, channel, deadline, alive, directory)
            else:
                qmp = _Qmp(_Channel(qmp_ours), deadline, alive)
                qmp.resume_incoming(template)
                for id_, driver, rest in devices:
                    qmp.add_device(id_, driver, rest)
                self._deliver_share(sandbox, [gpu.pci_bus_id for gpu in launch.gpus])
        except BaseException as exc:
            if process is not None:
                stop_process(process)
            for function in functions:
                function.handed_over()
            for claim in claims:
                self.vfio.release(claim.group)
            for end in ends:
                end.close()
            if isinstance(exc, GpuFunctionBusy):
                raise GpuBusy(", ".join(gpu.pci_bus_id for gpu in launch.gpus), str(exc)) from exc
            if isinstance(exc, (OSError, VfioError, TimeoutError, EOFError, SandboxExecError)):
                raise SandboxStartError(
                    f"VM {launch.sandbox_id} could not start: {type(exc).__name__}: {exc}; "
                    f"qemu (exit {process.poll() if process else None}): "
                    f"{_tail(directory / 'qemu.log')} console: {_tail(directory / 'console.log')}"
                ) from exc
            raise
        qmp_ours.close()
        return sandbox

    def _deliver_share(self, sandbox: VmSandbox, buses: list[str]) -> None:
        """A restored VM: the simulated host's share into /run/gpu-sim, then its GPU nodes."""
        script = ""
        if self.host.simulated is not None:
            archive = base64.b64encode(self.share_archive()).decode()
            script = (
                f"echo {archive} | base64 -d | (cd {SANDBOX_SHARE} && cpio -i -d 2>/dev/null) "
                f"&& mount -o remount,ro {SANDBOX_SHARE} && "
            )
        script += shlex.join(["/sbin/gpu-sandbox-gpus", *buses])
        done = sandbox.exec(["sh", "-c", script], timeout=HOTPLUG_TIMEOUT_S)
        if done.returncode != 0:
            raise SandboxStartError(
                f"VM {sandbox.id}: its GPUs {buses} did not come up after hot-plug "
                f"(exit {done.returncode}): {done.stderr.strip()} {done.stdout.strip()}"
            )

    def boot_mode(self) -> str:
        """``snapshot`` (a restored template VM, GPUs hot-plugged) or ``cold`` (a boot)."""
        wanted = os.environ.get(BOOT_ENV)
        if wanted in (SNAPSHOT, COLD):
            return wanted
        return SNAPSHOT if self.host.simulated is not None else COLD

    def layout(self) -> tuple[str, ...]:
        """Where a VM restored from the template has root ports: every GPU's bus of the host."""
        return tuple(sorted(gpu.pci_bus_id for gpu in self.host.gpus))

    def template(self, image: GuestImage, accel: str) -> Path:
        """The saved state of a booted VM with no GPU, for every VM of this layout to resume.

        Made once (one boot) per guest image, memory size, acceleration and layout of GPU
        buses, by whichever process needs it first, under a lock; others wait for it.
        """
        initrd = self.guest_initrd(image)
        key = hashlib.sha256(
            json.dumps(
                [str(image.kernel), image.kernel.stat().st_mtime_ns, str(initrd),
                 initrd.stat().st_mtime_ns, accel, self.memory_mib, self.layout(),
                 KERNEL_ARGS, self.version(), TEMPLATE_FORMAT]
            ).encode()
        ).hexdigest()[:20]  # fmt: skip
        state = self.run_dir / "templates" / f"{key}.state"
        if state.exists():
            _touch(state)
            return state
        state.parent.mkdir(parents=True, exist_ok=True)
        lock = os.open(state.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            wait_until(
                lambda: fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB),
                retry_on=(BlockingIOError,),
                timeout_s=BOOT_TIMEOUT_S + TEMPLATE_SAVE_TIMEOUT_S,
                what=f"another process to make the VM template {state}",
            )
            if not state.exists():
                _prune(state.parent, "*.state", also=(".ram", ".lock"))
                self._make_template(image, accel, state)
        finally:
            os.close(lock)
        return state

    def _make_template(self, image: GuestImage, accel: str, state: Path) -> None:
        directory = self.run_dir / "templates" / f"{state.stem}.boot"
        directory.mkdir(parents=True, exist_ok=True)
        exec_ours, exec_theirs = socket.socketpair()
        control_ours, control_theirs = socket.socketpair()
        qmp_ours, qmp_theirs = socket.socketpair()
        initrd = self.guest_initrd(image)
        partial = state.with_suffix(f".{os.getpid()}.tmp")
        ram = state.with_suffix(f".{os.getpid()}.ram.tmp")
        memory = f"memory-backend-file,mem-path={ram},share=on"
        argv = self.qemu_argv(f"template-{state.stem}", image, initrd, accel, directory, memory)
        argv += _chardev("exec", exec_theirs.fileno(), EXEC_PORT)
        argv += _chardev("ctl", control_theirs.fileno(), CONTROL_PORT)
        argv += ["-chardev", f"socket,id=qmp,fd={qmp_theirs.fileno()}"]
        argv += ["-mon", "chardev=qmp,mode=control", *_root_ports(self.layout())]
        with open(directory / "qemu.log", "wb") as log:
            process = spawn(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                pass_fds=[end.fileno() for end in (exec_theirs, control_theirs, qmp_theirs)],
                env=HOST_ENV,
            )
        try:
            for end in (exec_theirs, control_theirs, qmp_theirs):
                end.close()
            deadline = time.monotonic() + BOOT_TIMEOUT_S

            def alive() -> bool:
                return process.poll() is None

            self._wait_until_ready(state.stem, _Channel(exec_ours), deadline, alive, directory)
            qmp = _Qmp(_Channel(qmp_ours), time.monotonic() + TEMPLATE_SAVE_TIMEOUT_S, alive)
            qmp.save(partial)
            stop_process(process)  # its memory file is the template's memory from now on
            ram.rename(state.with_suffix(".ram"))
            partial.rename(state)
        finally:
            stop_process(process)
            partial.unlink(missing_ok=True)
            ram.unlink(missing_ok=True)
            for end in (exec_ours, control_ours, qmp_ours):
                end.close()
            shutil.rmtree(directory, ignore_errors=True)

    def _claim_simulated(self, gpu: GpuDevice) -> GpuFunction:
        assert self.host.simulated is not None
        return GpuFunction.claim(self.host.simulated.root / "vfio-groups", gpu.pci_bus_id)

    def _claim_vfio(self, gpu: GpuDevice, sandbox_id: str) -> VfioClaim:
        self.vfio.reconcile()  # groups that a VM which died left bound
        return self.vfio.claim(gpu.pci_bus_id, sandbox_id, Holder.process(os.getpid()))

    def _wait_until_ready(
        self,
        sandbox_id: str,
        channel: _Channel,
        deadline: float,
        alive: Callable[[], bool],
        directory: Path,
    ) -> None:
        """Wait for the guest agent's ``ready``; a VM that exits or hangs fails by name."""
        try:
            line = channel.read_line(deadline, alive)
        except (TimeoutError, EOFError, OSError) as exc:
            raise SandboxStartError(
                f"VM {sandbox_id} did not boot to its agent ({type(exc).__name__}: {exc}): "
                f"{_tail(directory / 'qemu.log')} console: {_tail(directory / 'console.log')}"
            ) from None
        if line != b"ready":
            raise SandboxStartError(f"VM {sandbox_id}'s agent said {line!r}, not ready")

    def qemu_argv(
        self,
        sandbox_id: str,
        image: GuestImage,
        initrd: Path,
        accel: str,
        directory: Path,
        memory_backend: str = "memory-backend-memfd,share=on",
    ) -> list[str]:
        """QEMU's command line for a sandbox, less its ports, root ports and GPUs.

        Its memory is a backend with a file descriptor, which the multi-process (proxy)
        device needs: a memfd, or a template's memory file, mapped copy-on-write.
        """
        memory = f"{self.memory_mib}M"
        return [
            "setpriv", "--pdeathsig", "SIGKILL", "--",
            shutil.which(QEMU, path=_BASE_PATH) or QEMU,
            "-name", f"{NAME_PREFIX}/{self.session_id}/{sandbox_id}",
            *SECCOMP,
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-accel", accel, *(["-cpu", "host"] if accel == "kvm" else []),
            "-M", "q35,memory-backend=mem",
            "-object", f"{memory_backend},id=mem,size={memory}",
            "-m", memory,
            "-kernel", str(image.kernel),
            "-initrd", str(initrd),
            "-append", KERNEL_ARGS,
            "-chardev", f"file,id=console,path={directory / 'console.log'}",
            "-serial", "chardev:console",
            "-device", "virtio-serial-pci,id=ports",
        ]  # fmt: skip

    def guest_initrd(self, image: GuestImage) -> Path:
        """The initramfs every VM boots, before any host's share: the image's."""
        return image.initrd

    def initrd(self, image: GuestImage) -> Path:
        """The guest's initramfs with the simulated host's share appended (a second cpio).

        Built once per image and share, then reused by every VM of the host that boots cold.
        """
        base = self.guest_initrd(image)
        sim = self.host.simulated
        if sim is None:
            return base
        digest = hashlib.sha256(str(base).encode())
        digest.update(str(base.stat().st_mtime_ns).encode())
        for path in sorted(sim.share_dir.rglob("*")):
            if path.is_file():
                digest.update(str(path.relative_to(sim.share_dir)).encode() + path.read_bytes())
        combined = self.run_dir / "initrd" / f"{digest.hexdigest()[:20]}.cpio"
        with self._initrd_lock:
            if combined.exists():
                _touch(combined)
                return combined
            combined.parent.mkdir(parents=True, exist_ok=True)
            _prune(combined.parent, "*.cpio")
            with tempfile.TemporaryDirectory(prefix="gpu-sandbox-vm-") as tmp:
                staging = Path(tmp) / "root"
                shutil.copytree(sim.share_dir, staging / SANDBOX_SHARE.lstrip("/"))
                overlay = _cpio(staging)
            partial = combined.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            partial.write_bytes(base.read_bytes() + overlay)
            partial.rename(combined)
        return combined

    def share_archive(self) -> bytes:
        """The simulated host's share as a cpio archive of its own tree (for /run/gpu-sim)."""
        assert self.host.simulated is not None
        if self._share_archive is None:
            self._share_archive = _cpio(self.host.simulated.share_dir)
        return self._share_archive

    def sandbox_dir(self, session_id: str, sandbox_id: str) -> Path:
        return self.run_dir / "sandboxes" / session_id / sandbox_id

    def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        tools = f"{SANDBOX_SHARE}/bin:" if self.host.simulated else ""
        return {"PATH": tools + GUEST_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", **extra}

    # -- finding and reaping -----------------------------------------------------------------

    def sandboxes(self, session_id: str) -> list[str]:
        return sorted({sandbox for sandbox, _ in _qemu_processes(session_id)})

    def reap(self, session_id: str) -> list[str]:
        found = _qemu_processes(session_id)
        for _, pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_for(
            lambda: _qemu_processes(session_id),
            lambda left: not left,
            timeout_s=REAP_TIMEOUT_S,
            what=f"the VMs of session {session_id} to exit",
            hint="a QEMU process that outlives SIGKILL is stuck in the kernel (D state)",
        )
        if self.host.simulated is None:
            self.vfio.reconcile()
        released = self.host.leases.release_session(session_id, driver=self.name)
        shutil.rmtree(self.run_dir / "sandboxes" / session_id, ignore_errors=True)
        return sorted({sandbox for sandbox, _ in found} | {x.sandbox_id for x in released})


class VmSandbox(Sandbox):
    """A running VM: its QEMU process holds its leases; commands go through its agent."""

    def __init__(
        self,
        sandbox_id: str,
        driver: str,
        gpus: tuple[GpuDevice, ...],
        process: subprocess.Popen[bytes],
        holder: Holder,
        channel: _Channel,
        control: _Channel,
        env: Mapping[str, str],
        leases: LeaseRegistry,
        vfio_groups: tuple[str, ...] = (),
        vfio: VfioBinder | None = None,
    ) -> None:
        super().__init__(sandbox_id, driver, gpus, holder, leases)
        self.process = process
        self._channel = channel
        self._control = control
        self._env = env
        self._exec_lock = threading.Lock()
        self._requests = 0
        self.vfio_groups = vfio_groups
        self._vfio = vfio

    @property
    def pid(self) -> int:
        """The QEMU process, the holder of the VM's GPU leases."""
        return self.process.pid

    def run(self, command: Command, output: Output) -> int:
        with self._exec_lock:
            env = {**self._env, **command.env}
            script = shlex.join(
                ["exec", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *command.argv]
            )
            self._requests += 1
            request = self._requests
            payload = base64.b64encode(script.encode()).decode()
            alive = self.running
            try:
                self._channel.send(f"exec {request} {payload}\n".encode())
                try:
                    header = self._channel.read_line(time.monotonic() + command.timeout, alive)
                    timed_out = False
                except TimeoutError:
                    # The agent kills every process carrying the marker, setsid or not;
                    # the command then ends and its answer comes.
                    self._control.send(f"kill {command.marker}\n".encode())
                    header = self._channel.read_line(time.monotonic() + AGENT_KILL_TIMEOUT_S, alive)
                    timed_out = True
                verb, answered, returncode, out, err = header.decode().split()
                if (verb, answered) != ("done", str(request)):
                    raise SandboxExecError(f"the agent of VM {self.id} answered {header!r}")
                deadline = time.monotonic() + TRANSFER_TIMEOUT_S
                output.stdout(self._channel.read_exactly(int(out), deadline, alive))
                output.stderr(self._channel.read_exactly(int(err), deadline, alive))
            except (OSError, EOFError, TimeoutError, ValueError) as exc:
                raise SandboxExecError(
                    f"cannot run {list(command.argv)!r} in VM {self.id}: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        if timed_out:
            raise CommandTimedOut
        return int(returncode)

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        # The guest keeps nothing: its root is the initramfs. Killing QEMU is its poweroff.
        stop_process(self.process)
        self._channel.close()
        self._control.close()
        if self._vfio is not None:
            for group in self.vfio_groups:
                self._vfio.release(group)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(KILL_TIMEOUT_S)


class _Channel:
    """One end of a socketpair to the guest agent, read with deadlines."""

    def __init__(self, end: socket.socket) -> None:
        self.end = end
        self.buffer = bytearray()

    def send(self, data: bytes) -> None:
        self.end.sendall(data)

    def read_line(self, deadline: float, alive: Callable[[], bool] | None = None) -> bytes:
        while b"\n" not in self.buffer:
            self._fill(deadline, alive)
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer[:] = rest
        return line

    def read_exactly(self, size: int, deadline: float, alive: Callable[[], bool] | None) -> bytes:
        while len(self.buffer) < size:
            self._fill(deadline, alive)
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def _fill(self, deadline: float, alive: Callable[[], bool] | None) -> None:
        # Short rounds, so that a VM that died is noticed without waiting out the deadline.
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer from the guest agent in time")
            ready, _, _ = select.select([self.end], [], [], min(remaining, 0.5))
            if ready:
                break
            if alive is not None and not alive():
                raise EOFError("the VM exited")
        chunk = self.end.recv(1 << 20)
        if not chunk:
            raise EOFError("the guest agent's port closed")
        self.buffer += chunk

    def close(self) -> None:
        self.end.close()


class _Qmp:
    """QEMU's machine protocol on a socketpair: resume an incoming VM, hot-plug, save."""

    def __init__(self, channel: _Channel, deadline: float, alive: Callable[[], bool]) -> None:
        self.channel = channel
        self.deadline = deadline
        self.alive = alive
        self.channel.read_line(deadline, alive)  # the greeting
        self.command("qmp_capabilities")

    def command(self, name: str, **arguments: object) -> object:
        request = {"execute": name, "arguments": arguments} if arguments else {"execute": name}
        self.channel.send(json.dumps(request).encode() + b"\n")
        while True:
            reply = json.loads(self.channel.read_line(self.deadline, self.alive))
            if "error" in reply:
                raise OSError(f"QEMU refused {name}: {reply['error'].get('desc', reply)}")
            if "return" in reply:
                return reply["return"]

    def _migration(self) -> str:
        status = self.command("query-migrate")
        return str(status.get("status", "")) if isinstance(status, dict) else ""

    def _until(self, done: Callable[[], bool], what: str) -> None:
        wait_for(
            done,
            bool,
            timeout_s=max(0.0, self.deadline - time.monotonic()),
            what=f"QEMU to {what}",
            hint="see the VM's qemu.log under the driver's run directory",
            interval_s=0.02,
        )

    def resume_incoming(self, state: Path) -> None:
        """Load the template's state (its memory is mapped already), then run the VM."""
        self.command("migrate-set-capabilities", capabilities=_IGNORE_SHARED)
        self.command("migrate-incoming", uri=f"exec:cat {shlex.quote(str(state))}")

        def loaded() -> bool:
            status = self._migration()
            if status == "failed":
                raise OSError("QEMU could not load the VM template")
            return status == "completed"

        self._until(loaded, "load the VM template")
        self.command("cont")

    def add_device(self, id_: str, driver: str, options: str) -> None:
        arguments: dict[str, object] = {"driver": driver, "id": id_}
        for option in options.split(","):
            key, _, value = option.partition("=")
            arguments[key] = value
        self.command("device_add", **arguments)

    def save(self, path: Path) -> None:
        """Stop the VM and save its state, less its memory (in its shared file), to ``path``."""
        self.command("stop")
        self.command("migrate-set-capabilities", capabilities=_IGNORE_SHARED)
        self.command("migrate", uri=f"exec:cat > {shlex.quote(str(path))}")

        def saved() -> bool:
            status = self._migration()
            if status == "failed":
                raise OSError(f"QEMU could not save the VM template to {path}")
            return status == "completed"

        self._until(saved, f"save the VM template to {path}")


_IGNORE_SHARED = [{"capability": "x-ignore-shared", "state": True}]
"""Memory in a shared file is not copied into the saved state: the template's file is it."""


def _chardev(name: str, fd: int, port: str) -> list[str]:
    return [
        "-chardev", f"socket,id={name},fd={fd}",
        "-device", f"virtserialport,bus=ports.0,chardev={name},name={port}",
    ]  # fmt: skip


def _root_ports(buses: Sequence[str]) -> list[str]:
    """Root ports ``port<i>`` that put a device behind them at the host's bus ``buses[i]``.

    Each on a PCIe expander bridge numbered one below the GPU's bus: the device behind the
    port gets the GPU's own bus number, at device 0, function 0. Each reserves room for a
    GPU's registers, for one hot-plugged into a VM restored from the template.
    """
    argv = []
    for position, bus_id in enumerate(buses):
        bus = int(bus_id.split(":")[1], 16)
        argv += [
            "-device", f"pxb-pcie,id=pxb{position},bus_nr={bus - 1},bus=pcie.0",
            "-device", f"pcie-root-port,id=port{position},bus=pxb{position},"
            f"chassis={position + 1},slot=0,mem-reserve={ROOT_PORT_MEMORY}",
        ]  # fmt: skip
    return argv


def _cpio(root: Path) -> bytes:
    """A newc archive of ``root``'s tree, owned by root, as the kernel unpacks initramfs."""
    names = sorted(str(path.relative_to(root)) for path in root.rglob("*"))
    done = subprocess.run(
        ["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"],
        input="\n".join(names).encode() + b"\n",
        cwd=root,
        capture_output=True,
        check=False,
        env=HOST_ENV,
        timeout=CPIO_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise SandboxStartError(f"cpio could not pack the guest overlay: {done.stderr.decode()}")
    return done.stdout


def _probe_kvm(image: GuestImage) -> tuple[str, str]:
    """Boot the guest under KVM to its init, with a deadline: ``("kvm", ...)`` if it got there."""
    argv = [
        shutil.which(QEMU, path=_BASE_PATH) or QEMU, *SECCOMP,
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-accel", "kvm", "-cpu", "host", "-M", "q35", "-m", f"{DEFAULT_MEMORY_MIB}M",
        "-kernel", str(image.kernel), "-initrd", str(image.initrd),
        "-append", f"{KERNEL_ARGS} gpu_sandbox.probe=1", "-serial", "stdio",
    ]  # fmt: skip
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=PROBE_TIMEOUT_S, check=False, env=HOST_ENV
        )
    except subprocess.TimeoutExpired:
        return "tcg", f"a KVM guest had not reached its init after {PROBE_TIMEOUT_S:g} s"
    if b"gpu-sandbox: probe booted" in done.stdout:
        return "kvm", "a KVM guest booted"
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return "tcg", f"KVM failed (qemu exit {done.returncode}: {lines[-1] if lines else ''})"


def _qemu_processes(session_id: str) -> list[tuple[str, int]]:
    """(sandbox id, pid) of every QEMU process named for ``session_id``."""
    found = []
    for pid, cmdline in each_process("cmdline"):
        argv = cmdline.split(b"\0")
        if not argv[0].endswith(QEMU.encode()):
            continue
        for flag, value in itertools.pairwise(argv):
            if flag == b"-name" and (match := _NAME.match(value.decode(errors="replace"))):
                if match["session"] == session_id:
                    found.append((match["sandbox"], pid))
                break
    return found


def _default_run_dir() -> Path:
    """/run/gpu-sandbox-vm (a tmpfs), or a directory of the user's own where /run is not theirs."""
    if os.access(DEFAULT_RUN_DIR, os.W_OK) or os.access(DEFAULT_RUN_DIR.parent, os.W_OK):
        return DEFAULT_RUN_DIR
    return Path(tempfile.gettempdir()) / f"gpu-sandbox-vm-{os.getuid()}"


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def _prune(directory: Path, pattern: str, also: Sequence[str] = ()) -> None:
    """Remove what no VM has used for a while: templates and initramfs of hosts long gone.

    Each is read only as a VM starts (a running VM keeps its mapping of a template's memory
    file); an hour unused is long past any start. ``also``: suffixes of files that go with.
    """
    for path in directory.glob(pattern):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > UNUSED_AFTER_S:
                path.unlink()
                for suffix in also:
                    path.with_suffix(suffix).unlink(missing_ok=True)


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(none)"
    shown = [line for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(shown) or "(empty)"
