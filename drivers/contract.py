"""The driver contract, public: every name a driver of its own needs, in one import.

``from drivers.contract import Driver, Launch, Sandbox, ...``. Each name is defined where it
lives (``drivers.base``, ``drivers.sandbox``, ``drivers.commands``, ``gpuhost``); this module
is the one a driver author imports and reads first, and what ``__all__`` lists is what this
project keeps stable. docs/writing-a-driver.md names each of them
(tests/test_reading_list.py holds it to that).
"""

from __future__ import annotations

from drivers.base import Availability, Driver, Elsewhere, Launch
from drivers.commands import DEFAULT_EXEC_TIMEOUT_S, Command, CommandTimedOut, ExecResult, Output
from drivers.sandbox import Sandbox
from gpuhost.devices import GpuDevice
from gpuhost.errors import (
    ExecTimeout,
    InvalidDriverConfig,
    SandboxExecError,
    SandboxStartError,
    UnsupportedGpuRequest,
)
from gpuhost.leases import Holder
from gpuhost.spec import (
    DRIVER_SCHEDULER,
    HOST_REGISTRY,
    VENDORS,
    DriverCapabilities,
    DriverRequest,
    GpuPlan,
    SandboxSpec,
)

__all__ = [
    "DEFAULT_EXEC_TIMEOUT_S",
    "DRIVER_SCHEDULER",
    "HOST_REGISTRY",
    "VENDORS",
    "Availability",
    "Command",
    "CommandTimedOut",
    "Driver",
    "DriverCapabilities",
    "DriverRequest",
    "Elsewhere",
    "ExecResult",
    "ExecTimeout",
    "GpuDevice",
    "GpuPlan",
    "Holder",
    "InvalidDriverConfig",
    "Launch",
    "Output",
    "Sandbox",
    "SandboxExecError",
    "SandboxSpec",
    "SandboxStartError",
    "UnsupportedGpuRequest",
]
