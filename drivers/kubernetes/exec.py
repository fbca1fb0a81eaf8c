"""Commands run in a pod through the API server's exec stream (the client's ``stream``).

Stdout and stderr are handed on in parts as the stream brings them, never gathered here; the
exit code comes at the stream's end. Each command carries a marker in its environment,
which everything it starts inherits; the API has no call to stop an exec, so at the
command's timeout every process of the pod that carries the marker is killed from a second
exec. ``kill -9 -1`` from inside ends every process of a pod, its first one too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from drivers.base import Command, CommandTimedOut
from drivers.kubernetes.api import said
from gpuhost.errors import SandboxExecError
from gpuhost.procfs import EXEC_MARKER_ENV

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

# Kills, inside the pod, every process that carries an exec's marker (``$1``), until none
# is left: the API has no call to stop an exec, and what it started may have left its
# process group. Busybox and coreutils images alike have tr, grep and kill. It looks again
# 2 ms after its first kills (those processes are usually gone by then), then every 50 ms:
# a kill at an exec's timeout is timed.
KILL_MARKED_SCRIPT = (
    "n=0; pause=0.002; while :; do found=; for p in /proc/[0-9]*; do "
    'tr "\\0" "\\n" < "$p/environ" 2>/dev/null | grep -qxF "$1" && '
    '{ kill -9 "${p#/proc/}" 2>/dev/null; found=1; }; done; '
    '[ -z "$found" ] && exit 0; n=$((n+1)); [ "$n" -ge 100 ] && exit 1; sleep $pause; '
    "pause=0.05; done"
)


@dataclass(frozen=True)
class PodExec:
    """Commands run in the pods of one namespace, each exec on an API client of its own."""

    new_client: Callable[[], ApiClient]
    namespace: str

    def run(
        self,
        pod_name: str,
        command: Command,
        on_stdout: Callable[[bytes], None],
        on_stderr: Callable[[bytes], None],
    ) -> int:
        """Run ``command`` in the pod through the API's exec stream; its exit code.

        At its timeout every process it started (those carrying its marker) is killed from a
        second exec, and ``CommandTimedOut`` raised.
        """
        argv = command.argv
        # The marker set by the image's shell, which reports a missing program as "not found".
        marker = f'{EXEC_MARKER_ENV}={command.marker}; export {EXEC_MARKER_ENV}; exec "$@"'
        wrapped = ["sh", "-c", marker, "sh", *argv]
        socket = self._open(pod_name, wrapped, argv)
        deadline = time.monotonic() + command.timeout
        try:
            while socket.is_open():
                left = deadline - time.monotonic()
                if left <= 0:
                    self._kill_marked(pod_name, command.needle.decode())
                    raise CommandTimedOut
                socket.update(timeout=min(left, 1.0))
                _drain(socket, on_stdout, on_stderr)
            _drain(socket, on_stdout, on_stderr)
            returncode = exit_status(_text(socket.read_channel(3)))
        finally:
            socket.close()
        if returncode is None:
            raise SandboxExecError(
                f"the exec stream of {list(argv)!r} in pod {self.namespace}/{pod_name} ended "
                "without an exit status"
            )
        return returncode

    def kill_all(self, pod_name: str) -> None:
        """SIGKILL every process in the pod but its first, which then ends as its child did.

        What is left is a pod whose processes are all gone, Failed once the kubelet sees it.
        """
        kill = Command.of(["sh", "-c", "kill -9 -1"], 30.0)
        with contextlib.suppress(SandboxExecError, CommandTimedOut):  # an ended pod has none
            self.run(pod_name, kill, ignore, ignore)

    def _open(self, pod_name: str, command: Sequence[str], argv: Sequence[str]) -> Any:
        from kubernetes import client
        from kubernetes.stream import stream

        # ``stream`` swaps its API client's transport while it opens: one client per exec.
        core = client.CoreV1Api(self.new_client())
        try:
            return stream(
                core.connect_get_namespaced_pod_exec,
                pod_name,
                self.namespace,
                container="sandbox",
                command=list(command),
                stdin=False,
                stdout=True,
                stderr=True,
                tty=False,
                binary=True,
                _preload_content=False,
            )
        except Exception as exc:  # the API's refusal, and websocket errors of every kind
            raise SandboxExecError(
                f"cannot run {list(argv)!r} in pod {self.namespace}/{pod_name}: {said(exc)}"
            ) from exc

    def _kill_marked(self, pod_name: str, needle: str) -> None:
        socket = self._open(pod_name, ["sh", "-c", KILL_MARKED_SCRIPT, "sh", needle], ["kill"])
        try:
            socket.run_forever(timeout=15)
        finally:
            socket.close()


def _text(data: bytes | str) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _drain(
    socket: Any, on_stdout: Callable[[bytes], None], on_stderr: Callable[[bytes], None]
) -> None:
    if data := socket.read_channel(1):
        on_stdout(data)
    if data := socket.read_channel(2):
        on_stderr(data)


def exit_status(error_channel: str) -> int | None:
    """The exit code the API's exec stream reports on its error channel; None if none."""
    if not error_channel.strip():
        return None
    status = yaml.safe_load(error_channel)
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause["message"])
    raise SandboxExecError(f"the API server could not run the command: {status.get('message')}")


def ignore(_: bytes) -> None:
    """An exec's output that nobody reads."""
