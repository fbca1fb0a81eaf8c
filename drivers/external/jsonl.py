"""Mode ``jsonl``: a driver is one long-lived process speaking JSON lines (external-protocol.md).

The adapter leaves the request to the driver: nothing is planned or leased here, and
``create`` hands the driver the request in the seeds' shape, whose refusals come back as
typed errors (``drivers.external.protocol``). Every operation runs under the manifest's
timeout: at expiry the adapter cancels it, then ends what runs it (an exec's process group,
else the driver process), and raises the suite's typed error with "timeout" in its message.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from drivers.base import Availability, Command, CommandTimedOut, Launch, Output, Sandbox, write_all
from drivers.external.adapter import ExternalDriver
from drivers.external.connection import CANCEL_GRACE_S, Connection, DriverProcessDied, Pending
from drivers.external.process import ExternalDriverError, OperationTimedOut
from drivers.external.protocol import PROTOCOL_VERSION, ProtocolError, exec_error, request_error
from drivers.external.templates import substitute
from drivers.labels import DRIVER_LABEL, REQUEST_LABEL, SESSION_LABEL
from gpuhost.devices import GpuDevice
from gpuhost.errors import DriverError, SandboxExecError, SandboxStartError, shown
from gpuhost.leases import Holder
from gpuhost.procfs import kill_marked
from gpuhost.spawn import TERM_GRACE_S, kill_group

EXEC_SLACK_S = 1.0
"""How long past an exec's own timeout the driver has to answer ``timeout`` itself."""
CAPABILITY_DEFAULTS: dict[str, Any] = {
    "exclusive": True, "shared": False, "mig": False, "vendors": ["nvidia"], "idForms": [],
}  # fmt: skip

_connections: dict[tuple[Path, Any], Connection] = {}
_connections_lock = threading.Lock()


