"""What a sandbox's filesystem shows: nothing of other sandboxes, nothing of the host's state."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

from conformance.dimensions import declared
from conformance.fixtures import Dropped, SandboxFactory
from conformance.observe import BOOT_ID, COMMAND_PATHS, Run, ways_to_run
from drivers.base import Driver, Sandbox
from gpuhost.spec import SHARED, SandboxSpec

ENGINE_STATE = (
    "/var/lib/docker",
    "/var/lib/containers",
    "/var/lib/containerd",
    "/var/lib/kubelet",
    "/run/containerd",
    "/run/docker.sock",
    "/run/podman",
)
"""Where container engines and kubelet keep other containers' root filesystems and sockets."""
DIMENSIONS = {
    "SANDBOX-FS-01": declared(
        path=COMMAND_PATHS,
        reader=("no GPU", "a GPU", "a sharer of a GPU, where the driver shares"),
        writer=(
            "a sandbox without a GPU, running",
            "a sandbox with a GPU, closed",
            "a sharer of the reader's GPU",
        ),
        host_state=(
            "the lease registry's directory", "the homes", "/var/tmp", "/run",
            "a simulated host's root",
        ),
        mounted_under_any_name=(
            "the lease files", "the registry's directory", "/home and every home", "/var/tmp",
            "an engine's API socket",
        ),
        engine_state=ENGINE_STATE,
        host_secret=(
            "each file of the host's others may not read, under each directory the sandbox "
            "shows at its path (by its SHA-256)",
        ),
    )
}  # fmt: skip


def _host_state_dirs(driver: Driver) -> list[Path]:
    """Places on the host that are private to it: its GPU state, homes, its /run and /var."""
    places = [driver.host.leases.directory, *_homes(), Path("/var/tmp"), Path("/run")]
    if driver.host.simulated is not None:
        places.append(driver.host.simulated.root)
    return places


def _homes() -> list[Path]:
    """The current user's home, /home and every home under it."""
    home = Path("/home")
    others = sorted(p for p in home.iterdir() if p.is_dir()) if home.is_dir() else []
    return list(dict.fromkeys([Path.home(), home, *others]))


EVERY_DIRECTORY = (
    "find / \\( -path /proc -o -path /sys -o -path /usr \\) -prune -o -type d -print 2>/dev/null"
)


def _write_in_each(name: str) -> str:
    """A shell loop that writes ``name`` in each directory read from stdin, where it can."""
    return f'while read -r d; do echo x > "$d/{name}"; done 2>/dev/null'


KERNEL_VIEWS = ("/proc", "/sys", "/dev")
"""The kernel's views of processes and devices: no file of the host's is there to read."""
SECRET_SIZE_LIMIT = 1 << 20
"""Credentials are small (keys, password hashes, tokens): larger files are left unread."""
_EVERY_DIRECTORY_SHOWN = (
    f"find / \\( {' -o '.join(f'-path {view}' for view in KERNEL_VIEWS)} \\) -prune -o "
    "-type d -print0 2>/dev/null; true"
)


class _HostSecrets:
    """The host's files that others may not read, in the directories a sandbox shows.

    By their SHA-256, each directory of the host read once. Where this process cannot read
    one either (not root), it is named in ``unreadable``.
    """

    def __init__(self, left_out: list[Path]) -> None:
        self._left_out = left_out
        self._by_directory: dict[str, dict[str, str]] = {}
        self.unreadable: list[str] = []

    def shown_by(self, run: Run) -> dict[str, str]:
        """Path → digest of each such file under a directory the sandbox shows by its path."""
        listed = run(["sh", "-c", _EVERY_DIRECTORY_SHOWN]).check().stdout
        found: dict[str, str] = {}
        for directory in sorted({path for path in listed.split("\0") if path.startswith("/")}):
            if directory not in self._by_directory:
                self._by_directory[directory] = self._read(Path(directory))
            found.update(self._by_directory[directory])
        return found

    def _read(self, directory: Path) -> dict[str, str]:
        if any(directory.is_relative_to(place) for place in self._left_out):
            return {}  # checked apart: no sandbox shows them at all
        try:
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                return {}
            entries = list(os.scandir(directory))
        except OSError:
            return {}
        digests = {}
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_mode & stat.S_IROTH:
                continue
            if not 0 < st.st_size <= SECRET_SIZE_LIMIT:
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                self.unreadable.append(entry.path)
                continue
            with os.fdopen(fd, "rb") as file:
                digests[entry.path] = hashlib.sha256(file.read()).hexdigest()
        return digests


