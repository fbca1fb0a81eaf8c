"""Planted breakers of the host-wide lease registry: GPU-HOSTWIDE-01.

GPUs another driver, process or client of the registry holds are never granted. Their tests:
conformance/test_hostwide.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Self

from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost
from gpuhost.leasefile import parse
from gpuhost.leases import PROCESS, Holder, Lease, boot_id
from gpuhost.spec import GpuPlan
from tests.breakers.base import BrokenDriver, BrokenRegistry


class _NoBootIdMeansEarlierBoot(BrokenRegistry):
    """Reads a file without ``boot_id`` (version 1) as one of an earlier boot."""

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        if data and parse(data).boot_id != boot_id():
            return []  # "every lease of an earlier boot is dead"
        return super()._read(path, data, mtime)


class V1FileAsEarlierBoot(BrokenDriver):
    """GPU-HOSTWIDE-01: takes a version-1 lease file (no boot_id) for an earlier boot's: dead."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _NoBootIdMeansEarlierBoot


class _RegistryOfItsOwn(BrokenRegistry):
    """A sound registry, in a directory of its own beside the host's."""

    @classmethod
    def replacing(cls, host: GpuHost) -> Self:
        return cls(host.leases.directory.parent / "own-registry")


class OwnRegistry(BrokenDriver):
    """GPU-HOSTWIDE-01: a sound, locked lease registry of its own, blind to the host's."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _RegistryOfItsOwn


class ReclaimsOtherSessions(BrokenDriver):
    """GPU-HOSTWIDE-01: drops its driver's leases of other sessions, as crashed runs' leftovers."""

    BREAKS = "GPU-HOSTWIDE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        for lease in self.host.leases.leases():
            if lease.driver == self.name and lease.session_id != self.session_id:
                self.host.leases.release(lease.sandbox_id)
        return super().allocate(sandbox_id, plan)


class ReclaimsNonProcessHolders(BrokenDriver):
    """GPU-HOSTWIDE-01: drops leases whose holders are no process (a container, a VM) as stale."""

    BREAKS = "GPU-HOSTWIDE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        for lease in self.host.leases.leases():
            if lease.holder.kind != PROCESS:
                self.host.leases.release(lease.sandbox_id)
        return super().allocate(sandbox_id, plan)


def _pid_alive(holder: Holder) -> bool:
    """`kill -0 <pid>`: the holder's boot and start time go unread."""
    try:
        os.kill(int(holder.ref.split(":")[1]), 0)
    except ProcessLookupError:
        return False
    except (ValueError, IndexError, PermissionError):
        return True
    return True


class _PidOnlyRegistry(BrokenRegistry):
    def _judge(self, holder: Holder) -> bool:
        return _pid_alive(holder)


class PidOnlyLiveness(BrokenDriver):
    """GPU-HOSTWIDE-01: judges a process holder by its pid alone: a reused one keeps GPUs."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _PidOnlyRegistry


class _LockfRegistry(BrokenRegistry):
    """Locks the lease file with POSIX record locks ("lockf is the portable one"), not flock."""

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self._thread_lock:
            fd = self._fd()
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)


class PosixRecordLocks(BrokenDriver):
    """GPU-HOSTWIDE-01: locks the registry with lockf: every flock client of it races it."""

    BREAKS = "GPU-HOSTWIDE-01"
    LEASES = _LockfRegistry
