"""Reaching a cluster's API server and reading what it answers.

Where the cluster is: ``KUBECONFIG`` (its first file), else
``/run/gpu-sandbox-cluster/kubeconfig``, the local cluster's, when it exists, else
``~/.kube/config``; ``GPU_SANDBOX_K8S_CONTEXT`` picks a context of it. In a pod with none of
those (the catalogue as a Job, ``conformance.job``), the pod's service account: the
client's in-cluster configuration. Calls are made with
``_preload_content=False`` and their JSON read as it is: no model objects of the client.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

LOCAL_KUBECONFIG = Path("/run/gpu-sandbox-cluster/kubeconfig")
SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
IN_CLUSTER = "in-cluster"
"""The ``kubeconfig`` a cluster reached through the pod's service account is named by."""


@dataclass(frozen=True)
class Cluster:
    """Where the driver found its cluster: for probe() and reports."""

    kubeconfig: str
    context: str


def find_kubeconfig() -> Path | None:
    """``KUBECONFIG`` (its first file), the local cluster's, or ``~/.kube/config``."""
    if os.environ.get("KUBECONFIG"):
        return Path(os.environ["KUBECONFIG"].split(os.pathsep)[0])
    if LOCAL_KUBECONFIG.exists():
        return LOCAL_KUBECONFIG
    default = Path.home() / ".kube" / "config"
    return default if default.exists() else None


def in_cluster() -> bool:
    """In a pod, with its service account's token: the API server is reachable as its own."""
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and SERVICE_ACCOUNT_TOKEN.exists()


def json_body(response: object) -> Any:
    """The JSON body of a call made with ``_preload_content=False`` (no model objects)."""
    return json.loads(cast(Any, response).data)


def said(exc: Exception) -> str:
    """What the API server (or the connection to it) said, in one line."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        try:
            message = json.loads(exc.body or "{}").get("message")
        except ValueError:
            message = None
        return f"{exc.status} {exc.reason}: {message or exc.body}"
    return f"{type(exc).__name__}: {exc}"
