"""The lease registry between users: each writes its own file, and releases only its own leases.

The tries of the security reviews, as another local user (uid 65534) beside root: release
root's lease, corrupt or replace root's file, plant a file, a FIFO, a directory or a link
under root's name, or make root read a FIFO; the three clients (Python, sh, and Go: the
registry of examples/drivers/gosandbox, run as root through its driver) are held to the
same rules (docs/lease-protocol.md).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from drivers.external import driver_class
from drivers.external.process import ExternalDriverError
from gpuhost import leasefile, simulated
from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuBusy
from gpuhost.host import GpuHost, HostConfig
from gpuhost.leases import Holder, LeaseFileCorrupt, LeaseOwner, LeaseRegistry, boot_id
from gpuhost.spec import SandboxSpec
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


# -- what another user plants under a user's name, for each client ---------------------------

CLIENTS = ["python", "sh", "go"]
GO_SOURCE = ROOT / "examples" / "drivers" / "gosandbox"


class Refused(Exception):
    """A client refused to grant: its message."""


@pytest.fixture(scope="module")
def go_manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Go driver's manifest, its binary built beside it (its registry is the Go client).

    Built from a copy of its sources: other workers build and run the one in the checkout.
    """
    go = shutil.which("go")
    if go is None:
        pytest.skip("needed go on PATH to build examples/drivers/gosandbox (found none)")
    out = tmp_path_factory.mktemp("gosandbox")
    shutil.copytree(GO_SOURCE, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("gosandbox"))
    if (ROOT / "drivers" / "seccomp.py").exists():  # as make gosandbox: the filter it embeds
        subprocess.run([sys.executable, "-m", "drivers.seccomp", str(out / "seccomp.bpf")],
                       check=True, cwd=ROOT)  # fmt: skip
    done = subprocess.run(
        [go, "build", "-o", "gosandbox", "."], cwd=out, capture_output=True, text=True,
        env={**os.environ, "GOFLAGS": "-mod=mod", "GOPROXY": "off"}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, f"go build failed: {done.stderr}"
    return out / "driver.yaml"


@pytest.fixture
def host(shared_dir: Path, registry: LeaseRegistry) -> Iterator[GpuHost]:
    """A simulated host of 2 GPUs whose registry is ``registry``, which every user reaches."""
    sim = simulated.setup(shared_dir / "sim", 2)
    yield GpuHost.open(HostConfig(sim.root, state_dir=registry.directory))
    simulated.teardown(sim.root)


@contextmanager
def held_by_root(
    client: str, host: GpuHost, gpu: GpuDevice, request: pytest.FixtureRequest
) -> Iterator[None]:
    """Root's ``client`` holds ``gpu`` while in the block; ``Refused`` with its message."""
    directory = host.leases.directory
    if client == "python":
        registry = LeaseRegistry(directory)
        try:
            registry.acquire(host.gpus, owner("roots"), exact=[gpu])
        except LeaseFileCorrupt as exc:
            raise Refused(str(exc)) from None
        with _refusal_on_release():
            yield
            registry.release("roots")
    elif client == "sh":
        argv = [str(CLIENT), "--dir", str(directory), "hold", "--sandbox", "roots", gpu.uuid,
                "--", "sh", "-c", "echo held; exec sleep 60"]  # fmt: skip
        held = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        # A client that hangs says nothing, and its children keep its stderr open: the bound
        # kills them all.
        bound = threading.Timer(15, _kill_group, (held.pid,))
        bound.start()
        try:
            assert held.stdout is not None
            assert held.stderr is not None
            if held.stdout.readline().strip() != "held":
                _kill_group(held.pid)
                raise Refused(held.stderr.read())
            bound.cancel()
            yield
        finally:
            bound.cancel()
            _kill_group(held.pid)
            held.wait()
    else:
        driver = driver_class(request.getfixturevalue("go_manifest"))(host, "users")
        try:
            sandbox = driver.create(
                SandboxSpec.with_gpus(driver="gosandbox", device_ids=[gpu.uuid])
            )
        except Exception as exc:
            raise Refused(str(exc)) from None
        with _refusal_on_release(), sandbox:
            yield


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


@contextmanager
def _refusal_on_release() -> Iterator[None]:
    """A release refused (it reads every user's file, as a grant does) is a ``Refused``."""
    try:
        yield
    except (LeaseFileCorrupt, ExternalDriverError) as exc:
        raise Refused(str(exc)) from None


def other_user_gets(src: Path, registry: LeaseRegistry, gpu: GpuDevice) -> str:
    """What uid 65534's Python client says when it asks for ``gpu``: granted, or busy."""
    code = (
        "import os; from gpuhost.devices import GpuDevice; from gpuhost.errors import GpuBusy; "
        "from gpuhost.leases import Holder, LeaseOwner; "
        f"gpu = GpuDevice(0, {gpu.uuid!r}, 'GPU', {gpu.pci_bus_id!r}); "
        "owner = LeaseOwner('test', 'users', 's', Holder.process(os.getpid()))\n"
        "try: registry.acquire([gpu], owner, exact=[gpu]); print('granted')\n"
        "except GpuBusy: print('busy')"
    )
    tried = python_as_other_user(src, registry, code)
    assert tried.returncode == 0, tried.stderr
    return tried.stdout.strip()


def _forged(path: Path, host: GpuHost) -> str:
    """A file of uid 65534's listing every GPU as held by pid 1, which lives."""
    forged = {
        "version": 4,
        "boot_id": boot_id(),
        "leases": [
            {"gpu_uuid": gpu.uuid, "driver": "forged", "sandbox_id": "forged", "session_id": "",
             "holder": {"kind": "process", "ref": Holder.process(1).ref}, "mode": "exclusive",
             "acquired_at": 1.0}
            for gpu in host.gpus
        ],
    }  # fmt: skip
    return f"umask 022; printf '%s' {shlex.quote(json.dumps(forged))} > {path}"


@functools.cache
def _terminal() -> tuple[int, int, int]:
    """A pseudo-terminal of root's (master, slave, its mode): what a link could name."""
    master, slave = os.openpty()
    os.set_blocking(master, False)
    return master, slave, stat.S_IMODE(os.fstat(slave).st_mode)


PLANTED: dict[str, Callable[[Path, GpuHost], str]] = {
    "forged-file": _forged,
    "fifo": lambda path, host: f"mkfifo -m 666 {path}",
    "directory": lambda path, host: f"mkdir -m 777 {path}",
    "link-to-roots-file": lambda path, host: f"ln -s {path.parent.parent / 'roots'} {path}",
    "link-to-a-terminal": lambda path, host: f"ln -s {os.ttyname(_terminal()[1])} {path}",
}


@needs_root
@pytest.mark.parametrize("planted", sorted(PLANTED))
@pytest.mark.parametrize("client", CLIENTS)
def test_what_another_user_plants_under_roots_name_is_replaced(
    host: GpuHost, registry: LeaseRegistry, src: Path, client: str, planted: str,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """Removed, never opened, followed or read, and root's own file made in its place.

    Before: the sh client wrote root's leases into a file of uid 65534's, which every other
    client ignored as forged (uid 65534 was granted root's GPU, and could rewrite root's
    leases); a FIFO, a directory or a link stopped every grant of root's in every client
    (the Python client raising IsADirectoryError or PermissionError).
    """
    roots = registry.directory.parent / "roots"
    roots.write_text("root's")
    roots.chmod(0o600)
    registry.path.unlink()
    as_other_user(src, "sh", "-c", PLANTED[planted](registry.path, host)).check_returncode()
    gpu = host.gpus[0]
    with held_by_root(client, host, gpu, request):
        st = registry.path.lstat()
        assert (stat.S_ISREG(st.st_mode), st.st_uid, st.st_nlink) == (True, 0, 1)
        assert other_user_gets(src, registry, gpu) == "busy"
        tried = as_other_user(src, "sh", "-c", f"echo '{{}}' > {registry.path}")
        assert tried.returncode != 0, "uid 65534 could write root's lease file"
    assert (roots.read_text(), stat.S_IMODE(roots.stat().st_mode)) == ("root's", 0o600)
    master, slave, mode = _terminal()
    assert stat.S_IMODE(os.fstat(slave).st_mode) == mode
    with contextlib.suppress(BlockingIOError):
        assert os.read(master, 1024) == b""  # nothing was written to the terminal


@needs_root
@pytest.mark.parametrize("client", CLIENTS)
def test_a_planted_directory_root_cannot_empty_is_refused_naming_it(
    host: GpuHost, registry: LeaseRegistry, src: Path, client: str,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """Never removed whole (what is in it is another user's), nor written into."""
    registry.path.unlink()
    as_other_user(src, "sh", "-c", f"mkdir {registry.path} && touch {registry.path}/x")
    said = rf"{registry.path} is a directory of uid {OTHER_USER}.* cannot be removed"
    with pytest.raises(Refused, match=said), held_by_root(client, host, host.gpus[0], request):
        pass
    assert (registry.path / "x").exists()


@needs_root
@pytest.mark.parametrize("client", ["python", "sh"])
def test_a_name_planted_where_its_user_cannot_remove_it_is_refused_naming_it(
    registry: LeaseRegistry, src: Path, client: str
) -> None:
    """The sticky bit keeps a user from removing root's FIFO: its client says so, by name.

    Before: the Python client raised a raw PermissionError.
    """
    planted = registry.directory / leasefile.file_name(OTHER_USER)
    os.mkfifo(planted, 0o644)
    if client == "python":
        tried = python_as_other_user(src, registry, "registry.leases()")
    else:
        lease_client = str(src / "gpuhost" / "gpu-lease")
        tried = as_other_user(src, lease_client, "--dir", str(registry.directory), "list")
    assert tried.returncode == 1
    assert f"{planted} is a FIFO of uid 0" in tried.stderr.replace("fifo", "FIFO")
    assert "cannot be removed" in tried.stderr
    assert "ask root to remove it" in tried.stderr


@needs_root
@pytest.mark.parametrize("client", CLIENTS)
def test_another_users_file_swapped_for_a_fifo_never_hangs_a_reader(
    host: GpuHost, registry: LeaseRegistry, src: Path, client: str,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """Uid 65534 swaps its own file for a FIFO and back as fast as it can while root grants.

    Before: the sh client checked the file by its path, then read it by its path: jq opened
    the FIFO and waited for a writer, forever, holding the registry's lock (jq inherits it).
    """
    users = registry.directory / leasefile.file_name(OTHER_USER)
    empty = json.dumps({"version": 4, "boot_id": boot_id(), "leases": []})
    swapper = subprocess.Popen(
        [*setpriv(), "sh", "-c",
         f"cd {registry.directory}; umask 022; printf '%s' '{empty}' > f; while :; do "
         f"ln -f f t 2>/dev/null; mv -T t {users.name}; mkfifo p; mv -T p {users.name}; done"],
        cwd=src,
    )  # fmt: skip
    try:
        outcomes = []
        for _ in range(15):
            started = time.monotonic()
            try:
                with held_by_root(client, host, host.gpus[0], request):
                    outcomes.append("granted")
            except Refused as exc:
                outcomes.append(str(exc))
            assert time.monotonic() - started < 10, f"the {client} client hung: {outcomes}"
    finally:
        swapper.kill()
        swapper.wait()
    said = ("granted", "is not a plain file", "changed while it was read")
    assert all(any(s in outcome for s in said) for outcome in outcomes), outcomes


UNSAFE = {  # what uid 65534 makes of its own file, and what root's clients say of it
    "world-writable": ("printf '{{}}' > {path}; chmod 666 {path}", "is writable by others"),
    "fifo": ("mkfifo -m 644 {path}", "is not a plain file"),
    "link": ("ln -s /etc/hostname {path}", "is a symbolic link|cannot be opened"),
}


@needs_root
@pytest.mark.parametrize("made", sorted(UNSAFE))
@pytest.mark.parametrize("client", CLIENTS)
def test_another_users_unsafe_file_is_refused_not_trusted_nor_waited_on(
    host: GpuHost, src: Path, client: str, made: str, request: pytest.FixtureRequest
) -> None:
    users = host.leases.directory / leasefile.file_name(OTHER_USER)
    script, said = UNSAFE[made]
    as_other_user(src, "sh", "-c", script.format(path=users)).check_returncode()
    started = time.monotonic()
    refused = pytest.raises(Refused, match=rf"the lease file {users} ({said})")
    with refused, held_by_root(client, host, host.gpus[0], request):
        pass
    assert time.monotonic() - started < 5


@needs_root
@pytest.mark.parametrize("client", CLIENTS)
def test_what_a_user_made_under_a_third_users_name_is_skipped(
    host: GpuHost, src: Path, client: str, request: pytest.FixtureRequest
) -> None:
    """No lease file of the user it names, whatever it is: it neither grants nor stops grants."""
    for uid, script in [(12345, "mkfifo {path}"), (12346, "ln -s /etc/hostname {path}")]:
        path = host.leases.directory / leasefile.file_name(uid)
        as_other_user(src, "sh", "-c", script.format(path=path)).check_returncode()
    with held_by_root(client, host, host.gpus[0], request):
        pass


@needs_root
def test_the_command_hold_runs_holds_no_lock(registry: LeaseRegistry) -> None:
    """``hold`` execs its command without the registry's descriptor: grants go on meanwhile."""
    held = subprocess.Popen(
        [str(CLIENT), "--dir", str(registry.directory), "hold", "--sandbox", "sh-1",
         INVENTORY[0].uuid, "--", "sh", "-c",
         "readlink /proc/$$/fd/* | tr '\\n' ' '; echo; exec sleep 60"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert held.stdout is not None
        opened = held.stdout.readline()
        assert opened.strip()
        assert str(registry.directory) not in opened
        quick = LeaseRegistry(registry.directory, lock_timeout_s=1)
        assert quick.acquire(INVENTORY, owner("b"), count=1) == INVENTORY[1:2]
    finally:
        held.kill()
        held.wait()


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
