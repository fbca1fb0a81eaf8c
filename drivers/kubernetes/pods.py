"""A sandbox's pod as the API takes it, and pods as the API returns them (plain JSON).

The GPU request becomes the pod's ``resources.limits["nvidia.com/gpu"]`` (a default request
is 1; no request, no limit): the scheduler picks a node with that many free, and the node's
device plugin picks the GPUs and injects them. The pod's first process prints what the
device plugin gave it (``GRANT_LINE``) and waits. Every pod carries labels naming its
session, its sandbox and its driver, and everything the driver makes is labelled
``MANAGED_BY``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from gpuhost.requestjson import thawed

MANAGED_BY = {"app.kubernetes.io/managed-by": "gpu-sandbox"}
SECURITY_CONTEXT: Mapping[str, Any] = MappingProxyType(
    {
        "privileged": False,
        "allowPrivilegeEscalation": False,  # no_new_privs in every process of the container
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
)
"""A sandbox's container: no privilege, no capability, no way to gain one."""
GRANT_LINE = "gpu-sandbox: NVIDIA_VISIBLE_DEVICES="
# The pod's main process: it says what the device plugin gave it, then waits; SIGTERM ends
# it at once (a pod's first process has no default handlers), and so does the death of its
# child, so that SIGKILL of the sandbox's processes ends the pod as a crash would.
MAIN_SCRIPT = (
    f'echo "{GRANT_LINE}${{NVIDIA_VISIBLE_DEVICES-}}"; trap "exit 0" TERM; '
    "while :; do sleep 86400 & wait $! || exit 137; done"
)


def pod_manifest(
    *,
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    image: str,
    env: Mapping[str, str],
    resource: str,
    gpus: int,
    runtime_class_name: str | None = None,
    node_selector: Mapping[str, str] | None = None,
    node: str | None = None,
    security_context: Mapping[str, Any] = MappingProxyType({}),
) -> dict[str, Any]:
    """The pod of one sandbox, as the API takes it.

    No service account token, no service links, no host namespaces, and its container's
    ``security_context`` (``SECURITY_CONTEXT`` by default: no privilege, no capability,
    no-new-privileges, the runtime's default seccomp profile); the GPU limit only when GPUs
    are asked for (extended resources are requested by their limit). ``node``: the pod goes
    to that node alone, by its name, through the scheduler (as a DaemonSet's pods do).
    """
    container: dict[str, Any] = {
        "name": "sandbox",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", MAIN_SCRIPT],
        "env": [{"name": key, "value": value} for key, value in sorted(env.items())],
        "securityContext": thawed(security_context or SECURITY_CONTEXT),
    }
    if gpus:
        container["resources"] = {"limits": {resource: str(gpus)}}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 5,
        "containers": [container],
    }
    if runtime_class_name:
        spec["runtimeClassName"] = runtime_class_name
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if node:
        on_the_node = {
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]
        }
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [on_the_node]
                }
            }
        }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": spec,
    }


def pod_gpu_request(pod: Mapping[str, Any], resource: str) -> int:
    """The GPUs a pod (as the API returns it, a dict) asks for: its containers' limits."""
    total = 0
    for container in pod.get("spec", {}).get("containers") or []:
        resources = container.get("resources") or {}
        amount = (resources.get("limits") or {}).get(resource) or (
            resources.get("requests") or {}
        ).get(resource)
        total += int(amount or 0)
    return total


def free_gpus(
    nodes: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]], resource: str
) -> tuple[int, int, int]:
    """(most free on one node, most free once deleting pods are gone, allocatable in all).

    Pods bound to a node and not finished hold their GPUs; a finished pod (Succeeded,
    Failed) holds none, as the scheduler and the kubelet count them.
    """
    held: dict[str, int] = {}
    leaving: dict[str, int] = {}
    for pod in pods:
        node = pod.get("spec", {}).get("nodeName")
        if not node or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        amount = pod_gpu_request(pod, resource)
        held[node] = held.get(node, 0) + amount
        if pod.get("metadata", {}).get("deletionTimestamp"):
            leaving[node] = leaving.get(node, 0) + amount
    total = free_now = free_later = 0
    for node in nodes:
        name = node["metadata"]["name"]
        allocatable = int((node.get("status", {}).get("allocatable") or {}).get(resource) or 0)
        total += allocatable
        free_now = max(free_now, allocatable - held.get(name, 0))
        free_later = max(free_later, allocatable - held.get(name, 0) + leaving.get(name, 0))
    return max(free_now, 0), max(free_later, 0), total


def granted_uuids(log: str) -> list[str] | None:
    """The UUIDs the pod printed at start (``GRANT_LINE``); None while it has not."""
    for line in log.splitlines():
        if line.startswith(GRANT_LINE):
            value = line[len(GRANT_LINE) :].strip()
            return [item for item in value.split(",") if item.startswith(("GPU-", "MIG-"))]
    return None
