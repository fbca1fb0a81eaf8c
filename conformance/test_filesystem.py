"""What a sandbox's filesystem shows: nothing of other sandboxes, nothing of the host's state."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest

from conformance.fixtures import SandboxFactory
from conformance.observe import BOOT_ID
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


HOST_SECRETS = (
    "/etc/shadow", "/etc/gshadow", "/etc/sudoers",
    "/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_ecdsa_key", "/etc/ssh/ssh_host_rsa_key",
)  # fmt: skip
"""Files of the host that hold its credentials: a sandbox's own /etc may have some of these
names, never the host's contents."""


def _host_secrets() -> dict[str, str]:
    """Of ``HOST_SECRETS``, those this process can read on the host: their SHA-256 digests."""
    found = {}
    for path in HOST_SECRETS:
        with contextlib.suppress(OSError):
            if content := Path(path).read_bytes():
                found[path] = hashlib.sha256(content).hexdigest()
    return found


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


def _mounts_exposing(sandbox: Sandbox, places: dict[Path, bool]) -> list[str]:
    """The sandbox's mounts that show one of ``places`` (or a part, where True), by any name.

    Only where the sandbox runs on this kernel (a container, a namespace): a VM's device
    numbers are its own kernel's.
    """
    inside = sandbox.exec(["cat", str(BOOT_ID), "/proc/self/mountinfo"])
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
    driver: Driver, sandboxes: SandboxFactory
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
    secrets = _host_secrets()
    with _planted(_host_state_dirs(driver), f"{marker}-host") as planted:
        assert planted, "could not write a single probe file on the host"
        for spec, writer in readers:
            if writer is not None:
                sandboxes(writer).exec(["sh", "-c", write])
            with sandboxes(spec) as second:
                _assert_sees_nothing_of_others(driver, second, marker, first.id, planted, secrets)


def _assert_sees_nothing_of_others(
    driver: Driver,
    second: Sandbox,
    marker: str,
    first_id: str,
    planted: list[Path],
    secrets: dict[str, str],
) -> None:
    """No file another sandbox wrote or the driver keeps for it; none of the host's state."""
    __tracebackhide__ = True
    # Everywhere but the kernel's file systems and /usr, which only holds programs; and
    # what the driver keeps of the first sandbox (a keepalive FIFO, a socket) by its id.
    search = (
        "find / \\( -path /proc -o -path /sys -o -path /usr \\) -prune -o "
        f"\\( -name '{marker}*' -o -name '*{first_id}*' \\) -print 2>/dev/null; true"
    )
    found = second.exec(["sh", "-c", search]).check().stdout.split()
    assert found == [], (
        f"sandbox {second.id} sees files of another sandbox or of the host ({planted}): {found}"
    )
    # Under any name: a mount of the host's private state is told by what it mounts.
    exposed = _mounts_exposing(second, _private_places(driver))
    assert exposed == [], f"sandbox {second.id} mounts the host's private state: {exposed}"
    listing = " ".join(f'[ -e {path} ] && echo "{path}";' for path in ENGINE_STATE)
    seen = second.exec(["sh", "-c", f"{listing} true"]).check().stdout.split()
    present = [path for path in ENGINE_STATE if os.path.exists(path)]
    assert not set(seen) & set(present), (
        f"sandbox {second.id} sees the engines' state of the host: {seen}"
    )
    digests = f"sha256sum {' '.join(secrets)} 2>/dev/null; true" if secrets else "true"
    read = {
        line.split()[-1]: line.split()[0]
        for line in second.exec(["sh", "-c", digests]).stdout.splitlines()
        if len(line.split()) == 2
    }
    readable = sorted(path for path, digest in secrets.items() if read.get(path) == digest)
    assert readable == [], f"sandbox {second.id} reads the host's secrets {readable}"
