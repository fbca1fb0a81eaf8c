"""A running container: exec through the engine, bounded by a timer that kills by marker."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from drivers.base import Command, CommandTimedOut, Output, Sandbox
from drivers.container.api import EngineError
from drivers.container.keepalive import Keepalive
from gpuhost.devices import GpuDevice
from gpuhost.errors import SandboxExecError
from gpuhost.leases import Holder, LeaseRegistry
from gpuhost.procfs import kill_marked

if TYPE_CHECKING:
    from drivers.container.driver import ContainerDriver


class ContainerSandbox(Sandbox):
    """A running container of one engine: the container holds its leases."""

    def __init__(
        self,
        sandbox_id: str,
        driver: str,
        gpus: tuple[GpuDevice, ...],
        holder: Holder,
        container_id: str,
        cdi_devices: tuple[str, ...],
        keepalive: Keepalive,
        engine: ContainerDriver,
        leases: LeaseRegistry,
    ) -> None:
        super().__init__(sandbox_id, driver, gpus, holder, leases)
        self.container_id = container_id
        self.cdi_devices = cdi_devices
        self._keepalive = keepalive
        self._engine = engine

    def run(self, command: Command, output: Output) -> int:
        # Engines have no call to stop an exec: at the timeout the timer kills what it started.
        timer = ExecTimer(command.timeout, command.needle)
        timer.start()
        try:
            returncode = self._engine.exec_in(
                self.container_id, command.argv, command.env, output.stdout, output.stderr
            )
        except EngineError as exc:
            if timer.fired:
                raise CommandTimedOut from exc
            raise SandboxExecError(
                f"cannot run {list(command.argv)!r} in sandbox {self.id}: {exc}"
            ) from exc
        finally:
            timer.cancel()
        if timer.fired:
            raise CommandTimedOut
        return returncode

    def stop(self) -> None:
        self._keepalive.close()
        self._engine.stop_container(self.container_id)

    def kill(self) -> None:
        self._engine.kill_container(self.container_id)


KILL_RESCAN_S = 0.05
"""How often a fired exec timeout looks again for what the exec started."""


class ExecTimer(threading.Timer):
    """Kills, when it fires, every process an exec started: those carrying its marker.

    Engines have no call to stop an exec; what an exec starts inherits its environment,
    setsid or not, so the marker finds it wherever it went in the container (a process that
    clears its own environment escapes). Finding them reads the host's /proc: the suite must
    run as root, or as the user of a rootless engine, for a timeout to kill anything.
    """

    def __init__(self, timeout: float, needle: bytes) -> None:
        super().__init__(timeout, self._kill)
        self.daemon = True
        self.fired = False
        self._needle = needle

    def _kill(self) -> None:
        # Until the exec returns: under load the engine may start the command only after the
        # timeout, when one scan would find nothing, and the command would run unbounded.
        self.fired = True
        while not self.finished.is_set():
            kill_marked(self._needle)
            self.finished.wait(KILL_RESCAN_S)
