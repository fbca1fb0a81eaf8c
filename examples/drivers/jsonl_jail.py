"""An example driver of the jsonl protocol (docs/external-protocol.md): jail.py's jails, in Python.

One long-lived process, run by the adapter from jsonl-jail.yaml, reads one request per line
on stdin and writes one reply or event per line on stdout. Each request is handled in a
thread of its own; creates go through jail.py's JailDriver (the request model's checks, the
host-wide lease registry, bubblewrap), and the suite's typed errors go back as the
protocol's (``drivers.external.protocol.error_of``). Its jails die with it (bwrap's
--die-with-parent): a crash leaves no sandbox running, and their leases come back.

``JSONL_JAIL_BREAK`` plants a fault, for the suite's own tests: ``exit-codes`` (every
non-zero exit code reported as 1), ``merged-streams`` (stderr sent as stdout),
``crash-on-third-create`` (the first driver process of a host dies at its third create),
``forget-on-restart`` (list and reap answer from this process's memory: a driver process
started later, or another process's, knows none of the sandboxes made before it).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jail import HOST_ENV, Jail, JailDriver

from drivers import seccomp
from drivers.contract import CommandTimedOut, DriverCapabilities
from drivers.external.protocol import PROTOCOL_VERSION, error_of
from gpuhost.errors import SandboxExecError
from gpuhost.host import GpuHost, HostConfig
from gpuhost.procfs import EXEC_MARKER_ENV, kill_marked
from gpuhost.spec import parse_spec

NAME = "jsonl-jail"
VERSION = "1.0"
CAPABILITIES = {
    "maxGpusPerSandbox": "all", "exactIds": True, "idForms": ["index", "uuid", "cdi", "pci"],
    "exclusive": True, "shared": True, "mig": True, "vendors": ["nvidia", "amd", "intel"],
}  # fmt: skip
"""What jsonl-jail.yaml declares: the adapter checks that hello says the same."""
BREAK = os.environ.get("JSONL_JAIL_BREAK", "")
CHUNK = 64 * 1024


class Unavailable(Exception):
    """The sandbox is not there, or not running."""


class Cancelled(Exception):
    """The adapter cancelled the request."""


class JsonlJail(JailDriver):
    name = NAME  # the leases' driver, and the request's block: template.driver_config.jsonl-jail

    @property
    def capabilities(self) -> DriverCapabilities:
        # The manifest's idForms (index, uuid, cdi, pci): a whole GPU's PCI address too.
        forms = ("index", "uuid", "cdi", "pci")  # exact_id_forms="": the words say them anew
        return dataclasses.replace(super().capabilities, id_forms=forms, exact_id_forms="")


class Server:
    def __init__(self) -> None:
        self.host: GpuHost | None = None
        self.jails: dict[str, tuple[str, Jail]] = {}  # sandbox id: (session, jail)
        self.running: dict[int, tuple[subprocess.Popen[bytes], bytes]] = {}  # exec id: its nsenter
        self.cancelled: set[int] = set()
        self.creates = 0
        self.lock = threading.Lock()
        self.out = threading.Lock()

    def send(self, message: Mapping[str, Any]) -> None:
        line = json.dumps(message, default=_plain, separators=(",", ":")).encode() + b"\n"
        with self.out:
            sys.stdout.buffer.write(line)
            sys.stdout.buffer.flush()

    def serve(self) -> None:
        for line in sys.stdin.buffer:
            request = json.loads(line)
            threading.Thread(target=self.handle, args=(request,), daemon=True).start()
        os._exit(0)  # the adapter is gone: so are its jails (--die-with-parent)

    def handle(self, request: dict[str, Any]) -> None:
        ident, op = request["id"], request["op"]
        handler = getattr(self, f"op_{op}", None)
        try:
            if handler is None:
                raise LookupError(f"no operation {op!r}")
            result = handler(request)
        except Cancelled:
            error = {"type": "cancelled", "message": "cancelled by the adapter"}
        except CommandTimedOut:
            error = {"type": "timeout", "message": f"ran past {request['timeout']} s; killed"}
        except Unavailable as exc:
            error = {"type": "unavailable", "message": str(exc)}
        except LookupError as exc:
            error = {"type": "unsupported", "message": str(exc), "field": "op", "value": op}
        except Exception as exc:  # every failure is answered: the suite's typed errors, or infra
            error = error_of(exc)
        else:
            self.send({"id": ident, "op": op, "result": result})
            if op == "shutdown":
                os._exit(0)
            return
        self.send({"id": ident, "op": op, "error": error})

    def driver(self, session: str) -> JsonlJail:
        assert self.host is not None, "hello comes first"
        return JsonlJail(self.host, session)

    def op_hello(self, request: dict[str, Any]) -> dict[str, Any]:
        host = request["host"]
        sim_root = Path(host["sim_root"]) if host.get("sim_root") else None
        state_dir = Path(host["state_dir"]) if host.get("state_dir") else None
        self.host = GpuHost.open(HostConfig(sim_root, state_dir, host["share_limit"]))
        version = f"{VERSION} ({self.driver('hello').version()})"
        driver = {"name": NAME, "version": version}
        return {"protocol": PROTOCOL_VERSION, "driver": driver, "capabilities": CAPABILITIES}

    def op_create(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.creates += 1
            crash = BREAK == "crash-on-third-create" and self.creates == 3 and self._first()
        if crash:
            os.kill(os.getpid(), signal.SIGKILL)
        session = request["session_id"]
        jail = self.driver(session).create(parse_spec(request["request"]))
        with self.lock:
            self.jails[jail.id] = (session, jail)
            cancelled = request["id"] in self.cancelled
        if cancelled:
            self.op_close({"sandbox_id": jail.id, "kill": False})
            raise Cancelled
        return {"sandbox_id": jail.id, "gpus": [gpu.uuid for gpu in jail.gpus]}

    def _first(self) -> bool:
        """Whether no driver process of this host has crashed yet (the breaker crashes once)."""
        assert self.host is not None
        mark = self.host.config.state_directory() / "jsonl-jail-crashed"
        with contextlib.suppress(FileExistsError):
            mark.touch(exist_ok=False)
            return True
        return False

    def op_exec(self, request: dict[str, Any]) -> dict[str, Any]:
        ident, sandbox_id = request["id"], request["sandbox_id"]
        _, jail = self.jails.get(sandbox_id, ("", None))
        if jail is None or jail.closed or not jail.running():
            raise Unavailable(f"sandbox {sandbox_id} is not running")
        # As jail.py's Jail.run: into the jail's namespaces, as its user, its environment, under
        # the system call filter from nsenter's first instruction.
        env = [f"{key}={value}" for key, value in {**jail.env, **request["env"]}.items()]
        enter = ["nsenter", f"--target={jail.init}", "--all", "--root", "--wd"]
        merged = BREAK == "merged-streams"
        seccomp.prepare()
        try:
            process = subprocess.Popen(
                [*enter, *jail.drop, "env", "-i", *env, *request["argv"]],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if merged else subprocess.PIPE, env=HOST_ENV,
                start_new_session=True, preexec_fn=seccomp.load_in_child,
            )  # fmt: skip
        except OSError as exc:
            raise SandboxExecError(f"cannot run {request['argv']}: {exc}") from exc
        needle = f"{EXEC_MARKER_ENV}={request['env'].get(EXEC_MARKER_ENV, '-')}".encode()
        with self.lock:
            self.running[ident] = (process, needle)
        self.send({"id": ident, "event": "started", "pid": process.pid})
        try:
            timed_out = not self._stream(ident, process, request["timeout"])
        finally:
            with self.lock:
                self.running.pop(ident, None)
        if timed_out:
            self._kill(process, needle)
            raise CommandTimedOut
        code = process.wait()
        if ident in self.cancelled:
            raise Cancelled
        if code != 0 and not jail.running():
            raise Unavailable(f"sandbox {sandbox_id} ended while {request['argv']} ran")
        if BREAK == "exit-codes" and code != 0:
            code = 1
        return {"exit_code": code} if code >= 0 else {"signal": -code}

    def _stream(self, ident: int, process: subprocess.Popen[bytes], timeout: float) -> bool:
        """Send its output as it comes, until both streams end; False at ``timeout``."""
        streams = {p.fileno(): name for p, name in ((process.stdout, "stdout"),
                   (process.stderr, "stderr")) if p is not None}  # fmt: skip
        deadline = time.monotonic() + timeout
        while streams:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for fd in select.select(list(streams), [], [], left)[0]:
                data = os.read(fd, CHUNK)
                if not data:
                    del streams[fd]
                    continue
                text = base64.b64encode(data).decode()
                self.send({"id": ident, "event": "output", "stream": streams[fd], "data": text})
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(max(0.0, deadline - time.monotonic()))
        return process.poll() is not None

    def _kill(self, process: subprocess.Popen[bytes], needle: bytes) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        kill_marked(needle)  # what left nsenter's process group (setsid), inside the jail too
        process.wait()

    def op_cancel(self, request: dict[str, Any]) -> dict[str, Any]:
        target = request["target"]
        with self.lock:
            self.cancelled.add(target)
            running = self.running.get(target)
        if running is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(running[0].pid, signal.SIGKILL)
            kill_marked(running[1])
        return {}

    def op_close(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            _, jail = self.jails.get(request["sandbox_id"], ("", None))
            if jail is not None and not request["kill"]:
                del self.jails[request["sandbox_id"]]
        if jail is None:
            return {}  # gone already: closing twice is harmless
        if request["kill"]:
            jail.kill()  # as a crash would: its leases come back when its pid 1 is seen dead
        else:
            jail.close()
        return {}

    def op_inventory(self, request: dict[str, Any]) -> dict[str, Any]:
        driver = self.driver("inventory")
        gpus = [
            {"uuid": gpu.uuid, "ids": list(driver.device_ids(gpu))} for gpu in driver.inventory()
        ]
        return {"gpus": gpus}

    def op_list(self, request: dict[str, Any]) -> dict[str, Any]:
        if BREAK == "forget-on-restart":
            return {"sandbox_ids": sorted(self._remembered(request["session_id"]))}
        return {"sandbox_ids": self.driver(request["session_id"]).sandboxes(request["session_id"])}

    def op_reap(self, request: dict[str, Any]) -> dict[str, Any]:
        session = request["session_id"]
        if BREAK == "forget-on-restart":
            removed = self._remembered(session)
            for sandbox_id in removed:
                self.op_close({"sandbox_id": sandbox_id, "kill": False})
            return {"removed": removed}
        removed = self.driver(session).reap(session)
        with self.lock:
            gone = [sid for sid, (owner, _) in self.jails.items() if owner == session]
            jails = [self.jails.pop(sid)[1] for sid in gone]
        for jail in jails:
            jail.bwrap.wait()  # reaped: killed already, its pid 1 too (reap waits for it)
            jail.user.release()
        return {"removed": removed}

    def _remembered(self, session: str) -> list[str]:
        with self.lock:
            return [sid for sid, (owner, _) in self.jails.items() if owner == session]

    def op_shutdown(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            jails = [jail for _, jail in self.jails.values()]
            self.jails.clear()
        for jail in jails:
            with contextlib.suppress(Exception):
                jail.close()
        return {}


def _plain(value: object) -> object:
    """A value of an error (the request's own, frozen) as JSON has it."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    return repr(value)


if __name__ == "__main__":
    Server().serve()
