"""The driver contract every sandbox driver implements, built-in or out of tree.

The flow is one-directional: spec → plan → allocate → start (inject) → observe, and
``Driver.create`` owns it, so that a driver implements only what is its own:

0. the gateway (``gpuhost.spec.select``) hands the driver its own block of the request's
   ``template.driver_config``, as a ``DriverRequest``; no other driver's block reaches it;
1. ``plan(request)``: every check of the request, in the documented order, and the exact
   IDs resolved to GPUs; a typed error, and nothing taken, when any fails;
2. ``allocate``: the GPUs leased from the host-wide registry, held by this process, where
   the driver declares that the registry allocates (``capabilities.allocated_by``; a
   cluster's scheduler allocates for itself);
3. ``start(launch)``: the one thing each driver does differently, returning a running
   ``Sandbox`` that holds exactly the launch's GPUs;
4. the leases handed over to what now embodies the sandbox (``Sandbox.holder``), unless
   ``start`` already did (a container holds them before it runs: ``launch.hand_over``);
5. on any failure, the leases released (``abandon``), and the error raised.

``Sandbox.exec`` observes from inside; ``Sandbox.gpus`` is what the driver says it gave.
A driver whose lease holders are not processes (a container, a VM managed by a daemon)
names their kind in ``holder_kind`` and judges them in ``holder_alive``: the contract
registers the check with the lease registry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, final

from drivers import watch
from drivers.commands import DEFAULT_EXEC_TIMEOUT_S as DEFAULT_EXEC_TIMEOUT_S
from drivers.commands import KEPT_BYTES as KEPT_BYTES
from drivers.commands import Command as Command
from drivers.commands import CommandTimedOut as CommandTimedOut
from drivers.commands import ExecResult as ExecResult
from drivers.commands import Output as Output
from drivers.commands import check_argv as check_argv
from drivers.commands import check_timeout as check_timeout
from drivers.commands import write_all as write_all
from drivers.sandbox import Sandbox as Sandbox
from gpuhost.devices import GpuDevice, pci_spellings
from gpuhost.errors import (
    DuplicateGpuDevice,
    GpuCountMismatch,
    UnknownGpuDevice,
    UnsupportedGpuRequest,
    shown,
)
from gpuhost.host import GpuHost
from gpuhost.idforms import ids_of
from gpuhost.leases import PROCESS, Holder, LeaseOwner, register_liveness
from gpuhost.spec import (
    HOST_REGISTRY,
    DriverCapabilities,
    DriverRequest,
    GpuPlan,
    SandboxSpec,
    block_field,
    select,
)
from gpuhost.validation import validate_gpu_request

SESSION_ID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?")
"""A session id: a Kubernetes label value (63 characters at most, letters and digits at each
end, '-', '_' and '.' between), so that it is safe in a label, a file name, a glob and a
QEMU -name alike: no '/', no '..' of its own, nothing a shell or a glob reads."""


def check_session_id(session_id: str) -> str:
    """``session_id``, when it is one (``SESSION_ID``); ValueError naming it otherwise."""
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise ValueError(
            f"invalid session id {session_id!r}: 1 to 63 letters, digits, '-', '_' and '.', "
            "beginning and ending with a letter or digit"
        )
    return session_id


@dataclass(frozen=True)
class Availability:
    """Whether a driver can run here; ``reason`` says what was needed and what was found."""

    ok: bool
    reason: str = ""


def client_library(module: str, extra: str) -> Availability | None:
    """Why a driver cannot run without the Python package ``module``; None when it imports.

    An engine's client is an optional extra of this project (``[docker]``, ``[podman]``,
    ``[kubernetes]``): a driver author installs the contract and the catalogue alone.
    """
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return Availability(
            False,
            f"needed the Python package {module} (found: {exc}); install it with "
            f"`pip install 'gpu-sandbox-conformance[{extra}]'`",
        )
    return None


@dataclass(frozen=True)
class Elsewhere:
    """Where a driver's sandboxes run when that is not this host: a cluster's node.

    Reports name it, and its GPUs, in the host's place.
    """

    name: str
    """Its name: the report's hostname."""
    description: str
    """What it is, and what hands out its GPUs (a node's device plugins' resources)."""
    gpus: tuple[GpuDevice, ...]
    identity: tuple[str, ...]
    """What makes it itself beside its GPUs, for the report's host identity (a cluster's
    server and the node's uid)."""
    simulated: bool
    kernel_driver: str
    """Its GPUs' kernel driver and its version, as far as it says (or ``simulated``)."""


