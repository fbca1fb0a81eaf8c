"""A running reference sandbox: its commands, entered with ``nsenter``, and its end.

``drivers.reference`` starts it (bwrap, as a session's sandbox); this module runs each command
in its namespaces, as its user, under its system call filter, and stops or kills it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from typing import ClassVar

from drivers import seccomp
from drivers.base import Command, CommandTimedOut, Output
from drivers.host_process import HOST_ENV, HostProcessSandbox, tool
from gpuhost.devices import GpuDevice
from gpuhost.errors import SandboxExecError
from gpuhost.leases import (
    PROCESS,
    Holder,
    LeaseRegistry,
    boot_id,
    process_running,
    process_start_time,
)
from gpuhost.procfs import kill_marked
from gpuhost.spawn import kill_group, stop_process
from gpuhost.uids import SandboxUser
from gpuhost.wait import wait_for

CLOSE_TIMEOUT_S = 5.0
KILL_TIMEOUT_S = 5.0
"""After SIGKILL a process is gone in milliseconds; seconds mean something holds its pipes."""


class ReferenceSandbox(HostProcessSandbox):
    """A running bubblewrap sandbox: its pid 1 holds its leases."""

    exec_privileges: ClassVar[tuple[str, ...]] = (
        "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all",
    )  # fmt: skip
    """What ``setpriv`` takes from every command: new privileges, and every capability."""
    syscall_filter: ClassVar[bool] = True
    """Whether each command runs under ``drivers.seccomp``'s filter, from its first call."""

    def __init__(
        self,
        sandbox_id: str,
        driver: str,
        gpus: tuple[GpuDevice, ...],
        process: subprocess.Popen[bytes],
        child_pid: int,
        child_start: str,
        env: Mapping[str, str],
        leases: LeaseRegistry,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
        as_sandbox_user: Sequence[str] = (),
        user: SandboxUser | None = None,
    ) -> None:
        # The holder is the sandbox's pid 1: the kernel ends it only after every other
        # process of the sandbox, so while it runs, the GPUs may still be in use. bwrap itself
        # may exit (or be killed) before that.
        holder = Holder(PROCESS, f"{boot_id()}:{child_pid}:{child_start}")
        super().__init__(sandbox_id, driver, gpus, holder, leases)
        self._process = process
        self._env = env
        self._child_pid = child_pid
        self._child_start = child_start
        self._close_timeout_s = close_timeout_s
        self._as_sandbox_user = list(as_sandbox_user)
        self._user = user

    def run(self, command: Command, output: Output) -> int:
        # Each command runs in the sandbox's pid namespace, as `docker exec` does. Not in one
        # of its own: on a real GPU (H100, driver 580) CUDA fails with error 304 in a nested
        # pid namespace once any CUDA process has run in the sandbox. A timeout finds what
        # the command started, setsid or not, by the marker in its environment. It runs with
        # the sandbox's environment and no capabilities: root in the sandbox's user
        # namespace could otherwise unmount and re-bind device nodes and so reach GPUs it was
        # not given. nsenter itself runs with the host's fixed environment, never the user's
        # (an LD_PRELOAD there would run in the host's namespaces as the host user), and as
        # the sandbox's host user, whose credentials it keeps inside (never root's).
        env = self.command_env(command)
        enter = [tool("nsenter"), f"--target={self._child_pid}", *NAMESPACES, "--root", "--wd"]
        userns = -1
        if os.geteuid() != 0:  # the sandbox's user namespace, which its user owns
            try:
                userns = _sandbox_userns(self._child_pid)
            except OSError as exc:
                raise SandboxExecError(f"cannot enter sandbox {self.id}: {exc}") from exc
            enter += [f"--user=/proc/self/fd/{userns}", "--preserve-credentials"]
        argv = [
            *enter, "setpriv", *self._as_sandbox_user, *self.exec_privileges, "--",
            "env", "-i", *(f"{key}={value}" for key, value in env.items()), *command.argv,
        ]  # fmt: skip
        stdout, stderr = output.fds or (subprocess.PIPE, subprocess.PIPE)
        if self.syscall_filter:
            seccomp.prepare()
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                env=HOST_ENV,
                start_new_session=True,
                pass_fds=(userns,) if userns >= 0 else (),
                preexec_fn=seccomp.load_in_child if self.syscall_filter else None,
            )
        except OSError as exc:
            raise SandboxExecError(
                f"cannot run {list(command.argv)!r} in sandbox {self.id}: {exc}"
            ) from exc
        finally:
            if userns >= 0:
                os.close(userns)
        try:
            return output.read_from(process, command.timeout)
        except BaseException as exc:
            # The group holds nsenter; the marker finds the rest, wherever it went.
            kill_group(process.pid)
            kill_marked(command.needle)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(KILL_TIMEOUT_S)
            stop_process(process)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise CommandTimedOut from None
            raise

    def running(self) -> bool:
        # The start time guards against entering an unrelated process that reused the pid.
        try:
            alive = process_start_time(self._child_pid) == self._child_start
        except OSError:
            alive = False
        return self._process.poll() is None and alive

    def stop(self) -> None:
        # Closing its stdin ends the init, and the sandbox with it; then kill what is left.
        try:
            assert self._process.stdin is not None
            self._process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(self._close_timeout_s)
        finally:
            stop_process(self._process)
        # bwrap exits once the init has, while its pid 1 in the sandbox may still be reaping
        # the rest: gone means that one too (reap and a fresh process's listing look for it).
        wait_for(
            lambda: process_running(self._child_pid, self._child_start),
            lambda running: not running,
            timeout_s=self._close_timeout_s,
            what=f"the pid 1 of sandbox {self.id} (pid {self._child_pid}) to exit",
            interval_s=0.002,
        )
        if self._user is not None:
            self._user.release()

    def kill(self) -> None:
        self._process.send_signal(signal.SIGKILL)


NAMESPACES = ("--mount", "--uts", "--ipc", "--net", "--pid", "--cgroup")
"""The sandbox's namespaces a command enters besides its user namespace: all it has (not
the host's time namespace, which only root may enter)."""
_NS_GET_PARENT = 0xB702  # ioctl_ns(2): _IO(0xb7, 0x2)


def _sandbox_userns(child_pid: int) -> int:
    """An open fd of the user namespace that owns the sandbox's other namespaces.

    bwrap's --disable-userns runs the sandbox's pid 1 in a nested user namespace, which owns
    none of them: a command joins its parent, where the sandbox's host user (its owner) may
    enter the rest with its own credentials, and where no further user namespace can be made.
    """
    nested = os.open(f"/proc/{child_pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return fcntl.ioctl(nested, _NS_GET_PARENT)
    finally:
        os.close(nested)
