"""Running an external driver's commands: their environment, process group and timeout.

Every command runs in a process group of its own, under its timeout: at expiry the group
gets SIGTERM, then SIGKILL, and the suite's typed error is raised. Its environment is fixed
(``command_env``): the host's ``PATH`` and ``LANG``, and of the caller's variables only
those the manifest names in ``passEnv``; never the rest of the caller's (an
``LD_PRELOAD``, a ``PATH`` of theirs, credentials of other tools). It runs in an empty
directory only its user may enter (``empty_dir``), never the caller's: a value that a CLI
reads as a relative path (an image ``Dockerfile``, ``tmp``, whose ``Dockerfile`` any local
user may write) names nothing. Its errors (``ExternalDriverError``, ``OperationTimedOut``)
are both modes' (``drivers.external.driver``, ``drivers.external.jsonl``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from drivers.host_process import HOST_ENV
from gpuhost.errors import DriverError, shown
from gpuhost.procfs import kill_marked
from gpuhost.spawn import TERM_GRACE_S, kill_group

PIPE = subprocess.PIPE


@functools.cache
def empty_dir() -> str:
    """An empty directory only this user may enter: the commands' working directory.

    One per user, kept (``gpu-sandbox-empty-<uid>`` in the temporary directory, mode 0500):
    a process killed before its exit leaves nothing behind. Where that one is not this
    user's, is open to others or holds anything, a fresh one of this process's own,
    removed at its exit.
    """
    shared = Path(tempfile.gettempdir()) / f"gpu-sandbox-empty-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(shared, 0o500)
    try:
        fd = os.open(shared, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        fd = -1  # a link, a file, or gone
    if fd >= 0:
        try:
            found = os.fstat(fd)
            mine = found.st_uid == os.getuid() and not stat.S_IMODE(found.st_mode) & 0o077
            if mine and not os.listdir(fd):
                return str(shared)
        finally:
            os.close(fd)
    path = tempfile.mkdtemp(prefix="gpu-sandbox-cwd-")
    atexit.register(shutil.rmtree, path, True)
    return path


def command_env(
    pass_env: Sequence[str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a manifest's commands: ``HOST_ENV``, and ``pass_env`` over it.

    Of ``pass_env``, the variables the caller has (``environ``: this process's by default).
    """
    environ = os.environ if environ is None else environ
    return {**HOST_ENV, **{name: environ[name] for name in pass_env if name in environ}}


class ExternalDriverError(DriverError):
    """An operation of an external driver failed: its command, exit code and stderr."""


class OperationTimedOut(ExternalDriverError):
    """An operation ran past the manifest's timeout; its process group was killed."""


def terminate_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group of ``process``, SIGKILL it after ``TERM_GRACE_S``; reap it."""
    kill_group(process.pid, TERM_GRACE_S, process.wait)
    process.wait()


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    stdout: int = PIPE,
    stderr: int = PIPE,
    stdin: int = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:
    """``argv`` started in a process group of its own, no stdin, with ``env`` and no other.

    Its working directory is ``empty_dir()``.
    """
    return subprocess.Popen(
        list(argv), stdin=stdin, stdout=stdout, stderr=stderr,
        start_new_session=True, env=dict(env), cwd=empty_dir(),
    )  # fmt: skip


def finish(
    process: subprocess.Popen[bytes],
    timeout: float,
    needle: bytes | None = None,
    data: bytes | None = None,
) -> tuple[bytes, bytes] | None:
    """Its output, once it ends within ``timeout``; None once it is killed at the timeout.

    At the timeout its process group is killed, and, given a ``needle``, every process
    carrying it (what an exec started, wherever it went).
    """
    try:
        out, err = process.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        if needle is not None:
            kill_marked(needle)
        terminate_group(process)
        process.communicate()
        return None
    return out or b"", err or b""


def run_operation(
    argv: Sequence[str],
    timeout: float,
    what: str,
    data: bytes | None = None,
    env: Mapping[str, str] = HOST_ENV,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` in a process group of its own, within ``timeout`` seconds.

    ``data`` goes on its stdin (else it has none).
    ``OperationTimedOut`` (with "timeout" in its message) once the group is killed;
    ``ExternalDriverError`` when the program cannot be started.
    """
    try:
        process = spawn(argv, env, stdin=subprocess.DEVNULL if data is None else PIPE)
    except OSError as exc:
        raise ExternalDriverError(f"{what}: cannot run {shown(list(argv))}: {exc}") from exc
    output = finish(process, timeout, data=data)
    if output is None:
        raise OperationTimedOut(
            f"{what}: {shown(list(argv))} ran past its timeout of {timeout:g} s; its process "
            "group was sent SIGTERM, then SIGKILL"
        )
    return subprocess.CompletedProcess(list(argv), process.returncode, *output)


def checked(done: subprocess.CompletedProcess[bytes], what: str) -> str:
    """The stdout of a command that succeeded; ``ExternalDriverError`` naming it otherwise."""
    if done.returncode != 0:
        raise ExternalDriverError(
            f"{what}: {shown(done.args)} exited {done.returncode}: "
            f"{done.stderr.decode(errors='replace').strip()}"
        )
    return done.stdout.decode(errors="replace")
