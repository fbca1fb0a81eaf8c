"""Drivers the suite did not write: ``--driver=exec:PATH``, a manifest of argv templates.

``driver_class(path)`` reads and checks the manifest (``drivers.external.manifest``) and
makes one ``ExternalDriver`` class for it (``drivers.external.adapter``, what both modes
share): command templates (``drivers.external.driver``), or one long-lived process speaking
JSON lines (``mode: jsonl``, ``drivers.external.jsonl``).
See docs/external-drivers.md and docs/external-protocol.md.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from drivers.external.adapter import ExternalDriver

EXEC_PREFIX: Final = "exec:"


def driver_class(path: str | Path) -> type[ExternalDriver]:
    """The driver class of the manifest at ``path``; ``ManifestError`` naming the key if bad."""
    return _driver_class(Path(path).resolve())


@functools.cache
def _driver_class(path: Path) -> type[ExternalDriver]:
    from drivers.external.manifest import load

    manifest = load(path)
    base: type[ExternalDriver]
    if manifest.mode == "jsonl":
        from drivers.external.jsonl import JsonlDriver

        base = JsonlDriver
    else:
        from drivers.external.driver import TemplatesDriver

        base = TemplatesDriver
    caps = manifest.capabilities
    attrs: dict[str, object] = {"name": manifest.name, "manifest": manifest}
    if "exhaustionGraceSeconds" in caps:
        attrs["exhaustion_grace_s"] = float(caps["exhaustionGraceSeconds"])
    cls = type(f"ExternalDriver[{manifest.name}]", (base,), attrs)
    # What a fresh process is told to build the same driver with (conformance.hold names a
    # driver class by ``module:qualname``): exec:PATH itself.
    cls.__module__ = EXEC_PREFIX.rstrip(":")
    cls.__qualname__ = str(path)
    return cls
