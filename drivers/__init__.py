"""Sandbox drivers: the built-in registry and lookup by name or import path."""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from drivers.base import Driver

REGISTRY: Final = {
    "reference": "drivers.reference:ReferenceDriver",
    "docker": "drivers.docker:DockerDriver",
    "podman": "drivers.podman:PodmanDriver",
    "vm": "drivers.vm:VmDriver",
}
"""Built-in drivers by name. Modules are imported only when their driver is chosen."""


class UnknownDriver(LookupError):
    """A driver name that is neither built in nor an importable ``module:Class``."""


def get_driver_class(name: str) -> type[Driver]:
    """The driver class for a built-in ``name`` or a ``package.module:Class`` import path."""
    from drivers.base import Driver

    target = REGISTRY.get(name, name)
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise UnknownDriver(
            f"unknown driver {name!r}; known: {', '.join(REGISTRY)}, "
            "or an import path such as mypkg.mymodule:MyDriver"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a driver module may fail to import in any way at all
        raise UnknownDriver(
            f"driver {name!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Driver)):
        raise UnknownDriver(
            f"driver {name!r}: {module_name}.{class_name} is not a drivers.base.Driver subclass"
        )
    if inspect.isabstract(cls):
        raise UnknownDriver(f"driver {name!r}: {module_name}.{class_name} is abstract")
    return cls
