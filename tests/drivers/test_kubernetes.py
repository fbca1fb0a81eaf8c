"""The kubernetes lane: its pods, the API's answers it maps, and the lane on a real cluster.

The cluster is the single-node one of ``make cluster``.
The unit tests read API bodies recorded from that cluster (tests/data/kubernetes/). The rest
needs the cluster answering: `make test` starts it (`make cluster`); a machine without it
fails here with the reason, never skips. Catalogue runs make many pods: they run in one
xdist group, one after the other.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from conformance import requirements
from drivers.kubernetes import (
    DEFAULT_RESOURCE,
    GRANT_LINE,
    KubernetesDriver,
    exit_status,
    free_gpus,
    granted_uuids,
    micro_time,
    pod_gpu_request,
    pod_manifest,
)
from gpuhost import simulated
from gpuhost.devices import gpus_from_json
from gpuhost.errors import (
    DriverError,
    ExecTimeout,
    GpusExhausted,
    InvalidDriverConfig,
    SandboxExecError,
    SandboxStartError,
    UnknownImage,
    UnsupportedGpuRequest,
    shown,
)
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SHARED, SandboxSpec, parse_spec
from tests.breakers import pods
from tests.catalogue import (
    assert_fails_its_requirement,
    golden_ids,
    partial_by_what_it_dropped,
    run_catalogue,
    without_the_busybox_key_case,
)

pytestmark = pytest.mark.xdist_group("kubernetes")
DATA = Path(__file__).parents[1] / "data" / "kubernetes"
ROOT = Path(__file__).parents[2]


def recorded(name: str) -> Any:
    return json.loads((DATA / name).read_text())


# -- the pod it builds --------------------------------------------------------------------


def test_the_pod_asks_for_its_gpus_by_limit_and_nothing_more() -> None:
    pod = pod_manifest(
        name="gpu-sandbox-abc",
        namespace="ns",
        labels={"gpu-sandbox.dev/session": "s1"},
        image="img:1",
        env={"B": "2", "A": "1"},
        resource=DEFAULT_RESOURCE,
        gpus=2,
        runtime_class_name="nvidia",
        node_selector={"gpu": "h100"},
    )
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert container["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    assert container["securityContext"] == {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"gpu": "h100"}
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False
    assert not {"hostNetwork", "hostPID", "hostIPC"} & set(spec)
    assert pod_gpu_request(pod, DEFAULT_RESOURCE) == 2


def test_a_pod_without_a_gpu_request_has_no_gpu_limit() -> None:
    pod = pod_manifest(
        name="p", namespace="ns", labels={}, image="i", env={}, resource=DEFAULT_RESOURCE, gpus=0
    )
    (container,) = pod["spec"]["containers"]
    assert "resources" not in container
    assert "runtimeClassName" not in pod["spec"]
    assert "nodeSelector" not in pod["spec"]


# -- what it reads from the API -----------------------------------------------------------


def test_free_gpus_count_bound_unfinished_pods_and_those_leaving() -> None:
    nodes = recorded("nodes.json")["items"]
    pods = recorded("pods-holding-gpus.json")["items"]
    held = sum(
        pod_gpu_request(pod, DEFAULT_RESOURCE)
        for pod in pods
        if pod["spec"].get("nodeName") and pod["status"]["phase"] not in ("Succeeded", "Failed")
    )
    leaving = sum(
        pod_gpu_request(pod, DEFAULT_RESOURCE)
        for pod in pods
        if pod["metadata"].get("deletionTimestamp") and pod["spec"].get("nodeName")
    )
    free, free_later, total = free_gpus(nodes, pods, DEFAULT_RESOURCE)
    assert total == 8
    assert free == total - held
    assert free_later == free + leaving


def test_an_unschedulable_pod_is_gpus_exhausted_with_the_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = _offline_driver(monkeypatch)
    pending = recorded("pod-unschedulable.json")
    (condition,) = [c for c in pending["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert "Insufficient nvidia.com/gpu" in condition["message"]
    with pytest.raises(GpusExhausted) as raised:
        driver._judge(pending, 9, "img")
    free, _, total = free_gpus(driver.nodes(), driver.pods(), DEFAULT_RESOURCE)
    assert (raised.value.requested, raised.value.available, raised.value.total) == (9, free, total)
    assert condition["message"] in str(raised.value)


def test_an_image_the_node_cannot_get_is_unknown_image(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _offline_driver(monkeypatch)
    with pytest.raises(UnknownImage) as raised:
        driver._judge(recorded("pod-image-never-pull.json"), 0, "no-such-image:1")
    assert raised.value.field == "image"
    assert "no-such-image:1" in str(raised.value)
    assert "ErrImageNeverPull" in str(raised.value)


def test_a_running_pod_is_running_and_a_finished_one_never_will(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = _offline_driver(monkeypatch)
    assert driver._judge(recorded("pod-running.json"), 1, "img") is True
    finished = recorded("pod-running.json")
    finished["status"]["phase"] = "Failed"
    with pytest.raises(SandboxStartError):
        driver._judge(finished, 1, "img")


def test_the_exec_streams_status_is_the_exit_code() -> None:
    assert exit_status(json.dumps(recorded("exec-status-success.json"))) == 0
    assert exit_status(json.dumps(recorded("exec-status-exit-3.json"))) == 3
    assert exit_status("") is None
    with pytest.raises(SandboxExecError, match="could not run"):
        exit_status(json.dumps({"status": "Failure", "message": "container not found"}))


def test_the_grant_line_names_the_uuids_the_device_plugin_gave() -> None:
    assert granted_uuids("") is None
    assert granted_uuids(f"{GRANT_LINE}\n") == []
    assert granted_uuids(f"noise\n{GRANT_LINE}GPU-1,GPU-2\n") == ["GPU-1", "GPU-2"]
    # Another plugin strategy: no UUIDs in the variable, nvidia-smi inside decides.
    assert granted_uuids(f"{GRANT_LINE}/var/run/nvidia-container-devices\n") == []


def _offline_driver(monkeypatch: pytest.MonkeyPatch) -> KubernetesDriver:
    """A driver whose cluster is the recorded one: nodes and pods from tests/data."""
    host = GpuHost.open(HostConfig(sim_root=None, state_dir=Path("/nonexistent")))
    driver = KubernetesDriver(host, "offline")
    monkeypatch.setattr(driver, "nodes", lambda: recorded("nodes.json")["items"])
    monkeypatch.setattr(driver, "pods", lambda: recorded("pods-holding-gpus.json")["items"])
    return driver


# -- requests refused before any pod is made ----------------------------------------------


@pytest.mark.parametrize(
    ("block", "field"),
    [
        ({"runtime_class_name": ""}, "template.driver_config.kubernetes.runtime_class_name"),
        ({"image": 3}, "template.driver_config.kubernetes.image"),
        ({"node_selector": ["gpu"]}, "template.driver_config.kubernetes.node_selector"),
        ({"node_selector": {"gpu": 1}}, "template.driver_config.kubernetes.node_selector.gpu"),
        ({"node_selector": {"": ""}}, "template.driver_config.kubernetes.node_selector"),
        ({"node_selector": {"a/b/c": "x"}}, "template.driver_config.kubernetes.node_selector"),
        (
            {"node_selector": {"gpu": "h 100"}},
            "template.driver_config.kubernetes.node_selector.gpu",
        ),
        (
            {"runtime_class_name": "nvi\x00dia"},
            "template.driver_config.kubernetes.runtime_class_name",
        ),
        ({"runtime_class_name": "Nvidia"}, "template.driver_config.kubernetes.runtime_class_name"),
        ({"image": " busybox\n"}, "template.driver_config.kubernetes.image"),
    ],
)
def test_bad_options_name_the_field(
    monkeypatch: pytest.MonkeyPatch, block: dict[str, Any], field: str
) -> None:
    driver = _offline_driver(monkeypatch)
    monkeypatch.setattr(driver, "start", _no_pod)
    spec = parse_spec(
        {"resource_requirements": {"gpu": {}}, "template": {"driver_config": {"kubernetes": block}}}
    )
    with pytest.raises(InvalidDriverConfig) as raised:
        driver.create(spec)
    assert raised.value.field == field
    assert shown(raised.value.value) in str(raised.value)


def test_exact_ids_and_sharing_are_refused_by_field(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = _offline_driver(monkeypatch)
    monkeypatch.setattr(driver, "start", _no_pod)
    ids = SandboxSpec.with_gpus(driver="kubernetes", device_ids=["GPU-x"])
    with pytest.raises(UnsupportedGpuRequest) as raised:
        driver.create(ids)
    assert raised.value.field == "template.driver_config.kubernetes.gpu_device_ids"
    assert "GPU-x" in str(raised.value)
    with pytest.raises(UnsupportedGpuRequest) as shared:
        driver.create(SandboxSpec.with_gpus(sharing=SHARED))
    assert shared.value.field == "resource_requirements.gpu.sharing"


def _no_pod(*_: object) -> None:
    raise AssertionError("a pod was started for a request that must be refused")


# -- on the cluster -----------------------------------------------------------------------


@pytest.fixture
def cluster_driver(tmp_path: Path) -> Iterator[KubernetesDriver]:
    sim = simulated.setup(tmp_path / "sim", 2)
    driver = KubernetesDriver(GpuHost.open(HostConfig(sim.root)), f"k8s-{time.time_ns()}")
    availability = driver.probe()
    assert availability.ok, f"the kubernetes driver cannot run here: {availability.reason}"
    # The cluster's GPUs are shared with any catalogue run on it: take turns with them.
    with driver.catalogue_turn():
        yield driver
        driver.reap(driver.session_id)
    simulated.teardown(sim.root)


def test_probe_names_the_kubeconfig_the_server_and_the_gpus(
    cluster_driver: KubernetesDriver,
) -> None:
    said = cluster_driver.probe().reason
    assert cluster_driver.cluster.kubeconfig in said
    assert "v1." in said
    assert "nvidia.com/gpu on" in said
    assert cluster_driver.version().startswith("kubernetes v1.")


def test_a_sandbox_sees_its_gpus_and_its_exec_is_whole(cluster_driver: KubernetesDriver) -> None:
    with cluster_driver.create(SandboxSpec.with_gpus(2)) as sandbox:
        listed = sandbox.exec(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"]).check()
        assert sorted(listed.stdout.split()) == sorted(gpu.uuid for gpu in sandbox.gpus)
        assert len({gpu.uuid for gpu in sandbox.gpus}) == 2
        assert all(gpu.nodes for gpu in sandbox.gpus), "the node's annotation gave no device node"
        big = sandbox.exec(
            ["sh", "-c", "head -c 3000000 /dev/zero | tr '\\0' x; echo e >&2; exit 4"]
        )
        assert (big.returncode, len(big.stdout), big.stderr) == (4, 3_000_000, "e\n")
        missing = sandbox.exec(["no-such-program"])
        assert missing.returncode == 127
        assert "not found" in missing.stderr


def test_an_exec_past_its_timeout_is_killed_with_what_it_started(
    cluster_driver: KubernetesDriver,
) -> None:
    with cluster_driver.create(SandboxSpec()) as sandbox:
        with pytest.raises(ExecTimeout):
            sandbox.exec(["sh", "-c", "setsid sleep 300 & sleep 300"], timeout=2)
        left = sandbox.exec(["sh", "-c", "ps -o args | grep -c '^sleep 300' || true"]).check()
        assert left.stdout.strip() == "0", f"processes left: {left.stdout}"


def test_a_pod_that_cannot_start_is_deleted_with_the_reason(
    cluster_driver: KubernetesDriver,
) -> None:
    spec = parse_spec(
        {
            "resource_requirements": {"gpu": {}},
            "template": {"driver_config": {"kubernetes": {"image": "nope:1"}}},
        }
    )
    with pytest.raises(UnknownImage, match="nope:1"):
        cluster_driver.create(spec)
    assert cluster_driver.sandboxes(cluster_driver.session_id) == []


def test_reap_from_a_fresh_process_removes_the_pods(cluster_driver: KubernetesDriver) -> None:
    cluster_driver.create(SandboxSpec.with_gpus())
    cluster_driver.create(SandboxSpec())
    assert len(cluster_driver.sandboxes(cluster_driver.session_id)) == 2
    gpu_sandbox = Path(sys.executable).parent / "gpu-sandbox"
    sim_root = f"--sim-root={cluster_driver.host.config.sim_root}"
    reap = [str(gpu_sandbox), "reap", sim_root, "--driver=kubernetes", cluster_driver.session_id]
    subprocess.run(reap, cwd=ROOT, check=True, capture_output=True)
    assert cluster_driver.sandboxes(cluster_driver.session_id) == []


# -- the catalogue's turn on the cluster -------------------------------------------------


@pytest.fixture
def two_runs(
    cluster_driver: KubernetesDriver,
) -> Iterator[tuple[KubernetesDriver, KubernetesDriver]]:
    """Drivers of two sessions, taking turns on a Lease of the test's own, of 2 s."""
    second = KubernetesDriver(cluster_driver.host, f"k8s-{time.time_ns()}")
    lease = f"test-turn-{time.time_ns()}"
    for driver in (cluster_driver, second):
        driver.turn_lease = lease
        driver.turn_duration_s = 2
    yield cluster_driver, second
    from kubernetes.client.exceptions import ApiException

    with contextlib.suppress(ApiException):
        _leases(cluster_driver).delete_namespaced_lease(lease, cluster_driver.namespace)


