"""The lease registry's files: one per user, who may write each, and their one strict reader.

A registry is a directory (sticky and world-writable, like /tmp) holding ``leases.<uid>.json``
for each user that took a lease: a user writes only its own file, so only a lease's owner
can release it or hand it on, and every reader takes the union of all of them. The files'
grammar is docs/lease-file.schema.json; ``parse`` is its reader, and nothing outside it is
read as leases.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

FORMAT_VERSION = 4
"""Version 2 adds ``boot_id``; version 3 a lease's ``parent_uuid`` and ``share_limit``;
version 4 the file of each user (the content is version 3's)."""
READABLE_VERSIONS = (1, 2, 3, 4)
LEGACY_FILE = "leases.json"
"""The one world-writable file of versions 1 to 3: refused while it holds a lease."""
MAX_FILE_BYTES = 16 << 20
"""A lease takes some 300 bytes: a larger file is no registry's."""
_FILE_NAME = re.compile(r"leases\.(0|[1-9][0-9]{0,9})\.json")
_PROCESS_REF = re.compile(r"[^:]+:[0-9]+:[0-9]+", re.ASCII)
MODES = ("exclusive", "shared")


class LeaseFileCorrupt(RuntimeError):
    """A lease file of this boot holds something outside the protocol, or is not safe to read."""


def file_name(uid: int) -> str:
    """The name of the file that holds ``uid``'s leases."""
    return f"leases.{uid}.json"


def file_owner(name: str) -> int | None:
    """The uid a registry file's name says owns it; None for a name that is no lease file's."""
    match = _FILE_NAME.fullmatch(name)
    return int(match[1]) if match else None


@dataclass(frozen=True)
class Document:
    """A lease file's content: ``boot_id`` None for version 1, which has none."""

    version: int
    boot_id: str | None
    leases: tuple[Mapping[str, Any], ...]


class InvalidLeaseFile(ValueError):
    """What ``parse`` refuses: the field (``leases[2].holder.ref``) and what is wrong with it."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}" if where else problem)


class NewerVersion(InvalidLeaseFile):
    """A file of a version this reader does not know: refused whenever it was written."""


def parse(data: bytes) -> Document:
    """A lease file's first JSON value, judged by the schema; ``ValueError`` naming the field.

    Strict where the schema is, and in what JSON leaves open: duplicate keys, ``NaN`` and
    ``Infinity`` are refused; a byte-order mark and white space before the value are not;
    bytes after it are what a writer killed before its truncation left, and are ignored.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidLeaseFile("", f"not UTF-8 (byte {exc.start})") from None
    text = text.removeprefix("\ufeff")
    start = len(text) - len(text.lstrip(" \t\r\n"))
    decoder = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    try:
        document, _ = decoder.raw_decode(text, start)
    except RecursionError:
        raise InvalidLeaseFile("", "nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and an integer too long to convert
        raise InvalidLeaseFile("", str(exc)) from None
    return _document(document)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) == len(pairs):
        return document
    document = {}
    for key, value in pairs:
        if key in document:
            raise InvalidLeaseFile("", f"the key {_short(key)} appears twice in one object")
        document[key] = value
    return document


def _no_constant(name: str) -> None:
    raise InvalidLeaseFile("", f"{name} is not JSON")


def _document(document: object) -> Document:
    if not isinstance(document, dict):
        raise InvalidLeaseFile("", f"a {_kind(document)}, not an object")
    _no_other_keys("", document, {"version", "boot_id", "leases"})
    version = _integral(document.get("version"))
    if _is_int(version) and version > FORMAT_VERSION:
        raise NewerVersion(
            "version",
            f"version {_short(version)}, written by a newer client; this one reads versions "
            f"1 to {FORMAT_VERSION}: upgrade it",
        )
    if not _is_int(version) or version not in READABLE_VERSIONS:
        raise InvalidLeaseFile("version", f"{_short(version)} is not one of {READABLE_VERSIONS}")
    boot = document.get("boot_id")
    if "boot_id" in document or version >= 2:
        boot = _string("boot_id", boot, empty=False)
    leases = document.get("leases")
    if not isinstance(leases, list):
        raise InvalidLeaseFile("leases", f"a {_kind(leases)}, not an array")
    return Document(
        version,
        boot,
        tuple(x if _plainly_valid(x) else _lease(f"leases[{i}]", x) for i, x in enumerate(leases)),
    )


_REQUIRED = ("gpu_uuid", "driver", "sandbox_id", "session_id", "holder", "mode", "acquired_at")
_OPTIONAL = ("parent_uuid", "share_limit")
_REQUIRED_KEYS = frozenset(_REQUIRED)
_ALLOWED_KEYS = frozenset((*_REQUIRED, *_OPTIONAL))
_HOLDER_KEYS = frozenset(("kind", "ref"))


def _plainly_valid(lease: object) -> bool:
    """A lease as writers write it, judged at a glance: every grant reads every lease.

    True only where ``_lease`` would accept it unchanged; anything else gets ``_lease``'s
    checks one by one, which name what is wrong.
    """
    if type(lease) is not dict or not _REQUIRED_KEYS <= lease.keys() <= _ALLOWED_KEYS:
        return False
    holder, acquired = lease["holder"], lease["acquired_at"]
    return (
        _filled(lease["gpu_uuid"])
        and _filled(lease["driver"])
        and _filled(lease["sandbox_id"])
        and type(lease["session_id"]) is str
        and type(holder) is dict
        and holder.keys() == _HOLDER_KEYS
        and _filled(holder["kind"])
        and _filled(holder["ref"])
        and (holder["kind"] != "process" or _PROCESS_REF.fullmatch(holder["ref"]) is not None)
        and lease["mode"] in MODES
        and (type(acquired) is int or (type(acquired) is float and math.isfinite(acquired)))
        and ("parent_uuid" not in lease or _filled(lease["parent_uuid"]))
        and (
            "share_limit" not in lease
            or (type(lease["share_limit"]) is int and lease["share_limit"] >= 1)
        )
    )


def _filled(value: object) -> bool:
    return type(value) is str and value != ""


def _lease(where: str, lease: object) -> Mapping[str, Any]:
    if not isinstance(lease, dict):
        raise InvalidLeaseFile(where, f"a {_kind(lease)}, not an object")
    _no_other_keys(where, lease, {*_REQUIRED, *_OPTIONAL})
    for key in _REQUIRED:
        if key not in lease:
            raise InvalidLeaseFile(where, f"no {key!r}")
    for key in ("gpu_uuid", "driver", "sandbox_id", "parent_uuid"):
        if key in lease:
            _string(f"{where}.{key}", lease[key], empty=False)
    _string(f"{where}.session_id", lease["session_id"], empty=True)
    _holder(f"{where}.holder", lease["holder"])
    if lease["mode"] not in MODES:
        raise InvalidLeaseFile(f"{where}.mode", f"{_short(lease['mode'])} is not one of {MODES}")
    acquired = lease["acquired_at"]
    if not _is_int(acquired) and not (isinstance(acquired, float) and math.isfinite(acquired)):
        raise InvalidLeaseFile(f"{where}.acquired_at", f"{_short(acquired)} is not a number")
    if "share_limit" in lease:
        limit = _integral(lease["share_limit"])
        if not _is_int(limit) or limit < 1:
            problem = f"{_short(limit)} is not an integer of 1 or more"
            raise InvalidLeaseFile(f"{where}.share_limit", problem)
        return {**lease, "share_limit": limit}
    return lease


def _holder(where: str, holder: object) -> None:
    if not isinstance(holder, dict):
        raise InvalidLeaseFile(where, f"a {_kind(holder)}, not an object")
    _no_other_keys(where, holder, {"kind", "ref"})
    kind = _string(f"{where}.kind", holder.get("kind"), empty=False)
    ref = _string(f"{where}.ref", holder.get("ref"), empty=False)
    if kind == "process" and not _PROCESS_REF.fullmatch(ref):
        raise InvalidLeaseFile(f"{where}.ref", f"{_short(ref)} is not <boot id>:<pid>:<start time>")


def _string(where: str, value: object, *, empty: bool) -> str:
    if not isinstance(value, str) or (not empty and not value):
        what = "a string" if empty else "a non-empty string"
        raise InvalidLeaseFile(where, f"{_short(value)} is not {what}")
    return value


def _no_other_keys(where: str, mapping: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(mapping) - allowed)
    if unknown:
        raise InvalidLeaseFile(where, f"unknown key {_short(unknown[0])}")


def _integral(value: object) -> object:
    """An integer written as ``2.0`` is an integer (JSON Schema's rule): read as one."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: object) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), "null" if value is None else "number"
    )


def _short(value: object) -> str:
    """``value`` for a message: its JSON kind when it is large, else its repr, cut short."""
    if isinstance(value, dict | list):
        return f"an {_kind(value)}"
    if isinstance(value, int) and not -(10**40) < value < 10**40:
        return "an integer of over 40 digits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}... ({len(text)} characters)"


# -- the files on disk ----------------------------------------------------------------------


def check_directory(directory: Path, st: os.stat_result) -> None:
    """Refuse a registry directory (``st``: its stat) another user could swap files in.

    Owned by root or by us; if others may write it, it must be sticky (as /tmp is), so that
    none of them can remove or rename a file of another.
    """
    problem = ""
    if st.st_uid not in (0, os.geteuid()):
        problem = f"belongs to uid {st.st_uid}"
    elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        problem = f"is writable by others (mode {stat.S_IMODE(st.st_mode):o}) but not sticky"
    if problem:
        raise LeaseFileCorrupt(f"the lease registry {directory} {problem}: refusing to use it")


OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
"""Every lease file is opened with these: never through a link, never waiting on a FIFO,
never taking a terminal for its own."""
_TRIES = 3
"""How often a name another user planted is removed before the client gives up on it."""


def describe(st: os.stat_result) -> str:
    """What an entry is, and whose, for a message: ``a FIFO of uid 65534``."""
    kinds = {
        stat.S_IFLNK: "a symbolic link",
        stat.S_IFIFO: "a FIFO",
        stat.S_IFDIR: "a directory",
        stat.S_IFSOCK: "a socket",
        stat.S_IFCHR: "a device",
        stat.S_IFBLK: "a device",
    }
    kind = kinds.get(stat.S_IFMT(st.st_mode), "a plain file")
    return f"{kind} of uid {st.st_uid}"


def remove_entry(dir_fd: int, name: str, st: os.stat_result) -> None:
    """Remove the entry ``name`` (``st``: its lstat) without opening or following it.

    A directory only when empty. ``OSError`` when it cannot be: a directory that is not
    empty, or another user's entry of a sticky directory removed by anyone but root.
    """
    try:
        if stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def open_own(dir_fd: int, path: Path, uid: int) -> int:
    """``uid``'s lease file ``path`` in the registry ``dir_fd``, open read-write; made if absent.

    What stands under its name and is not a plain file of ``uid``'s (a file another user
    made, a FIFO, a directory, a symbolic link) was planted: it is removed, never opened,
    followed or read, and a file of ``uid``'s made in its place (``O_CREAT | O_EXCL``).
    ``LeaseFileCorrupt`` naming the path where it cannot be removed, or where a file of
    ``uid``'s has a second name (a hard link made elsewhere: not written through).
    """
    name = path.name
    for _ in range(_TRIES):
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o644,
                             dir_fd=dir_fd)  # fmt: skip
            except FileExistsError:
                continue  # made again meanwhile: look again
            os.fchmod(fd, 0o644)  # whatever the umask: every user's client reads it
            return fd
        if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
            return _open_checked(dir_fd, path, st)
        try:
            remove_entry(dir_fd, name, st)
        except OSError as exc:
            raise LeaseFileCorrupt(
                f"{path} is {describe(st)}, not a lease file of its user {uid}, and cannot be "
                f"removed ({exc.strerror}): ask root to remove it"
            ) from None
    raise LeaseFileCorrupt(f"{path} was made again each time it was removed: refusing to use it")


def _open_checked(dir_fd: int, path: Path, st: os.stat_result) -> int:
    """Open the file of ours that ``st`` describes; refuse another, or one of two names.

    No other user can replace a file of ours: the directory is sticky.
    """
    fd = -1
    try:
        fd = os.open(path.name, os.O_RDWR | OPEN_FLAGS, dir_fd=dir_fd)
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise LeaseFileCorrupt(f"{path} was replaced while it was opened: refusing to use it")
        if opened.st_nlink != 1:
            raise LeaseFileCorrupt(
                f"the lease file {path} has {opened.st_nlink} names (another was linked to it): "
                "refusing to write it; remove it"
            )
        if stat.S_IMODE(opened.st_mode) & 0o022:
            os.fchmod(fd, 0o644)  # ours: only we may write it
            opened = os.fstat(fd)
        check_file(path, opened, st.st_uid)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        if isinstance(exc, OSError):
            raise LeaseFileCorrupt(f"the lease file {path} cannot be opened: {exc}") from None
        raise
    return fd


def check_file(path: Path, st: os.stat_result, owner: int | None) -> None:
    """Refuse a lease file that is not a plain file of ``owner`` only it may write.

    ``owner`` None: a file of any user, writable by any (the legacy file).
    """
    problem = ""
    if not stat.S_ISREG(st.st_mode):
        problem = f"is not a plain file ({describe(st)})"
    elif owner is not None and st.st_uid != owner:
        problem = f"belongs to uid {st.st_uid}, not {owner}"
    elif owner is not None and st.st_mode & 0o022:
        problem = f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    elif st.st_size > MAX_FILE_BYTES:
        problem = f"holds {st.st_size} bytes, over {MAX_FILE_BYTES}"
    if problem:
        raise LeaseFileCorrupt(f"the lease file {path} {problem}: refusing to read it")


def others_files(dir_fd: int, me: int) -> Iterator[tuple[int | None, str]]:
    """The names of every user's lease file but ``me``'s, with the uid each name gives.

    And the legacy file, with None for its owner: whoever wrote it.
    """
    for name in sorted(os.listdir(dir_fd)):
        owner = file_owner(name)
        if owner is not None and owner != me:
            yield owner, name
        elif name == LEGACY_FILE:
            yield None, name


def read_file(dir_fd: int, path: Path, owner: int | None) -> tuple[bytes, float] | None:
    """The bytes and mtime of another user's lease file; None when it is gone or forged.

    Read through one descriptor: opened without following a link, waiting on a FIFO or
    taking a terminal, judged by ``fstat`` on it, then read from it. Whatever another user
    made under ``owner``'s name is no lease file (its maker could not have been granted
    what it lists): skipped, whatever it is. ``owner`` None: any user's (the legacy file).
    """
    try:
        fd = os.open(path.name, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        with contextlib.suppress(OSError):  # a link is never followed: whose is it?
            made = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
            if owner is not None and made.st_uid != owner:
                return None
        raise LeaseFileCorrupt(f"the lease file {path} cannot be opened: {exc}") from None
    try:
        st = os.fstat(fd)
        if owner is not None and st.st_uid != owner:
            return None
        check_file(path, st, owner)
        return os.pread(fd, st.st_size, 0), st.st_mtime
    finally:
        os.close(fd)


def corrupt(path: Path, problem: Exception) -> LeaseFileCorrupt:
    return LeaseFileCorrupt(
        f"the GPU lease file {path} cannot be read ({problem}); no GPU can be granted safely "
        "until it is fixed: stop every sandbox of its user on this host, then delete it"
    )
