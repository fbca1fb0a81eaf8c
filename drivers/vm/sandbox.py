"""A running VM, as a sandbox: its QEMU process holds its leases; commands go to its agent.

Leases come from the host-wide registry and are held by the QEMU process (pid and start
time): SIGKILL of QEMU frees its GPU. The guest keeps nothing: its root is the initramfs,
and killing QEMU is its poweroff.
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence

from drivers.base import Command, CommandTimedOut, Launch, Output
from drivers.host_process import HostProcessSandbox
from drivers.vm.agent import GuestAgent
from drivers.vm.passthrough import GpuClaim
from gpuhost.errors import SandboxExecError
from gpuhost.leases import Holder, LeaseRegistry
from gpuhost.spawn import stop_process

KILL_TIMEOUT_S = 10.0
"""After SIGKILL a process is gone in milliseconds; seconds mean it is stuck in the kernel."""


class VmSandbox(HostProcessSandbox):
    """A running VM: its QEMU process holds its leases; commands go through its agent."""

    def __init__(
        self,
        launch: Launch,
        driver: str,
        process: subprocess.Popen[bytes],
        agent: GuestAgent,
        env: Mapping[str, str],
        leases: LeaseRegistry,
        claims: Sequence[GpuClaim] = (),
    ) -> None:
        super().__init__(
            launch.sandbox_id, driver, launch.gpus, Holder.process(process.pid), leases
        )
        self.agent = agent
        self.claims = tuple(claims)
        """The GPUs passed through to it, given back when it stops."""
        self._process = process
        self._env = env

    def run(self, command: Command, output: Output) -> int:
        env = [f"{key}={value}" for key, value in self.command_env(command).items()]
        script = shlex.join(["exec", "env", "-i", *env, *command.argv])
        try:
            returncode, timed_out = self.agent.run(script, command, output, self.running)
        except (OSError, EOFError, TimeoutError, ValueError) as exc:
            raise SandboxExecError(
                f"cannot run {list(command.argv)!r} in VM {self.id}: {type(exc).__name__}: {exc}"
            ) from exc
        if timed_out:
            raise CommandTimedOut
        return returncode

    def running(self) -> bool:
        return self._process.poll() is None

    def stop(self) -> None:
        # The guest keeps nothing: its root is the initramfs. Killing QEMU is its poweroff.
        stop_process(self._process)
        self.agent.close()
        for claim in self.claims:
            claim.release()

    def kill(self) -> None:
        self._process.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(KILL_TIMEOUT_S)
