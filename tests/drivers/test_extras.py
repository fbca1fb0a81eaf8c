"""The engines' clients are extras: the contract and the catalogue run without any of them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from drivers.base import Driver
from drivers.docker import DockerDriver
from drivers.kubernetes import KubernetesDriver
from drivers.podman import PodmanDriver
from gpuhost import simulated
from gpuhost.host import GpuHost, HostConfig

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ("docker", "podman", "kubernetes", "grpc", "google.protobuf")
"""Every package the extras bring: what a driver author's environment may lack."""


@pytest.mark.parametrize(
    ("driver_class", "package"),
    [(DockerDriver, "docker"), (PodmanDriver, "podman"), (KubernetesDriver, "kubernetes")],
    ids=["docker", "podman", "kubernetes"],
)
def test_a_lane_without_its_client_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
    sim_host: simulated.SimulatedHost,
    driver_class: type[Driver],
    package: str,
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # import raises ModuleNotFoundError
    availability = driver_class(GpuHost.open(HostConfig(sim_host.root)), "extras").probe()
    assert not availability.ok
    assert f"needed the Python package {package}" in availability.reason
    assert f"pip install 'gpu-sandbox-conformance[{package}]'" in availability.reason


def _without_clients(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The catalogue run with ``args`` where no engine client can be imported."""
    blocked = textwrap.dedent(
        f"""
        import sys
        for name in {CLIENTS!r}:
            sys.modules[name] = None  # import raises ModuleNotFoundError
        import pytest
        sys.exit(pytest.main(sys.argv[1:]))
        """
    )
    return subprocess.run(
        [
            sys.executable, "-c", blocked, "--pyargs", "conformance", "-p", "no:cacheprovider",
            "-p", "no:xdist", "-q", "--sim-gpus=2", *args,
        ],
        cwd=cwd, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def test_the_catalogue_runs_a_driver_without_any_engine_client(tmp_path: Path) -> None:
    """The reference lane passes with no engine client importable; a docker lane says why not."""
    reference = _without_clients(tmp_path, "--driver=reference", "-k", "test_validation")
    output = reference.stdout + reference.stderr
    assert reference.returncode == 0, output[-3000:]
    assert "reference: PASS" in output, output[-3000:]
    docker = _without_clients(tmp_path, "--driver=docker", "-k", "test_validation")
    output = docker.stdout + docker.stderr
    assert docker.returncode != 0
    assert (
        "docker: NOT RUN — needed the Python package docker (found: import of docker halted; "
        "None in sys.modules); install it with `pip install 'gpu-sandbox-conformance[docker]'`"
    ) in output, output[-3000:]
