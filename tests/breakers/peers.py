"""Planted breakers of what sandboxes share of the kernel's per-user state: SANDBOX-PEER-01.

Each sandbox runs as a host user of its own, under the engines' system call filter. Their
tests: conformance/test_peers.py.
"""

from __future__ import annotations

import fcntl
import os
from typing import ClassVar

from drivers.reference import ReferenceSandbox
from gpuhost import uids
from gpuhost.uids import SANDBOX_UIDS, UID_DIR, SandboxUser
from tests.breakers.base import BrokenDriver


class _UnfilteredSandbox(ReferenceSandbox):
    syscall_filter = False


class OneUserForEverySandbox(BrokenDriver):
    """SANDBOX-PEER-01: every sandbox runs as one host uid (filtered): limits are shared."""

    BREAKS = "SANDBOX-PEER-01"

    def claim_user(self) -> SandboxUser | None:
        return SandboxUser(SANDBOX_UIDS.start, -1)


class OneUserUnfiltered(OneUserForEverySandbox):
    """SANDBOX-PEER-01: one host uid for all, no system call filter: keys are shared too."""

    BREAKS = "SANDBOX-PEER-01"
    SANDBOX = _UnfilteredSandbox
    syscall_filter = False


class ReusesTheLowestUserUnfiltered(BrokenDriver):
    """SANDBOX-PEER-01: a uid of its own, the lowest free, no filter: the next gets the keys."""

    BREAKS = "SANDBOX-PEER-01"
    SANDBOX = _UnfilteredSandbox
    syscall_filter = False
    FIRST: ClassVar[int] = SANDBOX_UIDS.stop - 4_096
    """A corner of the range of its own, so that the breaker's runs reuse each other's uids
    and nobody else's."""

    def claim_user(self) -> SandboxUser | None:
        directory = os.open(UID_DIR, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for uid in range(self.FIRST, SANDBOX_UIDS.stop):
                fd = os.open(
                    str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600, dir_fd=directory
                )
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                if uids.runs_a_process(uid):
                    os.close(fd)
                    continue
                return SandboxUser(uid, fd)
        finally:
            os.close(directory)
        raise AssertionError("no uid left in the breaker's corner")
