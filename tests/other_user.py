"""Running the project's code as another local user, whatever the checkout's permissions.

A checkout under a private directory (a CI runner's, ``mktemp -d``) is no other user's to
read: such tests run a copy of ``gpuhost/`` (standard library only) from a directory every
user can read, with the system's interpreter, not the venv's path through the checkout.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
OTHER_USER = 65534
"""Another local user, who holds nothing of root's."""
PYTHON = os.path.realpath(sys.executable)


def readable_copy(base: Path) -> Path:
    """``gpuhost/`` copied under ``base``, readable to all: the directory for PYTHONPATH.

    The sh client is at ``<it>/gpuhost/gpu-lease``.
    """
    tree = base / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "gpuhost", tree / "gpuhost", ignore=ignore)
    for path in [base, *base.rglob("*")]:
        mode = path.stat().st_mode
        opened = 0o055 if path.is_dir() or mode & 0o100 else 0o044
        path.chmod(stat.S_IMODE(mode) | opened)
    return tree


def setpriv() -> list[str]:
    """The command prefix that runs what follows as ``OTHER_USER``."""
    return ["setpriv", f"--reuid={OTHER_USER}", f"--regid={OTHER_USER}", "--clear-groups"]
