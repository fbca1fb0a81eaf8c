"""The lease registry between users: each writes its own file, and releases only its own leases.

The tries of the security review, as another local user (uid 65534) beside root: release
root's lease, corrupt or replace root's file, plant files under root's name, or make root
read a FIFO; both clients (Python and sh) are held to the same rules.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuhost import leasefile
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuBusy
from gpuhost.leases import Holder, LeaseFileCorrupt, LeaseOwner, LeaseRegistry, boot_id
from tests.other_user import OTHER_USER, PYTHON, ROOT, readable_copy, setpriv

CLIENT = ROOT / "gpuhost" / "gpu-lease"
INVENTORY = tuple(
    GpuDevice(i, f"GPU-{i:08d}-aaaa-bbbb-cccc-000000000000", "GPU", f"0000:{0x18 + i:02x}:00.0")
    for i in range(4)
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it acts as another user")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can reach, for a registry both root and another user use."""
    base = Path(tempfile.mkdtemp(prefix="gpu-lease-users-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base)


@pytest.fixture
def src(shared_dir: Path) -> Path:
    """The copy of gpuhost/ the other user runs (tests/other_user.py)."""
    return readable_copy(shared_dir)


@pytest.fixture
def registry(shared_dir: Path, src: Path) -> LeaseRegistry:
    registry = LeaseRegistry(shared_dir / "leases")
    registry.leases()  # makes the directory, sticky and world-writable
    return registry


ME = Holder.process(os.getpid())


def owner(sandbox_id: str) -> LeaseOwner:
    return LeaseOwner("test", sandbox_id, "s", ME)


def as_other_user(src: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*setpriv(), *argv], capture_output=True, text=True, timeout=60, check=False, cwd=src,
        env={**os.environ, "PYTHONPATH": str(src)},
    )  # fmt: skip


def _registry_of(registry: LeaseRegistry) -> str:
    """Python that opens ``registry`` as ``registry``."""
    return (
        "from gpuhost.leases import LeaseRegistry; from pathlib import Path; "
        f"registry = LeaseRegistry(Path({str(registry.directory)!r})); "
    )


def python_as_other_user(
    src: Path, registry: LeaseRegistry, code: str
) -> subprocess.CompletedProcess[str]:
    return as_other_user(src, PYTHON, "-c", _registry_of(registry) + code)


def test_the_registry_directory_is_sticky_and_each_file_its_users(
    registry: LeaseRegistry,
) -> None:
    registry.acquire(INVENTORY, owner("a"), count=1)
    mode = registry.directory.stat().st_mode
    assert stat.S_IMODE(mode) == 0o1777
    assert registry.path.name == f"leases.{os.geteuid()}.json"
    assert stat.S_IMODE(registry.path.stat().st_mode) == 0o644


@needs_root
@pytest.mark.parametrize("client", ["python", "sh"])
def test_another_user_cannot_release_roots_lease(
    registry: LeaseRegistry, src: Path, client: str
) -> None:
    """Before: user 65534 released root's lease, and root's next request got the same GPU."""
    registry.acquire(INVENTORY, owner("roots"), count=1)
    if client == "python":
        tried = python_as_other_user(src, registry, "print(registry.release('roots'))")
        assert tried.stdout.strip() == "0", tried
    else:
        client = str(src / "gpuhost" / "gpu-lease")
        tried = as_other_user(src, client, "--dir", str(registry.directory), "release", "roots")
        assert tried.returncode == 0, tried
    assert [lease.sandbox_id for lease in registry.leases()] == ["roots"]
    with pytest.raises(GpuBusy):
        registry.acquire(INVENTORY, owner("again"), exact=INVENTORY[:1])


@needs_root
def test_another_user_cannot_write_roots_file(registry: LeaseRegistry, src: Path) -> None:
    registry.acquire(INVENTORY, owner("roots"), count=1)
    tried = as_other_user(src, "sh", "-c", f"echo garbage > {registry.path}")
    assert tried.returncode != 0
    assert "Permission denied" in tried.stderr
    tried = as_other_user(src, "rm", "-f", str(registry.path))
    assert tried.returncode != 0  # the directory is sticky
    assert [lease.sandbox_id for lease in registry.leases()] == ["roots"]


@needs_root
@pytest.mark.parametrize("client", ["python", "sh"])
def test_a_users_leases_hold_against_root_and_roots_against_the_user(
    registry: LeaseRegistry, src: Path, client: str
) -> None:
    registry.acquire(INVENTORY, owner("roots"), exact=INVENTORY[:1])
    sleeper = "import time; time.sleep(60)"
    if client == "python":
        code = (
            "import os, sys; from gpuhost.devices import GpuDevice; "
            "from gpuhost.leases import Holder, LeaseOwner; "
            "inventory = [GpuDevice(i, f'GPU-{i:08d}-aaaa-bbbb-cccc-000000000000', 'GPU', "
            "f'0000:{0x18 + i:02x}:00.0') for i in range(4)]; "
            "got = registry.acquire(inventory, LeaseOwner('test', 'users', 's', "
            "Holder.process(os.getpid())), count=1); print(got[0].index, flush=True); "
            "sys.stdout.close(); " + sleeper
        )
        argv = [PYTHON, "-c", _registry_of(registry) + code]
    else:
        argv = [
            str(src / "gpuhost" / "gpu-lease"),
            "--dir",
            str(registry.directory),
            "hold",
            "--driver",
            "sh",
            "--sandbox",
            "users",
            INVENTORY[1].uuid,
            "--",
            "sh",
            "-c",
            "echo 1; sleep 60",
        ]
    held = subprocess.Popen(
        [*setpriv(), *argv],
        stdout=subprocess.PIPE, text=True, cwd=src, env={**os.environ, "PYTHONPATH": str(src)},
    )  # fmt: skip
    try:
        assert held.stdout is not None
        assert held.stdout.readline().strip() == "1"  # the first GPU root does not hold
        users = registry.directory / leasefile.file_name(OTHER_USER)
        assert users.stat().st_uid == OTHER_USER
        assert {lease.sandbox_id for lease in registry.leases()} == {"roots", "users"}
        with pytest.raises(GpuBusy, match="sandbox users"):
            registry.acquire(INVENTORY, owner("b"), exact=INVENTORY[1:2])
        # Root can release nothing of the user's either: its release is of its own file.
        assert registry.release("users") == 0
    finally:
        held.kill()
        held.wait()
    # Its holder gone, the user's lease is dead to every reader, though only it may drop it.
    assert registry.acquire(INVENTORY, owner("c"), exact=INVENTORY[1:2]) == INVENTORY[1:2]


@needs_root
def test_a_file_planted_under_roots_name_is_no_lease_and_root_replaces_it(
    registry: LeaseRegistry,
) -> None:
    """Another user makes ``leases.0.json`` first: its leases are forged, and root's own file."""
    forged = {
        "version": 4,
        "boot_id": boot_id(),
        "leases": [
            {"gpu_uuid": gpu.uuid, "driver": "forged", "sandbox_id": "forged", "session_id": "",
             "holder": {"kind": "process", "ref": Holder.process(1).ref}, "mode": "exclusive",
             "acquired_at": 1.0}
            for gpu in INVENTORY
        ],
    }  # fmt: skip
    registry.path.unlink()
    subprocess.run(
        [*setpriv(), "sh", "-c", f"umask 022; cat > {registry.path}"],
        input=json.dumps(forged), text=True, check=True,
    )  # fmt: skip
    fresh = LeaseRegistry(registry.directory)
    assert fresh.acquire(INVENTORY, owner("a"), count=4) == INVENTORY
    assert registry.path.stat().st_uid == 0


def _fifo_in_place(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda path: path.chmod(0o666), "is writable by others"),
        (_fifo_in_place, "is not a plain file"),
    ],
    ids=["world-writable", "fifo"],
)
def test_another_users_unsafe_file_is_refused_not_trusted_nor_waited_on(
    registry: LeaseRegistry, change: Callable[[Path], None], said: str
) -> None:
    other = registry.directory / leasefile.file_name(os.geteuid() + 1)
    other.write_text(json.dumps({"version": 4, "boot_id": boot_id(), "leases": []}))
    if os.geteuid() == 0:
        os.chown(other, os.geteuid() + 1, -1)
    change(other)
    started = time.monotonic()
    with pytest.raises(LeaseFileCorrupt, match=said):
        registry.acquire(INVENTORY, owner("a"), count=1)
    assert time.monotonic() - started < 5


