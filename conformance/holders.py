"""Who holds a GPU: every holder the catalogue plants in the host's lease registry.

GPU-HOSTWIDE-01's dimension "who holds". Each holder is a context manager that holds the GPUs
it is given for as long as its block runs, and yields those it holds. Those of ``MUST_HOLD``
live, and their GPUs are never granted: the lease protocol's sh client; a holder kind that
is no process; a sandbox another process made; the driver's own sandbox of another session;
another user's lease file, written by the Python client and by the sh client; a holder of a
kind nobody can judge, which the protocol says lives. Those of ``GONE`` are dead, and their
GPUs are free: a zombie (exited, its parent has not reaped it), a process of an earlier boot,
a pid that another process has now. ``python -m conformance.holders`` is the Python client's
holder as another user.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from uuid import uuid4

from conformance.bounds import fail
from conformance.hold import (
    HOLD_TIMEOUT_S,
    LEASE_CLIENT,
    RUN_HOLDER,
    HeldSandbox,
    close_all,
    held_by_the_sh_client,
)
from drivers.base import Driver
from drivers.reference import ReferenceDriver
from gpuhost.devices import GpuDevice
from gpuhost.leases import PROCESS, Holder, LeaseOwner, LeaseRegistry, boot_id, process_start_time
from gpuhost.spec import SandboxSpec
from gpuhost.wait import wait_for

if TYPE_CHECKING:
    from conformance.settings import Settings

SH_CLIENT = "the sh client"
NO_PROCESS = "a holder kind that is no process"
OTHER_PROCESS = "a reference sandbox of another process"
OTHER_SESSION = "the driver's sandbox of another session"
OTHER_USER_PYTHON = "another user's file, by the Python client"
OTHER_USER_SH = "another user's file, by the sh client"
UNJUDGED = "a kind nobody can judge (slurm-job)"
MUST_HOLD = (
    SH_CLIENT, NO_PROCESS, OTHER_PROCESS, OTHER_SESSION, OTHER_USER_PYTHON, OTHER_USER_SH, UNJUDGED,
)  # fmt: skip
"""Holders that live: their GPUs MUST never be granted."""

ZOMBIE = "a zombie (exited, not reaped)"
EARLIER_BOOT = "a process of an earlier boot"
PID_REUSED = "a pid another process has now"
GONE = (ZOMBIE, EARLIER_BOOT, PID_REUSED)
"""Holders that are gone: their leases MUST hold nothing."""

LOCK_HOLDER = "another client's flock on the registry, held until the create gives up"
LOCK_HOLDERS = (LOCK_HOLDER,)
"""Who holds the registry's lock while a create waits: no grant while it is held."""

MIG_INSTANCE_HOLDERS = ("the driver's sandbox in another process", "the sh client, with --parent")
"""MIG-EXCLUSIVE-01: who holds a MIG instance while its GPU and its siblings are asked for."""
MIG_WHOLE_HOLDERS = ("the driver's sandbox", "the sh client")
"""MIG-EXCLUSIVE-01: who holds a GPU in MIG mode whole while its instances are asked for."""

OTHER_USER = 65534
"""Another local user (nobody), who holds nothing of the run's."""
UNJUDGED_KIND = "slurm-job"
"""A holder kind no client here has a liveness check for: alive, by the protocol."""


class CannotHold(Exception):
    """The run cannot plant the holder (why): its case is dropped, never passed."""


@dataclass(frozen=True)
class Place:
    """Where a holder holds: the run's settings and the driver under test."""

    settings: Settings
    driver: Driver


Holding = Callable[[Place, list[GpuDevice]], AbstractContextManager[list[GpuDevice]]]


def _lease_id(what: str) -> str:
    return f"{what}-{time.time_ns()}"


@contextmanager
def _sh_client(place: Place, gpus: list[GpuDevice]) -> Iterator[list[GpuDevice]]:
    with held_by_the_sh_client(place.settings.host, place.driver.session_id, gpus):
        yield gpus


