"""Planted breakers of visibility: GPU-NONE-01, GPU-DEFAULT-01, GPU-COUNT-01, GPU-ISOLATION-01.

A sandbox sees exactly the GPUs it was given, by UUID, and only their device nodes. Their
tests: conformance/test_visibility.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
from collections.abc import Sequence
from typing import ClassVar

from conformance.observe import COMMAND_PATHS
from conformance.test_visibility import GPU_NODE_PLACES
from drivers.base import Launch
from drivers.reference import ReferenceSandbox
from gpuhost.devices import SIMULATED_DRM_MAJOR, DeviceNode, GpuDevice
from gpuhost.spec import (
    CHOICE_KEYS,
    DEVICE_IDS_KEY,
    DriverRequest,
    GpuPlan,
    GpuRequest,
    SandboxSpec,
)
from tests.breakers.base import BrokenDriver, class_name, family, with_binds
from tests.breakers.execution import EnteredOnOnePath, way_name


class GpuWithoutRequest(BrokenDriver):
    """GPU-NONE-01: a sandbox with no GPU request still gets a GPU."""

    BREAKS = "GPU-NONE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        return super().plan(request) or GpuPlan(count=1)


def _implies_a_request(key: str) -> type[BrokenDriver]:
    class ImpliesARequest(BrokenDriver):
        __doc__ = f"GPU-NONE-01: a {key} in its block, with no GPU request, still gets a GPU."
        BREAKS = "GPU-NONE-01"

        def plan(self, request: DriverRequest) -> GpuPlan | None:
            if request.gpu is None and key in request.config:
                request = dataclasses.replace(request, gpu=GpuRequest())
            return super().plan(request)

    ImpliesARequest.__name__ = ImpliesARequest.__qualname__ = f"{class_name(key)}ImpliesARequest"
    return ImpliesARequest


family(globals(), CHOICE_KEYS, _implies_a_request)


class OtherBlocksImplyARequest(BrokenDriver):
    """GPU-NONE-01: device IDs in other drivers' blocks, with no GPU request, still get a GPU."""

    BREAKS = "GPU-NONE-01"

    def select(self, spec: SandboxSpec) -> DriverRequest:
        if spec.gpu is None and any(DEVICE_IDS_KEY in b for b in spec.driver_config.values()):
            spec = dataclasses.replace(spec, gpu=GpuRequest())
        return super().select(spec)


class AllGpusOnDefault(BrokenDriver):
    """GPU-DEFAULT-01: a default request injects every GPU (the old `nvidia.com/gpu=all`)."""

    BREAKS = "GPU-DEFAULT-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        plan = super().plan(request)
        if plan is not None and request.gpu is not None and request.gpu.count is None:
            return GpuPlan(count=len(self.inventory()))
        return plan


class NodeByIndex(BrokenDriver):
    """GPU-DEFAULT-01: binds /dev/nvidia<index> for GPU <index>: right only where minor == index."""

    BREAKS = "GPU-DEFAULT-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        by_minor = {gpu.minor: gpu for gpu in self.inventory()}
        return super().bwrap_argv(sandbox_id, [by_minor[gpu.index] for gpu in gpus])


class CudaVisibleHostIndex(BrokenDriver):
    """GPU-DEFAULT-01: sets CUDA_VISIBLE_DEVICES to host indices; inside they are 0..n-1."""

    BREAKS = "GPU-DEFAULT-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        nvidia = [gpu for gpu in launch.gpus if gpu.vendor == "nvidia"]
        if nvidia:
            indices = ",".join(str(gpu.index) for gpu in nvidia)
            sandbox._env = {**sandbox._env, "CUDA_VISIBLE_DEVICES": indices}
        return sandbox


class CountIgnored(BrokenDriver):
    """GPU-COUNT-01: every request gets one GPU, whatever the count."""

    BREAKS = "GPU-COUNT-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        plan = super().plan(request)
        return plan if plan is None or plan.device_ids else GpuPlan(count=1)


class OneAtATime(BrokenDriver):
    """GPU-COUNT-01: leases a count one GPU at a time: a shared count lands N times on one GPU."""

    BREAKS = "GPU-COUNT-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.device_ids or plan.count == 1:
            return super().allocate(sandbox_id, plan)
        granted: list[GpuDevice] = []
        try:
            for _ in range(plan.count):
                granted += super().allocate(sandbox_id, dataclasses.replace(plan, count=1))
        except BaseException:
            self.host.leases.release(sandbox_id)
            raise
        return tuple(granted)


class EnvironmentOnlyIsolation(BrokenDriver):
    """GPU-ISOLATION-01: every GPU node is mounted; CUDA_VISIBLE_DEVICES alone "selects"."""

    BREAKS = "GPU-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, self.inventory() if gpus else gpus)
        visible = ",".join(str(gpu.index) for gpu in gpus)
        return [*argv, "--setenv", "CUDA_VISIBLE_DEVICES", visible]


