"""The keepalive: a FIFO whose only write end the creating process holds.

The container's main process reads it; when the creator dies, the read sees end-of-file,
the container exits and is removed, and its GPUs come back, as a bubblewrap sandbox dies
with its parent.

The FIFOs live in a directory of the lease registry that is the running user's only
(``keepalive.<euid>``, mode 0700): the registry is world-writable, and what another user
could put under a FIFO's name would be bound into a container, and chmod'ed by root. The
directory is judged by ``fstat`` on the descriptor it was opened by, without following a
link; each FIFO is made, opened and sealed through descriptors, never by its path. The
engine binds the FIFO by its path, resolved in the engine's own process: before each
engine call the path is checked to name this very FIFO, and once the container runs, what
its shell opened at ``KEEPALIVE_PATH`` must be it too, or the container is removed.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from gpuhost import leasefile
from gpuhost.errors import SandboxStartError
from gpuhost.wait import wait_for

KEEPALIVE_PATH = "/run/gpu-sandbox-keepalive"
KEEPALIVE_OPEN_TIMEOUT_S = 30.0
"""A started container's shell opens its keepalive in milliseconds; a start may be slow."""
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def keepalive_directory(registry: Path) -> Path:
    """Where this user's keepalive FIFOs live: a directory of the registry of its own."""
    return registry / f"keepalive.{os.geteuid()}"


def open_directory(directory: Path, *, make: bool) -> int | None:
    """``directory``, opened: a directory of this user's that no one else may enter.

    With ``make``, made (0700) when absent, and what another user planted under its name
    (a link, a FIFO, a file, an empty directory) removed first, never followed; without,
    None when there is none of this user's. ``SandboxStartError`` naming it when it is
    there and cannot be used: a directory of another user's that is not empty, one in a
    registry another user could swap it in.
    """
    try:
        parent = os.open(directory.parent, _DIRECTORY)
    except FileNotFoundError:
        if not make:
            return None
        raise
    try:
        leasefile.check_directory(directory.parent, os.fstat(parent))
        return _open_in(parent, directory, make=make)
    except leasefile.LeaseFileCorrupt as exc:
        raise SandboxStartError(str(exc)) from None
    finally:
        os.close(parent)


def _open_in(parent: int, directory: Path, *, make: bool) -> int | None:
    name = directory.name
    for _ in range(3):
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            if not make:
                return None
            with contextlib.suppress(FileExistsError):  # made meanwhile: look again
                os.mkdir(name, 0o700, dir_fd=parent)
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            fd = os.open(name, _DIRECTORY, dir_fd=parent)
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) == (st.st_dev, st.st_ino):
                if stat.S_IMODE(opened.st_mode) != 0o700:
                    os.fchmod(fd, 0o700)  # ours (made 0755 by an older version)
                return fd
            os.close(fd)
            continue
        if not make:
            return None  # nothing of ours
        try:
            leasefile.remove_entry(parent, name, st)
        except OSError as exc:
            raise SandboxStartError(
                f"the keepalive directory {directory} is {leasefile.describe(st)}, not a "
                f"directory of this user's ({os.geteuid()}), and cannot be removed "
                f"({exc.strerror}): refusing to use it; ask root to remove it"
            ) from None
    raise SandboxStartError(
        f"the keepalive directory {directory} was made again by another user each time it "
        "was removed: refusing to use it"
    )


@dataclass
class Keepalive:
    """A FIFO whose only write end the creating process holds: the container reads it."""

    path: Path
    fd: int
    directory_fd: int

    @classmethod
    def open(cls, directory: Path, name: str) -> Keepalive:
        """Make the FIFO ``name`` in this user's keepalive ``directory`` and open it."""
        directory_fd = open_directory(directory, make=True)
        assert directory_fd is not None
        path = directory / name
        try:
            os.mkfifo(name, 0o600, dir_fd=directory_fd)
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory_fd)
        except OSError as exc:
            os.close(directory_fd)
            raise SandboxStartError(f"cannot make the keepalive FIFO {path}: {exc}") from None
        _KEEPALIVE_FDS.add(fd)
        keepalive = cls(path, fd, directory_fd)
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid():
            keepalive.close()
            raise SandboxStartError(f"the keepalive {path} is not the FIFO this process made")
        return keepalive

    def check_path(self) -> None:
        """Refuse unless ``path``, as the engine will resolve it, names this very FIFO.

        Only this user can change its directory; a user who could write a directory above
        the registry could swap the path, and would then be refused here.
        """
        fifo = os.fstat(self.fd)
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise SandboxStartError(f"the keepalive {self.path} is gone: {exc}") from None
        if (st.st_dev, st.st_ino) != (fifo.st_dev, fifo.st_ino):
            raise SandboxStartError(
                f"the keepalive {self.path} no longer names the FIFO this process made: "
                "refusing to bind it into a container"
            )

    def seal(self, pid: int, timeout_s: float) -> None:
        """Once the container's main process has the FIFO open, let nothing open it to write.

        That process (``pid``, the first, or its child under the engine's init) opens it
        read-write (which never blocks), so until then its owner, the container's root, may
        write it; after, a command in the container that opened it to write would keep the
        container alive past its creator. Without capabilities (every container's are
        dropped) root is held to the owner's bits like anyone, and the FIFO's are now
        read-only. What it opened at ``KEEPALIVE_PATH`` must be this FIFO: anything else
        the engine bound there (a terminal, a file of root's) is refused at once.
        """
        fifo = os.fstat(self.fd)

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
                        link = f"/proc/{process}/fd/{fd}"
                        st = os.stat(link)
                        if (st.st_dev, st.st_ino) == (fifo.st_dev, fifo.st_ino):
                            return True
                        # The shell moves its descriptors as it opens the FIFO: a number may
                        # name another file between the stat and the readlink. Refused only
                        # where the same file stood there before and after.
                        named = os.readlink(link)
                        again = os.stat(link)
                        if named == KEEPALIVE_PATH and (again.st_dev, again.st_ino) == (
                            st.st_dev,
                            st.st_ino,
                        ):
                            raise SandboxStartError(
                                f"the container's {KEEPALIVE_PATH} is not the keepalive FIFO "
                                f"{self.path} this process made: refusing the container"
                            )
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
        os.fchmod(self.fd, 0o400)

    def close(self) -> None:
        """Without its last writer, the container's main process exits by itself."""
        if self.fd in _KEEPALIVE_FDS:
            _KEEPALIVE_FDS.discard(self.fd)
            os.close(self.fd)
        if self.directory_fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path.name, dir_fd=self.directory_fd)
            os.close(self.directory_fd)
            self.directory_fd = -1


def remove_session(directory: Path, session_id: str) -> None:
    """Remove the keepalive FIFOs a session left in this user's ``directory`` (a reap).

    Each is named ``<session>.<sandbox>``, and a sandbox id has no '.': session ``1``'s are
    not session ``1.1``'s, whose names begin with ``1.`` too.
    """
    fd = open_directory(directory, make=False)
    if fd is None:
        return
    try:
        for name in os.listdir(fd):
            if name.rpartition(".")[0] == session_id:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


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