@contextmanager
def _leased(place: Place, gpus: list[GpuDevice], holder: Holder) -> Iterator[list[GpuDevice]]:
    """A lease the run takes itself, in its own user's file, for ``holder``."""
    leases = place.settings.host.leases
    owner = LeaseOwner("scheduler", _lease_id("job"), f"other-{uuid4().hex}", holder)
    leases.acquire(gpus, owner, exact=gpus)
    try:
        yield gpus
    finally:
        leases.release(owner.sandbox_id)


def _no_process(place: Place, gpus: list[GpuDevice]) -> AbstractContextManager[list[GpuDevice]]:
    """A lease whose holder is no process: only the holder kind's own check may judge it."""
    return _leased(place, gpus, Holder(RUN_HOLDER, Holder.process(os.getpid()).ref))


def _unjudged(place: Place, gpus: list[GpuDevice]) -> AbstractContextManager[list[GpuDevice]]:
    """A batch job's lease: no client here can judge a ``slurm-job``, so it lives."""
    return _leased(place, gpus, Holder(UNJUDGED_KIND, f"cluster-a {os.getpid()}"))


@contextmanager
def _sandboxes_of_other_processes(
    settings: Settings, holder: Driver, gpus: list[GpuDevice]
) -> Iterator[list[GpuDevice]]:
    """Sandboxes of ``holder``, each made by another process: by exact IDs, or one count."""
    if not holder.probe().ok:
        raise CannotHold(f"the {holder.name} driver cannot run here: {holder.probe().reason}")
    if holder.capabilities.exact_ids:
        specs = [
            SandboxSpec.with_gpus(driver=holder.name, device_ids=[holder.device_ids(gpu)[0]])
            for gpu in gpus
        ]
    else:  # it holds what its own count gets
        specs = [SandboxSpec.with_gpus(min(len(gpus), holder.capabilities.max_gpus_per_sandbox))]
    others = [HeldSandbox.start(holder, settings, spec) for spec in specs]
    try:
        for other in others:
            other.send_go()
        got: list[str] = []
        for spec, other in zip(specs, others, strict=True):
            reply = other.result()
            assert reply["ok"], f"a {holder.name} sandbox could not take {spec.to_dict()}: {reply}"
            got += reply["gpus"]
        by_uuid = {gpu.uuid: gpu for gpu in holder.inventory()}
        yield [by_uuid[uuid] for uuid in got]
    finally:
        close_all(others)
        if holder.session_id != settings.session_id:  # another run's: reaped as it would be
            holder.reap(holder.session_id)


def _other_process(place: Place, gpus: list[GpuDevice]) -> AbstractContextManager[list[GpuDevice]]:
    reference = ReferenceDriver(place.settings.host, place.driver.session_id)
    return _sandboxes_of_other_processes(place.settings, reference, gpus)


def _other_session(place: Place, gpus: list[GpuDevice]) -> AbstractContextManager[list[GpuDevice]]:
    driver = place.driver
    same = type(driver)(place.settings.host, f"other-{uuid4().hex}", driver.image)
    return _sandboxes_of_other_processes(place.settings, same, gpus)


def _as_another_user() -> list[str]:
    """The command prefix that runs what follows as ``OTHER_USER``; CannotHold where none can."""
    if os.geteuid() != 0:
        raise CannotHold(f"only root can run a holder as another user (uid {OTHER_USER})")
    if not shutil.which("setpriv"):
        raise CannotHold("setpriv (util-linux) runs a holder as another user; it is missing")
    return ["setpriv", f"--reuid={OTHER_USER}", f"--regid={OTHER_USER}", "--clear-groups"]


def _wait_held(place: Place, gpus: list[GpuDevice], process: subprocess.Popen[str]) -> None:
    """Until the registry shows ``gpus`` held; fail if ``process`` ends or it takes too long."""
    wanted = {gpu.uuid for gpu in gpus}
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while not wanted <= {lease.gpu_uuid for lease in place.settings.host.leases.leases()}:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            _, stderr = process.communicate()
            fail(f"a holder (uid {OTHER_USER}) could not hold {sorted(wanted)}: {stderr.strip()}")
        time.sleep(0.02)


