"""Reading every process's /proc entries, for finding sandbox processes by their marks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def each_process(entry: str) -> Iterator[tuple[int, bytes]]:
    """(pid, contents of ``/proc/<pid>/<entry>``) of every process whose entry is readable.

    Processes exit while the listing is read, and others' entries may be unreadable: both
    are left out.
    """
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            yield int(proc.name), (proc / entry).read_bytes()
        except OSError:
            continue
