"""A kubernetes sandbox: a pod, its commands run through the API server's exec stream."""

from __future__ import annotations

import os

from drivers.base import Command, Output, Sandbox
from drivers.kubernetes.cluster import ClusterDriver
from gpuhost.devices import GpuDevice
from gpuhost.leases import Holder


class KubernetesSandbox(Sandbox):
    """The pod ``pod_name``: the cluster, not the host's lease registry, holds its GPUs."""

    def __init__(
        self,
        sandbox_id: str,
        gpus: tuple[GpuDevice, ...],
        pod_name: str,
        driver: ClusterDriver,
    ) -> None:
        super().__init__(sandbox_id, driver.name, gpus, Holder.process(os.getpid()), None)
        self.pod_name = pod_name
        self._driver = driver

    def run(self, command: Command, output: Output) -> int:
        return self._driver.execs.run(self.pod_name, command, output.stdout, output.stderr)

    def stop(self) -> None:
        self._driver.delete_pods([self.pod_name])

    def kill(self) -> None:
        self._driver.execs.kill_all(self.pod_name)
