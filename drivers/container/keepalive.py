"""The keepalive: a FIFO whose only write end the creating process holds.

The container's main process reads it; when the creator dies, the read sees end-of-file,
the container exits and is removed, and its GPUs come back, as a bubblewrap sandbox dies
with its parent.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from gpuhost.errors import SandboxStartError
from gpuhost.wait import wait_for

KEEPALIVE_PATH = "/run/gpu-sandbox-keepalive"
KEEPALIVE_OPEN_TIMEOUT_S = 30.0
"""A started container's shell opens its keepalive in milliseconds; a start may be slow."""


@dataclass
class Keepalive:
    """A FIFO whose only write end the creating process holds: the container reads it."""

    path: Path
    fd: int

    @classmethod
    def open(cls, path: Path) -> Keepalive:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path, 0o600)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        _KEEPALIVE_FDS.add(fd)
        return cls(path, fd)

    def seal(self, pid: int, timeout_s: float) -> None:
        """Once the container's main process has the FIFO open, let nothing open it to write.

        That process (``pid``, the first, or its child under the engine's init) opens it
        read-write (which never blocks), so until then its owner, the container's root, may
        write it; after, a command in the container that opened it to write would keep the
        container alive past its creator. Without capabilities (every container's are
        dropped) root is held to the owner's bits like anyone, and the FIFO's are now
        read-only.
        """
        fifo = os.stat(self.path)

        def opened() -> bool:
            # The engine's init is the first process; the keepalive's shell, its child.
            try:
                children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except FileNotFoundError:
                raise SandboxStartError(
                    f"the container's first process (pid {pid}) ended before its keepalive "
                    f"{self.path} was opened: has the image a /bin/sh?"
                ) from None
            for process in (pid, *children):
                with contextlib.suppress(OSError):
                    for fd in os.listdir(f"/proc/{process}/fd"):
                        st = os.stat(f"/proc/{process}/fd/{fd}")
                        if (st.st_dev, st.st_ino) == (fifo.st_dev, fifo.st_ino):
                            return True
            return False

        try:
            wait_for(
                opened,
                bool,
                timeout_s=timeout_s,
                what=f"the container's first process (pid {pid}) to open its keepalive",
                interval_s=0.002,
            )
        except TimeoutError as exc:
            raise SandboxStartError(str(exc)) from None
        os.chmod(self.path, 0o400)

    def close(self) -> None:
        """Without its last writer, the container's main process exits by itself."""
        if self.fd in _KEEPALIVE_FDS:
            _KEEPALIVE_FDS.discard(self.fd)
            os.close(self.fd)
        self.path.unlink(missing_ok=True)


# The container's main process: it reads the keepalive FIFO until every writer is gone. It
# opens the FIFO read-write first, which never blocks (a read-only open waits for a writer,
# forever if the creator died before), then drops its own write end.
KEEPALIVE_SCRIPT = f"exec 3<>{KEEPALIVE_PATH} 4<{KEEPALIVE_PATH} 3>&-; exec cat <&4 >/dev/null"
_KEEPALIVE_FDS: set[int] = set()


def _close_keepalives_in_child() -> None:
    # A child forked without exec would hold the write ends and keep its parent's
    # containers alive after the parent died.
    for fd in _KEEPALIVE_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _KEEPALIVE_FDS.clear()


os.register_at_fork(after_in_child=_close_keepalives_in_child)
