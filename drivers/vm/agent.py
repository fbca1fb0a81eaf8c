"""The guest agent: how commands reach a VM and their results come back.

A small agent in the guest (``scripts/vm-guest/gpu-sandbox-agent``) serves two virtio-serial
ports, each connected to this process by a socketpair: no network and no vsock needed. On
the exec port it says ``ready`` once the guest is up, then runs one command a request
(``exec <n> <base64 script>``) and answers ``done <n> <exit code> <stdout size> <stderr
size>`` followed by both outputs. On the control port, ``kill <marker>`` makes it kill every
process carrying the command's marker, setsid or not, and the command's answer then comes.
"""

from __future__ import annotations

import base64
import select
import socket
import threading
import time
from collections.abc import Callable

from drivers.base import Command, Output
from gpuhost.errors import SandboxExecError, SandboxStartError

EXEC_PORT, CONTROL_PORT = "gpu-sandbox.exec", "gpu-sandbox.ctl"
"""The names of the agent's two virtio-serial ports, as the guest finds them."""
AGENT_KILL_TIMEOUT_S = 20.0
"""How long the guest agent may take to kill a timed-out command and answer, under TCG."""
KILL_AGAIN_S = 1.0
"""How long the command's answer may take to come after a kill before it is said again."""
TRANSFER_TIMEOUT_S = 120.0
"""For a command's output to cross the virtio-serial port once it has ended (MB/s)."""


class Channel:
    """One end of a socketpair to the guest agent, read with deadlines."""

    def __init__(self, end: socket.socket) -> None:
        self.end = end
        self.buffer = bytearray()

    def send(self, data: bytes) -> None:
        self.end.sendall(data)

    def read_line(self, deadline: float, alive: Callable[[], bool] | None = None) -> bytes:
        while b"\n" not in self.buffer:
            self._fill(deadline, alive)
        line, _, rest = bytes(self.buffer).partition(b"\n")
        self.buffer[:] = rest
        return line

    def pass_on(
        self,
        size: int,
        sink: Callable[[bytes], None],
        deadline: float,
        alive: Callable[[], bool] | None,
    ) -> None:
        """Hand the next ``size`` bytes to ``sink`` as they come, never holding them all."""
        while size > 0:
            if not self.buffer:
                self._fill(deadline, alive)
            data = bytes(self.buffer[:size])
            del self.buffer[: len(data)]
            size -= len(data)
            sink(data)

    def _fill(self, deadline: float, alive: Callable[[], bool] | None) -> None:
        # Short rounds, so that a VM that died is noticed without waiting out the deadline.
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no answer from the guest agent in time")
            ready, _, _ = select.select([self.end], [], [], min(remaining, 0.5))
            if ready:
                break
            if alive is not None and not alive():
                raise EOFError("the VM exited")
        chunk = self.end.recv(1 << 20)
        if not chunk:
            raise EOFError("the guest agent's port closed")
        self.buffer += chunk

    def close(self) -> None:
        self.end.close()


class GuestAgent:
    """The agent of one VM, on its exec and control ports: one command at a time."""

    def __init__(self, vm: str, exec_port: Channel, control_port: Channel) -> None:
        self.vm = vm
        self.exec_port = exec_port
        self.control_port = control_port
        self._lock = threading.Lock()
        self._requests = 0

    def wait_ready(
        self, deadline: float, alive: Callable[[], bool], logs: Callable[[], str]
    ) -> None:
        """Wait for the agent's ``ready``; a VM that exits or hangs fails by name.

        ``logs``: what QEMU and the guest's console said, for the error.
        """
        try:
            line = self.exec_port.read_line(deadline, alive)
        except (TimeoutError, EOFError, OSError) as exc:
            raise SandboxStartError(
                f"VM {self.vm} did not boot to its agent ({type(exc).__name__}: {exc}): {logs()}"
            ) from None
        if line != b"ready":
            raise SandboxStartError(f"VM {self.vm}'s agent said {line!r}, not ready")

    def run(
        self, script: str, command: Command, output: Output, alive: Callable[[], bool]
    ) -> tuple[int, bool]:
        """Run ``script`` (sh) in the guest: its exit code, and whether it timed out.

        At ``command.timeout`` the agent is told to kill what carries ``command.marker``;
        the command then ends, and its answer and output come as for any other.
        """
        with self._lock:
            self._requests += 1
            request = self._requests
            payload = base64.b64encode(script.encode()).decode()
            self.exec_port.send(f"exec {request} {payload}\n".encode())
            try:
                header = self.exec_port.read_line(time.monotonic() + command.timeout, alive)
                timed_out = False
            except TimeoutError:
                header = self._kill(command, alive)
                timed_out = True
            verb, answered, returncode, out, err = header.decode().split()
            if (verb, answered) != ("done", str(request)):
                raise SandboxExecError(f"the agent of VM {self.vm} answered {header!r}")
            deadline = time.monotonic() + TRANSFER_TIMEOUT_S
            self.exec_port.pass_on(int(out), output.stdout, deadline, alive)
            self.exec_port.pass_on(int(err), output.stderr, deadline, alive)
        return int(returncode), timed_out

    def _kill(self, command: Command, alive: Callable[[], bool]) -> bytes:
        """Have the agent kill what carries ``command.marker``: the command's answer.

        The agent kills every process carrying the marker, setsid or not, and says so; the
        command then ends and its answer comes. A kill that came before the command started
        found nothing: it is said again, each time its last one is answered.
        """
        deadline = time.monotonic() + AGENT_KILL_TIMEOUT_S
        while True:
            self.control_port.send(f"kill {command.marker}\n".encode())
            while (
                self.control_port.read_line(deadline, alive) != f"killed {command.marker}".encode()
            ):
                pass  # the answer to an earlier command's kill, said again as it ended
            try:
                return self.exec_port.read_line(
                    min(deadline, time.monotonic() + KILL_AGAIN_S), alive
                )
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise

    def close(self) -> None:
        self.exec_port.close()
        self.control_port.close()
