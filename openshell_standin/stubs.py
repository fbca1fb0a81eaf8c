"""Where OpenShell's CLI and its generated gRPC code are, as scripts/openshell.sh installed them."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

VERSION = "0.0.111"
"""The last PyPI release of ``openshell`` that carries the CLI; its API is the stand-in's."""
CACHE_ENV = "GPU_SANDBOX_OPENSHELL_CACHE"
DEFAULT_CACHE = Path("/var/cache/gpu-sandbox/openshell")
ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "scripts" / "openshell"
"""Runs the installed binary, through Debian 13's loader where the host's glibc is too old."""
INSTALL_HINT = "scripts/openshell.sh install (make openshell)"


class StubsMissing(RuntimeError):
    """OpenShell's CLI or generated code is not installed, or cannot be imported here."""


def install_dir() -> Path:
    """The directory of this version in the cache (``$GPU_SANDBOX_OPENSHELL_CACHE``)."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE) / VERSION


def cli_missing() -> str:
    """Why the CLI cannot run here, or "" when the launcher finds the binary."""
    binary = install_dir() / "bin" / "openshell"
    if not os.access(binary, os.X_OK):
        return f"needed OpenShell's CLI in {binary} (found none; {INSTALL_HINT})"
    return ""


@dataclass(frozen=True)
class Api:
    """OpenShell's generated modules, imported at run time (their attributes are ``Any``).

    ``messages``: openshell_pb2 (the gateway's API), ``services``: openshell_pb2_grpc,
    ``datamodel``: datamodel_pb2 (object metadata).
    """

    messages: ModuleType
    services: ModuleType
    datamodel: ModuleType


def load_api(directory: Path | None = None) -> Api:
    """Import ``openshell._proto`` from ``<install dir>/python``; ``StubsMissing`` says why not.

    The wheel's generated code, unchanged: ``openshell`` is a namespace package there (the
    SDK's own ``__init__`` needs httpx), so an ``openshell`` package installed elsewhere
    would shadow it, which is refused.
    """
    python = (directory or install_dir()) / "python"
    generated = python / "openshell" / "_proto"
    if not (generated / "openshell_pb2_grpc.py").is_file():
        raise StubsMissing(
            f"needed OpenShell's generated gRPC code in {generated} ({INSTALL_HINT})"
        )
    if str(python) not in sys.path:
        sys.path.insert(0, str(python))
    try:
        services = importlib.import_module("openshell._proto.openshell_pb2_grpc")
        messages = importlib.import_module("openshell._proto.openshell_pb2")
        datamodel = importlib.import_module("openshell._proto.datamodel_pb2")
    except (ImportError, RuntimeError, TypeError) as exc:
        # protobuf refuses generated code newer than its runtime; grpcio likewise.
        raise StubsMissing(
            f"cannot import OpenShell's generated code from {generated}: {exc}"
        ) from exc
    where = Path(str(services.__file__)).resolve()
    if not where.is_relative_to(generated.resolve()):
        raise StubsMissing(
            f"openshell._proto came from {where}, not from {generated}: another package named "
            "openshell shadows it"
        )
    return Api(messages=messages, services=services, datamodel=datamodel)
