"""One long-lived driver process of a ``jsonl`` manifest, and the requests in flight to it.

A ``Connection`` starts the process on its first request (``hello`` first, its answer checked),
writes one request per line to its stdin and hands each line of its stdout to the request of
that id, from a reader thread, so that any number of threads have requests in flight at once.
Every message read is held to the protocol's schema, and must answer its request's op. An
exec's output events go, decoded, straight to its sink as they are read: nothing of them
queues. A message that breaks the protocol fails its request alone (``ProtocolError``, naming
the field and the value), and what comes later of that request is dropped.

The process itself is watched (a pidfd), not only its stdout: when it dies, every request in
flight fails at once naming it, even while something it started still holds the pipe, and
nothing it started outlives it: its process group, every process carrying its marker
(``DRIVER_MARKER_ENV``, which everything it starts inherits, setsid or not) and every other
process holding its end of its stdin or stdout is killed. The next request starts a new
process (a new ``generation``).

``GPU_SANDBOX_JSONL_TRACE=PATH`` appends every message, both ways, to PATH as JSON lines
(``{"to": "driver"|"adapter", "message": ...}``): the self-tests validate them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drivers.external.jsonl_process import DriverProcess
from drivers.external.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    answer_error,
    output_data,
    validator,
)
from gpuhost.errors import DriverError, shown

TRACE_ENV = "GPU_SANDBOX_JSONL_TRACE"
CANCEL_GRACE_S = 2.0
"""How long a cancelled request has to be answered before the adapter ends what runs it."""
Sink = Callable[[str, bytes], None]
"""Where an exec's output goes as it is read: the stream ("stdout", "stderr"), the bytes."""


class DriverProcessDied(DriverError):
    """The driver process exited (or was killed) while this request was in flight."""


