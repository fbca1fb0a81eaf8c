"""A ``jsonl`` driver process: its lines as they come, its end, and what is left of it after.

The process is watched through a pidfd, not only through its stdout: a child it started may
hold the pipe open long after it died (setsid, so outside its process group), and its
requests must fail when it dies, not when that child goes. Whatever it started is then
found three ways, and killed: its process group; every process whose environment carries
its marker (``DRIVER_MARKER_ENV``, inherited setsid or not); every process holding the
driver's end of its stdin or stdout pipe (one that also cleared its environment).
"""

from __future__ import annotations

import fcntl
import os
import selectors
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from drivers.external.protocol import ProtocolError
from gpuhost.procfs import KILL_MARKED_TIMEOUT_S, kill_if, kill_marked
from gpuhost.spawn import TERM_GRACE_S, kill_group
from gpuhost.wait import intervals

MAX_LINE = 64 * 1024 * 1024
"""A line longer than this is not a message (64 MiB: an output chunk is far smaller)."""
READ_SIZE = 1 << 20
DRIVER_MARKER_ENV = "GPU_SANDBOX_JSONL_DRIVER"
"""Set, to a value of each driver process's own, in its environment: inherited by whatever it
starts, setsid or not, and how what is left of it is found once it has ended."""


@dataclass(frozen=True)
class DriverProcess:
    """A started driver process, and how to find what it leaves behind."""

    popen: subprocess.Popen[bytes]
    needle: bytes
    """``DRIVER_MARKER_ENV=<value>``, as it appears in /proc/<pid>/environ."""
    pipes: Mapping[int, int]
    """The inode of its stdin and stdout pipes: the access mode of the driver's end."""

    @classmethod
    def start(cls, argv: list[str], cwd: str, env: Mapping[str, str] | None) -> DriverProcess:
        """``argv`` started in a session of its own, pipes on its stdin and stdout, marked.

        ``env`` is its whole environment (None: this process's), its marker added.
        """
        marker = uuid.uuid4().hex
        env = {**(os.environ if env is None else env), DRIVER_MARKER_ENV: marker}
        popen = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=cwd,
            start_new_session=True, env=env,
        )  # fmt: skip
        assert popen.stdin is not None
        assert popen.stdout is not None
        pipes = {
            os.fstat(popen.stdin.fileno()).st_ino: os.O_RDONLY,
            os.fstat(popen.stdout.fileno()).st_ino: os.O_WRONLY,
        }
        return cls(popen, f"{DRIVER_MARKER_ENV}={marker}".encode(), pipes)

    def lines(self, pidfd: int) -> Iterator[bytes]:
        """The lines of its stdout, until the pipe ends or the process does (``pidfd``).

        Once the process has ended, what it wrote before is still read (what the pipe
        holds), and no more: what else holds the pipe may write on for ever.
        ``ProtocolError`` for a line longer than ``MAX_LINE``.
        """
        assert self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        os.set_blocking(fd, False)
        lines = _Lines()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            selector.register(pidfd, selectors.EVENT_READ)
            while True:
                exited = any(key.fd == pidfd for key, _ in selector.select())
                left = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) if exited else READ_SIZE
                while left > 0:
                    try:
                        data = os.read(fd, min(left, READ_SIZE))
                    except BlockingIOError:
                        break
                    if not data:
                        exited = True
                        break
                    yield from lines.add(data)
                    left = left - len(data) if exited else 0
                if exited:
                    break
        if lines.rest:
            yield bytes(lines.rest)

    def stop(self, term: bool = True) -> int:
        """SIGTERM its process group (``term``), then SIGKILL it: its exit status, once reaped."""
        kill_group(self.popen.pid, TERM_GRACE_S if term else 0, self.popen.wait)
        return self.popen.wait()

    def clear(self) -> None:
        """Kill what is left of it outside its group: what carries its marker or holds its pipes."""
        kill_marked(self.needle)
        deadline = time.monotonic() + KILL_MARKED_TIMEOUT_S
        sleeps = intervals(0.02)
        while time.monotonic() < deadline:
            holders = [pid for pid in _processes() if _holds(pid, self.pipes)]
            if not holders:
                return
            for holder in holders:
                kill_if(holder, lambda pid: _holds(pid, self.pipes))
            time.sleep(next(sleeps))

    def end(self) -> None:
        """``stop``, then ``clear``: nothing of it is left."""
        self.stop()
        self.clear()


class _Lines:
    """Bytes as they come, cut into lines; a line past ``MAX_LINE`` is refused."""

    def __init__(self) -> None:
        self.rest = bytearray()
        self._scanned = 0

    def add(self, data: bytes) -> Iterator[bytes]:
        self.rest += data
        start = 0
        while (end := self.rest.find(b"\n", max(start, self._scanned))) >= 0:
            yield bytes(self.rest[start:end])
            start = self._scanned = end + 1
        del self.rest[:start]
        self._scanned = len(self.rest)
        if len(self.rest) > MAX_LINE:
            raise ProtocolError(
                f"a line longer than {MAX_LINE} bytes (it begins {bytes(self.rest[:80])!r})"
            )


def _processes() -> Iterator[int]:
    """Every other process's pid."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            yield int(entry.name)


def _holds(pid: int, pipes: Mapping[int, int]) -> bool:
    """Whether ``pid`` holds a pipe of ``pipes`` open by the driver's end (its access mode).

    This process holds the other ends, and so may a child it forked: those are not the
    driver's.
    """
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not link.startswith("pipe:[") or int(link[6:-1]) not in pipes:
                continue
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except (OSError, ValueError):
            continue
        flags = [line.split()[1] for line in info.splitlines() if line.startswith("flags:")]
        if flags and int(flags[0], 8) & os.O_ACCMODE == pipes[int(link[6:-1])]:
            return True
    return False
