"""The container lane: no proxy of the creator's client or of the engine's service gets inside.

Both engines' clients forward proxies unless told not to: docker-py those of the creator's
client configuration (``~/.docker/config.json``, ``DOCKER_CONFIG``), podman those of its
service's environment (the CLI by default; the API as its version and containers.conf say).
A proxy's URL carries its credentials. Needs dockerd and podman (`make engines`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from drivers.container import ContainerDriver
from drivers.docker import DockerDriver
from drivers.podman import PodmanDriver
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec
from gpuhost.wait import wait_for

pytestmark = pytest.mark.xdist_group("engines")
CDI_DIR = Path("/var/run/cdi")
SECRET = "gpu-sandbox-proxy-secret"
PROXY = f"http://someone:{SECRET}@proxy.invalid:3128"
PROXY_VARIABLES = [
    name
    for base in ("http", "https", "ftp", "no")
    for name in (f"{base}_proxy", f"{base}_PROXY".upper())
]
ENGINES_STATE = Path(os.environ.get("GPU_SANDBOX_ENGINES_STATE", "/run/gpu-sandbox-engines"))


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuHost]:
    sim = simulated.setup(tmp_path_factory.mktemp("proxies") / "sim", 1, cdi_dir=CDI_DIR)
    try:
        yield GpuHost.open(HostConfig(sim.root))
    finally:
        simulated.teardown(sim.root)


def _proxies_inside(driver: ContainerDriver) -> list[str]:
    """The proxy variables a command of a sandbox the driver makes sees.

    Made in a thread of its own: the drivers keep an engine client per thread, and a client
    reads its configuration when it is made.
    """

    def made() -> list[str]:
        with driver.create(SandboxSpec()) as sandbox:
            listing = sandbox.exec(["env"]).check().stdout.splitlines()
        return [line for line in listing if line.split("=", 1)[0] in PROXY_VARIABLES]

    try:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(made).result()
    finally:
        driver.reap(driver.session_id)


def test_docker_forwards_no_proxy_of_the_creators_client_configuration(
    host: GpuHost, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: http_proxy, HTTP_PROXY, no_proxy and NO_PROXY of the configuration, inside."""
    proxies = {"httpProxy": PROXY, "httpsProxy": PROXY, "ftpProxy": PROXY, "noProxy": SECRET}
    (tmp_path / "config.json").write_text(json.dumps({"proxies": {"default": proxies}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    inside = _proxies_inside(DockerDriver(host, f"proxies-{time.time_ns()}"))
    assert inside == [], f"a docker sandbox sees its creator's client proxies: {inside}"


@pytest.fixture
def podman_with_proxies(tmp_path: Path) -> Iterator[str]:
    """A podman service of its own, on the engines' storage, its environment holding proxies."""
    socket = tmp_path / "podman.sock"
    env = {
        "PATH": os.environ["PATH"],
        "CONTAINERS_CONF": str(ENGINES_STATE / "containers.conf"),
        **dict.fromkeys(PROXY_VARIABLES, PROXY),
    }
    service = subprocess.Popen(
        ["podman", "system", "service", "--time=0", f"unix://{socket}"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(socket.exists, bool, timeout_s=30, what=f"podman to listen on {socket}")
        yield f"unix://{socket}"
    finally:
        os.killpg(service.pid, signal.SIGTERM)
        service.wait(30)


def test_podman_forwards_no_proxy_of_its_services_environment(
    host: GpuHost, podman_with_proxies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Podman forwards its service's proxies where asked to: the driver says no.

    Asked (``httpproxy``) by its CLI by default, by its API as its version and
    containers.conf say. Before: podman 4.3's API forwarded nothing unasked, and a driver that asked
    (``use_config_proxy=True``) had every variable inside.
    """
    monkeypatch.setenv(PodmanDriver.url_env, podman_with_proxies)
    driver = PodmanDriver(host, f"proxies-{time.time_ns()}")
    assert driver.url == podman_with_proxies
    inside = _proxies_inside(driver)
    assert inside == [], f"a podman sandbox sees its service's proxies: {inside}"
