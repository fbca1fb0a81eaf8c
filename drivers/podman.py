"""The podman driver: containers of podman's REST service, GPUs injected as CDI devices.

Host needs: podman 4.1 or newer (Debian 12's 4.3 works with runc), its REST service
(``podman system service``), a CDI spec naming each GPU in /etc/cdi or /var/run/cdi
(podman 4.3 reads cdiVersion 0.3.0 to 0.5.0 only), and podman-py (PyPI ``podman``). The
service is found as the podman CLI finds it: ``$CONTAINER_HOST``, else the rootful socket.

GPUs are injected as CDI names in ``devices``; podman 4.3 accepts ``--gpus`` and ignores it.

podman-py is imported only once the service is used.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

from drivers.container import (
    API_TIMEOUT_S,
    EXEC_API_TIMEOUT_S,
    KEEPALIVE_PATH,
    LIVENESS_TIMEOUT_S,
    SANDBOX_LABEL,
    SESSION_LABEL,
    STOP_TIMEOUT_S,
    ContainerDriver,
    ContainerRequest,
    EngineError,
    client_cache,
)
from gpuhost import cdi
from gpuhost.wait import wait_until

if TYPE_CHECKING:
    import podman


class PodmanDriver(ContainerDriver):
    name = "podman"
    client_package = "podman"
    holder_kind = "podman"
    url_env = "CONTAINER_HOST"
    default_url = "unix:///run/podman/podman.sock"
    cli = "podman"
    cli_url_flag = "url"
    security: ClassVar[Mapping[str, object]] = MappingProxyType({"no_new_privileges": True})
    """No command gains privileges. podman-py's own keyword: it passes ``security_opt`` on
    as SELinux options, where ``no-new-privileges`` would be dropped unseen."""

    @classmethod
    def engine_errors(cls) -> tuple[type[Exception], ...]:
        import podman.errors
        import requests

        return (podman.errors.PodmanError, requests.RequestException)

    @property
    def client(self) -> podman.PodmanClient:
        return _client(self.url, API_TIMEOUT_S)

    def ping(self) -> None:
        if not self.client.ping():
            raise EngineError("the service did not answer its ping")

    def version(self) -> str:
        version = self.client.version()  # type: ignore[no-untyped-call]
        return f"podman {version['Version']}"

    def cdi_spec_dirs(self) -> tuple[Path, ...]:
        return cdi.DEFAULT_SPEC_DIRS

    def has_image(self, image: str) -> bool:
        return bool(self.client.images.exists(image))

    def create_container(self, request: ContainerRequest) -> str:
        container = self.client.containers.create(
            request.image,
            list(request.command),
            name=request.name,
            labels=dict(request.labels),
            environment=dict(request.env),
            # Podman forwards the proxy variables of its service's environment (http_proxy,
            # https_proxy, ftp_proxy, no_proxy, both cases), credentials and all, unless told
            # not to: the CLI by default, the API as its version and containers.conf decide.
            use_config_proxy=False,
            init=True,  # reaps what timed-out execs leave behind
            network_mode="none",
            cap_drop=["ALL"],
            **self.security,
            devices=[
                *request.cdi_devices,
                *(f"{node.source}:{node.path}:rwm" for node in request.device_nodes),
            ],
            mounts=[
                {"type": "bind", "source": source, "target": target, "read_only": True}
                for source, target in [
                    (str(request.keepalive), KEEPALIVE_PATH),
                    *request.tool_mounts,
                ]
            ],
            stop_timeout=0,  # else a forced removal waits 10 s
            auto_remove=True,
        )
        return str(container.id)

    def start_created(self, container_id: str) -> int:
        container = self.client.containers.get(container_id)
        container.start()
        container.reload()
        return int(container.attrs["State"]["Pid"])

    def exec_in(
        self,
        container_id: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdout: Callable[[bytes], None],
        stderr: Callable[[bytes], None],
    ) -> int:
        # podman-py's exec_run(stream=True) gives no exit code: its own calls, one by one.
        from podman.api import stream_frames

        api = _client(self.url, EXEC_API_TIMEOUT_S).api
        exec_config = {
            "AttachStdout": True,
            "AttachStderr": True,
            "Cmd": list(argv),
            "Env": [f"{key}={value}" for key, value in env.items()],
        }
        try:
            created = api.post(f"/containers/{container_id}/exec", data=json.dumps(exec_config))
            created.raise_for_status()
            exec_id = created.json()["Id"]
            started = api.post(
                f"/exec/{exec_id}/start", data=json.dumps({"Detach": False}), stream=True
            )
            started.raise_for_status()
            for frame in stream_frames(started, demux=True):
                out, err = frame if isinstance(frame, tuple) else (frame, b"")
                if out:
                    stdout(out)
                if err:
                    stderr(err)
            inspected = api.get(f"/exec/{exec_id}/json")
            inspected.raise_for_status()
            returncode = inspected.json()["ExitCode"]
        except self.engine_errors() as exc:
            raise EngineError(str(exc)) from exc
        if not isinstance(returncode, int):
            raise EngineError(f"podman gave no exit code for {list(argv)!r}")
        return returncode

    def remove_container(self, container_id: str) -> None:
        import podman.errors

        def removed() -> None:
            try:
                self.client.containers.remove(container_id, force=True)
            except podman.errors.NotFound:
                return
            except podman.errors.APIError as exc:
                # A container already exiting (its keepalive closed, or killed) is being
                # removed by its own auto-remove, and podman refuses meanwhile; one whose conmon
                # was killed is never removed by itself, and a remove refused while podman
                # still deemed it stopping succeeds a moment later: asked again until gone.
                if self.client.containers.exists(container_id):
                    raise EngineError(f"still there after podman said: {exc}") from exc

        wait_until(
            removed,
            timeout_s=STOP_TIMEOUT_S,
            what=f"podman removing container {container_id[:12]}",
            retry_on=(EngineError,),
            interval_s=0.5,
        )

    def kill_container(self, container_id: str) -> None:
        import podman.errors

        try:
            self.client.containers.get(container_id).kill("SIGKILL")
        except podman.errors.NotFound:
            pass
        except podman.errors.APIError as exc:
            if exc.status_code != 409:  # not running any more
                raise

    def session_containers(self, session_id: str) -> dict[str, str]:
        found = self.client.containers.list(
            all=True, filters={"label": f"{SESSION_LABEL}={session_id}"}
        )
        return {container.labels[SANDBOX_LABEL]: str(container.id) for container in found}

    @classmethod
    def container_exists(cls, url: str, container_id: str) -> bool:
        """Whether podman knows the container, and it has not ended (``_ended``).

        One that has ended yet is still there is removed, as its conmon would have.
        """
        import podman.errors

        client = _client(url, LIVENESS_TIMEOUT_S)
        try:
            state = client.containers.get(container_id).attrs["State"]
        except podman.errors.NotFound:
            return False
        if not _ended(url, str(state["Status"]), int(state["Pid"] or 0)):
            return True

        def removed() -> None:
            with contextlib.suppress(podman.errors.NotFound):
                client.containers.remove(container_id, force=True)

        with contextlib.suppress(*cls.engine_errors(), TimeoutError):
            wait_until(
                removed,
                retry_on=(podman.errors.APIError,),
                timeout_s=LIVENESS_TIMEOUT_S,
                what=f"podman removing container {container_id[:12]}, which has ended",
                interval_s=0.5,
            )
        return False


_UNSTARTED = frozenset({"created", "configured", "initialized"})
"""States of a container whose first process has not run yet: it holds its GPUs all the same
(a container is handed its leases before it starts)."""
_RUNNING = frozenset({"running", "paused", "stopping"})


def _ended(url: str, status: str, pid: int) -> bool:
    """Whether a container podman knows has ended: it says so, or its first process is gone.

    podman learns of a container's end from its conmon, which then removes it: one whose
    conmon was killed stays "running" in podman's records for good once its processes die,
    and would hold its GPUs for good. Its first process is looked for only where podman's
    pids are this process's (``_same_pids``); a pid now another process's counts as it.
    """
    if status in _UNSTARTED:
        return False
    if status not in _RUNNING:
        return pid <= 0
    return pid > 0 and _same_pids(url) and not _runs(pid)


def _runs(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not); True where that cannot be told."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's, hidden by hidepid
            return True
        return True
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


@functools.lru_cache(maxsize=8)
def _same_pids(url: str) -> bool:
    """Whether the podman service at ``url`` numbers processes as this process does.

    Its socket's peer (the service, or what listens for it) is in this pid namespace; a
    service reached another way (ssh, TCP) or from a container is never judged by pid.
    """
    if not url.startswith("unix://"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
            peer.settimeout(LIVENESS_TIMEOUT_S)
            peer.connect(url.removeprefix("unix://"))
            creds = peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = struct.unpack("3i", creds)[0]
        return pid > 0 and os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
    except OSError:
        return False


def _podman_client(url: str, timeout: int) -> podman.PodmanClient:
    import podman

    return podman.PodmanClient(base_url=url, timeout=timeout)


_client = client_cache(_podman_client)
