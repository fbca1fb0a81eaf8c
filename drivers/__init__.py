"""Sandbox drivers: the built-in registry, lookup by name, import path or file, and reaping.

``reap_session`` is what ``pytest --reap`` and ``gpu-sandbox reap`` both do.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Final

import gpuhost  # noqa: F401  (first: this project's packages are its own, gpuhost.ownnames)

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
            f"unknown driver {name!r}; known: {', '.join(REGISTRY)}, an import path such as "
            "mypkg.mymodule:MyDriver, a file such as ./mydriver.py:MyDriver, or exec:PATH "
            "(a manifest)"
        )
    try:
        module = (
            _load_file(Path(module_name))
            if _is_file(module_name)
            else importlib.import_module(module_name)
        )
    except UnknownDriver as exc:
        raise UnknownDriver(f"driver {name!r}: {exc}") from None
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
    if _is_file(module_name):
        _FROM_FILES[cls] = f"{Path(module_name).resolve()}:{class_name}"
    return cls


_FROM_FILES: dict[type[Driver], str] = {}
"""Drivers loaded from a file, by class: the ``--driver`` that loads each again."""


def driver_argument(cls: type[Driver]) -> str:
    """The ``--driver`` value that makes another process build a driver of ``cls``."""
    if cls in _FROM_FILES:
        return _FROM_FILES[cls]
    cls_path = f"{cls.__module__}:{cls.__qualname__}"
    return cls.name if REGISTRY.get(cls.name) == cls_path else cls_path


def _is_file(module_name: str) -> bool:
    return module_name.endswith(".py") or "/" in module_name


def _load_file(path: Path) -> ModuleType:
    """The module in the file ``path``, under a name of its own.

    A driver's repository may have packages of its own called ``drivers`` or ``workloads``,
    as this project has: the file's outermost package (the directories above it that hold
    an ``__init__.py``) is loaded under a name made from its place, so that its modules
    import each other relatively and this project's by their names. A file in no package
    finds its neighbours through its directory, put at the end of ``sys.path``.
    """
    path = path.resolve()
    if not path.is_file():
        raise UnknownDriver(f"no file {path}")
    parts, top = [path.stem], path.parent
    while (top / "__init__.py").is_file():
        parts.insert(0, top.name)
        top = top.parent
    place = hashlib.sha256(str(top).encode()).hexdigest()[:12]
    if len(parts) == 1:
        if str(top) not in sys.path:
            sys.path.append(str(top))
        name = f"gpu_sandbox_file_{place}_{path.stem}"
        return sys.modules.get(name) or _exec_module(name, path, package_dir=None)
    package = f"gpu_sandbox_file_{place}_{parts[0]}"
    if package not in sys.modules:
        _exec_module(package, top / parts[0] / "__init__.py", package_dir=top / parts[0])
    return importlib.import_module(".".join([package, *parts[1:]]))


def _exec_module(name: str, path: Path, package_dir: Path | None) -> ModuleType:
    search = None if package_dir is None else [str(package_dir)]
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=search)
    if spec is None or spec.loader is None:
        raise UnknownDriver(f"{path} is not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


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
