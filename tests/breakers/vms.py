"""Planted broken vm drivers (and a VFIO binder): the vm driver with one defect each.

``BREAKS`` names the requirement the catalogue must fail for each driver; tests/drivers/test_vm.py
runs those tests against every one of them on a simulated host, on real QEMU.
``BindingNotRestored`` is judged by the VFIO tests on constructed sysfs trees
(tests/gpuhost/test_vfio.py): nothing here has an IOMMU to pass a GPU through.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import ClassVar

from drivers.base import Launch
from drivers.vm import GuestImage, VmDriver, VmSandbox
from drivers.vm.image import cpio
from gpuhost.leases import Holder
from gpuhost.spec import DriverCapabilities, DriverRequest, GpuPlan
from gpuhost.validation import validate_gpu_request
from gpuhost.vfio import VfioBinder

GUEST_AGENT = Path(__file__).parent.parent / "scripts" / "vm-guest" / "gpu-sandbox-agent"


class BrokenVmDriver(VmDriver):
    BREAKS: ClassVar[str]


class SecondGpuAccepted(BrokenVmDriver):
    """GPU-VALIDATE-02: it says one GPU per VM, but a request for two gets two (no check)."""

    BREAKS = "GPU-VALIDATE-02"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        generous = DriverCapabilities(
            max_gpus_per_sandbox=len(self.inventory()), exact_ids=True, shared=False
        )
        plan = validate_gpu_request(request, generous)
        if plan is not None and plan.device_ids:
            return GpuPlan(plan.count, plan.device_ids, plan.field, self.resolve(plan))
        return plan


class GpuNeverReclaimed(BrokenVmDriver):
    """GPU-RECLAIM-01: leases stay with the creating process, not QEMU: a killed VM's GPU too."""

    BREAKS = "GPU-RECLAIM-01"

    def start(self, launch: Launch) -> VmSandbox:
        launch.hand_over(Holder.process(os.getpid()))
        return super().start(launch)


class PlantedAgent(BrokenVmDriver):
    """The guest's agent changed by ``plant``, in an initrd of its own beside the image's."""

    def plant(self, agent: str) -> str:
        raise NotImplementedError

    def guest_initrd(self, image: GuestImage) -> Path:
        base = super().guest_initrd(image)
        name = type(self).__name__
        planted = self.run_dir / "initrd" / f"{name}-{base.stat().st_mtime_ns}.cpio"
        if not planted.exists():
            agent = self.plant(GUEST_AGENT.read_text())
            assert agent != GUEST_AGENT.read_text(), f"{name}: the agent's line moved"
            with tempfile.TemporaryDirectory() as tmp:
                target = Path(tmp) / "sbin" / "gpu-sandbox-agent"
                target.parent.mkdir()
                target.write_text(agent)
                target.chmod(0o755)
                overlay = cpio(Path(tmp))
            planted.parent.mkdir(parents=True, exist_ok=True)
            partial = planted.with_suffix(f".{os.getpid()}.tmp")
            partial.write_bytes(base.read_bytes() + overlay)
            partial.rename(planted)
        return planted


class AgentReportsSuccess(PlantedAgent):
    """SANDBOX-EXEC-01: the guest's agent reports exit code 0 for every command, failed or not."""

    BREAKS = "SANDBOX-EXEC-01"

    def plant(self, agent: str) -> str:
        return re.sub(r'echo "done \$id \$rc ', 'echo "done $id 0 ', agent)


class AgentGainsPrivileges(PlantedAgent):
    """SANDBOX-PRIV-01: the guest's agent runs commands without no-new-privileges."""

    BREAKS = "SANDBOX-PRIV-01"

    def plant(self, agent: str) -> str:
        return agent.replace("exec setsid setpriv --nnp sh", "exec setsid sh")


class AgentKillsTheGroupOnly(PlantedAgent):
    """SANDBOX-EXEC-01: at a timeout the agent kills the command's group, not what left it."""

    BREAKS = "SANDBOX-EXEC-01"

    def plant(self, agent: str) -> str:
        return agent.replace("marked=$(grep -lF", "return 0; marked=$(grep -lF")


class BindingNotRestored(VfioBinder):
    """Releasing a group forgets it but leaves its functions bound to vfio-pci."""

    def _restore(self, functions: dict[str, str | None]) -> None:
        pass


ALL: tuple[type[BrokenVmDriver], ...] = (
    SecondGpuAccepted,
    GpuNeverReclaimed,
    AgentReportsSuccess,
    AgentGainsPrivileges,
    AgentKillsTheGroupOnly,
)
