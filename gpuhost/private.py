"""A directory of this user's own that no one else can use, and the files written in it.

Where the suite writes as root in a directory another local user could have made or can
write (``/tmp``, a lane directory given by path), a link planted there would have root
write through it, and a file planted there would be read back as the suite's own. So the
directory is made here, mode 0700, and checked through a file descriptor to be a real
directory of this user's own (``private_directory``); files are created in it through that
descriptor, never through a link and never over what is there (``create``), and read back
only when they are regular files of this user's own (``read_own``).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from gpuhost.errors import named


class NotPrivate(OSError):
    """A directory or file that is not this user's own: ``path`` and what is wrong with it."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"{named(str(path))}: {problem}")
        self.path = str(path)
        self.problem = problem


def private_directory(path: Path) -> int:
    """A descriptor of ``path``: made 0700 when missing; else refused unless it is this user's.

    Refused (``NotPrivate``, naming the path): a link, anything but a directory, another
    user's directory, and one under a parent that others may write without its sticky bit
    (they could move it away and put theirs in its place). One of this user's own that
    others may read or write is made 0700.
    """
    path = Path(path)
    _check_parent(path.parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise NotPrivate(path, f"cannot be made: {exc.strerror}") from exc
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        what = "is a link" if os.path.islink(path) else f"cannot be opened: {exc.strerror}"
        raise NotPrivate(path, f"{what}, not a directory of this user's own") from exc
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise NotPrivate(
                path, f"is uid {info.st_uid}'s directory, not this user's (uid {os.geteuid()})"
            )
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_parent(parent: Path) -> None:
    try:
        info = os.stat(parent)
    except FileNotFoundError:
        return  # made by the caller's mkdir: this user's
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise NotPrivate(parent, "others may write it, and it is not sticky")


def create(directory: int, name: str, mode: int = 0o600) -> int:
    """A new file ``name`` in the directory open as ``directory``, for writing.

    What is there under that name is removed first (a link itself, never what it names);
    the file is then made with O_CREAT|O_EXCL|O_NOFOLLOW: it is new, and this user's.
    """
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=directory)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(name, flags, mode, dir_fd=directory)


def read_own(directory: int, name: str, max_bytes: int) -> bytes:
    """The bytes of ``name`` in ``directory``: a regular file of this user's, not a link.

    ``NotPrivate`` naming it otherwise, or when it is over ``max_bytes``;
    ``FileNotFoundError`` when there is none.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=directory)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise NotPrivate(name, f"cannot be read: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotPrivate(name, "is not a regular file")
        if info.st_uid != os.geteuid():
            raise NotPrivate(name, f"is uid {info.st_uid}'s file, not this user's")
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise NotPrivate(name, f"is over {max_bytes} bytes")
    return data