def _readable_secrets(run: Run, secrets: dict[str, str]) -> list[str]:
    """Of ``secrets`` (path → the host's digest), those a command reads the host's content of."""
    paths = sorted(secrets)
    read: dict[str, str] = {}
    for at in range(0, len(paths), 200):
        chunk = paths[at : at + 200]
        digests = run(["sh", "-c", 'sha256sum -- "$@" 2>/dev/null; true', "sh", *chunk])
        for line in digests.stdout.splitlines():
            digest, _, path = line.partition("  ")
            read[path] = digest
    return [path for path in paths if read.get(path) == secrets[path]]


ENGINE_SOCKETS = (
    "/run/docker.sock",
    "/run/podman/podman.sock",
    "/run/containerd/containerd.sock",
    "/run/crio/crio.sock",
)
"""The engines' API sockets: whoever reaches one is root on the host."""


def _private_places(driver: Driver) -> dict[Path, bool]:
    """What no sandbox may mount whole, under any name: homes, /var/tmp, the lease registry.

    True: nor any part of it. A part of a home may be a program's (a Python installed under
    ~/.pyenv that a sandbox runs), a part of the registry's directory a sandbox's own (the
    keepalive FIFO of a container); the lease files and the engines' sockets are no sandbox's.
    """
    registry = driver.host.leases.directory
    whole = [*_homes(), Path("/var/tmp"), registry]
    private = [*registry.glob("leases.*.json"), driver.host.leases.path]
    sockets = [Path(socket) for socket in ENGINE_SOCKETS if os.path.exists(socket)]
    return {**dict.fromkeys(whole, False), **dict.fromkeys([*private, *sockets], True)}


@dataclass(frozen=True)
class _Mount:
    device: str
    """``major:minor`` of the file system."""
    root: str
    """The path, within that file system, that is mounted."""
    point: str


def _mountinfo(text: str) -> list[_Mount]:
    """/proc/<pid>/mountinfo's lines (proc(5)): mount ID, parent ID, device, root, point, ..."""
    return [
        _Mount(fields[2], _unescape(fields[3]), _unescape(fields[4]))
        for fields in (line.split() for line in text.splitlines())
        if len(fields) >= 5
    ]


def _unescape(path: str) -> str:
    """Undo the octal escapes mountinfo writes for a space, a tab, a newline, a backslash."""
    return re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal[1], 8)), path)


def _where_on_its_file_system(path: Path, host: list[_Mount]) -> tuple[str, PurePosixPath]:
    """The device ``path`` lives on, and its path within that file system."""
    resolved = PurePosixPath(os.path.realpath(path))
    mount = max((m for m in host if resolved.is_relative_to(m.point)), key=lambda m: len(m.point))
    return mount.device, PurePosixPath(mount.root) / resolved.relative_to(mount.point)


def _mounts_exposing(run: Run, places: dict[Path, bool]) -> list[str]:
    """The mounts a command sees that show one of ``places`` (or a part, where True), by any name.

    Only where the sandbox runs on this kernel (a container, a namespace): a VM's device
    numbers are its own kernel's.
    """
    inside = run(["cat", str(BOOT_ID), "/proc/self/mountinfo"])
    boot, _, table = inside.check().stdout.partition("\n")
    if boot.strip() != BOOT_ID.read_text().strip():
        return []
    host = _mountinfo(Path("/proc/self/mountinfo").read_text())
    private = [
        (*_where_on_its_file_system(place, host), any_part)
        for place, any_part in places.items()
        if place.exists()
    ]
    return sorted(
        f"{mount.point} (mounts {mount.root} of {mount.device}, which holds {place})"
        for mount in _mountinfo(table)
        for (device, place, any_part) in private
        if mount.device == device
        and (
            place.is_relative_to(mount.root)
            or (any_part and PurePosixPath(mount.root).is_relative_to(place))
        )
    )


@contextlib.contextmanager
def _planted(places: list[Path], name: str) -> Iterator[list[Path]]:
    """A file called ``name`` in each of ``places`` that can be written; removed after."""
    planted = []
    try:
        for place in places:
            path = place / name
            with contextlib.suppress(OSError):
                path.write_text("host state a sandbox must not see\n")
                planted.append(path)
        yield planted
    finally:
        for path in planted:
            path.unlink(missing_ok=True)


