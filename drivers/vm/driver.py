"""``VmDriver``: the contract for VMs, at most one GPU each, and a VM's start step by step.

Host needs: ``qemu-system-x86_64`` (Debian's ``qemu-system-x86``, 7.2 or newer), util-linux
``setpriv``, and a guest image (``image.py``); on a simulated host ``cpio``, on a real one
VFIO (``passthrough.py``).

Exact IDs are the GPU's PCI address (``0000:2a:00.0``, any form nvidia-smi or lspci prints)
or its host index. Options, from the environment, besides those of the image, the
acceleration and the boot: ``GPU_SANDBOX_VM_MEMORY_MIB`` (guest memory),
``GPU_SANDBOX_VM_RUN_DIR`` (per-sandbox logs, templates, the KVM verdict).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from drivers.base import Availability, Driver, Launch
from drivers.host_process import HOST_PATH, missing_tools, run_tool, tool
from drivers.vm.agent import Channel, GuestAgent
from drivers.vm.image import GuestImage, find_guest_image
from drivers.vm.passthrough import GpuClaim, passthrough_for
from drivers.vm.qemu import (
    DEFAULT_MEMORY_MIB,
    MEMORY_ENV,
    QEMU,
    QEMU_PROCESSES,
    Machine,
    QemuDevice,
    Qmp,
    VmSockets,
    boot_logs,
    decide_acceleration,
    root_ports,
    spawn_qemu,
)
from drivers.vm.sandbox import VmSandbox
from drivers.vm.template import BOOT_ENV, BOOT_TIMEOUT_S, COLD, SNAPSHOT, resumed_memory, template
from gpuhost import environ
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
from gpuhost.idforms import forms_text
from gpuhost.private import NotPrivate, private_directory
from gpuhost.simulated.pci_proxy import GpuFunctionBusy
from gpuhost.spawn import stop_process
from gpuhost.spec import DEVICE_IDS_KEY, DriverCapabilities, DriverRequest, GpuPlan
from gpuhost.vfio import VfioError, VfioRefused

RUN_DIR_ENV = "GPU_SANDBOX_VM_RUN_DIR"
DEFAULT_RUN_DIR = Path("/run/gpu-sandbox-vm")
HOTPLUG_TIMEOUT_S = 60.0
"""A hot-plugged function shows in the guest within a second or two (pciehp), under TCG."""
VERSION_TIMEOUT_S = 10.0
# "invalid PCI BDF address" for anything that is neither an index nor a PCI address.
_INDEX = re.compile(r"0|[1-9][0-9]*")


def pci_forms(address: str) -> tuple[str, ...]:
    """The spellings of a PCI address the vm driver takes, each in either letter case.

    The kernel's (``0000:2a:00.0``), NVML's and nvidia-smi's (``00000000:2A:00.0``), lspci's
    (``2a:00.0``); no other domain width, no white space, no mixed case.
    """
    domain, _, rest = address.partition(":")
    written = (address, f"0000{domain}:{rest}", rest)
    return tuple(dict.fromkeys(form for w in written for form in (w.lower(), w.upper())))


VM_ID_FORMS = ("pci", "index")
"""A GPU is named by its PCI address, or its host index: what passthrough is given."""


class VmDriver(Driver):
    name = "vm"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        super().__init__(host, session_id, image)
        named = os.environ.get(RUN_DIR_ENV)
        self.run_dir = Path(named or _default_run_dir())
        self.run_dir_refused = "" if named or os.geteuid() == 0 else _own_run_dir(self.run_dir)
        """Why the default run directory of a user other than root is not used, if it is not."""
        self.memory_mib = environ.integer(MEMORY_ENV, DEFAULT_MEMORY_MIB, minimum=64)
        self.passthrough = passthrough_for(host, self.run_dir)
        self._accel: tuple[str, str] | None = None

    @property
    def capabilities(self) -> DriverCapabilities:
        return DriverCapabilities(
            max_gpus_per_sandbox=1,
            exact_ids=True,
            id_forms=VM_ID_FORMS,
            exact_id_forms=(
                f"{forms_text(VM_ID_FORMS)} (a PCI address as NVML or lspci write it too: "
                "00000000:2A:00.0, 2a:00.0)"
            ),
            exclusive=True,
            shared=False,
            mig_profiles=False,
            vendors=("nvidia",),
        )

    # -- what the host offers -------------------------------------------------------------

    def inventory(self) -> tuple[GpuDevice, ...]:
        """NVIDIA's whole GPUs not in MIG mode that the host lets VMs take (``offered``)."""
        return self.passthrough.offered(self._whole_gpus())

    def _whole_gpus(self) -> tuple[GpuDevice, ...]:
        return tuple(gpu for gpu in self._host_gpus() if not gpu.mig_enabled)

    def _host_gpus(self) -> tuple[GpuDevice, ...]:
        """The host's NVIDIA GPUs as VMs see them: on a real host, those of the PCI bus."""
        return self.passthrough.gpus(self.host.gpus)

    def device_index(self) -> dict[str, tuple[GpuDevice, ...]]:
        """Its IDs, and each GPU's PCI address in every form it takes (``pci_forms``)."""
        index = super().device_index()
        for gpu in self.exact_devices():
            index.update(dict.fromkeys(pci_forms(gpu.pci_bus_id), (gpu,)))
        return index

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
        """A PCI address in a form it lists (``pci_forms``), or a host index; one GPU.

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
                bus = normalize_pci_bus_id(device_id)
                if device_id not in pci_forms(bus):
                    raise ValueError(device_id)
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
                held_back = [g for g in self._whole_gpus() if g.pci_bus_id == bus]
                why = f": {self.passthrough.why_none(tuple(held_back))}" if held_back else ""
                raise UnknownGpuDevice(
                    plan.field,
                    device_id,
                    f"{plan.field} names {shown(device_id)}, but no GPU that passes through is "
                    f"at PCI address {bus} (this host's: {buses}){why}",
                )
            chosen.append(found[0])
        return tuple(chosen)

    def _by_index(self, field: str, device_id: str, inventory: tuple[GpuDevice, ...]) -> GpuDevice:
        """The host's index, as nvidia-smi numbers GPUs: GPUs in MIG mode count too.

        On a real host, the index among the NVIDIA GPUs of the PCI bus (nvidia-smi's where
        every GPU is bound to the nvidia driver): a GPU bound to vfio-pci has one too.
        """
        gpus = self._host_gpus()
        if len(device_id) > len(str(len(gpus))) or int(device_id) >= len(gpus):
            raise UnknownGpuDevice(
                field,
                device_id,
                f"GPU index {shown(device_id)} out of range (have {len(gpus)} GPUs) in {field}",
            )
        gpu = gpus[int(device_id)]
        if gpu in inventory:
            return gpu
        offered = ", ".join(g.pci_bus_id for g in inventory) or "none"
        why = (
            "is in MIG mode; a VM takes a whole GPU"
            if gpu.mig_enabled
            else f"is not one VMs are given here: {self.passthrough.why_none((gpu,))}"
        )
        raise UnknownGpuDevice(
            field,
            device_id,
            f"GPU index {shown(device_id)} ({gpu.pci_bus_id}) in {field} {why} (this host's: "
            f"{offered})",
        )

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
        if self.run_dir_refused:
            return Availability(False, self.run_dir_refused)
        missing = missing_tools((QEMU, "setpriv"))
        if missing:
            return Availability(
                False,
                f"needed {', '.join(missing)} (found none in {HOST_PATH}; `make vm-image` "
                "installs qemu-system-x86 as root, or: apt-get install qemu-system-x86)",
            )
        try:
            self.guest_image()
        except SandboxStartError as exc:
            return Availability(False, str(exc))
        if not self._whole_gpus():
            return Availability(
                False,
                "needed NVIDIA GPUs not in MIG mode (found none through NVML, nvidia-smi or "
                "the PCI bus; use --sim-gpus=N for a simulated GPU host)",
            )
        if not self.inventory():
            return Availability(False, self.passthrough.why_none(self._whole_gpus()))
        unavailable = self.passthrough.unavailable()
        if unavailable is not None:
            return Availability(False, unavailable)
        return Availability(True)

    def guest_image(self) -> GuestImage:
        """The kernel and initramfs to boot: the user's own, or ``make vm-image``'s."""
        return find_guest_image()

    def version(self) -> str:
        if not shutil.which(QEMU, path=HOST_PATH):
            return ""
        done = run_tool([tool(QEMU), "--version"], VERSION_TIMEOUT_S)
        if done is None:
            return ""
        found = re.search(r"version (\S+)", done.stdout)
        accel, _ = self.acceleration()
        return f"qemu {found[1] if found else '?'}, {accel.upper()}, {self.passthrough.description}"

    def acceleration(self) -> tuple[str, str]:
        """``("kvm" | "tcg", why)``: asked for, or decided by a probe once per host boot."""
        if self.run_dir_refused:  # its KVM verdict, like everything else, is written there
            raise SandboxStartError(self.run_dir_refused)
        if self._accel is None:
            self._accel = decide_acceleration(self.run_dir, self.guest_image)
        return self._accel

    # -- starting a VM ----------------------------------------------------------------------

    def start(self, launch: Launch) -> VmSandbox:
        image = self.guest_image()
        accel, _ = self.acceleration()
        state = self.template(image, accel) if self.boot_mode() == SNAPSHOT else None
        directory = self.sandbox_dir(self.session_id, launch.sandbox_id)
        directory.mkdir(parents=True, exist_ok=True)
        sockets = VmSockets()
        claims: list[GpuClaim] = []
        process: subprocess.Popen[bytes] | None = None
        try:
            machine = self._machine_argv(launch.sandbox_id, image, accel, state, directory)
            buses = tuple(gpu.pci_bus_id for gpu in launch.gpus)
            layout = buses if state is None else self.layout()
            devices = self._claim_gpus(launch, layout, claims)
            argv = [*machine, *sockets.argv(), *root_ports(layout), *_boot_args(state, devices)]
            process = spawn_qemu(argv, directory, [*sockets.fds(), *_fds(claims)])
            sandbox = self._sandbox(launch, process, sockets, claims)
            self._bring_up(sandbox, state, devices, sockets, directory)
        except BaseException as exc:
            if process is not None:
                stop_process(process)
            for claim in claims:
                claim.abandon()
            sockets.close()
            _raise_start_error(exc, launch, process, directory)
            raise
        sockets.qmp.close()
        return sandbox

    def _machine_argv(
        self, sandbox_id: str, image: GuestImage, accel: str, state: Path | None, directory: Path
    ) -> list[str]:
        """QEMU's command line for the sandbox's machine: booting cold, or resuming ``state``."""
        if state is None:
            return self.qemu_argv(sandbox_id, image, self.initrd(image), accel, directory)
        initrd, memory = self.guest_initrd(image), resumed_memory(state)
        return self.qemu_argv(sandbox_id, image, initrd, accel, directory, memory)

    def _claim_gpus(
        self, launch: Launch, layout: Sequence[str], claims: list[GpuClaim]
    ) -> list[QemuDevice]:
        """Take each GPU for the VM (into ``claims``): the device behind its bus's root port."""
        devices = []
        for position, gpu in enumerate(launch.gpus):
            claim = self.passthrough.claim(gpu, launch.sandbox_id)
            claims.append(claim)
            port = f"port{layout.index(gpu.pci_bus_id)}"
            options = f"{claim.options()},bus={port},addr=0x0"
            devices.append(QemuDevice(f"gpu{position}", claim.driver, options))
        return devices

    def _sandbox(
        self,
        launch: Launch,
        process: subprocess.Popen[bytes],
        sockets: VmSockets,
        claims: Sequence[GpuClaim],
    ) -> VmSandbox:
        """The started QEMU as the sandbox: its GPUs and this process's sockets handed over."""
        sockets.handed_over()
        agent = GuestAgent(launch.sandbox_id, Channel(sockets.exec), Channel(sockets.control))
        env = self.sandbox_env(launch.env)
        sandbox = VmSandbox(launch, self.name, process, agent, env, self.host.leases, claims)
        for claim in claims:
            claim.handed_over(sandbox.holder)
        return sandbox

    def _bring_up(
        self,
        sandbox: VmSandbox,
        state: Path | None,
        devices: Sequence[QemuDevice],
        sockets: VmSockets,
        directory: Path,
    ) -> None:
        """Wait for a booted guest's agent; or resume ``state``, then hot-plug the GPUs."""
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        if state is None:
            sandbox.agent.wait_ready(deadline, sandbox.running, lambda: boot_logs(directory))
            return
        qmp = Qmp(Channel(sockets.qmp), deadline, sandbox.running)
        qmp.resume_incoming(state)
        for device in devices:
            qmp.add_device(device)
        self._set_up_guest(sandbox, [gpu.pci_bus_id for gpu in sandbox.gpus])

    def _set_up_guest(self, sandbox: VmSandbox, buses: list[str]) -> None:
        """A resumed VM: what the guest needs of the host, then its GPUs' nodes."""
        script = self.passthrough.guest_setup()
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
        return self.passthrough.default_boot

    def layout(self) -> tuple[str, ...]:
        """Where a VM restored from the template has root ports: every GPU's bus of the host."""
        return tuple(sorted(gpu.pci_bus_id for gpu in self.host.gpus))

    def template(self, image: GuestImage, accel: str) -> Path:
        """The saved state of a booted VM with no GPU, for every VM of this layout to resume."""
        machine = self.machine(image, self.guest_initrd(image), accel)
        return template(machine, self.layout(), self.run_dir / "templates", self.version())

    def machine(self, image: GuestImage, initrd: Path, accel: str) -> Machine:
        """The VM this driver's sandboxes get, booting ``image`` with ``initrd``."""
        return Machine(self.session_id, image, initrd, accel, self.memory_mib)

    def qemu_argv(
        self,
        sandbox_id: str,
        image: GuestImage,
        initrd: Path,
        accel: str,
        directory: Path,
        memory_backend: str = "memory-backend-memfd,share=on",
    ) -> list[str]:
        """QEMU's command line for a sandbox, less its ports, root ports and GPUs."""
        return self.machine(image, initrd, accel).argv(sandbox_id, directory, memory_backend)

    def guest_initrd(self, image: GuestImage) -> Path:
        """The initramfs every VM boots, before any host's share: the image's."""
        return image.initrd

    def initrd(self, image: GuestImage) -> Path:
        """The initramfs a VM boots cold: the guest's, with what it needs of the host."""
        return self.passthrough.boot_initrd(self.guest_initrd(image))

    def sandbox_dir(self, session_id: str, sandbox_id: str) -> Path:
        return self.run_dir / "sandboxes" / session_id / sandbox_id

    def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        return {"PATH": self.passthrough.guest_path, "HOME": "/tmp", "LANG": "C.UTF-8", **extra}

    # -- finding and reaping -----------------------------------------------------------------

    def sandboxes(self, session_id: str) -> list[str]:
        return sorted({sandbox for sandbox, _ in QEMU_PROCESSES.find(session_id)})

    def remove_session(self, session_id: str) -> list[str]:
        reaped = QEMU_PROCESSES.reap(session_id)
        self.passthrough.reconcile()
        if not self.run_dir_refused:
            shutil.rmtree(self.run_dir / "sandboxes" / session_id, ignore_errors=True)
        return reaped


