"""The driver contract every sandbox driver implements, built-in or out of tree.

The flow is one-directional: spec → validate → allocate → inject → observe.

- ``Driver.validate(spec)`` turns a ``SandboxSpec`` into a ``GpuPlan`` or raises a typed
  error, before anything is allocated;
- ``Driver.create(spec)`` allocates GPUs (from the host-wide lease registry for local
  drivers), injects them into a new sandbox and returns a running ``Sandbox``;
- ``Sandbox.exec`` observes from inside; ``Sandbox.gpus`` is what the driver says it gave.
"""

from __future__ import annotations

import shlex
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar

from gpuhost.devices import GpuDevice
from gpuhost.errors import DuplicateGpuDevice, UnknownGpuDevice
from gpuhost.host import GpuHost
from gpuhost.spec import DriverCapabilities, GpuPlan, SandboxSpec, validate_gpu_request

DEFAULT_EXEC_TIMEOUT_S = 120.0
"""Long enough for a workload payload to import CUDA libraries on a cold host."""


@dataclass(frozen=True)
class Availability:
    """Whether a driver can run here; ``reason`` says what was needed and what was found."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class ExecResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def check(self) -> ExecResult:
        """Return self when the command succeeded; fail the test with its output otherwise."""
        __tracebackhide__ = True
        if self.returncode != 0:
            raise AssertionError(
                f"{shlex.join(self.argv)} exited {self.returncode}\n"
                f"stdout: {self.stdout.strip()}\nstderr: {self.stderr.strip()}"
            )
        return self


class Sandbox(ABC):
    """A running sandbox; a context manager that closes it.

    ``gpus`` are the GPUs the driver says it assigned, in host PCI order.
    """

    def __init__(self, sandbox_id: str, driver: str, gpus: tuple[GpuDevice, ...]) -> None:
        self.id = sandbox_id
        self.driver = driver
        self.gpus = gpus

    @abstractmethod
    def exec(self, argv: Sequence[str], timeout: float = DEFAULT_EXEC_TIMEOUT_S) -> ExecResult:
        """Run ``argv`` inside the sandbox and wait for it.

        A non-zero exit is a result, not an error; ``ExecTimeout`` is raised when the command
        outlives ``timeout`` (it is killed), ``SandboxExecError`` when it cannot be run.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop the sandbox and release its GPUs; calling it again does nothing."""

    @abstractmethod
    def kill(self) -> None:
        """Kill the sandbox's processes with SIGKILL and release nothing, as a crash would.

        The conformance suite uses it to check that the GPUs come back by themselves.
        """

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        gpus = ", ".join(gpu.uuid for gpu in self.gpus) or "no GPUs"
        return f"<{type(self).__name__} {self.id} of {self.driver} with {gpus}>"


class Driver(ABC):
    """A way to create GPU sandboxes. Subclasses set ``name`` and implement the abstracts.

    A driver is constructed with the host it hands GPUs out from and the id of the test
    session, which it stamps on everything it creates so that ``reap`` can find it.
    """

    name: ClassVar[str]
    exhaustion_grace_s: ClassVar[float] = 1.0
    """How much longer than a successful create a request for more GPUs than are free may
    take to fail (GPU-EXHAUST-01). A second is plenty for a driver that decides locally; a
    driver that must ask a scheduler sets (and documents) a longer one."""

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        self.host = host
        self.session_id = session_id
        self.image = image

    @property
    @abstractmethod
    def capabilities(self) -> DriverCapabilities:
        """Per-sandbox maximum, exact-ID support and form, exclusivity."""

    @abstractmethod
    def probe(self) -> Availability:
        """Check, without side effects, that this driver can run here."""

    @abstractmethod
    def inventory(self) -> tuple[GpuDevice, ...]:
        """The GPUs this driver can hand out, in PCI order."""

    @abstractmethod
    def create(self, spec: SandboxSpec) -> Sandbox:
        """Validate, allocate, start. Raises before allocating when the spec is invalid."""

    @abstractmethod
    def sandboxes(self, session_id: str) -> list[str]:
        """Ids of the sandboxes of ``session_id`` that still exist."""

    @abstractmethod
    def reap(self, session_id: str) -> list[str]:
        """Remove everything ``session_id`` left behind; returns what was removed."""

    @abstractmethod
    def device_ids(self, gpu: GpuDevice) -> tuple[str, ...]:
        """The exact, driver-native IDs that name ``gpu`` in ``gpu_device_ids``."""

    def version(self) -> str:
        """What the driver runs on, for reports (e.g. ``bubblewrap 0.8.0``); "" if unknown.

        Quick and without side effects. Where the driver cannot run it may raise; the
        reports then say "unknown" and why.
        """
        return ""

    def validate(self, spec: SandboxSpec) -> GpuPlan | None:
        """Validate the GPU request against this driver; ``None`` means no GPU."""
        return validate_gpu_request(spec, self.name, self.capabilities)

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        """Map a plan's exact IDs to host GPUs; unknown IDs and aliases of one GPU fail."""
        by_id = {device_id: gpu for gpu in self.inventory() for device_id in self.device_ids(gpu)}
        chosen: dict[str, tuple[str, GpuDevice]] = {}
        for device_id in plan.device_ids:
            gpu = by_id.get(device_id)
            if gpu is None:
                raise UnknownGpuDevice(
                    plan.field,
                    device_id,
                    f"{plan.field} names an unknown device '{device_id}' "
                    f"(the {self.name} driver accepts {self.capabilities.exact_id_forms}; "
                    f"this host has {len(self.inventory())} GPUs)",
                )
            if gpu.uuid in chosen:
                first = chosen[gpu.uuid][0]
                raise DuplicateGpuDevice(
                    plan.field,
                    device_id,
                    f"{plan.field} contains duplicate device ID '{device_id}': "
                    f"'{first}' names the same GPU ({gpu.uuid})",
                )
            chosen[gpu.uuid] = (device_id, gpu)
        return tuple(gpu for _, gpu in chosen.values())