@needs_root
def test_a_directory_others_can_write_without_the_sticky_bit_is_refused(tmp_path: Path) -> None:
    (tmp_path / "leases").mkdir()
    (tmp_path / "leases").chmod(0o777)
    with pytest.raises(LeaseFileCorrupt, match=r"writable by others \(mode 777\) but not sticky"):
        LeaseRegistry(tmp_path / "leases").leases()
    tried = subprocess.run(
        [str(CLIENT), "--dir", str(tmp_path / "leases"), "list"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert tried.returncode == 1
    assert "not sticky" in tried.stderr


@needs_root
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    (tmp_path / "leases").mkdir()
    os.chown(tmp_path / "leases", OTHER_USER, OTHER_USER)
    with pytest.raises(LeaseFileCorrupt, match=f"belongs to uid {OTHER_USER}"):
        LeaseRegistry(tmp_path / "leases").leases()


@pytest.mark.parametrize("client", ["python", "sh"])
def test_a_live_lease_of_a_version_3_file_stops_grants(
    registry: LeaseRegistry, client: str
) -> None:
    """A client of version 3 would not see this one's leases: the two cannot share a host."""
    legacy = {
        "version": 3,
        "boot_id": boot_id(),
        "leases": [
            {"gpu_uuid": INVENTORY[0].uuid, "driver": "old", "sandbox_id": "old",
             "session_id": "", "holder": {"kind": "process", "ref": ME.ref},
             "mode": "exclusive", "acquired_at": 1.0}
        ],
    }  # fmt: skip
    (registry.directory / leasefile.LEGACY_FILE).write_text(json.dumps(legacy))
    if client == "python":
        with pytest.raises(LeaseFileCorrupt, match="protocol version 3 or older"):
            registry.acquire(INVENTORY, owner("a"), count=1)
    else:
        tried = subprocess.run(
            [str(CLIENT), "--dir", str(registry.directory), "hold", "--sandbox", "x",
             INVENTORY[1].uuid, "--", "true"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert tried.returncode == 1
        assert "protocol version 3 or older" in tried.stderr
