"""The stand-in gateway's sandboxes: reference-driver sandboxes, their main process, their execs.

A record is what the gateway knows of one sandbox: its name, labels and phase, and the
reference driver's running sandbox behind it. Its main process runs inside the sandbox from
the start; once it exits the sandbox is in phase Error and refuses exec, as OpenShell's
gateway has it since v0.0.111 (server/compute/mod.rs:3318-3338). An exec runs its command
line through ``/bin/bash -lc`` in the sandbox (supervisor/ssh.rs:1237-1243), its output
streamed as it comes.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from drivers.base import Command, CommandTimedOut, Output, Sandbox
from drivers.reference import ReferenceDriver
from gpuhost.errors import GpuAllocationError, RequestError, SandboxExecError
from gpuhost.procfs import kill_marked
from gpuhost.spec import parse_spec
from openshell_standin.rules import SIGNALLED_EXIT_CODE, TIMEOUT_EXIT_CODE, Refused

LONGEST_RUN_S = 30 * 24 * 3600.0
"""A main process, and an exec with no timeout (0), run at most this long: 30 days."""
POST_EXIT_CLOSE_S = 0.5
"""How long output is still read once the command has exited: what its children left
(server/grpc/sandbox.rs:1882, EXEC_POST_EXIT_CLOSE_TIMEOUT)."""
READ_CHUNK = 64 * 1024
PROVISIONING, READY, ERROR = "provisioning", "ready", "error"


@dataclass
class Record:
    """One sandbox as the gateway knows it."""

    id: str
    name: str
    labels: dict[str, str]
    created_ms: int
    spec: object
    """The request's ``SandboxSpec`` message, as the gateway keeps it."""
    sandbox: Sandbox
    phase: str = READY
    exit_code: int | None = None
    version: int = 0
    deleted: bool = False
    main: threading.Thread | None = field(default=None, repr=False)


@dataclass(frozen=True)
class Request:
    """A create, once the gateway's rules have passed: what the sandbox is made of."""

    name: str
    labels: Mapping[str, str]
    command: tuple[str, ...]
    env: Mapping[str, str]
    gpu: bool
    count: int | None
    device_ids: tuple[str, ...]
    spec: object


