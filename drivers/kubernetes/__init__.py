"""The kubernetes driver: a pod per sandbox, on a cluster whose device plugin hands out GPUs.

``driver.py`` (``KubernetesDriver``: the contract, a pod's start, what it was given),
``cluster.py`` (the connection, the namespace, deleting pods), ``pods.py`` (the pod
manifest, its labels, the cluster's pods read as JSON), ``options.py`` (a sandbox's own pod
options), ``exec.py`` (commands through the API's exec stream), ``sandbox.py``
(``KubernetesSandbox``), ``turn.py`` (catalogue runs taking turns on a cluster), ``api.py``
(the kubeconfig, the API server's answers).

Options, from the environment: ``KUBECONFIG`` (else ``/run/gpu-sandbox-cluster/kubeconfig``,
the local cluster's, when it exists, else ``~/.kube/config``), ``GPU_SANDBOX_K8S_CONTEXT``,
``GPU_SANDBOX_K8S_NAMESPACE`` (default ``gpu-sandbox``, one for every session: see
``cluster.py``), ``GPU_SANDBOX_K8S_RESOURCE`` (default ``nvidia.com/gpu``),
``GPU_SANDBOX_K8S_START_TIMEOUT_S`` (default 120), ``GPU_SANDBOX_K8S_TURN_TIMEOUT_S``
(default 600), ``GPU_SANDBOX_K8S_NODE`` (every pod to that node: a run that judges the
cluster node by node, ``conformance.nodes``). Per sandbox,
``template.driver_config.kubernetes`` takes ``runtime_class_name``, ``node_selector`` and
``image`` (``options.py``).
"""

from drivers.images import DEFAULT_IMAGE
from drivers.kubernetes.cluster import DEFAULT_NAMESPACE, DEFAULT_RESOURCE
from drivers.kubernetes.driver import KubernetesDriver
from drivers.kubernetes.exec import exit_status
from drivers.kubernetes.pods import (
    GRANT_LINE,
    free_gpus,
    granted_uuids,
    pod_gpu_request,
    pod_manifest,
)
from drivers.kubernetes.sandbox import KubernetesSandbox
from drivers.kubernetes.turn import CatalogueTurn, micro_time

__all__ = [
    "DEFAULT_IMAGE",
    "DEFAULT_NAMESPACE",
    "DEFAULT_RESOURCE",
    "GRANT_LINE",
    "CatalogueTurn",
    "KubernetesDriver",
    "KubernetesSandbox",
    "exit_status",
    "free_gpus",
    "granted_uuids",
    "micro_time",
    "pod_gpu_request",
    "pod_manifest",
]
