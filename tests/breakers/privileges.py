"""Planted breakers of privileges: SANDBOX-PRIV-01.

Commands gain no privileges and cannot change the host's kernel settings. Their tests:
conformance/test_privileges.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from drivers.reference import ReferenceSandbox
from gpuhost.devices import GpuDevice
from gpuhost.uids import SandboxUser
from tests.breakers.base import BrokenDriver


class SandboxRunsAsHostRoot(BrokenDriver):
    """SANDBOX-PRIV-01: run by root, the sandbox's root is the host's (bwrap's own mapping)."""

    BREAKS = "SANDBOX-PRIV-01"

    def as_sandbox_user(self, gpus: Sequence[GpuDevice], user: SandboxUser | None) -> list[str]:
        return []


class _PrivilegedExecSandbox(ReferenceSandbox):
    exec_privileges = ("--bounding-set=-all", "--inh-caps=-all")


class ExecGainsPrivileges(BrokenDriver):
    """SANDBOX-PRIV-01: commands run without no-new-privileges: a setuid program gains them."""

    BREAKS = "SANDBOX-PRIV-01"
    SANDBOX = _PrivilegedExecSandbox


class _UnfilteredExecSandbox(ReferenceSandbox):
    syscall_filter = False


class UnfilteredCommands(BrokenDriver):
    """SANDBOX-PRIV-01: the first process runs under the filter, commands (nsenter) do not."""

    BREAKS = "SANDBOX-PRIV-01"
    SANDBOX = _UnfilteredExecSandbox


class UnfilteredFirstProcess(BrokenDriver):
    """SANDBOX-PRIV-01: commands run under the filter, the sandbox's first process does not."""

    BREAKS = "SANDBOX-PRIV-01"
    syscall_filter = False
