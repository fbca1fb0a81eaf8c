"""Planted breakers of the sandbox's files: SANDBOX-FS-01.

Nothing of another sandbox, nor of the host's private state, is visible inside. Their tests:
conformance/test_filesystem.py.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path

from conformance.observe import COMMAND_PATHS
from drivers.base import Launch
from drivers.reference import ReferenceSandbox
from drivers.reference_sandbox import NAMESPACES
from gpuhost.devices import GpuDevice
from gpuhost.spec import SHARED
from gpuhost.uids import SandboxUser
from tests.breakers.base import BrokenDriver, family, with_binds
from tests.breakers.execution import EnteredOnOnePath, way_name


class HostRootVisible(BrokenDriver):
    """SANDBOX-FS-01: the sandbox's root is the host's whole root, read-only: homes, storage..."""

    BREAKS = "SANDBOX-FS-01"

    def root_argv(self) -> list[str]:
        return ["--ro-bind", "/", "/"]


class SharedScratch(BrokenDriver):
    """SANDBOX-FS-01: every sandbox of a session gets the same host directory as its /tmp."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        shared = Path(tempfile.gettempdir()) / f"gpu-sandbox-shared-{self.session_id}"
        shared.mkdir(exist_ok=True)
        shared.chmod(0o1777)  # writable by the sandbox's user, whoever it is
        argv = super().bwrap_argv(sandbox_id, gpus)
        return with_binds(argv, "--bind", str(shared), "/tmp")


class SessionSharedShm(BrokenDriver):
    """SANDBOX-FS-01: a session's sandboxes share one /dev/shm of the host (for NCCL)."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        shm = self.host.leases.directory.parent / f"shm-{self.session_id}"
        shm.mkdir(exist_ok=True)
        shm.chmod(0o1777)
        return with_binds(argv, "--bind", str(shm), "/dev/shm")


class LeaseFileInside(BrokenDriver):
    """SANDBOX-FS-01: binds the host's lease file into every sandbox, read-only, to show holders."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        registry = str(self.host.leases.path)
        return with_binds(argv, "--ro-bind-try", registry, "/run/gpu/leases.json")


class HomesVisible(BrokenDriver):
    """SANDBOX-FS-01: binds /home read-only, for users' code and venvs: every home but root's."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        return with_binds(argv, "--ro-bind-try", "/home", "/home")


class GpuSandboxesShareCudaCache(BrokenDriver):
    """SANDBOX-FS-01: a session's GPU sandboxes share one writable CUDA JIT cache."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        if not gpus:
            return argv
        cache = self.host.leases.directory.parent / f"cuda-cache-{self.session_id}"
        cache.mkdir(exist_ok=True)
        cache.chmod(0o1777)
        shared = ["--bind", str(cache), "/var/cache/cuda", "--setenv", "CUDA_CACHE_PATH",
                  "/var/cache/cuda"]  # fmt: skip
        return with_binds(argv, *shared)


class EtcSecretsVisible(BrokenDriver):
    """SANDBOX-FS-01: binds /etc read-only, credentials unmasked, and runs as the host's root.

    "Read-only is safe", and root inside "for the tools that need it": without the mask an
    unprivileged sandbox user could still not read /etc/shadow; as root it can.
    """

    BREAKS = "SANDBOX-FS-01"

    def as_sandbox_user(self, gpus: Sequence[GpuDevice], user: SandboxUser | None) -> list[str]:
        return []

    def root_argv(self) -> list[str]:
        argv = super().root_argv()
        secrets = {"/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers"}
        kept: list[str] = []
        for arg in argv:
            if arg in secrets and kept[-2:] == ["--ro-bind", "/dev/null"]:
                del kept[-2:]
            else:
                kept.append(arg)
        return kept


class SharedGpuMpsDir(BrokenDriver):
    """SANDBOX-FS-01: sandboxes sharing a GPU get one writable host directory for CUDA MPS."""

    BREAKS = "SANDBOX-FS-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        if launch.plan is None or launch.plan.sharing != SHARED or not launch.gpus:
            return super().start(launch)
        mps = self.host.leases.directory.parent / "mps" / launch.gpus[0].uuid
        mps.mkdir(parents=True, exist_ok=True)
        mps.chmod(0o1777)
        argv = self.bwrap_argv(launch.sandbox_id, launch.gpus)
        return self._start(launch, with_binds(argv, "--bind", str(mps), "/tmp/nvidia-mps"))


OLD_SECRETS = (
    "/etc/shadow", "/etc/gshadow", "/etc/sudoers",
    "/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_ecdsa_key", "/etc/ssh/ssh_host_rsa_key",
)  # fmt: skip
"""The host's credentials SANDBOX-FS-01 named until it read every file others may not."""


class MasksTheOldListOnly(BrokenDriver):
    """SANDBOX-FS-01: runs as the host's root and masks only a list of names: /etc/shadow's.

    /etc/shadow- and /etc/gshadow- (yesterday's), and every other file of the host that
    others may not read, are read inside.
    """

    BREAKS = "SANDBOX-FS-01"

    def as_sandbox_user(self, gpus: Sequence[GpuDevice], user: SandboxUser | None) -> list[str]:
        return []

    def root_argv(self) -> list[str]:
        argv, kept, at = super().root_argv(), [], 0
        while at < len(argv):  # every mask under /etc dropped...
            if argv[at : at + 2] == ["--ro-bind", "/dev/null"] and argv[at + 2].startswith("/etc/"):
                at += 3
            elif argv[at] == "--tmpfs" and argv[at + 1].startswith("/etc/"):
                at += 2
            else:
                kept.append(argv[at])
                at += 1
        for secret in OLD_SECRETS:  # ...but the list's
            if Path(secret).exists():
                kept += ["--ro-bind", "/dev/null", secret]
        return kept


def _host_files_on(way: str) -> type[BrokenDriver]:
    class _Sandbox(EnteredOnOnePath):
        BROKEN_ON = way
        ENTER = tuple(arg for arg in NAMESPACES if arg != "--mount")

    class HostFiles(BrokenDriver):
        __doc__ = (
            f"SANDBOX-FS-01: a command run through {way} is entered without the sandbox's "
            "mount namespace and root: it sees the host's files (to write where it streams)."
        )
        BREAKS = "SANDBOX-FS-01"
        SANDBOX = _Sandbox

    HostFiles.__name__ = HostFiles.__qualname__ = f"HostFilesOn{way_name(way)}"
    return HostFiles


HOST_FILES_ON = family(globals(), COMMAND_PATHS, _host_files_on)
