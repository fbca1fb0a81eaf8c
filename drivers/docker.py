"""The docker driver: containers of dockerd, GPUs injected as CDI devices.

Host needs: dockerd 25 or newer with CDI enabled (``"features": {"cdi": true}`` in
daemon.json), a CDI spec naming each GPU (``nvidia-ctk cdi generate``, or the simulated
host's), and the docker SDK (PyPI ``docker``). The engine is found as the docker CLI finds
it: ``$DOCKER_HOST``, else ``unix:///var/run/docker.sock``.

GPUs are injected with ``DeviceRequest(driver="cdi", device_ids=[...])``, never with
``--gpus``, which needs the NVIDIA runtime.

The docker SDK is imported only once the engine is used: a process that only names this
driver (``gpu-sandbox spec``) does not pay for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

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

if TYPE_CHECKING:
    import docker


class DockerDriver(ContainerDriver):
    name = "docker"
    client_package = "docker"
    holder_kind = "docker"
    url_env = "DOCKER_HOST"
    default_url = "unix:///var/run/docker.sock"
    cli = "docker"
    cli_url_flag = "host"
    security_opt: ClassVar[tuple[str, ...]] = ("no-new-privileges",)
    """No command gains privileges (setuid, file capabilities); docker's masked and
    read-only /proc paths (/proc/sys among them) stay as they are."""

    @classmethod
    def engine_errors(cls) -> tuple[type[Exception], ...]:
        import docker.errors
        import requests

        return (docker.errors.DockerException, requests.RequestException)

    @property
    def api(self) -> docker.APIClient:
        return _client(self.url, API_TIMEOUT_S)

    def ping(self) -> None:
        self.api.ping()

    def version(self) -> str:
        return f"dockerd {self.api.version()['Version']}"

    def cdi_spec_dirs(self) -> tuple[Path, ...]:
        info = self.api.info()
        dirs = info.get("CDISpecDirs")
        if not dirs:
            raise EngineError(
                f"needed dockerd with CDI enabled (found docker {info.get('ServerVersion')} "
                'without it: add "features": {"cdi": true} to /etc/docker/daemon.json and '
                "restart dockerd; CDI needs docker 25 or newer)"
            )
        return tuple(Path(d) for d in dirs)

    def has_image(self, image: str) -> bool:
        import docker.errors

        try:
            self.api.inspect_image(image)  # type: ignore[no-untyped-call]
        except docker.errors.ImageNotFound:
            return False
        return True

    def create_container(self, request: ContainerRequest) -> str:
        from docker.types import DeviceRequest, Mount

        api = self.api
        devices = [DeviceRequest(driver="cdi", device_ids=list(request.cdi_devices))]
        host_config = api.create_host_config(
            auto_remove=True,
            init=True,  # reaps what timed-out execs leave behind
            network_mode="none",
            cap_drop=["ALL"],
            security_opt=list(self.security_opt),
            device_requests=devices if request.cdi_devices else None,
            devices=[f"{node.source}:{node.path}:rwm" for node in request.device_nodes] or None,
            mounts=[
                Mount(KEEPALIVE_PATH, str(request.keepalive), type="bind", read_only=True),
                *(
                    Mount(target, source, type="bind", read_only=True)
                    for source, target in request.tool_mounts
                ),
            ],
        )
        created = api.create_container(
            request.image,
            list(request.command),
            name=request.name,
            labels=dict(request.labels),
            environment=dict(request.env),
            host_config=host_config,
            # docker-py adds the proxies of the creator's client configuration
            # (~/.docker/config.json, DOCKER_CONFIG), credentials and all, unless told not to.
            use_config_proxy=False,
        )
        return str(created["Id"])

    def start_created(self, container_id: str) -> int:
        self.api.start(container_id)
        return int(self.api.inspect_container(container_id)["State"]["Pid"])

    def exec_in(
        self,
        container_id: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdout: Callable[[bytes], None],
        stderr: Callable[[bytes], None],
    ) -> int:
        api = _client(self.url, EXEC_API_TIMEOUT_S)
        try:
            exec_id = api.exec_create(container_id, list(argv), environment=dict(env))["Id"]
            for out, err in api.exec_start(exec_id, stream=True, demux=True):
                if out:
                    stdout(out)
                if err:
                    stderr(err)
            return int(api.exec_inspect(exec_id)["ExitCode"])
        except self.engine_errors() as exc:
            raise EngineError(self.explain(exc)) from exc

    def remove_container(self, container_id: str) -> None:
        import docker.errors

        try:
            self.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: auto-remove is already removing it
                raise

    def stop_container(self, container_id: str) -> None:
        # The main process is exiting by itself and auto-remove follows: waiting for that is
        # quicker than killing and removing it, and it is what `docker run --rm` does.
        import docker.errors
        import requests

        try:
            self.api.wait(container_id, timeout=STOP_TIMEOUT_S, condition="removed")
        except docker.errors.NotFound:
            return  # already removed
        except (docker.errors.DockerException, requests.RequestException):
            self.remove_container(container_id)

    def kill_container(self, container_id: str) -> None:
        import docker.errors

        try:
            self.api.kill(container_id, "SIGKILL")
        except docker.errors.APIError as exc:
            if exc.status_code not in (404, 409):  # gone, or not running any more
                raise

    def session_containers(self, session_id: str) -> dict[str, str]:
        found = self.api.containers(all=True, filters={"label": f"{SESSION_LABEL}={session_id}"})
        return {item["Labels"][SANDBOX_LABEL]: item["Id"] for item in found}

    def explain(self, exc: Exception) -> str:
        return str(getattr(exc, "explanation", None) or exc)

    @classmethod
    def container_exists(cls, url: str, container_id: str) -> bool:
        import docker.errors

        try:
            _liveness_client(url, LIVENESS_TIMEOUT_S).inspect_container(container_id)
        except docker.errors.NotFound:
            return False
        return True


def _api_client(url: str, timeout: int, version: str) -> docker.APIClient:
    import docker

    class UpgradedStreamClient(docker.APIClient):
        """An APIClient that reads exec and attach streams through http.client's buffer.

        Exec and attach are HTTP upgrades: http.client reads the ``101 UPGRADED`` headers
        through a buffered reader, which takes whatever else came in the same read. docker-py
        then reads the stream from the socket beneath it, so frames that arrived with the
        headers are lost: a short command's whole output, under load (docker/docker-py#3332,
        fixed upstream in an open pull request). Read the stream through that buffer.
        """

        def _get_raw_response_socket(self, response: Any) -> Any:
            super()._get_raw_response_socket(response)  # type: ignore[misc]  # raises API errors
            return _BufferedStream(response)

    return UpgradedStreamClient(base_url=url, timeout=timeout, version=version)


class _BufferedStream:
    """A socket, as docker-py's stream readers use one, read through the response's buffer.

    What came with the headers is taken from the buffer at once and handed out first; then
    the connection's bytes, read straight through (``read1`` of an empty buffer reads at
    most what is asked for, so nothing is buffered again). docker-py polls the descriptor
    before each read: while bytes are pending, it is given one that is always readable (an
    eventfd), or a command's first lines would wait for its next output.
    """

    def __init__(self, response: Any) -> None:
        self._response = response  # keeps the connection open while the stream is read
        self._reader = response.raw._fp.fp
        self._pending = _buffered_now(self._reader)
        self._ready = os.eventfd(1, os.EFD_CLOEXEC) if self._pending else -1

    def fileno(self) -> int:
        return self._ready if self._pending else int(self._reader.fileno())

    def recv(self, size: int) -> bytes:
        if not self._pending:
            return bytes(self._reader.read1(size))
        taken, self._pending = self._pending[:size], self._pending[size:]
        if not self._pending:
            os.close(self._ready)
        return taken

    def __del__(self) -> None:
        if self._pending:
            os.close(self._ready)


def _buffered_now(reader: Any) -> bytes:
    """What ``reader`` holds, or its socket has ready, without waiting for more."""
    sock = reader.raw._sock
    timeout = sock.gettimeout()
    sock.settimeout(0)
    try:
        return bytes(reader.read1(65536))
    except BlockingIOError:
        return b""
    finally:
        sock.settimeout(timeout)


_client = client_cache(lambda url, timeout: _api_client(url, timeout, "auto"))
# The oldest API version dockerd 25 and later still serve: asking a hung engine for its
# version first would double the wait of every liveness check.
_liveness_client = client_cache(lambda url, timeout: _api_client(url, timeout, "1.24"))