def signal_code(result: dict[str, Any]) -> int:
    """An exec's result as an exit code: a signal N as a shell reports it, 128 + N."""
    return int(result["exit_code"]) if "exit_code" in result else 128 + int(result["signal"])


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is ``ancestor`` or one of its descendants (by /proc's parent links)."""
    seen = 0
    while pid > 1 and seen < 64:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        seen += 1
    return False


class JsonlDriver(ExternalDriver):
    """An external driver of ``mode: jsonl``: each class is one manifest."""

    def connection(self) -> Connection:
        """The driver process of this manifest for this host, in this process (started lazily)."""
        key = (self.manifest.path, self.host.config)
        with _connections_lock:
            conn = _connections.get(key)
            if conn is None:
                conn = _connections[key] = self._connect()
        return conn

    def _connect(self) -> Connection:
        manifest = self.manifest
        values = {"python": sys.executable, "driver": self.name}
        argv = [substitute(arg, values) for arg in manifest.command]
        config = self.host.config
        hello = {
            "op": "hello", "protocol": PROTOCOL_VERSION, "adapter": "gpu-sandbox-conformance",
            "host": {
                "sim_root": str(config.sim_root) if config.sim_root else None,
                "state_dir": str(config.state_dir) if config.state_dir else None,
                "leases_dir": str(self.host.leases.directory), "share_limit": self.host.share_limit,
            },
        }  # fmt: skip
        conn = Connection(
            argv, str(manifest.path.parent), hello, self._check_hello, manifest.timeouts["hello"],
            self.env,
        )  # fmt: skip

        def reap_dead(sessions: set[str]) -> None:
            for session in sorted(sessions):
                with contextlib.suppress(DriverError, TimeoutError):
                    conn.call(
                        {"op": "reap", "session_id": session}, manifest.timeouts["reap"],
                        f"{self.name} reap of session {session} after its driver process died",
                    )  # fmt: skip

        conn.on_restart = reap_dead
        atexit.register(conn.shutdown, manifest.timeouts["shutdown"])
        return conn

    def _check_hello(self, hello: dict[str, Any]) -> None:
        """The driver is the manifest's: its name, and capabilities the manifest declares."""
        name = hello["driver"]["name"]
        if name != self.name:
            raise ProtocolError(f"hello: the driver is {name!r}, its manifest names {self.name!r}")
        declared, said = self.manifest.capabilities, hello["capabilities"]
        for key in sorted({*declared, *said}):
            mine = declared.get(key, CAPABILITY_DEFAULTS.get(key))
            theirs = said.get(key, CAPABILITY_DEFAULTS.get(key))
            if mine != theirs:
                raise ProtocolError(
                    f"hello: the driver declares capabilities.{key} = {shown(theirs)}, its "
                    f"manifest {self.manifest.path} {shown(mine)}"
                )

    def request(self, op: str, what: str, **fields: Any) -> dict[str, Any]:
        """One operation's reply (result or error), under the manifest's timeout."""
        conn = self.connection()
        try:
            conn.ensure()
            return conn.call({"op": op, **fields}, self.manifest.timeouts[op], what)
        except TimeoutError as exc:
            raise OperationTimedOut(f"{what}: timeout: {exc}") from exc

    def result(self, op: str, what: str, **fields: Any) -> dict[str, Any]:
        """One operation's result; ``ExternalDriverError`` with the driver's error otherwise."""
        reply = self.request(op, what, **fields)
        if "error" in reply:
            error = reply["error"]
            raise ExternalDriverError(f"{what}: {error['type']}: {error['message']}")
        result: dict[str, Any] = reply["result"]
        return result

    # -- the create sequence: the driver plans, validates and allocates ---------------------

    def validate(self, request: Any) -> None:
        return None  # the request goes to the driver as given: its refusals are its own

    def start(self, launch: Launch) -> JsonlSandbox:
        what = f"{self.name} create in session {self.session_id}"
        labels = {
            SESSION_LABEL: self.session_id, DRIVER_LABEL: self.name,
            REQUEST_LABEL: launch.sandbox_id,
        }  # fmt: skip
        request = launch.request.to_spec().to_dict()
        try:
            reply = self.request(
                "create", what, session_id=self.session_id, labels=labels, request=request
            )
        except DriverError as exc:
            raise SandboxStartError(str(exc)) from exc
        if "error" in reply:
            error = request_error(reply["error"], what)
            raise error if error is not None else SandboxStartError(f"{what}: {reply['error']}")
        result = reply["result"]
        self.connection().made_in(self.session_id)
        by_uuid = {gpu.uuid: gpu for gpu in self.host.devices}
        unknown = [uuid for uuid in result["gpus"] if uuid not in by_uuid]
        sandbox = JsonlSandbox(
            self, result["sandbox_id"], tuple(by_uuid[u] for u in result["gpus"] if u in by_uuid)
        )
        if unknown:
            with contextlib.suppress(DriverError):
                sandbox.stop()
            raise SandboxStartError(f"{what}: the driver gave GPUs this host lacks: {unknown}")
        return sandbox

    # -- the rest of the contract -----------------------------------------------------------

    def probe(self) -> Availability:
        try:
            self.sandboxes(self.session_id)
        except DriverError as exc:
            return Availability(
                False, f"needed the driver process to answer hello and list (found: {exc})"
            )
        return Availability(True)

    def ask_inventory(self) -> dict[str, tuple[str, ...]]:
        gpus = self.result("inventory", f"{self.name} inventory")["gpus"]
        return {gpu["uuid"]: tuple(gpu.get("ids") or (gpu["uuid"],)) for gpu in gpus}

    def sandboxes(self, session_id: str) -> list[str]:
        what = f"{self.name} list of session {session_id}"
        return sorted(self.result("list", what, session_id=session_id)["sandbox_ids"])

    def reap_once(self, session_id: str) -> None:
        self.result("reap", f"{self.name} reap of session {session_id}", session_id=session_id)

    def version(self) -> str:
        conn = self.connection()
        conn.ensure()
        return str(conn.hello["driver"]["version"])


class JsonlSandbox(Sandbox):
    """A sandbox of a ``jsonl`` driver; ``generation`` is the driver process that made it."""

    def __init__(self, adapter: JsonlDriver, sandbox_id: str, gpus: tuple[GpuDevice, ...]) -> None:
        super().__init__(sandbox_id, adapter.name, gpus, Holder.process(os.getpid()), None)
        self._adapter = adapter
        self._conn = adapter.connection()
        self.generation = self._conn.generation

    def running(self) -> bool:
        return self._conn.alive(self.generation)

    def run(self, command: Command, output: Output) -> int:
        what = f"{self.driver} exec of {shown(list(command.argv))} in {self.id}"
        request = {
            "op": "exec", "sandbox_id": self.id, "argv": list(command.argv),
            "env": command.env, "timeout": command.timeout,
        }  # fmt: skip
        sink = _Sink(output)
        try:
            pending = self._conn.send(request, what, self.generation, sink.write)
            message = self._conn.next(pending, time.monotonic() + command.timeout + EXEC_SLACK_S)
            if message is None:
                self._cancel(pending, command)
                raise CommandTimedOut
        except DriverError as exc:
            raise SandboxExecError(str(exc)) from exc
        finally:
            sink.close()
        if "error" in message:
            if message["error"]["type"] in ("timeout", "cancelled"):
                raise CommandTimedOut
            raise exec_error(message["error"], what)
        return signal_code(message["result"])

    def _cancel(self, pending: Pending, command: Command) -> None:
        """Past its timeout: cancel it; unanswered, SIGTERM then SIGKILL what it started."""
        if self._conn.cancel(pending, CANCEL_GRACE_S) is not None:
            return
        pid, driver = pending.pid, self._conn.pid
        own = pid is not None and driver is not None and descends_from(pid, driver)
        if own:
            assert pid is not None
            kill_group(pid, TERM_GRACE_S)
        kill_marked(command.needle)  # what left its process group, on this host

    def _close(self, kill: bool) -> None:
        if not self._conn.alive(self.generation):
            return  # its driver process died: what it made was reaped when it restarted
        op = "kill" if kill else "close"
        what = f"{self.driver} {op} of {self.id}"
        try:
            reply = self._conn.call(
                {"op": "close", "sandbox_id": self.id, "kill": kill},
                self._adapter.manifest.timeouts[op], what,
            )  # fmt: skip
        except TimeoutError as exc:
            raise OperationTimedOut(f"{what}: timeout: {exc}") from exc
        except DriverProcessDied:
            return
        if "error" in reply:
            raise ExternalDriverError(f"{what}: {reply['error']['message']}")

    def stop(self) -> None:
        self._close(kill=False)

    def kill(self) -> None:
        self._close(kill=True)


class _Sink:
    """Where the reader thread hands an exec's output; once closed, nothing more is written.

    To the caller's descriptors through copies of them (``exec_stream``): the reader may be
    in a write when the exec ends (a descriptor nobody reads), and the caller may close its
    own then; the copies are closed after that write, never under it.
    """

    def __init__(self, output: Output) -> None:
        self._output = output
        self._fds = () if output.fds is None else tuple(os.dup(fd) for fd in output.fds)
        self._lock = threading.Lock()
        self._writing = self._closed = False

    def write(self, stream: str, data: bytes) -> None:
        with self._lock:
            if self._closed:
                return
            self._writing = True
        try:
            if self._fds:
                write_all(self._fds[stream == "stderr"], data)
            else:
                (self._output.stdout if stream == "stdout" else self._output.stderr)(data)
        finally:
            with self._lock:
                self._writing = False
                if self._closed:
                    self._release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if not self._writing:
                self._release()

    def _release(self) -> None:
        fds, self._fds = self._fds, ()
        for fd in fds:
            os.close(fd)
