"""What a container engine is asked and answers: labels, timeouts, a request, its errors.

Every container carries labels (``drivers.labels``): the session, the sandbox id, the driver
and the CDI devices it holds; ``session_containers`` finds a session's by them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gpuhost.devices import DeviceNode

API_TIMEOUT_S = 60
"""For every engine call but exec, which runs as long as the command: a minute means stuck."""
LIVENESS_TIMEOUT_S = 5
"""Does a container still exist? An engine answers in milliseconds; a request waits on it."""
EXEC_API_TIMEOUT_S = 24 * 3600
"""Exec's own timeout kills the command, which ends the call; this only bounds a lost engine."""
STOP_TIMEOUT_S = 10
"""A container whose keepalive closed exits in milliseconds; then it is removed by force."""
REAP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ContainerRequest:
    """Everything the engine needs to start one sandbox's container."""

    name: str
    image: str
    command: tuple[str, ...]
    labels: Mapping[str, str]
    cdi_devices: tuple[str, ...]
    env: Mapping[str, str]
    keepalive: Path
    """A FIFO on the host, bound read-only at ``KEEPALIVE_PATH`` inside."""
    device_nodes: tuple[DeviceNode, ...] = ()
    """Nodes passed as they are, read-write at the same path: AMD and Intel GPUs' DRI nodes
    (and /dev/kfd), as ROCm's and Intel's container guides pass them; NVIDIA's go by CDI."""
    tool_mounts: tuple[tuple[str, str], ...] = ()
    """Read-only binds (host path, container path) of a simulated host's GPU tools, for
    devices no CDI spec brings them with (its spec mounts them with NVIDIA's)."""


Client = TypeVar("Client")


def client_cache(make: Callable[[str, int], Client]) -> Callable[[str, int], Client]:
    """One engine client per URL, timeout, process and thread.

    A forked child must not share its parent's connections, and a client's HTTP session is
    not made for threads: an exec's hijacked stream read while another thread uses the same
    session can come back empty. Exec's client waits as long as the command runs.
    """
    local = threading.local()

    def client(url: str, timeout: int) -> Client:
        clients: dict[tuple[str, int, int], Client] = local.__dict__.setdefault("clients", {})
        key = (url, timeout, os.getpid())
        if key not in clients:
            clients[key] = make(url, timeout)
        return clients[key]

    return client


class EngineError(Exception):
    """An engine call failed; the message is the engine's own."""
