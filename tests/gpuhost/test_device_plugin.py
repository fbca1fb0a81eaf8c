"""The simulated host's device plugin, called directly and over its socket (no cluster)."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc  # type: ignore[import-untyped]
import pytest

from gpuhost import simulated
from gpuhost.simulated import device_plugin
from gpuhost.simulated.device_plugin import Api, PluginRunner, SimulatedGpuPlugin

try:
    API = device_plugin.load_api()
except device_plugin.ApiMissing as exc:
    pytest.skip(
        f"needs `make cluster` (the generated device plugin API): {exc}", allow_module_level=True
    )


def _allocate(plugin: SimulatedGpuPlugin, *requests: list[str]) -> Any:
    m = API.messages
    return plugin.Allocate(
        m.AllocateRequest(
            container_requests=[m.ContainerAllocateRequest(devicesIDs=r) for r in requests]
        ),
        None,
    )


def _devices(response: Any) -> list[tuple[str, str, str]]:
    return [(d.container_path, d.host_path, d.permissions) for d in response.devices]


def test_allocate_gives_the_granted_gpus_nodes_and_the_cdi_specs_edits(
    sim_host: simulated.SimulatedHost,
) -> None:
    plugin = SimulatedGpuPlugin(API, sim_host)
    granted = [sim_host.gpus[5], sim_host.gpus[2]]
    (response,) = _allocate(plugin, [g.uuid for g in granted]).container_responses

    assert dict(response.envs) == {"NVIDIA_VISIBLE_DEVICES": f"{granted[0].uuid},{granted[1].uuid}"}
    spec = simulated.cdi_spec(sim_host)
    edits: dict[str, Any] = spec["containerEdits"]  # type: ignore[assignment]
    control = [(n["path"], n["hostPath"], "rw") for n in edits["deviceNodes"]]
    gpu_nodes = [
        (n.path, n.source, "rw") for g in sorted(granted, key=lambda g: g.index) for n in g.nodes
    ]
    assert _devices(response) == gpu_nodes + control
    assert [(m.container_path, m.host_path, m.read_only) for m in response.mounts] == [
        (m["containerPath"], m["hostPath"], "ro" in m["options"]) for m in edits["mounts"]
    ]
    assert all(Path(host).exists() for _, host, _ in _devices(response))


def test_allocate_answers_each_container_of_a_pod_on_its_own(
    sim_host: simulated.SimulatedHost,
) -> None:
    plugin = SimulatedGpuPlugin(API, sim_host)
    first, second = sim_host.gpus[0].uuid, sim_host.gpus[7].uuid
    responses = _allocate(plugin, [first], [second]).container_responses
    assert [r.envs["NVIDIA_VISIBLE_DEVICES"] for r in responses] == [first, second]
    assert [_devices(r)[0][1] for r in responses] == [
        sim_host.gpus[0].nodes[0].source,
        sim_host.gpus[7].nodes[0].source,
    ]


def test_inject_all_leaks_every_node_but_names_only_the_granted(
    sim_host: simulated.SimulatedHost,
) -> None:
    plugin = SimulatedGpuPlugin(API, sim_host, inject_all=True)
    (response,) = _allocate(plugin, [sim_host.gpus[3].uuid]).container_responses
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == sim_host.gpus[3].uuid
    paths = {path for path, _, _ in _devices(response)}
    assert {n.path for g in sim_host.gpus for n in g.nodes} <= paths


def test_allocate_refuses_a_device_it_does_not_have(sim_host: simulated.SimulatedHost) -> None:
    with pytest.raises(ValueError, match="unknown device ids"):
        _allocate(SimulatedGpuPlugin(API, sim_host), ["GPU-not-here"])


def test_preferred_allocation_is_the_must_include_then_the_lowest_in_pci_order(
    sim_host: simulated.SimulatedHost,
) -> None:
    m = API.messages
    uuids = [g.uuid for g in sim_host.gpus]
    request = m.PreferredAllocationRequest(
        container_requests=[
            m.ContainerPreferredAllocationRequest(
                available_deviceIDs=list(reversed(uuids[1:])),
                must_include_deviceIDs=[uuids[6]],
                allocation_size=3,
            )
        ]
    )
    (response,) = (
        SimulatedGpuPlugin(API, sim_host).GetPreferredAllocation(request, None).container_responses
    )
    assert list(response.deviceIDs) == [uuids[6], uuids[1], uuids[2]]


def test_list_and_watch_reports_every_gpu_healthy_then_a_lost_one(
    sim_host: simulated.SimulatedHost,
) -> None:
    plugin = SimulatedGpuPlugin(API, sim_host, poll_s=0.01)
    stream = plugin.ListAndWatch(API.messages.Empty(), None)
    first = next(stream)
    assert [(d.ID, d.health) for d in first.devices] == [(g.uuid, "Healthy") for g in sim_host.gpus]
    Path(sim_host.gpus[4].nodes[0].source).unlink()
    second = next(stream)
    assert [d.ID for d in second.devices if d.health == "Unhealthy"] == [sim_host.gpus[4].uuid]
    plugin.stopped.set()
    assert list(stream) == []


class _FakeKubelet:
    """The kubelet's Registration service on a kubelet.sock, recording each request."""

    def __init__(self, api: Api, socket_dir: Path) -> None:
        self.api = api
        self.socket = socket_dir / device_plugin.KUBELET_SOCKET
        self.requests: list[Any] = []
        self.registered = threading.Event()
        self.server: Any = None

    def Register(self, request: Any, context: Any) -> Any:
        self.requests.append(request)
        self.registered.set()
        return self.api.messages.Empty()

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.api.services.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        self.server.start()

    def restart(self) -> None:
        """As a kubelet restart does: the socket directory wiped, a new kubelet.sock."""
        self.server.stop(grace=0).wait()
        for path in self.socket.parent.iterdir():
            path.unlink()
        self.registered.clear()
        self.start()


@pytest.fixture
def kubelet() -> Iterator[_FakeKubelet]:
    # Not under tmp_path: a unix socket's path has 107 bytes at most.
    with tempfile.TemporaryDirectory(prefix="dp-") as short:
        fake = _FakeKubelet(API, Path(short))
        fake.start()
        yield fake
        fake.server.stop(grace=0)


def test_the_plugin_registers_serves_and_registers_again_after_a_kubelet_restart(
    sim_host: simulated.SimulatedHost, kubelet: _FakeKubelet
) -> None:
    plugin = SimulatedGpuPlugin(API, sim_host)
    runner = PluginRunner(plugin, "example.com/gpu", kubelet.socket.parent)
    stop = threading.Event()
    thread = threading.Thread(target=runner.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert kubelet.registered.wait(10), "the plugin never registered"
        (request,) = kubelet.requests
        assert (request.version, request.resource_name) == ("v1beta1", "example.com/gpu")
        assert request.options.get_preferred_allocation_available
        endpoint = kubelet.socket.parent / request.endpoint
        with grpc.insecure_channel(f"unix://{endpoint}") as channel:
            stub = API.services.DevicePluginStub(channel)
            m = API.messages
            response = stub.Allocate(
                m.AllocateRequest(
                    container_requests=[
                        m.ContainerAllocateRequest(devicesIDs=[sim_host.gpus[1].uuid])
                    ]
                ),
                timeout=10,
            )
        assert (
            response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == sim_host.gpus[1].uuid
        )

        kubelet.restart()
        assert kubelet.registered.wait(10), "the plugin did not register with the new kubelet"
        assert len(kubelet.requests) == 2
        assert endpoint.exists()
    finally:
        stop.set()
        thread.join(10)
    assert not endpoint.exists()
