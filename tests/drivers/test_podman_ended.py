"""A podman container whose conmon was killed: its end is podman's to miss, not its GPUs'.

podman learns of a container's end from its conmon, which then removes it (auto-remove). One
whose conmon was killed shows "running" for good once its processes die: it held its GPUs
for good, and a remove podman refused while it deemed it stopping was never asked again.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from drivers import podman
from drivers.container.sandbox import ContainerSandbox
from drivers.podman import PodmanDriver
from gpuhost import simulated
from gpuhost.errors import GpuBusy
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec
from gpuhost.wait import wait_until

CDI_DIR = Path("/var/run/cdi")


@pytest.mark.parametrize(
    ("status", "running_pid", "ended"),
    [
        ("created", False, False),  # handed its leases before it starts
        ("configured", False, False),
        ("exited", False, True),
        ("stopped", False, True),
        ("running", True, False),
        ("paused", True, False),
        ("stopping", True, False),
    ],
)
def test_a_container_has_ended_by_its_state_and_its_first_process(
    status: str, running_pid: bool, ended: bool
) -> None:
    # A pid that runs: this process's (not in the parameters: each xdist worker has its own).
    pid = os.getpid() if running_pid else 0
    assert podman._ended("unix:///run/podman/podman.sock", status, pid) is ended


def test_a_running_container_whose_process_is_gone_has_ended_only_where_pids_are_ours(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = _a_pid_nobody_has()
    monkeypatch.setattr(podman, "_same_pids", lambda url: True)
    assert podman._ended("unix:///x", "running", gone)
    # podman's pids are not this process's (a service over ssh, or seen from a container):
    # never judged by pid.
    monkeypatch.setattr(podman, "_same_pids", lambda url: False)
    assert not podman._ended("unix:///x", "running", gone)


def test_a_service_not_on_a_local_socket_numbers_no_process_of_ours() -> None:
    assert not podman._same_pids("ssh://root@example.com/run/podman/podman.sock")
    assert not podman._same_pids("tcp://127.0.0.1:1")
    assert not podman._same_pids("unix:///nonexistent/podman.sock")


def _a_pid_nobody_has() -> int:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


@pytest.fixture
def podman_host(tmp_path: Path) -> Iterator[GpuHost]:
    sim = simulated.setup(tmp_path / "sim", 2, cdi_dir=CDI_DIR)
    try:
        host = GpuHost.open(HostConfig(sim.root))
        availability = PodmanDriver(host, "probe").probe()
        assert availability.ok, f"podman cannot run: {availability.reason}"
        yield host
    finally:
        simulated.teardown(sim.root)


@pytest.mark.xdist_group("engines")
def test_gpus_come_back_once_a_container_without_its_conmon_dies(podman_host: GpuHost) -> None:
    """Its conmon killed, then its first process: its GPUs come back, and it is gone."""
    session = f"conmon-{os.getpid()}"
    driver = PodmanDriver(podman_host, session)
    sandbox = driver.create(SandboxSpec.with_gpus())
    assert isinstance(sandbox, ContainerSandbox)
    try:
        state = driver.client.containers.get(sandbox.container_id).attrs["State"]
        os.kill(state["ConmonPid"], signal.SIGKILL)
        assert sandbox.exec(["true"]).returncode == 0, "the container lives on without conmon"
        os.kill(state["Pid"], signal.SIGKILL)
        gpu = sandbox.gpus[0]
        spec = SandboxSpec.with_gpus(driver="podman", device_ids=[driver.device_ids(gpu)[0]])
        successor = wait_until(
            lambda: driver.create(spec),
            retry_on=(GpuBusy,),
            timeout_s=30,
            what=f"{gpu.uuid} to come back from container {sandbox.container_id[:12]}",
        )
        successor.close()
        assert sandbox.id not in driver.sandboxes(session), "a container with no process is listed"
        sandbox.close()
    finally:
        driver.reap(session)


@pytest.mark.xdist_group("engines")
def test_a_container_without_its_conmon_is_closed(podman_host: GpuHost) -> None:
    """Its conmon killed, then closed: close returns once it is gone, and its GPUs are free.

    podman refuses the first remove, the container still deemed stopping: it is asked again.
    """
    session = f"conmon-close-{os.getpid()}"
    driver = PodmanDriver(podman_host, session)
    sandbox = driver.create(SandboxSpec.with_gpus(len(podman_host.gpus)))
    assert isinstance(sandbox, ContainerSandbox)
    try:
        state = driver.client.containers.get(sandbox.container_id).attrs["State"]
        os.kill(state["ConmonPid"], signal.SIGKILL)
        sandbox.close()
        assert driver.session_containers(session) == {}
        driver.create(SandboxSpec.with_gpus(len(podman_host.gpus))).close()
    finally:
        driver.reap(session)
