"""Removing simulated hosts: one by its root, those whose owner is gone, stale CDI specs."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from gpuhost import strict
from gpuhost.leases import Holder, liveness_check
from gpuhost.simulated.host import (
    DEFAULT_ROOT,
    MARKER,
    OWNER,
    REGISTERED_PREFIX,
    SimulatedHostError,
)


def teardown(root: Path = DEFAULT_ROOT) -> None:
    """Remove a simulated host; refuses a directory that ``setup`` did not make."""
    if not root.exists():
        return
    if not (root / MARKER).is_file():
        raise SimulatedHostError(f"refusing to remove {root}: not a simulated GPU host")
    registration = root / "cdi" / "registered"
    if registration.is_file():
        unregister(Path(registration.read_text().strip()), root)
    shutil.rmtree(root)


def unregister(registered: Path, root: Path) -> None:
    """Remove the host's CDI registration: only a file of ours, named as ``setup`` names it.

    The path is read from the host's own directory, which its maker may have changed: a
    file of another name, a link, or one whose spec is not this host's stays where it is.
    """
    if not re.fullmatch(rf"{re.escape(REGISTERED_PREFIX)}[0-9a-f]+\.yaml", registered.name):
        return
    try:
        with open(registered, "rb", opener=_no_follow) as spec:
            ours = spec.read() == (root / "cdi" / "nvidia-sim.yaml").read_bytes()
    except OSError:  # gone, a link (ELOOP), unreadable: not ours to remove
        return
    if ours:
        registered.unlink(missing_ok=True)


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def sweep(base: Path) -> list[Path]:
    """Remove the simulated hosts under ``base`` whose owner is gone; return their roots.

    Runs killed before their teardown leave theirs behind. Hosts with no owner, or an owner
    of a kind with no liveness check, stay.
    """
    gone = [root for root in sorted(base.glob("*/")) if owner_gone(root)]
    for root in gone:
        teardown(root)
    return gone


def root_of(node: Path) -> Path | None:
    return next((parent for parent in node.parents if (parent / MARKER).is_file()), None)


def owner_gone(root: Path) -> bool:
    try:
        kind, ref = (root / OWNER).read_text().split()
    except (OSError, ValueError):
        return False  # no owner: not ours to judge
    check = liveness_check(kind)
    return check is not None and not check(Holder(kind, ref)) and (root / MARKER).is_file()


def prune_registrations(cdi_dir: Path) -> None:
    """Unregister the specs of simulated hosts that are gone, or whose owner is gone.

    Both are left by runs killed before their teardown; a host whose owner is gone goes too.
    """
    for spec in cdi_dir.glob(f"{REGISTERED_PREFIX}*.yaml"):
        try:
            data: Any = strict.read_yaml(spec)
            node = Path(data["containerEdits"]["deviceNodes"][0]["hostPath"])
        except (strict.InvalidFile, KeyError, IndexError, TypeError):
            continue  # not ours to judge
        if not node.exists():
            spec.unlink(missing_ok=True)
        elif (root := root_of(node)) is not None and owner_gone(root):
            teardown(root)