class Sandboxes:
    """Every sandbox of one stand-in gateway, made by the reference driver, by id and name."""

    def __init__(self, driver: ReferenceDriver) -> None:
        self.driver = driver
        self._records: dict[str, Record] = {}
        self._names: set[str] = set()
        self._changed = threading.Condition()

    # -- create, delete, look up ---------------------------------------------------------

    def create(self, request: Request) -> Record:
        """A running sandbox for ``request``, or ``Refused`` saying why not."""
        with self._changed:
            # server/compute/mod.rs:917-937: a second sandbox of one name is refused.
            if request.name in self._names:
                raise Refused("ALREADY_EXISTS", f"sandbox '{request.name}' already exists")
            self._names.add(request.name)
        try:
            sandbox = self._start(request)
        except BaseException:
            with self._changed:
                self._names.discard(request.name)
            raise
        record = Record(
            id=str(uuid.uuid4()),
            name=request.name,
            labels=dict(request.labels),
            created_ms=int(time.time() * 1000),
            spec=request.spec,
            sandbox=sandbox,
        )
        with self._changed:
            self._records[record.id] = record
        record.main = threading.Thread(
            target=self._run_main, args=(record, request.command), daemon=True
        )
        record.main.start()
        return record

    def _start(self, request: Request) -> Sandbox:
        """The reference driver's sandbox: its GPUs through the host registry."""
        template: dict[str, object] = {"env": dict(request.env)}
        count = request.count
        if request.device_ids:
            ids = self.cdi_devices(request.device_ids)
            template["driver_config"] = {self.driver.name: {"gpu_device_ids": list(ids)}}
            count = len(ids)  # one `<kind>=all` names every GPU
        data: dict[str, object] = {"template": template}
        if request.gpu:
            data["resource_requirements"] = {"gpu": {} if count is None else {"count": count}}
        try:
            return self.driver.create(parse_spec(data))
        except RequestError as exc:
            raise Refused("INVALID_ARGUMENT", str(exc)) from exc
        except GpuAllocationError as exc:
            # docker/lib.rs:2486-2488: a selection the GPUs cannot serve is a precondition.
            raise Refused("FAILED_PRECONDITION", str(exc)) from exc
        except Exception as exc:
            # server/compute/mod.rs:986-995: any other failure of the compute driver.
            raise Refused("INTERNAL", f"create sandbox failed: {exc}") from exc

    def cdi_devices(self, device_ids: Sequence[str]) -> tuple[str, ...]:
        """The CDI names docker or podman would resolve, as this host's CDI spec has them.

        Opaque to OpenShell (docker/lib.rs:650-657), resolved by the engine, which refuses a
        name its CDI registry does not know when it creates the container; ``<kind>=all``
        is every GPU of the kind (gpuhost.simulated's spec, nvidia-ctk's).
        """
        devices = self.driver.exact_devices()
        known = {name for gpu in devices for name in gpu.cdi_names}
        every: dict[str, list[str]] = {}
        for gpu in self.driver.host.gpus:  # the spec's `all`: every whole GPU
            every.setdefault(gpu.cdi_kind, []).append(gpu.cdi_names[0])
        out: list[str] = []
        for device in device_ids:
            kind, _, name = device.partition("=")
            if name == "all" and every.get(kind):
                out.extend(every[kind])
            elif device in known:
                out.append(device)
            else:
                raise Refused(
                    "FAILED_PRECONDITION",
                    f"ContainerCreateFailed: unresolvable CDI devices {device}",
                )
        return tuple(out)

    def login_path(self) -> str:
        """What the stand-in puts before an exec's command line: the host's GPU tools on PATH.

        ``bash -l`` reads /etc/profile, which sets PATH afresh. A container's CDI spec puts
        nvidia-smi in /usr/bin (gpuhost.simulated's as nvidia-ctk's); a reference sandbox of
        a simulated host has it in the host's tool path, put back first here once the login
        profile has run. Nothing on a real host, whose tools are in /usr/bin.
        """
        tools = self.driver.host.tool_path
        return f'PATH={":".join(tools)}:"$PATH"; ' if tools else ""

    def delete(self, name: str) -> Record:
        """Close the sandbox named ``name`` (its GPUs come back) and forget it."""
        record = self.by_name(name)
        record.sandbox.close()
        with self._changed:
            record.deleted = True
            self._records.pop(record.id, None)
            self._names.discard(record.name)
            self._bump(record)
        return record

    def close(self) -> None:
        """Close every sandbox: the gateway is going away."""
        for record in self.listed():
            with contextlib.suppress(Exception):
                self.delete(record.name)

    def by_name(self, name: str) -> Record:
        with self._changed:
            for record in self._records.values():
                if record.name == name:
                    return record
        raise Refused("NOT_FOUND", "sandbox not found")

    def by_id(self, sandbox_id: str) -> Record:
        with self._changed:
            record = self._records.get(sandbox_id)
        if record is None:
            raise Refused("NOT_FOUND", "sandbox not found")
        return record

    def listed(self) -> list[Record]:
        """Every sandbox, oldest first, then by name (server/persistence/postgres.rs:464)."""
        with self._changed:
            records = list(self._records.values())
        return sorted(records, key=lambda r: (r.created_ms, r.name))

    # -- phases ------------------------------------------------------------------------

    def _bump(self, record: Record) -> None:
        record.version += 1
        self._changed.notify_all()

    def snapshots(self, record: Record, alive: Callable[[], bool]) -> Iterator[int]:
        """Yield each version of ``record`` from now on, while ``alive()`` and it exists."""
        seen = -1
        while alive():
            with self._changed:
                if record.version == seen:
                    self._changed.wait(timeout=0.2)
                    continue
                seen = record.version
                gone = record.deleted
            yield seen
            if gone:
                return

    def _run_main(self, record: Record, command: Sequence[str]) -> None:
        """The canonical main process: when it exits, the sandbox goes to phase Error."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            code = record.sandbox.exec_stream(command, devnull, devnull, LONGEST_RUN_S)
        except SandboxExecError:
            code = 127  # it could not be started, or the sandbox went away
        finally:
            os.close(devnull)
        with self._changed:
            if record.deleted:
                return
            record.phase = ERROR
            # openshell.proto SandboxStatus.exit_code: a signal exit is 128 + its number.
            record.exit_code = 128 - code if code < 0 else code
            self._bump(record)

    # -- exec --------------------------------------------------------------------------

    def exec(
        self, record: Record, argv: Sequence[str], timeout_s: int, alive: Callable[[], bool]
    ) -> Iterator[tuple[str, bytes | int]]:
        """Run ``argv`` in the sandbox; yield ("stdout"|"stderr", data) then ("exit", code).

        ``timeout_s`` 0 is no timeout; past it the command is killed and the exit is 124.
        When the caller goes away (``alive()`` false) the command is killed.
        """
        if record.phase != READY or record.deleted:
            raise Refused("FAILED_PRECONDITION", "sandbox is not ready")  # sandbox.rs:1195-1197
        try:
            command = Command.of(argv, float(timeout_s) if timeout_s else LONGEST_RUN_S)
        except SandboxExecError as exc:
            raise Refused("INVALID_ARGUMENT", f"command construction failed: {exc}") from exc
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        result: dict[str, int | BaseException] = {}
        done = threading.Event()

        def run() -> None:
            try:
                result["code"] = record.sandbox.run(command, Output(out_write, err_write))
            except CommandTimedOut:
                result["code"] = TIMEOUT_EXIT_CODE
            except BaseException as exc:
                result["error"] = exc
            finally:
                os.close(out_write)
                os.close(err_write)
                done.set()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        try:
            yield from _stream({out_read: "stdout", err_read: "stderr"}, done, alive)
            while not done.wait(0.2) and alive():
                pass  # it closed its output and runs on
        finally:
            if not done.is_set():
                kill_marked(command.needle)  # the caller went away: so does the command
            worker.join()
            os.close(out_read)
            os.close(err_read)
        error = result.get("error")
        code = result.get("code")
        if error is not None or not isinstance(code, int):
            # server/grpc/sandbox.rs:1895-1903: no exit status is a relay failure.
            raise Refused(
                "UNAVAILABLE",
                f"exec relay closed before the command reported an exit status: {error}",
            )
        if code < 0:
            code = SIGNALLED_EXIT_CODE
        yield "exit", code


def _stream(
    streams: dict[int, str], done: threading.Event, alive: Callable[[], bool]
) -> Iterator[tuple[str, bytes | int]]:
    """Each chunk of the open ``streams`` as it comes, until both end.

    Or until the command exited ``POST_EXIT_CLOSE_S`` ago: what it left running may hold them.
    """
    open_fds = dict(streams)
    exited_at: float | None = None
    while open_fds and alive():
        if exited_at is None and done.is_set():
            exited_at = time.monotonic()
        if exited_at is not None and time.monotonic() - exited_at > POST_EXIT_CLOSE_S:
            return
        ready, _, _ = select.select(list(open_fds), [], [], 0.1)
        for fd in ready:
            data = os.read(fd, READ_CHUNK)
            if data:
                yield open_fds[fd], data
            else:
                del open_fds[fd]