@pytest.mark.requirement("SANDBOX-FS-01")
def test_nothing_of_other_sandboxes_or_the_host_is_visible(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped
) -> None:
    """A sandbox MUST see no file of another sandbox and none of the host's private state."""
    marker = f"gpu-sandbox-fs-probe-{uuid.uuid4().hex[:12]}"
    # In every directory a sandbox can write to: /tmp, /dev/shm, its home, wherever; one with
    # a GPU too (a cache shared by GPU sandboxes is a file of another sandbox), closed after.
    write = f"{EVERY_DIRECTORY} | {_write_in_each(f'{marker}-sandbox')}; true"
    first = sandboxes(SandboxSpec())
    first.exec(["sh", "-c", write])
    with sandboxes(SandboxSpec.with_gpus()) as gpu_writer:
        gpu_writer.exec(["sh", "-c", write])
    # Each reader, and the writer made just before it (a sharer of the reader's GPU).
    readers: list[tuple[SandboxSpec, SandboxSpec | None]] = [
        (SandboxSpec(), None),
        (SandboxSpec.with_gpus(), None),
    ]
    if driver.capabilities.shared:
        # Sharers of one GPU: whatever the driver gives them for sharing is theirs alone too.
        shared = SandboxSpec.with_gpus(sharing=SHARED)
        readers.append((shared, shared))
    engine_state = [Path(path) for path in ENGINE_STATE]
    secrets = _HostSecrets([*engine_state, *_host_state_dirs(driver)])
    with _planted(_host_state_dirs(driver), f"{marker}-host") as planted:
        assert planted, "could not write a single probe file on the host"
        for spec, writer in readers:
            if writer is not None:
                sandboxes(writer).exec(["sh", "-c", write])
            with sandboxes(spec) as second:
                for way, run in ways_to_run(second).items():
                    seen = _Seen(second, way, run)
                    _assert_sees_nothing_of_others(driver, seen, marker, first.id, planted, secrets)
    if secrets.unreadable:
        dropped(
            "the host's files others may not read, this user neither",
            f"run as uid {os.geteuid()}, it cannot read {sorted(secrets.unreadable)[:3]}...",
        )


@dataclass(frozen=True)
class _Seen:
    """A sandbox as the commands of one path to a command see it."""

    sandbox: Sandbox
    way: str
    run: Run

    def __str__(self) -> str:
        return f"sandbox {self.sandbox.id} (through {self.way})"


def _assert_sees_nothing_of_others(
    driver: Driver,
    second: _Seen,
    marker: str,
    first_id: str,
    planted: list[Path],
    secrets: _HostSecrets,
) -> None:
    """No file another sandbox wrote or the driver keeps for it; none of the host's state."""
    __tracebackhide__ = True
    # Everywhere but the kernel's file systems and /usr, which only holds programs; and
    # what the driver keeps of the first sandbox (a keepalive FIFO, a socket) by its id.
    search = (
        "find / \\( -path /proc -o -path /sys -o -path /usr \\) -prune -o "
        f"\\( -name '{marker}*' -o -name '*{first_id}*' \\) -print 2>/dev/null; true"
    )
    found = second.run(["sh", "-c", search]).check().stdout.split()
    assert found == [], (
        f"{second} sees files of another sandbox or of the host ({planted}): {found}"
    )
    # Under any name: a mount of the host's private state is told by what it mounts.
    exposed = _mounts_exposing(second.run, _private_places(driver))
    assert exposed == [], f"{second} mounts the host's private state: {exposed}"
    listing = " ".join(f'[ -e {path} ] && echo "{path}";' for path in ENGINE_STATE)
    seen = second.run(["sh", "-c", f"{listing} true"]).check().stdout.split()
    present = [path for path in ENGINE_STATE if os.path.exists(path)]
    assert not set(seen) & set(present), f"{second} sees the engines' state of the host: {seen}"
    # Every file of the host's that others may not read, wherever the sandbox shows its
    # directory: not a list of names (/etc/shadow- is /etc/shadow of yesterday).
    readable = _readable_secrets(second.run, secrets.shown_by(second.run))
    assert readable == [], (
        f"{second} reads the host's files that others may not read on the host: {readable}"
    )