def _sh_as_another_user(*args: str) -> list[str]:
    """The sh client as ``OTHER_USER``, on the registry that is its working directory.

    Its text is the command line, and the registry is reached through the directory the
    run's user entered: neither needs a path the other user could walk.
    """
    return [*_as_another_user(), "sh", "-c", LEASE_CLIENT.read_text(), "gpu-lease", "--dir", "."]


@contextmanager
def _other_user_sh(place: Place, gpus: list[GpuDevice]) -> Iterator[list[GpuDevice]]:
    sandbox_id = _lease_id("users-sh")
    directory = place.settings.host.leases.directory
    argv = [
        *_sh_as_another_user(), "hold", "--driver", "gpu-lease", "--session", f"u{OTHER_USER}",
        "--sandbox", sandbox_id, *(gpu.uuid for gpu in gpus), "--", "sleep", "3600",
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": "/tmp"}
    process = subprocess.Popen(argv, cwd=directory, env=env, stderr=subprocess.PIPE, text=True)
    try:
        _wait_held(place, gpus, process)
        yield gpus
    finally:
        process.kill()
        process.wait()
        subprocess.run(
            [*_sh_as_another_user(), "release", sandbox_id],
            cwd=directory, env=env, capture_output=True, check=False, timeout=HOLD_TIMEOUT_S,
        )  # fmt: skip


@contextmanager
def _other_user_python(place: Place, gpus: list[GpuDevice]) -> Iterator[list[GpuDevice]]:
    _as_another_user()  # it becomes that user itself, once it has entered the registry
    argv = [
        sys.executable, "-m", "conformance.holders",
        f"--dir={place.settings.host.leases.directory}", f"--session=u{OTHER_USER}",
        f"--sandbox={_lease_id('users-python')}",
        *(f"{gpu.uuid}:{gpu.parent_uuid or ''}" for gpu in gpus),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    try:
        _wait_held(place, gpus, process)
        yield gpus
    finally:
        assert process.stdin is not None
        process.stdin.close()  # it gives its leases back and exits
        try:
            process.wait(HOLD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


HOLDERS: dict[str, Holding] = {
    SH_CLIENT: _sh_client,
    NO_PROCESS: _no_process,
    OTHER_PROCESS: _other_process,
    OTHER_SESSION: _other_session,
    OTHER_USER_PYTHON: _other_user_python,
    OTHER_USER_SH: _other_user_sh,
    UNJUDGED: _unjudged,
}
assert tuple(HOLDERS) == MUST_HOLD


# -- holders that are gone ---------------------------------------------------------------


def _state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``Z`` for a zombie), "" once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return raw[raw.rindex(")") + 2 :].split()[0]


ZOMBIE_NAMES = ("z", "zz", "zzz", "zzzz", "z) z")
"""The zombies' command names: /proc/<pid>/stat writes the name between "(" and ")", so a
reader must cut at the last ")", wherever it falls; names of four lengths put it at four
offsets in a row, and one holds ") " itself."""


@contextmanager
def _zombie(place: Place, gpus: list[GpuDevice]) -> Iterator[list[GpuDevice]]:
    """The sh client's holders, killed: their parent (a ``sleep``) never reaps them.

    One per name of ``ZOMBIE_NAMES`` while GPUs last, each holding its share of ``gpus``;
    each runs the client through a link of that name to ``sh``, which becomes its name.
    """
    host = place.settings.host
    names = Path(tempfile.mkdtemp(prefix="gpu-sandbox-zombies-"))
    shares = [gpus[i :: len(ZOMBIE_NAMES)] for i in range(len(ZOMBIE_NAMES))]
    held: list[tuple[str, subprocess.Popen[str]]] = []
    try:
        for name, share in zip(ZOMBIE_NAMES, shares, strict=True):
            if not share:
                continue
            link = names / name
            link.symlink_to(shutil.which("sh") or "/bin/sh")
            sandbox_id = _lease_id("zombie")
            parent = subprocess.Popen(
                ["sh", "-c", '"$0" "$@" & echo $!; exec sleep 3600', str(link), str(LEASE_CLIENT),
                 "--dir", str(host.leases.directory), "hold", "--driver", "gpu-lease",
                 "--session", place.driver.session_id, "--sandbox", sandbox_id,
                 *(gpu.uuid for gpu in share), "--", "sleep", "3600"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            held.append((sandbox_id, parent))
            assert parent.stdout is not None
            holder = int(parent.stdout.readline())
            _wait_held(place, share, parent)
            os.kill(holder, signal.SIGKILL)
            wait_for(
                functools.partial(_state, holder), lambda state: state == "Z",
                timeout_s=HOLD_TIMEOUT_S,
                what=f"the sh client's holder {holder} ({name!r}), killed, to be a zombie",
            )  # fmt: skip
        yield gpus
    finally:
        for sandbox_id, parent in held:
            parent.kill()  # its zombie child goes to init, which reaps it
            parent.wait()
            host.leases.release(sandbox_id)
        shutil.rmtree(names, ignore_errors=True)


@contextmanager
def _forged(place: Place, gpus: list[GpuDevice], ref: str) -> Iterator[list[GpuDevice]]:
    """A lease of this user's whose process holder is ``ref``, which no process is."""
    with _leased(place, gpus, Holder(PROCESS, ref)):
        yield gpus


def _earlier_boot(place: Place, gpus: list[GpuDevice]) -> AbstractContextManager[list[GpuDevice]]:
    """The catalogue's own process, but of a boot that is not this one: dead."""
    me = os.getpid()
    return _forged(place, gpus, f"{uuid4()}:{me}:{process_start_time(me)}")


def _pid_reused(place: Place, gpus: list[GpuDevice]) -> AbstractContextManager[list[GpuDevice]]:
    """The catalogue's own pid, with a start time it does not have: another process, gone."""
    me = os.getpid()
    return _forged(place, gpus, f"{boot_id()}:{me}:{int(process_start_time(me)) + 1}")


GONE_HOLDERS: dict[str, Holding] = {
    ZOMBIE: _zombie,
    EARLIER_BOOT: _earlier_boot,
    PID_REUSED: _pid_reused,
}
assert tuple(GONE_HOLDERS) == GONE


def main(argv: list[str] | None = None) -> int:
    """Hold GPUs through the Python client as another user, until stdin closes.

    The run's user (root) enters the registry's directory, then this process becomes the
    other user: it needs no path that user could walk (a run's simulated host may lie
    under a private directory).
    """
    parser = argparse.ArgumentParser(prog="python -m conformance.holders", description=__doc__)
    parser.add_argument("--dir", type=Path, required=True, help="the registry's directory")
    parser.add_argument("--session", required=True)
    parser.add_argument("--sandbox", required=True)
    parser.add_argument("--uid", type=int, default=OTHER_USER)
    parser.add_argument("devices", nargs="+", help="UUID:PARENT-UUID (empty for a GPU)")
    args = parser.parse_args(argv)
    os.chdir(args.dir)
    os.setgroups([])
    os.setresgid(args.uid, args.uid, args.uid)
    os.setresuid(args.uid, args.uid, args.uid)
    registry = LeaseRegistry(Path("."))
    devices = []
    for at, device in enumerate(args.devices):
        uuid, _, parent = device.rpartition(":")  # a DRI GPU's UUID holds colons
        devices.append(GpuDevice(at, uuid, "GPU", "", parent_uuid=parent or None))
    owner = LeaseOwner("reference", args.sandbox, args.session, Holder.process(os.getpid()))
    registry.acquire(devices, owner, exact=devices)
    sys.stdout.write(json.dumps({"held": [device.uuid for device in devices]}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()
    registry.release(args.sandbox)
    return 0


if __name__ == "__main__":
    sys.exit(main())
