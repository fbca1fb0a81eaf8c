"""The error hierarchy every driver maps its native failures to.

Conformance tests assert on these types, so each encodes one semantic the suite checks:
a bad request (``InvalidGpuRequest``), a request the driver cannot serve at all
(``UnsupportedGpuRequest``), and a request the host cannot serve right now
(``GpusExhausted``, ``GpuBusy``).
"""

from __future__ import annotations

from collections.abc import Sequence


class DriverError(Exception):
    """Base of every error a driver raises on purpose."""


class RequestError(DriverError):
    """A refused request: ``field`` is where the problem is, ``value`` what was found there."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        super().__init__(problem)
        self.field = field
        self.value = value


class InvalidGpuRequest(RequestError, ValueError):
    """A GPU request that is malformed or inconsistent; raised before anything is allocated."""


class InvalidDriverConfig(InvalidGpuRequest):
    """The driver_config envelope or the active driver's block is malformed."""


class InvalidGpuCount(InvalidGpuRequest):
    """``resource_requirements.gpu.count`` is not a positive integer."""


class InvalidGpuSharing(InvalidGpuRequest):
    """``resource_requirements.gpu.sharing`` is neither ``exclusive`` nor ``shared``."""


class DuplicateGpuDevice(InvalidGpuRequest):
    """The same device is named twice in ``gpu_device_ids``."""


class GpuDevicesWithoutRequest(InvalidGpuRequest):
    """Exact device IDs were given without ``resource_requirements.gpu``."""


class GpuCountMismatch(InvalidGpuRequest):
    """``gpu.count`` differs from the number of exact device IDs."""


class UnknownGpuDevice(InvalidGpuRequest):
    """An exact device ID names no GPU on this host."""


class UnsupportedGpuRequest(RequestError):
    """A well-formed request that this driver can never serve (a capability it lacks)."""


class GpuAllocationError(DriverError):
    """A valid request that cannot be served now because of what other sandboxes hold."""


class GpusExhausted(GpuAllocationError):
    """Fewer GPUs are free than were requested."""

    def __init__(self, requested: int, available: int, total: int, why: str = "") -> None:
        super().__init__(
            f"GPU sandbox requested {requested} GPUs, but only {available} selectable "
            f"of {total} devices are available" + (f" ({why})" if why else "")
        )
        self.requested = requested
        self.available = available
        self.total = total


class GpuBusy(GpuAllocationError):
    """An exactly requested GPU is held by another sandbox."""

    def __init__(self, device: str, holder: str) -> None:
        super().__init__(f"GPU {device} is already assigned to another sandbox ({holder})")
        self.device = device
        self.holder = holder


class UnknownImage(RequestError, ValueError):
    """The spec's (or ``--image``'s) image is not in the engine; nothing was allocated."""


class SandboxStartError(DriverError):
    """The sandbox could not be started; everything it took has been released."""


class SandboxExecError(DriverError):
    """A command could not be run inside the sandbox (not a non-zero exit of the command)."""


class ExecTimeout(SandboxExecError):
    """A command inside the sandbox ran past its timeout and was killed."""

    def __init__(self, argv: Sequence[str], timeout_s: float) -> None:
        super().__init__(f"{list(argv)!r} ran past its timeout of {timeout_s:g} s and was killed")
        self.argv = tuple(argv)
        self.timeout_s = timeout_s
