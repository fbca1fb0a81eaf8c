"""Planted broken kubernetes drivers: the kubernetes driver with one defect each.

``BREAKS`` names the requirement the catalogue must fail for each; tests/drivers/test_kubernetes.py
runs those requirements against every one of them on the local cluster (``make cluster``).
``LeakyDevicePlugin`` is a healthy driver in front of a broken device plugin: the cluster
runs one (``gpu-sandbox.test/leaky-gpu``) that injects every GPU's node into each pod, so
the catalogue must catch a leak on the kubelet's path too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from drivers.base import Launch, Sandbox
from drivers.kubernetes import KubernetesDriver
from gpuhost.host import GpuHost
from gpuhost.spec import DEVICE_IDS_KEY, DriverRequest, GpuPlan

LEAKY_RESOURCE = "gpu-sandbox.test/leaky-gpu"


class BrokenPodDriver(KubernetesDriver):
    BREAKS: ClassVar[str]


class DeviceIdsIgnored(BrokenPodDriver):
    """GPU-VALIDATE-03: exact device IDs are dropped instead of refused: a default GPU."""

    BREAKS = "GPU-VALIDATE-03"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = {k: v for k, v in request.config.items() if k != DEVICE_IDS_KEY}
        return super().plan(dataclasses.replace(request, config=block))


class PendingReportedAsSuccess(BrokenPodDriver):
    """GPU-EXHAUST-01: a pod is a sandbox once it exists: a Pending pod (none free) succeeds."""

    BREAKS = "GPU-EXHAUST-01"

    def _judge(self, pod: Mapping[str, Any], count: int, image: str) -> bool:
        return True

    def _granted(self, name: str, count: int) -> list[str]:
        try:
            return super()._granted(name, count)
        except Exception:  # a pod that never started printed nothing
            return []


class GpuLimitDropped(BrokenPodDriver):
    """GPU-DEFAULT-01: the pod is made without its ``nvidia.com/gpu`` limit: no GPU."""

    BREAKS = "GPU-DEFAULT-01"

    def start(self, launch: Launch) -> Sandbox:
        return super().start(Launch(launch.sandbox_id, launch.request, None, (), launch.hand_over))


class LeakyDevicePlugin(BrokenPodDriver):
    """GPU-ISOLATION-01: a device plugin that injects every GPU's device node into each pod."""

    BREAKS = "GPU-ISOLATION-01"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        super().__init__(host, session_id, image)
        self.resource = LEAKY_RESOURCE


class PodGainsPrivileges(BrokenPodDriver):
    """SANDBOX-PRIV-01: pods allow privilege escalation: a setuid program in one gains them."""

    BREAKS = "SANDBOX-PRIV-01"
    security_context = MappingProxyType({"privileged": False, "allowPrivilegeEscalation": True})


ALL: tuple[type[BrokenPodDriver], ...] = (
    DeviceIdsIgnored,
    PendingReportedAsSuccess,
    GpuLimitDropped,
    LeakyDevicePlugin,
    PodGainsPrivileges,
)