@dataclass
class Pending:
    """A request in flight: its reply, or what failed it, arrives on ``inbox``.

    An exec's events do not: its output goes to ``sink`` and its ``started`` pid to ``pid``,
    from the reader thread, as they are read.
    """

    id: int
    what: str
    generation: int
    op: str
    sink: Sink | None = None
    pid: int | None = None
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
        self._sessions: dict[int, set[str]] = {}
        """The sessions each generation made sandboxes in: reaped once it has died."""
        self._driver: DriverProcess | None = None
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

    @property
    def pid(self) -> int | None:
        """The driver process's pid, once one was started."""
        return None if self._driver is None else self._driver.popen.pid

    def alive(self, generation: int | None = None) -> bool:
        """Whether the process runs (and is still ``generation``, when given)."""
        driver = self._driver
        running = driver is not None and driver.popen.poll() is None
        return running and (generation is None or generation == self.generation)

    def ensure(self) -> int:
        """The running process's generation; a new process (and its hello) when none runs."""
        with self._lock:
            if self.alive():
                return self.generation
            dead = self._sessions.pop(self.generation, set())
            self._start()
        if dead and self.on_restart is not None:
            self.on_restart(dead)  # the dead process's sandboxes: reaped through the new one
        return self.generation

    def made_in(self, session_id: str) -> None:
        """The running process made a sandbox in ``session_id``: reaped once it has died."""
        self._sessions.setdefault(self.generation, set()).add(session_id)

    def _start(self) -> None:
        try:
            driver = DriverProcess.start(self.argv, self.cwd, self.env)
        except OSError as exc:
            raise DriverError(f"cannot start the driver process {shown(self.argv)}: {exc}") from exc
        # Before anything may reap it: the pidfd says when the process itself has ended.
        pidfd = os.pidfd_open(driver.popen.pid)
        self._driver = driver
        self.generation += 1
        self._sessions[self.generation] = set()
        reader = threading.Thread(
            target=self._read, args=(driver, self.generation, pidfd), daemon=True,
            name=f"jsonl-reader-{driver.popen.pid}",
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
        """SIGTERM the driver process's group, then SIGKILL it and all that is left of it.

        What was in flight fails.
        """
        if self._driver is not None:
            self._driver.end()

    def shutdown(self, timeout: float) -> None:
        """Ask the process to end (``shutdown``), then end it anyway."""
        if self.alive():
            with contextlib.suppress(DriverError):
                self.call({"op": "shutdown"}, timeout, "shutdown")
            assert self._driver is not None
            process = self._driver.popen
            if process.stdin is not None:
                with contextlib.suppress(OSError):
                    process.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
        self.terminate()

    # -- requests -------------------------------------------------------------------------

    def send(
        self, request: dict[str, Any], what: str, generation: int | None = None,
        sink: Sink | None = None,
    ) -> Pending:  # fmt: skip
        """Write ``request`` with an id of its own; its answers come to the returned ``Pending``.

        An exec's output goes to ``sink``, from the reader thread.
        """
        with self._pending_lock:
            current = self.generation
            if generation is not None and generation != current:
                raise DriverProcessDied(f"{what}: the driver process it was made by has died")
            process = None if self._driver is None else self._driver.popen
            ident = self._next_id
            self._next_id += 1
            pending = Pending(ident, what, current, request["op"], sink)
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
        """Its reply, None at ``timeout``; raises what failed the request."""
        return self.next(pending, time.monotonic() + timeout)

    def next(self, pending: Pending, deadline: float) -> dict[str, Any] | None:
        """Its reply by ``deadline`` (None then); raises what failed the request."""
        try:
            item = pending.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self, pending: Pending, grace: float) -> dict[str, Any] | None:
        """Send ``cancel`` for it; its reply (a result or an error) within ``grace``, else None."""
        with contextlib.suppress(DriverError):
            self.send({"op": "cancel", "target": pending.id}, f"cancel of {pending.what}")
        try:
            message = self.wait(pending, grace)
        except DriverProcessDied:
            return None
        if message is None:
            self.forget(pending)
        return message

    def forget(self, pending: Pending) -> None:
        with self._pending_lock:
            self._pending.pop(pending.id, None)

    # -- the reader -------------------------------------------------------------------------

    def _read(self, driver: DriverProcess, generation: int, pidfd: int) -> None:
        problem = ""
        try:
            for line in driver.lines(pidfd):
                problem = self._take(line)
                if problem:
                    break
        except ProtocolError as exc:  # a line past MAX_LINE
            problem = str(exc)
        finally:
            os.close(pidfd)
        # Dead, or its stdout ended, or it broke the protocol: it can answer nothing more.
        code = driver.stop(term=driver.popen.poll() is None)
        self._fail_in_flight(generation, driver.popen, code, problem)
        driver.clear()
        for pipe in (driver.popen.stdin, driver.popen.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # a write may be failing on it meanwhile
                    pipe.close()

    def _take(self, raw: bytes) -> str:
        """Hand one line to its request; what breaks the protocol for them all, else ""."""
        try:
            message = json.loads(raw)
        except (ValueError, RecursionError):
            return f"a line that is not JSON: {shown(raw)}"
        self._record("adapter", message)
        ident = message.get("id") if isinstance(message, dict) else None
        if type(ident) is not int:
            ident = 0  # no request's: ids start at 1
        with self._pending_lock:
            pending = self._pending.get(ident)
            issued = 0 < ident < self._next_id
        if pending is None:
            if issued:
                return ""  # a request the adapter gave up on (cancelled, timed out, failed)
            errors = sorted(self._validator.iter_errors(message), key=str)
            if errors:  # answering nothing the adapter asked: the driver is broken
                return (
                    f"a message outside the protocol ({errors[0].message}): {shown(message, 200)}"
                )
            return ""
        try:
            if message.get("event") == "output" and pending.op == "exec":
                stream, data = output_data(message)
                if pending.sink is not None:
                    pending.sink(stream, data)
                return ""
            error = answer_error(message, pending.op)
            if error is not None:
                raise error
        except ProtocolError as exc:
            fault = ProtocolError(
                f"{pending.what}: the driver's message {ident} breaks the protocol: {exc}; "
                "the request fails, and what more comes of it is dropped",
                exc.field,
                exc.value,
            )
            self._answer(pending, fault)
            return ""
        except OSError as exc:  # the caller's descriptor (exec_stream) refused it
            self._answer(pending, DriverError(f"{pending.what}: cannot pass its output on: {exc}"))
            return ""
        if message.get("event") == "started":
            pending.pid = message["pid"]
        else:
            self._answer(pending, message)
        return ""

    def _answer(self, pending: Pending, answer: dict[str, Any] | BaseException) -> None:
        """The request's last word: nothing of it is read after this."""
        self.forget(pending)
        pending.inbox.put(answer)

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
