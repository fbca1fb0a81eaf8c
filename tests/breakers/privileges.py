"""Planted breakers of privileges: SANDBOX-PRIV-01.

Commands gain no privileges and cannot change the host's kernel settings. Their tests:
conformance/test_privileges.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from drivers.reference import ReferenceSandbox
from gpuhost.devices import GpuDevice
from tests.breakers.base import BrokenDriver


class SandboxRunsAsHostRoot(BrokenDriver):
    """SANDBOX-PRIV-01: run by root, the sandbox's root is the host's (bwrap's own mapping)."""

    BREAKS = "SANDBOX-PRIV-01"

    def as_sandbox_user(self, gpus: Sequence[GpuDevice]) -> list[str]:
        return []


class _PrivilegedExecSandbox(ReferenceSandbox):
    exec_privileges = ("--bounding-set=-all", "--inh-caps=-all")


class ExecGainsPrivileges(BrokenDriver):
    """SANDBOX-PRIV-01: commands run without no-new-privileges: a setuid program gains them."""

    BREAKS = "SANDBOX-PRIV-01"
    SANDBOX = _PrivilegedExecSandbox
