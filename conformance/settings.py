"""A run's settings, read once from its options: the drivers, the host, the session."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conformance.bounds import DriverPace
from drivers import REGISTRY, UnknownDriver, get_driver_class
from drivers.base import Driver
from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost, HostConfig


@dataclass
class Settings:
    drivers: dict[str, type[Driver]]
    explicit: bool
    host_config: HostConfig
    session_id: str
    image: str | None
    reclaim_timeout_s: float
    exhaustion_grace_s: float | None
    """How much longer than a create an exhausted request may take to fail; None: the
    driver's own ``exhaustion_grace_s``."""
    lanes_at_once: int = 1
    """Runs sharing the machine with this one (``--lanes-at-once``): the bounds allow for them."""
    unavailable: dict[str, str] = field(default_factory=dict)
    """Driver → why it cannot run here, once its probe said so (in this process)."""
    paces: dict[str, DriverPace] = field(default_factory=dict)
    """Driver → its ``conformance.bounds.DriverPace``: the pace of its calls so far."""

    @functools.cached_property
    def host(self) -> GpuHost:
        """The GPU host, discovered once per session (NVML is not free on a real host)."""
        return GpuHost.open(self.host_config)


settings_key = pytest.StashKey[Settings]()
SESSION_KEY = "gpu_sandbox_session"
SIM_ROOT_KEY = "gpu_sandbox_sim_root"
"""What an xdist worker is handed by the controller (``workerinput``)."""


def settings_from(config: pytest.Config) -> Settings:
    """The settings of the options; a worker's session and simulated host are its controller's."""
    options: list[str] = config.getoption("--driver") or []
    names = list(dict.fromkeys(n.strip() for o in options for n in o.split(",") if n.strip()))
    lane = config.getoption("--lane")
    if lane is not None and (names or lane not in REGISTRY):
        raise pytest.UsageError(
            f"--lane={lane}: one built-in driver ({', '.join(REGISTRY)}), without --driver"
        )
    at_once = config.getoption("--lanes-at-once")
    if at_once < 1:
        raise pytest.UsageError(f"--lanes-at-once={at_once}: at least 1")
    chosen = names or ([lane] if lane else list(REGISTRY))
    try:
        drivers = {name: get_driver_class(name) for name in chosen}
    except UnknownDriver as exc:
        raise pytest.UsageError(str(exc)) from None
    return Settings(
        drivers=drivers,
        explicit=bool(names),
        host_config=HostConfig(
            _worker_sim_root(config) or config.getoption("--sim-root"),
            config.getoption("--gpu-state-dir"),
            config.getoption("--gpu-share-limit"),
        ),
        session_id=getattr(config, "workerinput", {}).get(SESSION_KEY) or uuid.uuid4().hex[:16],
        image=config.getoption("--image"),
        reclaim_timeout_s=config.getoption("--reclaim-timeout"),
        exhaustion_grace_s=config.getoption("--exhaustion-grace"),
        lanes_at_once=at_once,
    )


def _worker_sim_root(config: pytest.Config) -> Path | None:
    root = getattr(config, "workerinput", {}).get(SIM_ROOT_KEY)
    return Path(root) if root else None


def driver_of(item: pytest.Item) -> str | None:
    """The driver a test runs on, if it takes one."""
    params = getattr(item, "callspec", None)
    return params.params.get("driver") if params else None


def gpu_model(gpus: Iterable[GpuDevice]) -> str:
    """The models of ``gpus``, as a report names them: sorted, once each."""
    return ", ".join(sorted({gpu.name for gpu in gpus}))


def gpu_properties(host: GpuHost) -> dict[str, Any]:
    """What a report says of the host's GPUs."""
    return {
        "gpu_model": gpu_model(host.gpus),
        "gpu_count": len(host.gpus),
        "simulated": "true" if host.simulated else "false",
    }
