"""Planted broken drivers: a built-in driver with one defect each, by the requirement it breaks.

Each names in ``BREAKS``, and in its docstring, the requirement its defect must make the
catalogue fail. The reference driver's are grouped by area, one module per
``conformance/test_<area>.py`` (``base.py`` holds what they are made of), and
``tests/conformance/test_planted.py`` runs the catalogue against every one of them
(``ALL``). The lanes' own, which need an engine, a cluster or QEMU to run, are apart:
``containers.py`` (docker and podman, ``tests/drivers/test_engines.py``), ``pods.py``
(kubernetes, ``tests/drivers/test_kubernetes.py``) and ``vms.py`` (the vm driver,
``tests/drivers/test_vm.py``).
"""

from __future__ import annotations

from types import ModuleType

from tests.breakers import (
    dri,
    environment,
    execution,
    exhaustion,
    filesystem,
    forms,
    hostwide,
    lifecycle,
    mig,
    namespaces,
    peers,
    privileges,
    selection,
    sharing,
    validation,
    visibility,
)
from tests.breakers.base import BrokenDriver

AREAS: tuple[ModuleType, ...] = (
    visibility, selection, validation, forms, exhaustion, hostwide, lifecycle, execution,
    environment, filesystem, namespaces, peers, privileges, sharing, mig, dri,
)  # fmt: skip
"""The reference driver's breakers, a module per area, in the catalogue's order."""


def _planted(module: ModuleType) -> list[type[BrokenDriver]]:
    """The broken drivers ``module`` defines."""
    return [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, BrokenDriver)
        and cls is not BrokenDriver
        and cls.__module__ == module.__name__
        and not cls.__name__.startswith("_")  # a base of the planted, generated ones
    ]


ALL: tuple[type[BrokenDriver], ...] = tuple(cls for area in AREAS for cls in _planted(area))
"""Every planted broken reference driver."""
