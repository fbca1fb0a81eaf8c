"""The GPU host the local drivers share: its inventory and its one lease registry."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuhost.devices import DeviceNode, GpuDevice
from gpuhost.leases import DEFAULT_SHARE_LIMIT, LeaseRegistry
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
    share_limit: int = DEFAULT_SHARE_LIMIT

    def state_directory(self) -> Path:
        """Where this host's shared state lives: the lease registry, the run lock."""
        if self.sim_root is not None:
            return self.state_dir or self.sim_root
        return self.state_dir or Path(os.environ.get(STATE_DIR_ENV, DEFAULT_STATE_DIR))

    def as_args(self) -> list[str]:
        args = [f"--sim-root={self.sim_root}"] if self.sim_root else []
        args += [f"--gpu-state-dir={self.state_dir}"] if self.state_dir else []
        return [*args, f"--gpu-share-limit={self.share_limit}"]


@dataclass(frozen=True)
class GpuHost:
    """A host's GPUs and the one lease registry its drivers share.

    ``gpus`` are NVIDIA's whole GPUs (those in MIG mode too), ``mig_devices`` their MIG
    instances, ``dri_gpus`` the AMD and Intel GPUs.
    """

    config: HostConfig
    gpus: tuple[GpuDevice, ...]
    control_nodes: tuple[DeviceNode, ...]
    leases: LeaseRegistry
    simulated: SimulatedHost | None = None
    mig_devices: tuple[GpuDevice, ...] = ()
    dri_gpus: tuple[GpuDevice, ...] = ()
    share_limit: int = DEFAULT_SHARE_LIMIT
    """How many shared sandboxes may co-hold one GPU here."""

    @property
    def devices(self) -> tuple[GpuDevice, ...]:
        """Every device a sandbox can be given: GPUs, MIG instances, DRI GPUs."""
        return (*self.gpus, *self.mig_devices, *self.dri_gpus)

    @property
    def default_devices(self) -> tuple[GpuDevice, ...]:
        """What default and count requests choose among when no vendor or profile is named.

        NVIDIA's GPUs not in MIG mode, if the host has any; else the GPUs of its first vendor
        of AMD and Intel. A request names another with ``driver_config.<driver>.vendor`` or
        ``.mig_profile``.
        """
        whole = tuple(gpu for gpu in self.gpus if not gpu.mig_enabled)
        if whole or not self.dri_gpus:
            return whole
        first = next(v for v in ("amd", "intel") if any(g.vendor == v for g in self.dri_gpus))
        return tuple(gpu for gpu in self.dri_gpus if gpu.vendor == first)

    def pool(
        self, vendor: str | None = None, mig_profile: str | None = None
    ) -> tuple[GpuDevice, ...]:
        """The devices a count or default request of this vendor or MIG profile chooses among."""
        if mig_profile is not None:
            return tuple(mig for mig in self.mig_devices if mig.profile == mig_profile)
        if vendor is None:
            return self.default_devices
        if vendor == "nvidia":
            return tuple(gpu for gpu in self.gpus if not gpu.mig_enabled)
        return tuple(gpu for gpu in self.dri_gpus if gpu.vendor == vendor)

    @property
    def device_majors(self) -> frozenset[int]:
        """The majors of every node that reaches one of the host's GPUs, control nodes too."""
        nodes = [*self.control_nodes, *(node for device in self.devices for node in device.nodes)]
        return frozenset(node.major for node in nodes)

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
                mig_devices=sim.mig_devices,
                dri_gpus=sim.dri_gpus,
                share_limit=config.share_limit,
            )
        from gpuhost.discovery import discover_dri, discover_nvidia

        nvidia = discover_nvidia()
        return cls(
            config=config,
            gpus=tuple(gpu for gpu in nvidia if not gpu.is_mig),
            control_nodes=_real_control_nodes(),
            leases=LeaseRegistry(config.state_directory() / "leases"),
            mig_devices=tuple(gpu for gpu in nvidia if gpu.is_mig),
            dri_gpus=discover_dri(),
            share_limit=config.share_limit,
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
        if not self.devices:
            return "no GPUs found"
        parts = [
            f"{len(gpus)} x {', '.join(sorted({gpu.name for gpu in gpus}))}"
            for gpus in (self.gpus, self.dri_gpus)
            if gpus
        ]
        if self.mig_devices:
            parts.append(f"{len(self.mig_devices)} MIG instances")
        kind = f"simulated GPUs under {self.simulated.root}" if self.simulated else "real GPUs"
        return f"{' + '.join(parts)} ({kind})"


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