@dataclass(frozen=True)
class Launch:
    """What ``Driver.start`` gets: everything decided before the sandbox exists."""

    sandbox_id: str
    request: DriverRequest
    """The request as the gateway handed it on: ``request.config`` is the driver's block."""
    plan: GpuPlan | None
    gpus: tuple[GpuDevice, ...]
    hand_over: Callable[[Holder], None]
    """Give the sandbox's leases to ``holder`` now: for a sandbox that must hold them before
    it runs. Otherwise ``create`` hands them to ``Sandbox.holder`` once it has started."""

    @property
    def env(self) -> Mapping[str, str]:
        """The environment the request asks for (``template.env``), over the driver's own."""
        return self.request.env


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
    holder_kind: ClassVar[str] = PROCESS
    """The kind of holder its sandboxes' leases get. Any kind but a process needs
    ``holder_alive``, which the contract registers with the host-wide lease registry (and
    which an entry point in ``gpu_sandbox.liveness`` makes known to every other process)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # The class that names a kind registers its check; its subclasses share it.
        if "holder_kind" in cls.__dict__ and cls.holder_kind != PROCESS:
            register_liveness(cls.holder_kind, cls.holder_alive)
        for contracts_own in ("create", "check_request"):
            if contracts_own in cls.__dict__:
                raise TypeError(
                    f"{cls.__qualname__} overrides Driver.{contracts_own}, the contract's own: "
                    "change a step through its hook (select, validate, plan, allocate, start)"
                )

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        self.host = host
        self.session_id = check_session_id(session_id)
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
        """The GPUs a default or count request chooses among, in PCI order."""

    def exact_devices(self) -> tuple[GpuDevice, ...]:
        """Every device an exact ID may name: the inventory, unless the driver takes more.

        More: MIG instances, GPUs of other vendors, a GPU in MIG mode whole.
        """
        return self.inventory()

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        """The devices a count or default request of ``plan`` chooses among.

        The inventory; a driver that serves ``mig_profile`` or ``vendor`` (see its
        capabilities) chooses among what the plan names.
        """
        return self.inventory()

    @abstractmethod
    def start(self, launch: Launch) -> Sandbox:
        """Start a sandbox holding exactly ``launch.gpus``; it runs when this returns.

        Raise ``SandboxStartError`` (or a typed request error) when it cannot start; the
        contract releases the GPUs. Leave nothing running on the way out.
        """

    @abstractmethod
    def sandboxes(self, session_id: str) -> list[str]:
        """Ids of the sandboxes of ``session_id`` that still exist."""

    def reap(self, session_id: str) -> list[str]:
        """Remove everything ``session_id`` left behind; returns the sandboxes it was.

        The driver's ``remove_session`` removes what it made; then the session's leases go
        (where the host registry allocates).
        """
        removed = self.remove_session(session_id)
        released = []
        if self.capabilities.allocated_by == HOST_REGISTRY:
            released = self.host.leases.release_session(session_id, driver=self.name)
        return sorted({*removed, *(lease.sandbox_id for lease in released)})

    @abstractmethod
    def remove_session(self, session_id: str) -> Iterable[str]:
        """Remove every sandbox of ``session_id``, and what they left; returns their ids.

        Returns once they are gone. ``reap`` releases the session's leases after.
        """

    def device_ids(self, gpu: GpuDevice) -> tuple[str, ...]:
        """The exact IDs that name ``gpu`` in ``gpu_device_ids``, the first its own.

        Written in the forms the driver declares for it (``capabilities.id_forms``, or
        ``other_vendor_id_forms`` for AMD and Intel GPUs), from the one table
        (``gpuhost.idforms``); a driver whose names are native overrides it.
        """
        return ids_of(gpu, self.capabilities.id_forms_of(gpu))

    def sees(self, path: Path) -> bool:
        """Whether a sandbox's commands can read ``path`` of the host, at that path.

        Only a driver whose sandboxes see the host's files (``capabilities.host_filesystem``)
        can; it says which.
        """
        return False

    def device_ids_offline(self, gpu: GpuDevice) -> tuple[str, ...]:
        """``device_ids`` as far as they can be told without asking an engine or a server.

        For listings (``gpu-sandbox gpus``) that must answer when an engine does not. The
        default is ``device_ids``; a driver whose IDs come from its engine overrides it.
        """
        return self.device_ids(gpu)

    @classmethod
    def holder_alive(cls, holder: Holder) -> bool:
        """Whether a lease holder of ``holder_kind`` still lives; True when it cannot tell.

        Asked by the lease registry, outside its lock, while a request waits: answer within
        seconds. Only drivers whose holders are not processes implement it.
        """
        raise NotImplementedError(f"{cls.__name__} names no holder kind of its own")

    def catalogue_turn(self) -> contextlib.AbstractContextManager[None]:
        """What a catalogue run holds while it runs this driver's lane, so that runs take turns.

        Entering may wait for another run (saying so on stderr), and raises when the turn
        does not come in time. Nothing by default: a host's runs take turns already (the
        plugin's run lock); a driver whose GPUs every run shares (a cluster) overrides it.
        """
        return contextlib.nullcontext()

    def runs_on(self) -> Elsewhere | None:
        """Where its sandboxes run, when that is not this host; None (this host) by default.

        A run that judges this driver alone reports that place as its host (a kubernetes
        run pinned to a node reports the node).
        """
        return None

    def version(self) -> str:
        """What the driver runs on, for reports (e.g. ``bubblewrap 0.8.0``); "" if unknown.

        Quick and without side effects. Where the driver cannot run it may raise; the
        reports then say "unknown" and why.
        """
        return ""

    # -- the create sequence -----------------------------------------------------------

    @final
    def create(self, spec: SandboxSpec) -> Sandbox:
        """Select, plan, allocate, start, hand over; on any failure nothing is left taken.

        ``spec`` is the whole request, as a gateway receives it; the driver's own hooks see
        only what ``select`` hands on. The contract's own: a driver changes a step by its
        hook (``select``, ``validate``, ``plan``, ``allocate``, ``start``), never this.
        """
        return watch.current().create(self, spec, lambda: self._create_sequence(spec))

    def _create_sequence(self, spec: SandboxSpec) -> Sandbox:
        request, plan = self.check_request(spec)
        sandbox_id = self.new_sandbox_id()
        registry = self.capabilities.allocated_by == HOST_REGISTRY
        gpus = self.allocate(sandbox_id, plan) if registry and plan is not None else ()
        handed: list[Holder] = []

        def hand_over(holder: Holder) -> None:
            self.host.leases.set_holder(sandbox_id, holder)
            handed.append(holder)

        try:
            sandbox = self.start(Launch(sandbox_id, request, plan, gpus, hand_over))
            try:
                if gpus and not handed:
                    hand_over(sandbox.holder)
            except BaseException:
                sandbox.close()
                raise
        except BaseException:
            if registry:
                self.abandon(sandbox_id)
            raise
        return sandbox

    @final
    def check_request(
        self, spec: SandboxSpec, *, resolve: bool = True
    ) -> tuple[DriverRequest, GpuPlan | None]:
        """The gateway and every check of ``spec``, taking nothing: what ``create`` runs first.

        A typed error for the first check that fails. ``resolve=False`` stops before the
        exact IDs are resolved to this host's GPUs, asking nothing of the host or an engine
        (``validate``): a CLI refuses a bad request so before it probes the driver.
        """
        request = self.select(spec)
        return request, (self.plan(request) if resolve else self.validate(request))

    def select(self, spec: SandboxSpec) -> DriverRequest:
        """The gateway (``gpuhost.spec.select``): the request, with this driver's block alone."""
        return select(spec, self.name)

    def new_sandbox_id(self) -> str:
        """A new sandbox's id, unique across processes and runs."""
        return uuid.uuid4().hex[:12]

    def validate(self, request: DriverRequest) -> GpuPlan | None:
        """The request model's rules for this driver, asking nothing of the host or an engine.

        ``validate_gpu_request``: the driver's own block, the count, this driver's
        capabilities, IDs without a request, duplicates, the count against the IDs. ``None``
        means no GPU. A driver with keys of its own in its block checks them here.
        """
        return validate_gpu_request(request, self.capabilities)

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        """Every check of the request, in the documented order; ``None`` means no GPU.

        ``validate``, then the IDs resolved to this host's GPUs (unknown IDs, two IDs of one
        GPU), or a MIG profile or vendor checked against the host's. Raises before anything
        is taken.
        """
        plan = self.validate(request)
        if plan is None:
            return None
        if plan.device_ids:
            gpus = self.resolve(plan)
            if (
                request.gpu is not None
                and request.gpu.count is not None
                and len(gpus) != plan.count
            ):
                # One ID may name several GPUs (a container's <kind>=all): the count given
                # must be theirs, not the number of IDs.
                raise GpuCountMismatch(
                    plan.field,
                    list(plan.device_ids),
                    f"gpu count ({plan.count}) must match the number of GPUs {plan.field} "
                    f"names ({len(gpus)}): {shown(list(plan.device_ids))}",
                )
            return dataclasses.replace(plan, count=len(gpus), gpus=gpus)
        self.check_choice(plan)
        return plan

    def check_choice(self, plan: GpuPlan) -> None:
        """A MIG profile or vendor that no device of this host has is refused, not exhausted."""
        field = block_field(self.name)
        if plan.mig_profile is not None and not self.pool(plan):
            profiles = sorted({gpu.profile for gpu in self.exact_devices() if gpu.profile})
            raise UnsupportedGpuRequest(
                f"{field}.mig_profile",
                plan.mig_profile,
                f"no MIG instance of this host has the profile {shown(plan.mig_profile)} "
                f"({field}.mig_profile); its profiles: {', '.join(profiles) or 'none'}",
            )
        if plan.vendor is not None and not self.pool(plan):
            vendors = sorted({gpu.vendor for gpu in self.exact_devices()})
            raise UnsupportedGpuRequest(
                f"{field}.vendor",
                plan.vendor,
                f"this host has no {shown(plan.vendor)} GPU ({field}.vendor); its GPUs are "
                f"{', '.join(vendors) or 'none'}",
            )

    def device_index(self) -> dict[str, tuple[GpuDevice, ...]]:
        """Every exact ID this driver takes, with the GPUs it names: each device's own IDs.

        A PCI address it lists names its device in either letter case (``pci_spellings``).
        """
        return {
            spelling: (gpu,)
            for gpu in self.exact_devices()
            for device_id in self.device_ids(gpu)
            for spelling in pci_spellings(device_id)
        }

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        """Map a plan's exact IDs to host GPUs; unknown IDs, and IDs naming one GPU twice, fail."""
        index = self.device_index()
        chosen: dict[str, tuple[str, GpuDevice]] = {}
        for device_id in plan.device_ids:
            gpus = index.get(device_id)
            if gpus is None:
                raise UnknownGpuDevice(
                    plan.field,
                    device_id,
                    f"{plan.field} names an unknown device {shown(device_id)} "
                    f"(the {self.name} driver accepts {self.capabilities.exact_id_forms}; "
                    f"this host has {len(self.inventory())} GPUs{self._in_mig_mode()})",
                )
            for gpu in gpus:
                if gpu.uuid in chosen:
                    first = chosen[gpu.uuid][0]
                    raise DuplicateGpuDevice(
                        plan.field,
                        device_id,
                        f"{plan.field} contains duplicate device ID {shown(device_id)}: "
                        f"{shown(first)} names the same GPU ({gpu.uuid})",
                    )
                chosen[gpu.uuid] = (device_id, gpu)
        for device_id, gpu in chosen.values():
            if gpu.parent_uuid in chosen:
                whole = chosen[gpu.parent_uuid][0]
                raise DuplicateGpuDevice(
                    plan.field,
                    device_id,
                    f"{plan.field} names {shown(whole)} whole and its MIG instance "
                    f"{shown(device_id)}: "
                    f"the instance is part of that GPU ({gpu.parent_uuid})",
                )
        return tuple(gpu for _, gpu in chosen.values())

    def _in_mig_mode(self) -> str:
        """What an unknown ID's message adds when some of the host's GPUs are in MIG mode."""
        taken = {gpu.uuid for gpu in self.exact_devices()}
        mig_mode = [gpu for gpu in self.host.gpus if gpu.mig_enabled and gpu.uuid not in taken]
        if not mig_mode:
            return ""
        which = ", ".join(str(gpu.index) for gpu in mig_mode)
        return (
            f", and GPU {which} in MIG mode: not whole GPUs, which no exact ID names; name "
            "one of their MIG instances instead (gpu-sandbox gpus lists their IDs), or take "
            "the GPU out of MIG mode"
        )

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        """Lease the plan's GPUs from the host registry, held by this process until started."""
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        return self.host.leases.acquire(
            self.pool(plan),
            owner,
            count=plan.count,
            exact=plan.gpus,
            mode=plan.sharing,
            share_limit=self.host.share_limit,
        )

    def abandon(self, sandbox_id: str) -> None:
        """Give back a sandbox's GPUs after a failed start.

        A driver whose sandbox may outlive a failed start (a container the engine still
        has) keeps the leases with it instead, for the liveness check to free.
        """
        self.host.leases.release(sandbox_id)
