"""What every planted broken reference driver is made of.

The reference driver, with a place for a defect of its sandboxes (``SANDBOX``) or of its
lease registry (``LEASES``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Self

from drivers.base import Launch
from drivers.reference import ReferenceDriver, ReferenceSandbox
from gpuhost.host import GpuHost
from gpuhost.leases import LeaseRegistry


class BrokenRegistry(LeaseRegistry):
    """A lease registry with a defect, which a broken driver uses in place of the host's."""

    @classmethod
    def replacing(cls, host: GpuHost) -> Self:
        """The registry in place of ``host``'s: by default, in the same directory."""
        return cls(host.leases.directory)


class BrokenDriver(ReferenceDriver):
    BREAKS: ClassVar[str]
    BREAKS_ONE_OF: ClassVar[frozenset[str]] = frozenset()
    """For a defect that fails at random (a race): the requirements it may fail first, of
    which the run must fail at least one. ``BREAKS`` is always among them."""
    SANDBOX: ClassVar[type[ReferenceSandbox]] = ReferenceSandbox
    """The sandbox class its sandboxes are made of: a defect of the sandbox's own."""
    LEASES: ClassVar[type[BrokenRegistry] | None] = None
    """The lease registry it uses in place of the host's: a defect of the registry."""

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        if self.LEASES is not None:
            host = dataclasses.replace(host, leases=self.LEASES.replacing(host))
        super().__init__(host, session_id, image)

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        sandbox.__class__ = self.SANDBOX
        return sandbox


def with_binds(argv: list[str], *binds: str) -> list[str]:
    """The reference driver's bwrap argv, ``binds`` added before its ``--remount-ro /``."""
    return [*argv[:-2], *binds, *argv[-2:]]
