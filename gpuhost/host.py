"""The GPU host the local drivers share: its inventory and its one lease registry."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuhost.devices import DeviceNode, GpuDevice
from gpuhost.leases import LeaseRegistry
from gpuhost.simulated import SANDBOX_SHARE, SimulatedHost
from gpuhost.simulated import load as load_simulated

DEFAULT_STATE_DIR = Path("/run/gpu-sandbox")
STATE_DIR_ENV = "GPU_SANDBOX_STATE_DIR"
# The NVIDIA nodes a CUDA process needs besides its GPUs' own; absent ones are skipped.
REAL_CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


@dataclass(frozen=True)
class HostConfig:
    """How to find the host again, e.g. from another process: a simulated root, or real."""

    sim_root: Path | None = None
    state_dir: Path | None = None

    def state_directory(self) -> Path:
        """Where this host's shared state lives: the lease registry, the run lock."""
        if self.sim_root is not None:
            return self.state_dir or self.sim_root
        return self.state_dir or Path(os.environ.get(STATE_DIR_ENV, DEFAULT_STATE_DIR))

    def as_args(self) -> list[str]:
        args = [f"--sim-root={self.sim_root}"] if self.sim_root else []
        return args + ([f"--gpu-state-dir={self.state_dir}"] if self.state_dir else [])


@dataclass(frozen=True)
class GpuHost:
    config: HostConfig
    gpus: tuple[GpuDevice, ...]
    control_nodes: tuple[DeviceNode, ...]
    leases: LeaseRegistry
    simulated: SimulatedHost | None = None

    @classmethod
    def open(cls, config: HostConfig) -> GpuHost:
        """The simulated host under ``config.sim_root``, or else this machine's real GPUs."""
        if config.sim_root is not None:
            sim = load_simulated(config.sim_root)
            return cls(
                config=config,
                gpus=sim.gpus,
                control_nodes=sim.control_nodes,
                leases=LeaseRegistry(config.state_dir or sim.lease_dir),
                simulated=sim,
            )
        from gpuhost.discovery import discover_nvidia

        return cls(
            config=config,
            gpus=discover_nvidia(),
            control_nodes=_real_control_nodes(),
            leases=LeaseRegistry(config.state_directory() / "leases"),
        )

    @property
    def tool_mounts(self) -> tuple[tuple[Path, str], ...]:
        """Read-only binds (host path, sandbox path) a sandbox needs for the GPUs' tools.

        A simulated host's nvidia-smi; nothing on a real host, whose tools are in /usr.
        """
        return ((self.simulated.share_dir, SANDBOX_SHARE),) if self.simulated else ()

    @property
    def tool_path(self) -> tuple[str, ...]:
        """Directories to put first on PATH inside a sandbox for those tools."""
        return (f"{SANDBOX_SHARE}/bin",) if self.simulated else ()

    @property
    def private_dirs(self) -> tuple[Path, ...]:
        """The host's own GPU state, which no sandbox may see.

        The lease registry (it names every sandbox's GPUs) and a simulated host's nodes.
        """
        dirs = (self.leases.directory,)
        return (*dirs, self.simulated.root) if self.simulated else dirs

    def describe(self) -> str:
        if not self.gpus:
            return "no GPUs found"
        models = sorted({gpu.name for gpu in self.gpus})
        kind = f"simulated GPUs under {self.simulated.root}" if self.simulated else "real GPUs"
        return f"{len(self.gpus)} x {', '.join(models)} ({kind})"


def _real_control_nodes() -> tuple[DeviceNode, ...]:
    nodes = []
    for name in REAL_CONTROL_NODES:
        try:
            st = os.stat(f"/dev/{name}")
        except FileNotFoundError:
            continue
        if stat.S_ISCHR(st.st_mode):
            nodes.append(DeviceNode(f"/dev/{name}", os.major(st.st_rdev), os.minor(st.st_rdev)))
    return tuple(nodes)
