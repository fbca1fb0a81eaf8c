"""The kubernetes driver's hold on its cluster: the connection, its namespace, its pods.

One namespace for every session (``GPU_SANDBOX_K8S_NAMESPACE``, default ``gpu-sandbox``),
its pods labelled by session: a namespace being deleted refuses new pods, and a session is
reaped after every test. The namespace is made once, with a NetworkPolicy that lets no
traffic in or out of the sandboxes where the cluster's network plugin enforces policies.
GPUs are the resource ``GPU_SANDBOX_K8S_RESOURCE`` (default ``nvidia.com/gpu``).

A sandbox's processes ending (``kill``) leave the pod Failed, which neither the scheduler
nor the kubelet count as holding GPUs. A pod belongs to the API server, not to the process
that made it: ``reap`` (one delete by label) removes a session's pods from any process.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from drivers.base import Driver
from drivers.kubernetes.api import (
    IN_CLUSTER,
    LOCAL_KUBECONFIG,
    Cluster,
    find_kubeconfig,
    in_cluster,
    json_body,
)
from drivers.kubernetes.exec import PodExec
from drivers.kubernetes.pods import MANAGED_BY
from drivers.labels import DRIVER_LABEL, SESSION_LABEL
from gpuhost.host import GpuHost
from gpuhost.wait import wait_for

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, CoreV1Api
    from kubernetes.client.configuration import Configuration

DEFAULT_NAMESPACE = "gpu-sandbox"
DEFAULT_RESOURCE = "nvidia.com/gpu"
DELETE_TIMEOUT_S = 60.0
NODE_ENV = "GPU_SANDBOX_K8S_NODE"
"""A node's name: every pod goes to that node, and the driver's GPUs are that node's."""


class ClusterDriver(Driver):
    """A driver whose sandboxes are pods of one namespace of a cluster (still abstract)."""

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        super().__init__(host, session_id, image)
        self.namespace = os.environ.get("GPU_SANDBOX_K8S_NAMESPACE") or DEFAULT_NAMESPACE
        self.resource = os.environ.get("GPU_SANDBOX_K8S_RESOURCE") or DEFAULT_RESOURCE
        self.node = os.environ.get(NODE_ENV) or None
        """The one node its pods go to, where a run judges a cluster node by node."""
        self._namespace_ready = threading.Lock()
        self._namespace_made = False

    # -- the cluster ---------------------------------------------------------------------

    @functools.cached_property
    def cluster(self) -> Cluster:
        from kubernetes import config

        path = find_kubeconfig()
        if path is None and in_cluster():
            return Cluster(IN_CLUSTER, "")
        if path is None:
            raise FileNotFoundError(
                f"no kubeconfig: KUBECONFIG is unset, neither {LOCAL_KUBECONFIG} nor "
                "~/.kube/config exists, and this is no pod with a service account token"
            )
        contexts, active = config.list_kube_config_contexts(config_file=str(path))  # type: ignore[no-untyped-call]
        wanted = os.environ.get("GPU_SANDBOX_K8S_CONTEXT") or (active or {}).get("name", "")
        if contexts and wanted not in {c["name"] for c in contexts}:
            raise LookupError(f"{path} has no context {wanted!r}")
        return Cluster(str(path), wanted)

    @functools.cached_property
    def configuration(self) -> Configuration:
        from kubernetes import client, config

        configuration = client.Configuration()
        if self.cluster.kubeconfig == IN_CLUSTER:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=self.cluster.kubeconfig,
                context=self.cluster.context or None,
                client_configuration=configuration,
            )
        # Concurrent creates (the catalogue's threads) each hold a connection.
        configuration.connection_pool_maxsize = 64
        return configuration

    def api_client(self) -> ApiClient:
        from kubernetes import client

        return client.ApiClient(self.configuration)

    @functools.cached_property
    def core(self) -> CoreV1Api:
        from kubernetes import client

        return client.CoreV1Api(self.api_client())

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's nodes; the one it is pinned to (``node``) alone, where it is."""
        if self.node is None:
            return list(json_body(self.core.list_node(_preload_content=False))["items"])
        field = f"metadata.name={self.node}"
        nodes = self.core.list_node(field_selector=field, _preload_content=False)
        return list(json_body(nodes)["items"])

    def pods(self) -> list[dict[str, Any]]:
        pods = self.core.list_pod_for_all_namespaces(_preload_content=False)
        return list(json_body(pods)["items"])

    def session_pods(self, session_id: str) -> list[dict[str, Any]]:
        pods = self.core.list_namespaced_pod(
            self.namespace,
            label_selector=f"{SESSION_LABEL}={session_id},{DRIVER_LABEL}={self.name}",
            _preload_content=False,
        )
        return list(json_body(pods)["items"])

    def pods_named(self, names: set[str]) -> list[dict[str, Any]]:
        pods = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{DRIVER_LABEL}={self.name}", _preload_content=False
        )
        return [pod for pod in json_body(pods)["items"] if pod["metadata"]["name"] in names]

    # -- the namespace -------------------------------------------------------------------

    def _ensure_namespace(self) -> None:
        from kubernetes.client.exceptions import ApiException

        with self._namespace_ready:
            if self._namespace_made:
                return
            try:
                self.core.create_namespace(
                    cast(Any, {"metadata": {"name": self.namespace, "labels": dict(MANAGED_BY)}})
                )
            except ApiException as exc:
                if exc.status != 409:
                    raise
            self._deny_network()
            self._namespace_made = True

    def _deny_network(self) -> None:
        """No traffic in or out of the sandboxes, where the cluster's network enforces it."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        policy = {
            "metadata": {"name": "gpu-sandbox-deny-all", "labels": dict(MANAGED_BY)},
            "spec": {
                "podSelector": {"matchLabels": dict(MANAGED_BY)},
                "policyTypes": ["Ingress", "Egress"],
            },
        }
        try:
            client.NetworkingV1Api(self.api_client()).create_namespaced_network_policy(
                self.namespace, cast(Any, policy)
            )
        except ApiException as exc:
            if exc.status != 409:
                raise

    # -- the pods' processes -------------------------------------------------------------

    @property
    def execs(self) -> PodExec:
        """Commands in the namespace's pods, through the API's exec stream (``exec.py``)."""
        return PodExec(self.api_client, self.namespace)

    def delete_pods(self, names: Sequence[str]) -> None:
        """End pods' processes, delete them, and return once the API server no longer has them.

        Their processes are killed first (from inside, ``kill -9 -1``, which ends the pod's
        first process too): then nothing of them can hold a GPU, and the delete needs no
        grace period, which would make the kubelet's housekeeping (every 2 s) the one to
        confirm it. Once a pod is gone from the API, the scheduler and the kubelet's device
        manager give its GPUs to the next pod.
        """
        from kubernetes.client.exceptions import ApiException

        if len(names) > 1:
            with ThreadPoolExecutor(min(len(names), 16)) as pool:
                list(pool.map(self.execs.kill_all, names))
        elif names:
            self.execs.kill_all(names[0])
        for name in names:
            try:
                self.core.delete_namespaced_pod(
                    name, self.namespace, grace_period_seconds=0, _preload_content=False
                )
            except ApiException as exc:
                if exc.status != 404:
                    raise
        wanted = set(names)
        wait_for(
            lambda: [p["metadata"]["name"] for p in self.pods_named(wanted)],
            lambda left: not left,
            timeout_s=DELETE_TIMEOUT_S,
            what=f"the API server to remove pods {sorted(wanted)} of {self.namespace}",
            hint=f"see kubectl get pods -n {self.namespace} -l {DRIVER_LABEL}={self.name}",
        )
