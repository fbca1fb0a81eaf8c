"""What every planted broken reference driver is made of.

The reference driver, with a place for a defect of its sandboxes (``SANDBOX``) or of its
lease registry (``LEASES``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
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


def family(
    namespace: dict[str, object], values: Iterable[str], make: Callable[[str], type[BrokenDriver]]
) -> list[type[BrokenDriver]]:
    """One planted breaker per value of a dimension, each a class of the calling module.

    ``make(value)`` returns the breaker of ``value`` (its docstring starts with its
    ``BREAKS`` and names the value); it is registered in ``namespace`` (the module's
    ``globals()``) under its own name, so that ``--driver=module:Name`` finds it.
    """
    made = []
    for value in values:
        cls = make(value)
        cls.__module__ = str(namespace["__name__"])
        namespace[cls.__name__] = cls
        made.append(cls)
    return made


def class_name(value: str) -> str:
    """A value of a dimension as part of a class name: ``-retry`` → ``Retry``, ``.1`` → ``Dot1``."""
    words = value.replace(".", " dot ").replace("-", " ").replace("_", " ").replace("=", " ")
    return "".join(word[:1].upper() + word[1:] for word in words.split() if word.isalnum())


def with_binds(argv: list[str], *binds: str) -> list[str]:
    """The reference driver's bwrap argv, ``binds`` added before its ``--remount-ro /``."""
    return [*argv[:-2], *binds, *argv[-2:]]