def _boot_args(state: Path | None, devices: Sequence[QemuDevice]) -> list[str]:
    """The GPUs on QEMU's command line (a boot), or QEMU waiting for ``state`` (a resume)."""
    if state is not None:
        return ["-incoming", "defer"]
    return [arg for device in devices for arg in device.argv()]


def _fds(claims: Sequence[GpuClaim]) -> list[int]:
    return [fd for claim in claims for fd in claim.fds()]


def _raise_start_error(
    exc: BaseException, launch: Launch, process: subprocess.Popen[bytes] | None, directory: Path
) -> None:
    """Raise the typed error for what made a VM fail to start, if it is one of the known."""
    if isinstance(exc, GpuFunctionBusy):
        raise GpuBusy(", ".join(gpu.pci_bus_id for gpu in launch.gpus), str(exc)) from exc
    if isinstance(exc, VfioRefused):  # refused before anything was changed, or QEMU run
        raise SandboxStartError(
            f"VM {launch.sandbox_id} could not start: VfioRefused: {exc}"
        ) from exc
    if isinstance(exc, (OSError, VfioError, TimeoutError, EOFError, SandboxExecError)):
        raise SandboxStartError(
            f"VM {launch.sandbox_id} could not start: {type(exc).__name__}: {exc}; "
            f"qemu (exit {process.poll() if process else None}): {boot_logs(directory)}"
        ) from exc


def _default_run_dir() -> Path:
    """/run/gpu-sandbox-vm (a tmpfs) for root; for another user a directory of its own.

    Under ``$XDG_RUNTIME_DIR`` (the user's own, 0700) when it is set, else
    ``/tmp/gpu-sandbox-vm-<uid>``, a name any user could take first: ``_own_run_dir``.
    """
    if os.geteuid() == 0:
        return DEFAULT_RUN_DIR
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        return Path(runtime) / "gpu-sandbox-vm"
    return Path(tempfile.gettempdir()) / f"gpu-sandbox-vm-{os.geteuid()}"


def _own_run_dir(path: Path) -> str:
    """Why ``path`` cannot be the run directory (for the probe to say), or "" once it is.

    It is made 0700, or checked to be this user's own real directory (not a link, not
    another user's) through a descriptor and made 0700.
    """
    try:
        os.close(private_directory(path))
    except NotPrivate as exc:
        return f"needed a run directory of this user's own ({RUN_DIR_ENV} names one): {exc}"
    return ""
