"""Keeps this project's top-level packages its own, whatever comes first on ``sys.path``.

A driver author's repository may hold packages called ``drivers`` or ``workloads`` of its
own, and ``python -m pytest`` run there puts that directory first on the path: an import
of ``drivers`` would find theirs, and the catalogue would break on it. Importing
``gpuhost`` (each of this project's packages does, first) puts a finder at the head of
``sys.meta_path`` that finds this project's top-level names where this project lies. The
author's driver is then named by its file (``--driver=drivers/mine.py:MyDriver``), and
its package loaded under a name of its own (``drivers.get_driver_class``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

NAMES = ("gpuhost", "drivers", "conformance", "workloads", "gpu_sandbox")
"""This project's top-level packages."""


class OwnPackages(importlib.abc.MetaPathFinder):
    """Finds each of ``names`` in ``root``, and nothing else."""

    def __init__(self, root: Path, names: Sequence[str]) -> None:
        self.root = str(root)
        self.names = frozenset(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or fullname not in self.names:
            return None  # a submodule is found through its package's own path
        return importlib.machinery.PathFinder.find_spec(fullname, [self.root])


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once per process."""
    if any(isinstance(finder, OwnPackages) for finder in sys.meta_path):
        return
    root = Path(__file__).resolve().parent.parent
    names = [name for name in NAMES if (root / name / "__init__.py").is_file()]
    sys.meta_path.insert(0, OwnPackages(root, names))
