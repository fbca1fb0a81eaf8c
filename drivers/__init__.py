"""Sandbox drivers: the built-in registry, lookup by name or import path, and reaping.

``reap_session`` is what ``pytest --reap`` and ``gpu-sandbox reap`` both do.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from drivers.base import Driver
    from gpuhost.host import GpuHost

REGISTRY: Final = {
    "reference": "drivers.reference:ReferenceDriver",
    "docker": "drivers.docker:DockerDriver",
    "podman": "drivers.podman:PodmanDriver",
    "kubernetes": "drivers.kubernetes:KubernetesDriver",
    "vm": "drivers.vm:VmDriver",
}
"""Built-in drivers by name. Modules are imported only when their driver is chosen."""


class UnknownDriver(LookupError):
    """A driver name that is neither built in nor an importable ``module:Class``."""


def get_driver_class(name: str) -> type[Driver]:
    """The driver class for a built-in ``name``, an import path, or ``exec:PATH``.

    An import path is ``package.module:Class``; ``exec:PATH`` an external driver's manifest
    (docs/external-drivers.md), refused naming the key when it is not valid.
    """
    from drivers.base import Driver

    if name.startswith("exec:"):
        from drivers.external import driver_class
        from drivers.external.manifest import ManifestError

        try:
            return driver_class(name.removeprefix("exec:"))
        except ManifestError as exc:
            raise UnknownDriver(f"driver {name!r}: {exc}") from exc

    target = REGISTRY.get(name, name)
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise UnknownDriver(
            f"unknown driver {name!r}; known: {', '.join(REGISTRY)}, "
            "an import path such as mypkg.mymodule:MyDriver, or exec:PATH (a manifest)"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a driver module may fail to import in any way at all
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        hint = (
            "; it is not on Python's path: run from its directory with PYTHONPATH=., or pip "
            "install the package that holds it"
            if missing and f"{module_name}.".startswith(f"{missing}.")
            else ""
        )
        raise UnknownDriver(
            f"driver {name!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Driver)):
        raise UnknownDriver(
            f"driver {name!r}: {module_name}.{class_name} is not a drivers.base.Driver subclass"
        )
    if inspect.isabstract(cls):
        raise UnknownDriver(f"driver {name!r}: {module_name}.{class_name} is abstract")
    return cls


@dataclass(frozen=True)
class Reaped:
    """What one driver removed of a session, or why it could not."""

    driver: str
    session_id: str
    removed: tuple[str, ...] = ()
    error: str = ""

    @property
    def line(self) -> str:
        if self.error:
            return f"{self.driver}: not reaped: {self.error}"
        return (
            f"{self.driver}: removed {len(self.removed)} sandbox(es) of session {self.session_id}"
        )


def reap_session(
    host: GpuHost,
    session_id: str,
    drivers: Mapping[str, type[Driver]],
    image: str | None = None,
) -> list[Reaped]:
    """Remove every sandbox and lease ``session_id`` left, with each of ``drivers`` in turn.

    A driver that cannot reap (an engine that is not running) says why, and the others
    still reap.
    """
    results = []
    for name, cls in drivers.items():
        try:
            removed = cls(host, session_id, image).reap(session_id)
        except Exception as exc:  # any failure of any driver: named, and the others go on
            results.append(Reaped(name, session_id, error=f"{type(exc).__name__}: {exc}"))
            continue
        results.append(Reaped(name, session_id, tuple(removed)))
    return results