def _leases(driver: KubernetesDriver) -> Any:
    from kubernetes import client

    return client.CoordinationV1Api(driver.api_client())


def _holder(driver: KubernetesDriver) -> str | None:
    """Who holds the driver's turn Lease; None when there is no Lease."""
    from kubernetes.client.exceptions import ApiException

    try:
        lease = _leases(driver).read_namespaced_lease(
            driver.turn_lease, driver.namespace, _preload_content=False
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return str(json.loads(lease.data)["spec"].get("holderIdentity") or "")


def test_a_second_run_waits_for_the_turn_and_gets_it_once_given_back(
    two_runs: tuple[KubernetesDriver, KubernetesDriver], capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = two_runs
    got: list[float] = []
    errors: list[BaseException] = []

    def second_run() -> None:
        try:
            with second.catalogue_turn():
                got.append(time.monotonic())
                assert (_holder(second) or "").startswith(second.session_id)
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=second_run, daemon=True)
    with first.catalogue_turn():
        waiter.start()
        # Twice the Lease's duration: the first run's renewals keep it.
        time.sleep(2 * first.turn_duration_s)
        assert not got, "the second run took a turn the first still held"
        assert (_holder(first) or "").startswith(f"{first.session_id} (pid ")
        given_back = time.monotonic()
    waiter.join(timeout=10)
    assert not errors, errors
    assert got, "the second run did not get its turn"
    assert got[0] - given_back < 2, f"the second run waited {got[0] - given_back:.1f} s more"
    assert _holder(first) is None, "the second run left the Lease behind"
    waited = (
        f"waiting for another conformance run on cluster {first.configuration.host} "
        f"(lease {first.turn_lease} held by {first.session_id} (pid "
    )
    lines = capsys.readouterr().err.splitlines()
    assert sum(line.startswith(waited) for line in lines) == 1, lines


def test_an_expired_turn_of_a_run_that_died_is_taken_over(
    two_runs: tuple[KubernetesDriver, KubernetesDriver],
) -> None:
    driver, _ = two_runs
    an_hour_ago = micro_time(datetime.now(UTC) - timedelta(hours=1))
    driver._ensure_namespace()
    _leases(driver).create_namespaced_lease(
        driver.namespace,
        {
            "metadata": {"name": driver.turn_lease},
            "spec": {
                "holderIdentity": "a-dead-run (pid 1 on elsewhere)",
                "leaseDurationSeconds": 15,
                "acquireTime": an_hour_ago,
                "renewTime": an_hour_ago,
            },
        },
    )
    started = time.monotonic()
    with driver.catalogue_turn():
        # Judged by its renewTime, not by watching it for its 15 s.
        assert time.monotonic() - started < 5
        assert (_holder(driver) or "").startswith(driver.session_id)
    assert _holder(driver) is None


def test_the_turn_is_given_back_when_the_lane_raises(
    two_runs: tuple[KubernetesDriver, KubernetesDriver],
) -> None:
    driver, _ = two_runs

    def lane() -> None:
        with driver.catalogue_turn():
            assert (_holder(driver) or "").startswith(driver.session_id)
            raise RuntimeError("the lane broke")

    with pytest.raises(RuntimeError, match="the lane broke"):
        lane()
    assert _holder(driver) is None


def test_a_run_that_waits_too_long_says_who_holds_the_turn(
    two_runs: tuple[KubernetesDriver, KubernetesDriver],
) -> None:
    first, second = two_runs
    second.turn_timeout_s = 1
    with first.catalogue_turn():
        with pytest.raises(TimeoutError) as raised, second.catalogue_turn():
            pass
        said = str(raised.value)
    assert f"held by {first.session_id} (pid " in said
    assert f"kubectl get lease -n {first.namespace} {first.turn_lease}" in said
    assert _holder(first) is None


def test_a_turn_taken_while_held_fails_the_run(
    two_runs: tuple[KubernetesDriver, KubernetesDriver],
) -> None:
    """As when the holder stalled longer than its Lease and another run took it over."""
    driver, _ = two_runs

    def lane() -> None:
        with driver.catalogue_turn():
            lease = json.loads(
                _leases(driver)
                .read_namespaced_lease(driver.turn_lease, driver.namespace, _preload_content=False)
                .data
            )
            lease["spec"]["holderIdentity"] = "another-run"
            lease["metadata"].pop("managedFields", None)
            _leases(driver).replace_namespaced_lease(driver.turn_lease, driver.namespace, lease)
            time.sleep(driver.turn_duration_s)  # a renewal or two

    with pytest.raises(DriverError, match="went to another-run while this run held it"):
        lane()
    assert _holder(driver) == "another-run", "a run gave back a turn that was not its own"


def test_catalogue_passes_the_kubernetes_driver(pytester: pytest.Pytester, tmp_path: Path) -> None:
    """Every requirement of the kubernetes profile passes on the cluster; the rest is N/A."""
    result, run = run_catalogue(pytester, tmp_path, "kubernetes", 2, full=False)
    verdicts = without_the_busybox_key_case(result, "kubernetes")
    # A pod's containerd-shim runs its other containers too: no host process above its init
    # runs it alone, so that way of ending it is left out, named.
    partial_by_what_it_dropped(verdicts, result, "GPU-RECLAIM-01")
    profile = requirements.load().profile("kubernetes")
    outcome = {"not applicable": "not applicable"}
    expected = {
        req: outcome.get(profile[req], "passed")
        for req in golden_ids() - {"SANDBOX-PEER-01", "GPU-RECLAIM-01"}
        if not req.startswith("WORKLOAD-")
    }
    assert {req: verdicts.get(req) for req in expected} == expected
    assert result["drivers"]["kubernetes"]["version"].startswith("kubernetes v1.")
    run.stdout.fnmatch_lines(["kubernetes: PASS (*mandatory passed*"])
    assert run.ret == pytest.ExitCode.OK


@pytest.mark.parametrize("broken", pods.ALL, ids=[cls.__name__ for cls in pods.ALL])
def test_catalogue_fails_the_broken_kubernetes_driver(
    pytester: pytest.Pytester, tmp_path: Path, broken: type[pods.BrokenPodDriver]
) -> None:
    assert_fails_its_requirement(pytester, tmp_path, broken, 2)


def test_the_node_annotation_carries_each_gpu_with_its_device_node(tmp_path: Path) -> None:
    """``gpu-sandbox gpus --node-annotation`` is what the driver reads back, node for node."""
    sim = simulated.setup(tmp_path / "sim", 3, mig={0: ["1g.10gb"]})
    gpu_sandbox = Path(sys.executable).parent / "gpu-sandbox"
    done = subprocess.run(
        [str(gpu_sandbox), "gpus", "--node-annotation", f"--sim-root={sim.root}"],
        capture_output=True,
        text=True,
        check=True,
    )
    published = gpus_from_json(json.dumps(json.loads(done.stdout)[DEFAULT_RESOURCE]))
    whole = [gpu for gpu in sim.gpus if not gpu.mig_enabled]
    assert [(g.uuid, g.pci_bus_id, g.minor) for g in published] == [
        (g.uuid, g.pci_bus_id, g.minor) for g in whole
    ]
    # As a pod sees them: the node's own path, whatever the host calls it.
    assert [[(n.path, n.major, n.minor) for n in g.nodes] for g in published] == [
        [(n.path, n.major, n.minor) for n in g.nodes] for g in whole
    ]


LOCAL_CLUSTER = Path("/run/gpu-sandbox-cluster")
"""scripts/cluster.sh's state: its etcd and its network are the suite's own to check."""


def test_the_local_clusters_etcd_answers_only_the_apiservers_certificate(
    cluster_driver: KubernetesDriver,
) -> None:
    """On plain http, or without a client certificate, any local user read every secret."""
    if cluster_driver.cluster.kubeconfig != str(LOCAL_CLUSTER / "kubeconfig"):
        pytest.skip(f"not the local cluster ({cluster_driver.cluster.kubeconfig})")
    pki = LOCAL_CLUSTER / "pki"
    key = base64.b64encode(b"/registry/").decode()
    ask = ["curl", "-s", "--max-time", "5", "-X", "POST", "-d", f'{{"key": "{key}"}}']
    answers = {
        name: subprocess.run([*ask, *extra, url], capture_output=True, text=True, check=False)
        for name, extra, url in [
            ("plain http", [], "http://127.0.0.1:12379/v3/kv/range"),
            ("no client certificate", ["-k"], "https://127.0.0.1:12379/v3/kv/range"),
            ("the apiserver's", ["--cacert", f"{pki}/ca.crt", "--cert", f"{pki}/etcd-client.crt",
                                 "--key", f"{pki}/etcd-client.key"],
             "https://127.0.0.1:12379/v3/kv/range"),
        ]
    }  # fmt: skip
    assert '"header"' in answers["the apiserver's"].stdout, answers["the apiserver's"]
    for name in ("plain http", "no client certificate"):
        assert '"header"' not in answers[name].stdout, f"etcd answered {name}: {answers[name]}"


def test_a_pod_has_no_route_out(cluster_driver: KubernetesDriver) -> None:
    """A pod reaches neither the host nor anything beyond it: no default route, no gateway."""
    if cluster_driver.cluster.kubeconfig != str(LOCAL_CLUSTER / "kubeconfig"):
        pytest.skip(f"not the local cluster ({cluster_driver.cluster.kubeconfig})")
    with cluster_driver.create(SandboxSpec()) as sandbox:
        routes = sandbox.exec(["ip", "route"]).check().stdout
    assert "default" not in routes, routes
