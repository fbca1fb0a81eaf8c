"""One long-lived driver process of a ``jsonl`` manifest, and the requests in flight to it.

A ``Connection`` starts the process on its first request (``hello`` first, its answer checked),
writes one request per line to its stdin and hands each line of its stdout to the request of
that id, from a reader thread, so that any number of threads have requests in flight at once.
Every message read is held to the protocol's schema. When the process dies, every request in
flight fails naming it, and the next request starts a new process (a new ``generation``).

``GPU_SANDBOX_JSONL_TRACE=PATH`` appends every message, both ways, to PATH as JSON lines
(``{"to": "driver"|"adapter", "message": ...}``): the self-tests validate them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drivers.external.protocol import PROTOCOL_VERSION, ProtocolError, validator
from gpuhost.errors import DriverError, shown

TRACE_ENV = "GPU_SANDBOX_JSONL_TRACE"
TERM_GRACE_S = 2.0
"""How long the driver process has between SIGTERM and SIGKILL."""
CANCEL_GRACE_S = 2.0
"""How long a cancelled request has to be answered before the adapter ends what runs it."""
MAX_LINE = 64 * 1024 * 1024
"""A line longer than this is not a message (64 MiB: an output chunk is far smaller)."""


class DriverProcessDied(DriverError):
    """The driver process exited (or was killed) while this request was in flight."""


@dataclass
class Pending:
    """A request in flight: its events and its final reply arrive on ``inbox`` in order."""

    id: int
    what: str
    generation: int
    inbox: queue.Queue[dict[str, Any] | BaseException] = field(default_factory=queue.Queue)


class Connection:
    """The driver process of one manifest, for one host, in this process."""

    def __init__(
        self, argv: Sequence[str], cwd: str, hello: Mapping[str, Any],
        check_hello: Callable[[dict[str, Any]], None], hello_timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.argv = list(argv)
        self.env = None if env is None else dict(env)
        """The driver process's whole environment (None: this process's)."""
        self.cwd = cwd
        self.hello_request = dict(hello)
        self.check_hello = check_hello
        self.hello_timeout = hello_timeout
        self.hello: dict[str, Any] = {}
        self.generation = 0
        self.sessions: dict[int, set[str]] = {}
        """The sessions each generation made sandboxes in: reaped once it has died."""
        self._process: subprocess.Popen[bytes] | None = None
        self._pending: dict[int, Pending] = {}
        self._next_id = 1
        self._lock = threading.RLock()
        """Held while a process starts (and says hello): one start at a time."""
        self._pending_lock = threading.Lock()
        """Held over the table of requests in flight, which the reader thread reads too."""
        self._write_lock = threading.Lock()
        self._trace_lock = threading.Lock()
        self._validator = validator("fromDriver")
        self._trace = os.environ.get(TRACE_ENV)
        self.on_restart: Callable[[set[str]], None] | None = None

    # -- the process ------------------------------------------------------------------------

    def alive(self, generation: int | None = None) -> bool:
        """Whether the process runs (and is still ``generation``, when given)."""
        process = self._process
        running = process is not None and process.poll() is None
        return running and (generation is None or generation == self.generation)

    def ensure(self) -> int:
        """The running process's generation; a new process (and its hello) when none runs."""
        with self._lock:
            if self.alive():
                return self.generation
            dead = self.sessions.pop(self.generation, set())
            self._start()
        if dead and self.on_restart is not None:
            self.on_restart(dead)  # the dead process's sandboxes: reaped through the new one
        return self.generation

    def _start(self) -> None:
        try:
            process = subprocess.Popen(
                self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=self.cwd,
                start_new_session=True, env=self.env,
            )  # fmt: skip
        except OSError as exc:
            raise DriverError(f"cannot start the driver process {shown(self.argv)}: {exc}") from exc
        self._process = process
        self.generation += 1
        self.sessions[self.generation] = set()
        reader = threading.Thread(
            target=self._read, args=(process, self.generation), daemon=True,
            name=f"jsonl-reader-{process.pid}",
        )  # fmt: skip
        reader.start()
        try:
            reply = self.call(dict(self.hello_request), self.hello_timeout, "hello")
            if "error" in reply or reply["result"]["protocol"] != PROTOCOL_VERSION:
                raise ProtocolError(
                    f"hello: the driver refused protocol {PROTOCOL_VERSION}: {shown(reply, 300)}"
                )
            self.hello = reply["result"]
            self.check_hello(self.hello)
        except BaseException:
            self.terminate()
            raise

    def terminate(self) -> None:
        """SIGTERM the driver process's group, then SIGKILL it; what was in flight fails."""
        process = self._process
        if process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)
            try:
                process.wait(TERM_GRACE_S)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # what it started, once it is gone
        process.wait()

    def shutdown(self, timeout: float) -> None:
        """Ask the process to end (``shutdown``), then end it anyway."""
        if self.alive():
            with contextlib.suppress(DriverError):
                self.call({"op": "shutdown"}, timeout, "shutdown")
            process = self._process
            assert process is not None
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
        self.terminate()

    # -- requests -------------------------------------------------------------------------

    def send(self, request: dict[str, Any], what: str, generation: int | None = None) -> Pending:
        """Write ``request`` with an id of its own; its answers come to the returned ``Pending``."""
        with self._pending_lock:
            current = self.generation
            if generation is not None and generation != current:
                raise DriverProcessDied(f"{what}: the driver process it was made by has died")
            process = self._process
            ident = self._next_id
            self._next_id += 1
            pending = Pending(ident, what, current)
            self._pending[ident] = pending
        message = {"id": ident, **request}
        line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        self._record("driver", message)
        try:
            assert process is not None
            assert process.stdin is not None
            with self._write_lock:
                process.stdin.write(line)
                process.stdin.flush()
        except (OSError, ValueError) as exc:
            self.forget(pending)
            raise DriverProcessDied(f"{what}: cannot write to the driver process: {exc}") from exc
        return pending

    def call(self, request: dict[str, Any], timeout: float, what: str) -> dict[str, Any]:
        """Send ``request`` and wait for its reply; at ``timeout``, cancel, then end the process."""
        pending = self.send(request, what)
        reply = self.wait(pending, timeout)
        if reply is None:
            reply = self.cancel(pending, CANCEL_GRACE_S)
        if reply is None:
            self.terminate()
            raise TimeoutError(
                f"{what} ran past its timeout of {timeout:g} s, and was not answered once "
                f"cancelled: the driver process was sent SIGTERM, then SIGKILL"
            )
        return reply

    def wait(self, pending: Pending, timeout: float) -> dict[str, Any] | None:
        """Its final reply (events are not expected), None at ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.next(pending, deadline)
            if message is None or "event" not in message:
                return message

    def next(self, pending: Pending, deadline: float) -> dict[str, Any] | None:
        """Its next message by ``deadline`` (None then); raises what killed the request."""
        try:
            item = pending.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        if "event" not in item:
            self.forget(pending)
        return item

    def cancel(self, pending: Pending, grace: float) -> dict[str, Any] | None:
        """Send ``cancel`` for it; its reply (a result or an error) within ``grace``, else None."""
        with contextlib.suppress(DriverError):
            self.send({"op": "cancel", "target": pending.id}, f"cancel of {pending.what}")
        deadline = time.monotonic() + grace
        while True:
            try:
                message = self.next(pending, deadline)
            except DriverProcessDied:
                return None
            if message is None or "event" not in message:
                if message is None:
                    self.forget(pending)
                return message

    def forget(self, pending: Pending) -> None:
        with self._pending_lock:
            self._pending.pop(pending.id, None)

    # -- the reader -------------------------------------------------------------------------

    def _read(self, process: subprocess.Popen[bytes], generation: int) -> None:
        assert process.stdout is not None
        problem = ""
        for raw in iter(lambda: process.stdout.readline(MAX_LINE), b""):  # type: ignore[union-attr]
            try:
                message = json.loads(raw)
            except ValueError:
                problem = f"a line that is not JSON: {shown(raw)}"
                break
            self._record("adapter", message)
            errors = sorted(self._validator.iter_errors(message), key=str)
            ident = message.get("id") if isinstance(message, dict) else None
            with self._pending_lock:
                pending = self._pending.get(ident) if isinstance(ident, int) else None
            if errors:
                error = ProtocolError(
                    f"the driver sent a message outside the protocol ({errors[0].message}): "
                    f"{shown(message, 200)}"
                )
                if pending is None:
                    problem = str(error)
                    break
                pending.inbox.put(error)
                self.forget(pending)
                continue
            if pending is not None:
                pending.inbox.put(message)
            # An answer to a request the adapter gave up on (cancelled, timed out) is dropped.
        code = process.wait() if not problem else None
        if problem:
            self.terminate()
            code = process.returncode
        self._fail_in_flight(generation, process, code, problem)

    def _fail_in_flight(
        self, generation: int, process: subprocess.Popen[bytes], code: int | None, problem: str
    ) -> None:
        with self._pending_lock:
            dead = [p for p in self._pending.values() if p.generation == generation]
            for pending in dead:
                self._pending.pop(pending.id, None)
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited {code}"
        why = f" after {problem}" if problem else ""
        for pending in dead:
            pending.inbox.put(
                DriverProcessDied(
                    f"{pending.what}: the driver process {shown(self.argv)} (pid {process.pid}) "
                    f"{how}{why} while it was in flight; the next request starts it again"
                )
            )

    def _record(self, to: str, message: Any) -> None:
        if self._trace:
            line = (json.dumps({"to": to, "message": message}) + "\n").encode()
            with self._trace_lock:  # one write of O_APPEND: other processes' lines stay whole
                fd = os.open(self._trace, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