class LeaksDriNode(BrokenDriver):
    """GPU-ISOLATION-01: GPU sandboxes get a DRM render node of the host too: another GPU's door."""

    BREAKS = "GPU-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        if not gpus:
            return argv
        node = self.host.leases.directory.parent / "renderD128"
        with contextlib.suppress(FileExistsError):
            os.mknod(node, 0o660 | stat.S_IFCHR, os.makedev(SIMULATED_DRM_MAJOR, 128))
        return with_binds(argv, "--dev-bind", str(node), "/dev/dri/renderD128")


class GpuNodesNodev(BrokenDriver):
    """GPU-ISOLATION-01: binds GPU and control nodes with --ro-bind ("safer"): nodev, none opens."""

    BREAKS = "GPU-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        return ["--ro-bind" if arg == "--dev-bind" else arg for arg in argv]


class OmitsUvmNode(BrokenDriver):
    """GPU-ISOLATION-01: of NVIDIA's control nodes binds nvidiactl, not nvidia-uvm: no CUDA."""

    BREAKS = "GPU-ISOLATION-01"
    LEFT_OUT = "/dev/nvidia-uvm"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        kept: list[str] = []
        at = 0
        while at < len(argv):
            if argv[at] == "--dev-bind" and argv[at + 2].startswith(self.LEFT_OUT):
                at += 3
                continue
            kept.append(argv[at])
            at += 1
        return kept


class OmitsCtlNode(OmitsUvmNode):
    """GPU-ISOLATION-01: binds the GPUs' nodes and nvidia-uvm, not nvidiactl: none of them opens."""

    LEFT_OUT = "/dev/nvidiactl"


def _another_gpu_under(place: str) -> type[BrokenDriver]:
    class AnotherGpuUnder(BrokenDriver):
        __doc__ = (
            f"GPU-ISOLATION-01: a GPU sandbox holds another GPU's node too, as {place}/<its "
            "name> (the GPU operator keeps the driver's under /run/nvidia/driver/dev)."
        )
        BREAKS = "GPU-ISOLATION-01"

        def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
            argv = super().bwrap_argv(sandbox_id, gpus)
            other = next((gpu for gpu in self.inventory() if gpu not in gpus), None)
            if not gpus or other is None:
                return argv
            node = other.nodes[0]
            inside = f"{place}/{os.path.basename(node.path)}"
            return with_binds(argv, "--dev-bind", node.source, inside)

    AnotherGpuUnder.__name__ = AnotherGpuUnder.__qualname__ = (
        f"AnotherGpuUnder{class_name(place.replace('/', ' '))}"
    )
    return AnotherGpuUnder


ANOTHER_GPU_UNDER = family(globals(), GPU_NODE_PLACES, _another_gpu_under)

_OPERATOR_DIR = "/run/nvidia/driver/dev"
_MAKE_NODES = (
    f"mkdir -p {_OPERATOR_DIR} && mount -t tmpfs -o mode=0755 gpu {_OPERATOR_DIR} && "
    'while [ "$1" != -- ]; do mknod -m 0666 "{_OPERATOR_DIR}/$1" c "$2" "$3"; shift 3; done; '
    'shift; exec "$@"'
).replace("{_OPERATOR_DIR}", _OPERATOR_DIR)


def _operator_dir_on(way: str) -> type[BrokenDriver]:
    class _Sandbox(EnteredOnOnePath):
        BROKEN_ON = way
        every_node: ClassVar[tuple[DeviceNode, ...]] = ()

        def before_setpriv(self) -> list[str]:
            nodes = [
                str(part)
                for node in self.every_node
                for part in (os.path.basename(node.path), node.major, node.minor)
            ]
            private = ["unshare", "--mount", "--propagation=private"]
            return [*private, "sh", "-c", _MAKE_NODES, "sh", *nodes, "--"]

    class OperatorDir(BrokenDriver):
        __doc__ = (
            f"GPU-ISOLATION-01: a command run through {way} gets {_OPERATOR_DIR} with every "
            "GPU's node in it, as the GPU operator keeps them, for nvidia-smi."
        )
        BREAKS = "GPU-ISOLATION-01"
        SANDBOX = _Sandbox

        def start(self, launch: Launch) -> ReferenceSandbox:
            sandbox = super().start(launch)
            nodes = tuple(node for gpu in self.host.gpus for node in gpu.nodes)
            sandbox.every_node = nodes  # type: ignore[attr-defined]
            return sandbox

    OperatorDir.__name__ = OperatorDir.__qualname__ = f"GpuOperatorDirOn{way_name(way)}"
    return OperatorDir


OPERATOR_DIR_ON = family(globals(), COMMAND_PATHS, _operator_dir_on)
