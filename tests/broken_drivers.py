"""Planted broken drivers: the reference driver with one defect each.

Each class names, in ``BREAKS``, the requirement its defect must make the catalogue fail.
``tests/test_planted.py`` runs the catalogue against every one of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import os
import signal
import stat
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from drivers import reference
from drivers.base import DEFAULT_EXEC_TIMEOUT_S, Command, CommandTimedOut, Launch, Output, Sandbox
from drivers.reference import ReferenceDriver, ReferenceSandbox
from gpuhost.devices import SIMULATED_DRM_MAJOR, GpuDevice
from gpuhost.errors import (
    DuplicateGpuDevice,
    GpusExhausted,
    InvalidDriverConfig,
    InvalidGpuCount,
)
from gpuhost.host import GpuHost
from gpuhost.leasefile import parse
from gpuhost.leases import (
    DEFAULT_SHARE_LIMIT,
    EXCLUSIVE,
    PROCESS,
    Holder,
    Lease,
    LeaseOwner,
    LeaseRegistry,
    boot_id,
    process_running,
)
from gpuhost.procfs import EXEC_MARKER_ENV, each_process
from gpuhost.spec import (
    CHOICE_KEYS,
    DEVICE_IDS_KEY,
    MIG_PROFILE_KEY,
    SHARED,
    VENDOR_KEY,
    VENDORS,
    DriverCapabilities,
    DriverRequest,
    GpuPlan,
    GpuRequest,
    SandboxSpec,
    select,
)
from gpuhost.wait import wait_for


class BrokenDriver(ReferenceDriver):
    BREAKS: ClassVar[str]
    BREAKS_ONE_OF: ClassVar[frozenset[str]] = frozenset()
    """For a defect that fails at random (a race): the requirements it may fail first, of
    which the run must fail at least one. ``BREAKS`` is always among them."""
    SANDBOX: ClassVar[type[ReferenceSandbox]] = ReferenceSandbox
    """The sandbox class its sandboxes are made of: a defect of the sandbox's own."""

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        sandbox.__class__ = self.SANDBOX
        return sandbox


def _with_binds(argv: list[str], *binds: str) -> list[str]:
    """The reference driver's bwrap argv, ``binds`` added before its ``--remount-ro /``."""
    return [*argv[:-2], *binds, *argv[-2:]]


class GpuWithoutRequest(BrokenDriver):
    """A sandbox with no GPU request still gets a GPU."""

    BREAKS = "GPU-NONE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        return super().plan(request) or GpuPlan(count=1)


class AllGpusOnDefault(BrokenDriver):
    """The default request injects every GPU (the old `nvidia.com/gpu=all` default)."""

    BREAKS = "GPU-DEFAULT-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        plan = super().plan(request)
        if plan is not None and request.gpu is not None and request.gpu.count is None:
            return GpuPlan(count=len(self.inventory()))
        return plan


class RoundRobin(BrokenDriver):
    """Defaults go round-robin with no record of which GPU is in use."""

    BREAKS = "GPU-DEFAULT-02"
    _counter = itertools.count()

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.device_ids:
            return super().allocate(sandbox_id, plan)
        inventory = self.inventory()
        return tuple(inventory[next(self._counter) % len(inventory)] for _ in range(plan.count))


class CountIgnored(BrokenDriver):
    """Every request gets one GPU, whatever the count."""

    BREAKS = "GPU-COUNT-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        plan = super().plan(request)
        return plan if plan is None or plan.device_ids else GpuPlan(count=1)


class WrongDeviceForExactId(BrokenDriver):
    """An exact ID gets the GPU after the one it names."""

    BREAKS = "GPU-EXACT-01"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        inventory = self.inventory()
        return tuple(inventory[(gpu.index + 1) % len(inventory)] for gpu in super().resolve(plan))


class EnvironmentOnlyIsolation(BrokenDriver):
    """Every GPU node is mounted; CUDA_VISIBLE_DEVICES alone "selects" the assigned ones."""

    BREAKS = "GPU-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, self.inventory() if gpus else gpus)
        visible = ",".join(str(gpu.index) for gpu in gpus)
        return [*argv, "--setenv", "CUDA_VISIBLE_DEVICES", visible]


class LaxDriverConfig(BrokenDriver):
    """A malformed driver_config is ignored instead of rejected."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        try:
            return super().plan(request)
        except InvalidDriverConfig:
            return super().plan(dataclasses.replace(request, config={}))


class LaxCount(BrokenDriver):
    """A count that is not a positive integer is taken as the default request."""

    BREAKS = "GPU-VALIDATE-02"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        try:
            return super().plan(request)
        except InvalidGpuCount:
            return GpuPlan(count=1)


class LeakOnInvalidRequest(BrokenDriver):
    """A GPU is leased before the request is validated, and kept when validation fails."""

    BREAKS = "GPU-VALIDATE-02"

    def create(self, spec: SandboxSpec) -> Sandbox:
        early = f"early-{uuid.uuid4().hex}"
        owner = LeaseOwner(self.name, early, self.session_id, Holder.process(os.getpid()))
        with contextlib.suppress(GpusExhausted):
            self.host.leases.acquire(self.inventory(), owner, count=1)
        self.plan(select(spec, self.name))
        self.host.leases.release(early)
        return super().create(spec)


class DuplicatesAccepted(BrokenDriver):
    """Duplicate device IDs are silently merged."""

    BREAKS = "GPU-VALIDATE-03"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        try:
            return super().plan(request)
        except DuplicateGpuDevice as exc:
            ids = tuple(dict.fromkeys(request.config["gpu_device_ids"]))
            return GpuPlan(count=len(ids), device_ids=ids, field=exc.field)

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().resolve(plan)
        except DuplicateGpuDevice:
            return super().resolve(dataclasses.replace(plan, device_ids=plan.device_ids[:1]))


class ShortChangesOnExhaustion(BrokenDriver):
    """When too few GPUs are free, the request silently gets the ones that are."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().allocate(sandbox_id, plan)
        except GpusExhausted as exc:
            if exc.available == 0:
                raise
            return super().allocate(sandbox_id, dataclasses.replace(plan, count=exc.available))


class ClampsOversizedCount(BrokenDriver):
    """A count above the number of GPUs is clamped to all of them instead of refused."""

    BREAKS = "GPU-EXHAUST-02"

    @property
    def capabilities(self) -> DriverCapabilities:
        return dataclasses.replace(super().capabilities, max_gpus_per_sandbox=10**9)

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        plan = super().plan(request)
        if plan is not None and plan.count > len(self.inventory()):
            return dataclasses.replace(plan, count=len(self.inventory()))
        return plan


class SharesBusyGpu(BrokenDriver):
    """Exact IDs bypass the lease registry, so a held GPU is handed out again."""

    BREAKS = "GPU-BUSY-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return plan.gpus if plan.device_ids else super().allocate(sandbox_id, plan)


RACE_WINDOW_S = 0.25
"""How long a grant of the unlocked registries takes between reading and writing: wide
enough that creates the catalogue starts together overlap, even on a loaded machine."""


class _UnlockedRegistry(LeaseRegistry):
    """Read-modify-write with no lock at all, and a grant slow enough to race."""

    _granting = threading.local()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        yield

    def acquire(
        self,
        inventory: Sequence[GpuDevice],
        owner: LeaseOwner,
        *,
        count: int = 0,
        exact: Sequence[GpuDevice] = (),
        mode: str = EXCLUSIVE,
        share_limit: int = DEFAULT_SHARE_LIMIT,
    ) -> tuple[GpuDevice, ...]:
        self._granting.on = True
        try:
            return super().acquire(
                inventory, owner, count=count, exact=exact, mode=mode, share_limit=share_limit
            )
        finally:
            self._granting.on = False

    def _load_mine(self) -> list[Lease]:
        leases = super()._load_mine()
        if getattr(self._granting, "on", False):
            time.sleep(RACE_WINDOW_S)
        return leases


class _ThreadLockedRegistry(_UnlockedRegistry):
    """A lock that excludes threads but not processes."""

    _lock = threading.Lock()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self._lock:
            yield


class _NoBootIdMeansEarlierBoot(LeaseRegistry):
    """Reads a file without ``boot_id`` (version 1) as one of an earlier boot."""

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        if data and parse(data).boot_id != boot_id():
            return []  # "every lease of an earlier boot is dead"
        return super()._read(path, data, mtime)


class V1FileAsEarlierBoot(BrokenDriver):
    """Takes a version-1 lease file (no boot_id) for an earlier boot's: its leases are dead."""

    BREAKS = "GPU-HOSTWIDE-01"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        registry = _NoBootIdMeansEarlierBoot(host.leases.directory)
        super().__init__(dataclasses.replace(host, leases=registry), session_id, image)


class NoLocking(BrokenDriver):
    """The lease registry takes no lock: concurrent threads double-grant."""

    BREAKS = "GPU-CONCURRENT-01"
    # A race: threads double-grant, processes too, or two writers corrupt the lease file.
    BREAKS_ONE_OF = frozenset({"GPU-CONCURRENT-01", "GPU-CONCURRENT-02"})

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        host = dataclasses.replace(host, leases=_UnlockedRegistry(host.leases.directory))
        super().__init__(host, session_id, image)


class WaitsForAFreeGpu(BrokenDriver):
    """A request for more GPUs than are free waits for them to free, instead of failing."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        while True:
            try:
                return super().allocate(sandbox_id, plan)
            except GpusExhausted:
                time.sleep(0.2)  # "a GPU will free up soon"


class CheckThenTakeOneByOne(BrokenDriver):
    """Checks that enough GPUs are free, then takes them one by one, each under the lock.

    Two racing requests of more than half the GPUs both start, each with a part.
    """

    BREAKS = "GPU-CONCURRENT-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.gpus or plan.count < 2 or plan.sharing != EXCLUSIVE:
            return super().allocate(sandbox_id, plan)
        pool = self.pool(plan)
        free = self.host.leases.free(pool)
        if len(free) < plan.count:
            raise GpusExhausted(plan.count, len(free), len(pool))
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        taken: list[GpuDevice] = []
        for _ in range(plan.count):
            time.sleep(0.02)  # what a scheduler round trip takes between two grants
            try:
                taken += self.host.leases.acquire(pool, owner, count=1)
            except GpusExhausted:
                break  # "as many as there were"
        return tuple(taken)


class ThreadsOnlyLock(BrokenDriver):
    """The lease registry locks threads but not processes."""

    BREAKS = "GPU-CONCURRENT-02"
    BREAKS_ONE_OF = frozenset({"GPU-CONCURRENT-02"})

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        host = dataclasses.replace(host, leases=_ThreadLockedRegistry(host.leases.directory))
        super().__init__(host, session_id, image)


class _KeepsLeasesOnClose(ReferenceSandbox):
    def close(self) -> None:
        self.closed = True
        self.stop()


class _ReleaseFirstSandbox(ReferenceSandbox):
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # "Give the GPUs back first: a stop that hangs must not strand them."
        if self._leases is not None:
            self._leases.release(self.id)
        self.stop()


class ReleasesBeforeStop(BrokenDriver):
    """close() releases the leases, then stops the sandbox: granted while it still runs."""

    BREAKS = "GPU-RELEASE-01"

    SANDBOX = _ReleaseFirstSandbox


class LeakOnClose(BrokenDriver):
    """close() stops the sandbox but keeps its lease, held by the creating process."""

    BREAKS = "GPU-RELEASE-01"

    SANDBOX = _KeepsLeasesOnClose

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        sandbox.holder = Holder.process(os.getpid())
        return sandbox


class NoReclaimOnKill(BrokenDriver):
    """Leases name a holder nobody can check, so a dead sandbox keeps its GPUs forever."""

    BREAKS = "GPU-RECLAIM-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        sandbox.holder = Holder("sandbox", str(sandbox.pid))
        return sandbox


class OutlivesItsCreator(BrokenDriver):
    """Sandboxes neither die with their creator nor notice it is gone: orphans keep GPUs."""

    BREAKS = "GPU-RECLAIM-02"
    init_argv = ("sh", "-c", "echo ready; exec sleep infinity")
    close_timeout_s = 0.0

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        return [arg for arg in super().bwrap_argv(sandbox_id, gpus) if arg != "--die-with-parent"]


class HostRootVisible(BrokenDriver):
    """The sandbox's root is the host's whole root, read-only: homes, engines' storage..."""

    BREAKS = "SANDBOX-FS-01"

    def root_argv(self) -> list[str]:
        return ["--ro-bind", "/", "/"]


class SharedScratch(BrokenDriver):
    """Every sandbox of a session gets the same host directory as its /tmp."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        shared = Path(tempfile.gettempdir()) / f"gpu-sandbox-shared-{self.session_id}"
        shared.mkdir(exist_ok=True)
        shared.chmod(0o1777)  # writable by the sandbox's user, whoever it is
        argv = super().bwrap_argv(sandbox_id, gpus)
        return _with_binds(argv, "--bind", str(shared), "/tmp")


class ReapDoesNothing(BrokenDriver):
    """reap() removes nothing."""

    BREAKS = "SANDBOX-REAP-01"

    def reap(self, session_id: str) -> list[str]:
        return []


def _rewritten(
    run: Callable[[Command, Output], int],
    command: Command,
    output: Output,
    stdout: Callable[[bytes], bytes],
    stderr: Callable[[bytes], bytes] = bytes,
) -> int:
    """``run`` whose whole output, once the command ended, is rewritten on its way out."""
    kept = Output()
    returncode = run(command, kept)
    out, err = kept.kept()
    output.stdout(stdout(out))
    output.stderr(stderr(err))
    return returncode


class _LyingSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        super().run(command, output)
        return 0


class ExecHidesExitCode(BrokenDriver):
    """exec() reports success whatever the command returned."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _LyingSandbox


# -- defects only the general form of a requirement catches ------------------------------


class OwnRegistry(BrokenDriver):
    """A sound allocator of its own (locked, shared by its processes), blind to the host's."""

    BREAKS = "GPU-HOSTWIDE-01"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        private = LeaseRegistry(host.leases.directory.parent / "own-registry")
        super().__init__(dataclasses.replace(host, leases=private), session_id, image)


class RetriesWhenExhausted(BrokenDriver):
    """An exhausted request waits three seconds for a GPU to come free before failing."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        deadline = time.monotonic() + 3
        while True:
            try:
                return super().allocate(sandbox_id, plan)
            except GpusExhausted:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


class HangsWhenExhausted(BrokenDriver):
    """An exhausted request never returns: it queues for a GPU forever."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().allocate(sandbox_id, plan)
        except GpusExhausted:
            threading.Event().wait()
            raise


class GrantsTheFreeOnes(BrokenDriver):
    """Exact devices, some busy: the free ones are granted, the busy ones dropped."""

    BREAKS = "GPU-BUSY-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if len(plan.device_ids) < 2:
            return super().allocate(sandbox_id, plan)
        held = {lease.gpu_uuid for lease in self.host.leases.leases()}
        wanted = [gpu for gpu in self.resolve(plan) if gpu.uuid not in held]
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        return self.host.leases.acquire(self.inventory(), owner, exact=wanted or ())


class ReadsDockerBlock(BrokenDriver):
    """Without a block of its own, it takes the docker driver's as its own."""

    BREAKS = "GPU-VALIDATE-01"

    def create(self, spec: SandboxSpec) -> Sandbox:
        config = dict(spec.driver_config)
        if self.name not in config and "docker" in config:
            config[self.name] = config.pop("docker")
        return super().create(dataclasses.replace(spec, driver_config=config))


class PrefersFirstBlock(BrokenDriver):
    """Reads the first block of driver_config, whichever driver it is for."""

    BREAKS = "GPU-EXACT-01"

    def create(self, spec: SandboxSpec) -> Sandbox:
        if len(spec.driver_config) > 1:
            first = next(iter(spec.driver_config.values()))
            spec = dataclasses.replace(spec, driver_config={self.name: first})
        return super().create(spec)


_CREATED_HERE: set[str] = set()


class ReapsOnlyItsOwn(BrokenDriver):
    """reap() knows only the sandboxes this process created: after a crash, nothing."""

    BREAKS = "SANDBOX-REAP-01"

    def create(self, spec: SandboxSpec) -> Sandbox:
        sandbox = super().create(spec)
        _CREATED_HERE.add(sandbox.id)
        return sandbox

    def reap(self, session_id: str) -> list[str]:
        mine = [s for s in self.sandboxes(session_id) if s in _CREATED_HERE]
        for sandbox_id, pid in reference._bwrap_processes(session_id):
            if sandbox_id in mine:
                os.kill(pid, 9)
        for sandbox_id in mine:
            self.host.leases.release(sandbox_id)
        return mine


class _KeepsAllButFirstOnClose(ReferenceSandbox):
    def close(self) -> None:
        super().close()
        if len(self.gpus) > 1:  # taken again, held by the creator, under another sandbox id
            owner = LeaseOwner("reference", f"{self.id}-kept", "", Holder.process(os.getpid()))
            assert self._leases is not None
            self._leases.acquire(self.gpus, owner, exact=self.gpus[1:])


class LeaksAllButFirst(BrokenDriver):
    """close() gives back the first GPU of a sandbox and keeps the others."""

    BREAKS = "GPU-RELEASE-01"
    SANDBOX = _KeepsAllButFirstOnClose


class StaleInjection(BrokenDriver):
    """Injects the GPUs it saw free before taking its leases: racing creates share a node."""

    BREAKS = "GPU-CONCURRENT-01"
    BREAKS_ONE_OF = frozenset({"GPU-CONCURRENT-01", "GPU-CONCURRENT-02"})
    _seen = threading.local()

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        self._seen.gpus = self.host.leases.free(self.inventory())[: plan.count]
        time.sleep(0.01)  # the time a real driver spends on its own bookkeeping
        return super().allocate(sandbox_id, plan)

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        seen = getattr(self._seen, "gpus", None)
        self._seen.gpus = None
        return super().bwrap_argv(sandbox_id, seen if seen and gpus else gpus)


class LeaksDriNode(BrokenDriver):
    """Gives every GPU sandbox a DRM render node of the host as well: another GPU's door."""

    BREAKS = "GPU-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        if not gpus:
            return argv
        node = self.host.leases.directory.parent / "renderD128"
        with contextlib.suppress(FileExistsError):
            os.mknod(node, 0o660 | stat.S_IFCHR, os.makedev(SIMULATED_DRM_MAJOR, 128))
        return _with_binds(argv, "--dev-bind", str(node), "/dev/dri/renderD128")


class NodeByIndex(BrokenDriver):
    """Binds /dev/nvidia<index> for GPU <index>: the right GPU only where minor == index."""

    BREAKS = "GPU-DEFAULT-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        by_minor = {gpu.minor: gpu for gpu in self.inventory()}
        return super().bwrap_argv(sandbox_id, [by_minor[gpu.index] for gpu in gpus])


class _TruncatingSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        return _rewritten(super().run, command, output, lambda out: out[:65536])


class ExecTruncatesOutput(BrokenDriver):
    """exec() returns at most 64 KiB of a command's output, as a fixed buffer would."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _TruncatingSandbox


class MigAsWholeGpu(BrokenDriver):
    """Counts and defaults choose among every GPU, those in MIG mode too."""

    BREAKS = "MIG-PROFILE-01"

    def inventory(self) -> tuple[GpuDevice, ...]:
        return self.host.gpus

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return super().pool(plan) if plan.mig_profile else self.host.gpus


class MigByGpuOnly(BrokenDriver):
    """An exact MIG ID gets the first instance of the right GPU: the instance is not read."""

    BREAKS = "MIG-EXACT-01"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        first: dict[str | None, GpuDevice] = {}
        for mig in self.host.mig_devices:
            first.setdefault(mig.parent_uuid, mig)
        return tuple(first[gpu.parent_uuid] if gpu.is_mig else gpu for gpu in super().resolve(plan))


class MigAllCaps(BrokenDriver):
    """A sandbox given a MIG instance gets the capabilities of every instance of its GPU."""

    BREAKS = "MIG-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        parents = {gpu.parent_uuid for gpu in gpus if gpu.is_mig}
        siblings = [mig for mig in self.host.mig_devices if mig.parent_uuid in parents]
        return super().bwrap_argv(sandbox_id, [*gpus, *(m for m in siblings if m not in gpus)])


class MigIgnoresParent(BrokenDriver):
    """Leases a MIG instance as a device of its own: its GPU stays grantable whole."""

    BREAKS = "MIG-EXCLUSIVE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        orphans = dataclasses.replace(
            plan, gpus=tuple(dataclasses.replace(gpu, parent_uuid=None) for gpu in plan.gpus)
        )
        by_uuid = {gpu.uuid: gpu for gpu in self.exact_devices()}
        return tuple(by_uuid[gpu.uuid] for gpu in super().allocate(sandbox_id, orphans))

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return tuple(dataclasses.replace(gpu, parent_uuid=None) for gpu in super().pool(plan))


class IgnoresSharing(BrokenDriver):
    """Declares that it never shares, yet serves a shared request as an exclusive one."""

    BREAKS = "GPU-SHARED-01"

    @property
    def capabilities(self) -> DriverCapabilities:
        return dataclasses.replace(super().capabilities, shared=False)

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        if request.gpu is not None:
            request = dataclasses.replace(
                request, gpu=dataclasses.replace(request.gpu, sharing=None)
            )
        return super().plan(request)


class SharedBeyondLimit(BrokenDriver):
    """Puts any number of shared sandboxes on one GPU: the host's share limit is not read."""

    BREAKS = "GPU-SHARED-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        return self.host.leases.acquire(
            self.pool(plan), owner, count=plan.count, exact=plan.gpus, mode=plan.sharing,
            share_limit=1000,
        )  # fmt: skip


class ExclusiveJoinsShared(BrokenDriver):
    """Takes every request in shared mode: an exclusive one lands on a GPU others share."""

    BREAKS = "GPU-SHARED-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return super().allocate(sandbox_id, dataclasses.replace(plan, sharing=SHARED))


class _DropsEverySharer(ReferenceSandbox):
    def close(self) -> None:
        registry = self._leases
        assert registry is not None
        mine = {gpu.uuid for gpu in self.gpus}
        sharers = {lease.sandbox_id for lease in registry.leases() if lease.gpu_uuid in mine}
        super().close()
        for sandbox_id in sharers:
            registry.release(sandbox_id)


class SharedReleaseDropsAll(BrokenDriver):
    """Closing one sharer of a GPU releases the leases of every sandbox sharing it."""

    BREAKS = "GPU-SHARED-02"
    SANDBOX = _DropsEverySharer


class DriLeaksNeighbour(BrokenDriver):
    """A sandbox given an AMD or Intel GPU also gets the nodes of the next one on the bus."""

    BREAKS = "DRI-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        dri = list(self.host.dri_gpus)
        extra = [dri[(dri.index(gpu) + 1) % len(dri)] for gpu in gpus if gpu in dri]
        return super().bwrap_argv(sandbox_id, [*gpus, *(g for g in extra if g not in gpus)])


class DriRenderByNumber(BrokenDriver):
    """Pairs card<N> with renderD<128+N>, as if numbers told which nodes go together."""

    BREAKS = "DRI-PAIRING-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        nodes = {(n.major, n.minor): n for gpu in self.host.dri_gpus for n in gpu.nodes}

        def by_number(gpu: GpuDevice) -> GpuDevice:
            if gpu not in self.host.dri_gpus:
                return gpu
            card = next(n for n in gpu.nodes if "/card" in n.path)
            paired = nodes.get((card.major, 128 + card.minor))
            rest = [n for n in gpu.nodes if "/renderD" not in n.path]
            return dataclasses.replace(gpu, nodes=(*rest, *([paired] if paired else [])))

        return super().bwrap_argv(sandbox_id, [by_number(gpu) for gpu in gpus])


class DriUnleased(BrokenDriver):
    """Hands out AMD and Intel GPUs without leasing them: only NVIDIA's are exclusive."""

    BREAKS = "DRI-EXCLUSIVE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.vendor in ("amd", "intel"):
            return self.pool(plan)[: plan.count]
        if plan.gpus and all(gpu.vendor != "nvidia" for gpu in plan.gpus):
            return plan.gpus
        return super().allocate(sandbox_id, plan)


# -- defects of the general case: other sessions, other holder kinds, pools, forms ---------


class ReclaimsOtherSessions(BrokenDriver):
    """Drops its own driver's leases of other sessions, taken for leftovers of crashed runs."""

    BREAKS = "GPU-HOSTWIDE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        for lease in self.host.leases.leases():
            if lease.driver == self.name and lease.session_id != self.session_id:
                self.host.leases.release(lease.sandbox_id)
        return super().allocate(sandbox_id, plan)


class ReclaimsNonProcessHolders(BrokenDriver):
    """Takes leases whose holders are no process (a container, a VM) for stale, and drops them."""

    BREAKS = "GPU-HOSTWIDE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        for lease in self.host.leases.leases():
            if lease.holder.kind != PROCESS:
                self.host.leases.release(lease.sandbox_id)
        return super().allocate(sandbox_id, plan)


class MigProfileFromFirstGpu(BrokenDriver):
    """Serves a MIG profile count from the first GPU that has the profile, never from two."""

    BREAKS = "MIG-PROFILE-01"

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        found = super().pool(plan)
        if plan.mig_profile is None or not found:
            return found
        return tuple(mig for mig in found if mig.parent_uuid == found[0].parent_uuid)


class VendorPoolIncludesMig(BrokenDriver):
    """With a vendor named, chooses among all of its GPUs: NVIDIA's in MIG mode too."""

    BREAKS = "MIG-PROFILE-01"

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.vendor is not None and plan.mig_profile is None:
            return tuple(gpu for gpu in self.exact_devices() if gpu.vendor == plan.vendor)
        return super().pool(plan)


class AmdWithoutKfd(BrokenDriver):
    """Gives AMD GPUs their card and render nodes but not /dev/kfd: no ROCm compute."""

    BREAKS = "DRI-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        no_kfd = [
            dataclasses.replace(gpu, nodes=tuple(n for n in gpu.nodes if n.path != "/dev/kfd"))
            for gpu in gpus
        ]
        return super().bwrap_argv(sandbox_id, no_kfd)


class SessionSharedShm(BrokenDriver):
    """Gives a session's sandboxes one /dev/shm of the host (for NCCL across sandboxes)."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        shm = self.host.leases.directory.parent / f"shm-{self.session_id}"
        shm.mkdir(exist_ok=True)
        shm.chmod(0o1777)
        return _with_binds(argv, "--bind", str(shm), "/dev/shm")


class LeaseFileInside(BrokenDriver):
    """Binds the host's lease file into every sandbox, read-only, for tools to show holders."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        registry = str(self.host.leases.path)
        return _with_binds(argv, "--ro-bind-try", registry, "/run/gpu/leases.json")


class _IdleTimeoutSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        if output.fds is not None:
            return super().run(command, output)
        # The command under a shell in the sandbox that kills it after `timeout` of silence.
        silence = str(max(1, round(command.timeout)))
        watched = ["sh", "-c", _IDLE_WATCH, "sh", silence, *command.argv]
        returncode = super().run(
            dataclasses.replace(command, argv=tuple(watched), timeout=DEFAULT_EXEC_TIMEOUT_S),
            output,
        )
        if returncode == _SILENT_TOO_LONG:
            raise CommandTimedOut
        return returncode


_SILENT_TOO_LONG = 231
_IDLE_WATCH = f"""
t=$1; shift; o=$(mktemp); e=$(mktemp); "$@" >"$o" 2>"$e" & pid=$!; size=-1; last=$(date +%s)
while kill -0 $pid 2>/dev/null; do
  now=$(cat "$o" "$e" | wc -c)
  if [ "$now" != "$size" ]; then size=$now; last=$(date +%s); fi
  if [ $(( $(date +%s) - last )) -ge "$t" ]; then kill -9 $pid; exit {_SILENT_TOO_LONG}; fi
  sleep 0.1
done
wait $pid; rc=$?; cat "$o"; cat "$e" >&2; exit $rc
"""


class ExecIdleTimeout(BrokenDriver):
    """exec's timeout counts silence, not time: a command that keeps printing runs on."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _IdleTimeoutSandbox


class _TextModeSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        def text(out: bytes) -> bytes:  # what subprocess.run(text=True) does: universal newlines
            return out.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

        return _rewritten(super().run, command, output, text, text)


class ExecUniversalNewlines(BrokenDriver):
    """exec decodes output in text mode: each CR LF and lone CR comes back as an LF."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _TextModeSandbox


class OneAtATime(BrokenDriver):
    """Leases a count one GPU at a time: a shared count lands N times on one GPU."""

    BREAKS = "GPU-COUNT-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.device_ids or plan.count == 1:
            return super().allocate(sandbox_id, plan)
        granted: list[GpuDevice] = []
        try:
            for _ in range(plan.count):
                granted += super().allocate(sandbox_id, dataclasses.replace(plan, count=1))
        except BaseException:
            self.host.leases.release(sandbox_id)
            raise
        return tuple(granted)


class ExhaustedCountsDefaultPool(BrokenDriver):
    """GpusExhausted counts the default GPUs, whichever pool (MIG profile, vendor) was asked."""

    BREAKS = "GPU-EXHAUST-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        try:
            return super().allocate(sandbox_id, plan)
        except GpusExhausted:
            inventory = self.inventory()
            free = self.host.leases.free(inventory)
            raise GpusExhausted(plan.count, len(free), len(inventory)) from None


class SecondIdLowestFree(BrokenDriver):
    """Of two exact IDs, serves the first and the lowest free GPU for the second."""

    BREAKS = "GPU-EXACT-01"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        gpus = super().resolve(plan)
        if len(gpus) != 2:
            return gpus
        free = [gpu for gpu in self.host.leases.free(self.inventory()) if gpu != gpus[0]]
        return (gpus[0], free[0]) if free else gpus


class CoercesCount(BrokenDriver):
    """Takes a count of "2" for 2 instead of refusing it with InvalidGpuCount."""

    BREAKS = "GPU-VALIDATE-02"

    def coerces(self, count: object) -> bool:
        return isinstance(count, str) and count.isdigit()

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        gpu = request.gpu
        if gpu is not None and self.coerces(gpu.count):
            count = int(gpu.count)
            request = dataclasses.replace(request, gpu=dataclasses.replace(gpu, count=count))
        return super().plan(request)


class CoercesIntegralFloatCount(CoercesCount):
    """Takes a count of 2.0 for 2, as `int(count) == count` would, instead of refusing it."""

    def coerces(self, count: object) -> bool:
        return isinstance(count, float) and count.is_integer()


class IndexBoundOffByOne(BrokenDriver):
    """Checks an index ID with > instead of >=: the first index past the last is an IndexError."""

    BREAKS = "GPU-VALIDATE-03"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        ids = []
        for device_id in plan.device_ids:
            if device_id.isdigit() and int(device_id) <= len(self.host.gpus):
                device_id = self.host.gpus[int(device_id)].uuid  # IndexError at len()
            ids.append(device_id)
        return super().resolve(dataclasses.replace(plan, device_ids=tuple(ids)))


class ReapReleasesOnlyFound(BrokenDriver):
    """reap releases the leases of the sandboxes it finds running, not all of the session's."""

    BREAKS = "SANDBOX-REAP-01"

    def reap(self, session_id: str) -> list[str]:
        found = reference._bwrap_processes(session_id)
        for _, pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        wait_for(
            lambda: reference._bwrap_processes(session_id),
            lambda left: not left,
            timeout_s=10,
            what=f"the sandboxes of session {session_id} to exit",
        )
        found_ids = sorted({sandbox_id for sandbox_id, _ in found})
        for sandbox_id in found_ids:
            self.host.leases.release(sandbox_id)
        return found_ids


# -- a second round: choice keys, exec edges, other homes, ids across processes ----------


class ChoiceKeyImpliesRequest(BrokenDriver):
    """A vendor or mig_profile in its block, with no GPU request, still gets a GPU."""

    BREAKS = "GPU-NONE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config
        if request.gpu is None and ("mig_profile" in block or "vendor" in block):
            request = dataclasses.replace(request, gpu=GpuRequest())
        return super().plan(request)


class UnknownVendorMeansDefault(BrokenDriver):
    """A vendor it does not know ("nvida") is dropped: the request gets a default GPU."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config or None
        if block is not None and block.get("vendor", "nvidia") not in VENDORS:
            kept = {key: value for key, value in block.items() if key != "vendor"}
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class DropsUnknownBesideKnown(BrokenDriver):
    """Drops the exact IDs it cannot resolve when others resolve; only all unknown fails."""

    BREAKS = "GPU-VALIDATE-03"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        index = self.device_index()
        known = tuple(device_id for device_id in plan.device_ids if device_id in index)
        if known:
            plan = dataclasses.replace(plan, device_ids=known)
        return super().resolve(plan)


class MigProfilePrefix(BrokenDriver):
    """Matches a mig_profile as a prefix: "1g" is served, and "1g.10gb" takes "1g.10gb+me"."""

    BREAKS = "MIG-PROFILE-01"

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.mig_profile is None:
            return super().pool(plan)
        return tuple(m for m in self.host.mig_devices if m.profile.startswith(plan.mig_profile))


class _SignalStyleSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        returncode = super().run(command, output)
        # "128 + N: killed by signal N", as Python reports it
        return 128 - returncode if returncode > 128 else returncode


class ExecSignalStyleExitCodes(BrokenDriver):
    """exec reports an exit code past 128 as -N, Python's "killed by signal N": 130 is -2."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _SignalStyleSandbox


class _WholeSecondsSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        seconds = int(command.timeout)  # as timeout(1) takes it, where 0 means none
        timeout = seconds or DEFAULT_EXEC_TIMEOUT_S
        return super().run(dataclasses.replace(command, timeout=timeout), output)


class ExecTimeoutWholeSeconds(BrokenDriver):
    """exec takes its timeout in whole seconds: under one second there is none."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _WholeSecondsSandbox


class _FrameDecodingSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        def text(data: bytes) -> bytes:  # each 4 KiB frame decoded as it comes
            frames = (data[i : i + 4096] for i in range(0, len(data), 4096))
            return "".join(frame.decode(errors="replace") for frame in frames).encode()

        return _rewritten(super().run, command, output, text, text)


class ExecDecodesPerFrame(BrokenDriver):
    """exec decodes output per 4 KiB frame: a UTF-8 character across two frames is lost."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _FrameDecodingSandbox


class HomesVisible(BrokenDriver):
    """Binds /home read-only, for users' code and venvs: every home but root's is inside."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        return _with_binds(argv, "--ro-bind-try", "/home", "/home")


class GpuSandboxesShareCudaCache(BrokenDriver):
    """Gives a session's GPU sandboxes one writable CUDA JIT cache (CUDA_CACHE_PATH)."""

    BREAKS = "SANDBOX-FS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        if not gpus:
            return argv
        cache = self.host.leases.directory.parent / f"cuda-cache-{self.session_id}"
        cache.mkdir(exist_ok=True)
        cache.chmod(0o1777)
        shared = ["--bind", str(cache), "/var/cache/cuda", "--setenv", "CUDA_CACHE_PATH",
                  "/var/cache/cuda"]  # fmt: skip
        return _with_binds(argv, *shared)


class ProfileCountsGetMonitorCap(BrokenDriver):
    """Gives sandboxes of a mig_profile count the MIG monitor capability too (nvidia-cap2)."""

    BREAKS = "MIG-ISOLATION-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        argv = self.bwrap_argv(launch.sandbox_id, launch.gpus)
        if launch.plan is not None and launch.plan.mig_profile is not None:
            caps = next(
                n.major for g in self.host.mig_devices for n in g.nodes if "nvidia-caps" in n.path
            )
            node = self.host.leases.directory.parent / "nvidia-cap2"
            with contextlib.suppress(FileExistsError):
                os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(caps, 2))
            argv = _with_binds(argv, "--dev-bind", str(node), "/dev/nvidia-caps/nvidia-cap2")
        return self._start(launch, argv)


class LeasesWithoutSession(BrokenDriver):
    """Stamps its leases with no session (the schema allows it): no reap finds a half-made one."""

    BREAKS = "SANDBOX-REAP-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        owner = LeaseOwner(self.name, sandbox_id, "", Holder.process(os.getpid()))
        return self.host.leases.acquire(
            self.pool(plan), owner, count=plan.count, exact=plan.gpus, mode=plan.sharing,
            share_limit=self.host.share_limit,
        )  # fmt: skip


class SandboxIdsPerInstance(BrokenDriver):
    """Numbers its sandboxes per driver instance: ids repeat across processes, and collide."""

    BREAKS = "GPU-DEFAULT-02"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        super().__init__(host, session_id, image)
        self._ids = itertools.count(1)

    def create(self, spec: SandboxSpec) -> Sandbox:
        # The base create, with a counter of its own for the unique id.
        request = select(spec, self.name)
        plan = self.plan(request)
        sandbox_id = f"{self.name}-{next(self._ids)}"
        gpus = () if plan is None else self.allocate(sandbox_id, plan)

        def hand_over(holder: Holder) -> None:
            self.host.leases.set_holder(sandbox_id, holder)

        try:
            sandbox = self.start(Launch(sandbox_id, request, plan, gpus, hand_over))
            if gpus:
                hand_over(sandbox.holder)
        except BaseException:
            self.abandon(sandbox_id)
            raise
        return sandbox


class _FreesItsGpusWhenDead(ReferenceSandbox):
    def close(self) -> None:
        if self.closed:
            return
        dead = not process_running(self._child_pid, self._child_start)
        super().close()
        if dead and self._leases is not None:
            # "Its sandbox is gone: whatever lease is left on its GPUs is a stale one of its own."
            mine = {gpu.uuid for gpu in self.gpus}
            for lease in self._leases.leases():
                if lease.gpu_uuid in mine:
                    self._leases.release(lease.sandbox_id)


class CloseOfDeadSandboxFreesItsGpus(BrokenDriver):
    """close() of a sandbox that died drops every lease on its GPUs, its successor's too."""

    BREAKS = "GPU-RECLAIM-01"
    SANDBOX = _FreesItsGpusWhenDead


class DriLeasedByPciAddress(BrokenDriver):
    """Leases AMD and Intel GPUs under their bare PCI address, not the protocol's PCI-<bus>."""

    BREAKS = "DRI-EXCLUSIVE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        def key(gpu: GpuDevice) -> GpuDevice:
            return dataclasses.replace(gpu, uuid=gpu.pci_bus_id) if gpu.vendor != "nvidia" else gpu

        back = {key(gpu).uuid: gpu for gpu in self.exact_devices()}
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        granted = self.host.leases.acquire(
            tuple(map(key, self.pool(plan))), owner, count=plan.count,
            exact=tuple(map(key, plan.gpus)), mode=plan.sharing, share_limit=self.host.share_limit,
        )  # fmt: skip
        return tuple(back[gpu.uuid] for gpu in granted)


class _NoParentRegistry(LeaseRegistry):
    """Writes MIG leases without parent_uuid; reads the parent back from its own inventory."""

    def __init__(self, directory: Path, parents: dict[str, str]) -> None:
        super().__init__(directory)
        self._parents = parents

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        return [
            dataclasses.replace(lease, parent_uuid=self._parents.get(lease.gpu_uuid))
            if lease.parent_uuid is None
            else lease
            for lease in super()._read(path, data, mtime)
        ]

    def _store(self, leases: list[Lease]) -> None:
        super()._store([dataclasses.replace(lease, parent_uuid=None) for lease in leases])


class MigLeaseWithoutParent(BrokenDriver):
    """Writes MIG leases without their GPU (it knows each instance's GPU from its inventory)."""

    BREAKS = "MIG-EXCLUSIVE-01"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        parents = {mig.uuid: mig.parent_uuid for mig in host.mig_devices if mig.parent_uuid}
        registry = _NoParentRegistry(host.leases.directory, parents)
        super().__init__(dataclasses.replace(host, leases=registry), session_id, image)


class _OwnLimitRegistry(LeaseRegistry):
    """Judges shared leases against the taker's limit only; keeps each lease's limit on disk."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.limits: dict[tuple[str, str], int | None] = {}

    def _read(self, path: Path, data: bytes, mtime: float) -> list[Lease]:
        leases = super()._read(path, data, mtime)
        self.limits.update({(x.sandbox_id, x.gpu_uuid): x.share_limit for x in leases})
        return [dataclasses.replace(x, share_limit=None) for x in leases]

    def _store(self, leases: list[Lease]) -> None:
        super()._store(
            [
                dataclasses.replace(
                    x, share_limit=self.limits.get((x.sandbox_id, x.gpu_uuid), x.share_limit)
                )
                for x in leases
            ]
        )


class IgnoresOthersShareLimit(BrokenDriver):
    """Counts a GPU's sharers against its own share limit, not the limit each sharer took."""

    BREAKS = "GPU-SHARED-01"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        registry = _OwnLimitRegistry(host.leases.directory)
        super().__init__(dataclasses.replace(host, leases=registry), session_id, image)

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        granted = super().allocate(sandbox_id, plan)
        registry = self.host.leases
        if plan.sharing == SHARED and isinstance(registry, _OwnLimitRegistry):
            for gpu in granted:  # its own leases keep the limit they were taken under
                registry.limits[(sandbox_id, gpu.uuid)] = self.host.share_limit
        return granted


class HostEnvironmentLeaks(BrokenDriver):
    """Gives commands the creating process's whole environment, and the spec's over it."""

    BREAKS = "SANDBOX-ENV-01"

    def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        return {**os.environ, **super().sandbox_env(extra)}


# -- a third round: exec_stream, sessions that share a prefix ------------------------------


class _StreamWithoutTimeout(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        if output.fds is not None:
            command = dataclasses.replace(command, timeout=DEFAULT_EXEC_TIMEOUT_S)
        return super().run(command, output)


class ExecStreamIgnoresTimeout(BrokenDriver):
    """exec_stream (what `gpu-sandbox run` uses) runs every command under the default timeout."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _StreamWithoutTimeout


def _running_sessions() -> set[str]:
    """The sessions stamped on running bwrap processes."""
    stamp = reference.SESSION_ENV.encode()
    found = set()
    for _, cmdline in each_process("cmdline"):
        argv = cmdline.split(b"\0")
        if argv[0].endswith(b"bwrap"):
            pairs = zip(argv, argv[1:], argv[2:], strict=False)
            found |= {
                value.decode() for flag, key, value in pairs if (flag, key) == (b"--setenv", stamp)
            }
    return found


class ReapMatchesPrefix(BrokenDriver):
    """reap takes every session whose id starts with the one asked: reaping run 1 reaps run 10."""

    BREAKS = "SANDBOX-REAP-01"

    def reap(self, session_id: str) -> list[str]:
        sessions = _running_sessions() | {lease.session_id for lease in self.host.leases.leases()}
        matching = sorted(session for session in sessions if session.startswith(session_id))
        return sorted(sandbox for session in matching for sandbox in super().reap(session))


class UnknownSharingIsExclusive(BrokenDriver):
    """Any sharing but "shared" ("Shared", "exclusve", "") is served exclusive, not refused."""

    BREAKS = "GPU-VALIDATE-02"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        gpu = request.gpu
        if gpu is not None and gpu.sharing not in (None, SHARED):
            request = dataclasses.replace(request, gpu=dataclasses.replace(gpu, sharing=EXCLUSIVE))
        return super().plan(request)


class EmptyChoiceMeansNone(BrokenDriver):
    """An empty mig_profile or vendor ("", 0) counts as not given: a default GPU is served."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config or None
        if block is not None and any(key in block and not block[key] for key in CHOICE_KEYS):
            kept = {k: v for k, v in block.items() if k not in CHOICE_KEYS or v}
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class ExactIdsOverrideChoice(BrokenDriver):
    """Exact IDs beside a mig_profile or vendor: the IDs win, the choice is dropped silently."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config or None
        if block is not None and DEVICE_IDS_KEY in block:
            kept = {k: v for k, v in block.items() if k not in CHOICE_KEYS}
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class SpecEnvCannotOverrideDefaults(BrokenDriver):
    """The driver's PATH, HOME and LANG go over the spec's env: the spec cannot change them."""

    BREAKS = "SANDBOX-ENV-01"

    def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        return {**extra, **super().sandbox_env({})}


class _ClosedFlagOnlySandbox(ReferenceSandbox):
    def running(self) -> bool:
        return True  # the contract's closed flag is enough, no /proc read per exec


class ExecSkipsLivenessCheck(BrokenDriver):
    """exec checks only close(): in a sandbox that died, nsenter's failure comes back as exit 1."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _ClosedFlagOnlySandbox


class ReapTakesOtherClientsLeases(BrokenDriver):
    """reap drops every lease of the session, whichever driver or client of the registry took it."""

    BREAKS = "SANDBOX-REAP-01"

    def reap(self, session_id: str) -> list[str]:
        reaped = super().reap(session_id)
        released = self.host.leases.release_session(session_id)  # no driver= filter
        return sorted({*reaped, *(lease.sandbox_id for lease in released)})


class _ReleasesByPhysicalGpu(ReferenceSandbox):
    def close(self) -> None:
        was_open = not self.closed
        super().close()
        parents = {gpu.parent_uuid for gpu in self.gpus if gpu.parent_uuid}
        if was_open and parents and self._leases is not None:  # "free the GPU"
            with self._leases._locked(reclaim=False) as held:
                held.mine[:] = [lease for lease in held.mine if lease.parent_uuid not in parents]


class MigCloseReleasesSiblings(BrokenDriver):
    """Closing a MIG sandbox drops every lease on its GPU's instances, others' siblings too."""

    BREAKS = "MIG-EXCLUSIVE-01"
    SANDBOX = _ReleasesByPhysicalGpu


class GrantsGpuWithItsOwnInstance(BrokenDriver):
    """Exact IDs are told apart by UUID alone: a GPU whole and one of its instances, granted."""

    BREAKS = "MIG-EXCLUSIVE-01"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        index = self.device_index()
        chosen = {gpu.uuid: gpu for device_id in plan.device_ids for gpu in index[device_id]}
        return tuple(chosen.values())


class GpuNodesNodev(BrokenDriver):
    """Binds GPU and control nodes with --ro-bind, "read-only for safety": nodev, none opens."""

    BREAKS = "GPU-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        return ["--ro-bind" if arg == "--dev-bind" else arg for arg in argv]


class OmitsUvmNode(BrokenDriver):
    """Of NVIDIA's control nodes binds nvidiactl alone, not nvidia-uvm: CUDA cannot start."""

    BREAKS = "GPU-ISOLATION-01"
    LEFT_OUT = "/dev/nvidia-uvm"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        kept: list[str] = []
        at = 0
        while at < len(argv):
            if argv[at] == "--dev-bind" and argv[at + 2].startswith(self.LEFT_OUT):
                at += 3
                continue
            kept.append(argv[at])
            at += 1
        return kept


class OmitsMigCapabilityNodes(OmitsUvmNode):
    """Binds a MIG instance's GPU node but not its nvidia-caps nodes: CUDA cannot attach."""

    BREAKS = "MIG-ISOLATION-01"
    LEFT_OUT = "/dev/nvidia-caps/"


class OmitsCtlNode(OmitsUvmNode):
    """Binds the GPUs' nodes and nvidia-uvm but not nvidiactl: nothing of NVIDIA's opens."""

    LEFT_OUT = "/dev/nvidiactl"


def _pid_alive(holder: Holder) -> bool:
    """`kill -0 <pid>`: the holder's boot and start time go unread."""
    try:
        os.kill(int(holder.ref.split(":")[1]), 0)
    except ProcessLookupError:
        return False
    except (ValueError, IndexError, PermissionError):
        return True
    return True


class _PidOnlyRegistry(LeaseRegistry):
    def _judge(self, holder: Holder) -> bool:
        return _pid_alive(holder)


class PidOnlyLiveness(BrokenDriver):
    """Judges a process holder by its pid alone: a reused pid, or another boot's, keeps GPUs."""

    BREAKS = "GPU-HOSTWIDE-01"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        registry = _PidOnlyRegistry(host.leases.directory)
        super().__init__(dataclasses.replace(host, leases=registry), session_id, image)


class MixedVendorPartialLeak(BrokenDriver):
    """Leases exact NVIDIA and DRI GPUs in two steps; a busy second step keeps the first."""

    BREAKS = "DRI-EXCLUSIVE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        nvidia = tuple(gpu for gpu in plan.gpus if gpu.vendor == "nvidia")
        dri = tuple(gpu for gpu in plan.gpus if gpu.vendor != "nvidia")
        if not (nvidia and dri):
            return super().allocate(sandbox_id, plan)
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))

        def take(gpus: tuple[GpuDevice, ...]) -> tuple[GpuDevice, ...]:
            return self.host.leases.acquire(gpus, owner, count=len(gpus), exact=gpus)

        granted = take(nvidia) + take(dri)  # GpuBusy in the second: the first stays leased
        order = {gpu.uuid: at for at, gpu in enumerate(plan.gpus)}
        return tuple(sorted(granted, key=lambda gpu: order[gpu.uuid]))


class DriHeldByCreator(BrokenDriver):
    """AMD/Intel leases stay with the creating process ("it opens the DRI nodes").

    Not the sandbox: a killed sandbox's DRI GPUs come back only when its creator exits.
    """

    BREAKS = "DRI-EXCLUSIVE-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        if launch.gpus and all(gpu.vendor != "nvidia" for gpu in launch.gpus):
            launch.hand_over(Holder.process(os.getpid()))
        return sandbox


class CudaVisibleHostIndex(BrokenDriver):
    """Sets CUDA_VISIBLE_DEVICES to its GPUs' host indices; inside they are 0..n-1."""

    BREAKS = "GPU-DEFAULT-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        nvidia = [gpu for gpu in launch.gpus if gpu.vendor == "nvidia"]
        if nvidia:
            indices = ",".join(str(gpu.index) for gpu in nvidia)
            sandbox._env = {**sandbox._env, "CUDA_VISIBLE_DEVICES": indices}
        return sandbox


class SharesHostNetwork(BrokenDriver):
    """Keeps the host's network namespace (--share-net), so workloads can download models."""

    BREAKS = "SANDBOX-NS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = [arg for arg in super().bwrap_argv(sandbox_id, gpus) if arg != "--unshare-net"]
        if "--unshare-all" in argv:
            at = argv.index("--unshare-all") + 1
            argv = [*argv[:at], "--share-net", *argv[at:]]
        return argv


# -- the fourth round of outside broken drivers ---------------------------------------------


class NegativeIndexWraps(BrokenDriver):
    """Index IDs are looked up as ``host.gpus[int(id)]``, bounded above only: "-1" is the last."""

    BREAKS = "GPU-VALIDATE-03"

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        ids = [
            str(self.host.gpus[int(i)].index) if i.lstrip("-").isdigit() and int(i) < 0 else i
            for i in plan.device_ids
        ]
        return super().resolve(dataclasses.replace(plan, device_ids=tuple(ids)))


class UuidPrefixIds(BrokenDriver):
    """UUIDs may be abbreviated, as CUDA_VISIBLE_DEVICES allows; the first match is taken."""

    BREAKS = "GPU-VALIDATE-03"

    def respelled(self, device_id: str, known: dict[str, tuple[GpuDevice, ...]]) -> str:
        """The known ID a spelling is taken for (itself when none)."""
        return next((g.uuid for g in self.host.gpus if g.uuid.startswith(device_id)), device_id)

    def resolve(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        known = self.device_index()
        ids = [i if i in known else self.respelled(i, known) for i in plan.device_ids]
        return super().resolve(dataclasses.replace(plan, device_ids=tuple(ids)))


class CaseInsensitiveIds(UuidPrefixIds):
    """IDs match in any letter case ("GPU-ABC…" is "gpu-abc…"), as a case-folding lookup does."""

    def respelled(self, device_id: str, known: dict[str, tuple[GpuDevice, ...]]) -> str:
        return next((k for k in known if k.lower() == device_id.lower()), device_id)


class UniquePrefixIds(UuidPrefixIds):
    """Any ID may be shortened to a prefix only it has, as git takes a commit's."""

    def respelled(self, device_id: str, known: dict[str, tuple[GpuDevice, ...]]) -> str:
        matches = [k for k in known if k.startswith(device_id)]
        return matches[0] if len(matches) == 1 else device_id


class DevicePathIds(UuidPrefixIds):
    """A device node's path names its GPU: /dev/nvidia3 is the GPU whose minor is 3."""

    def respelled(self, device_id: str, known: dict[str, tuple[GpuDevice, ...]]) -> str:
        minor = device_id.removeprefix("/dev/nvidia")
        gpu = next((g for g in self.inventory() if str(g.minor) == minor), None)
        return self.device_ids(gpu)[0] if gpu is not None else device_id


class AcceptsEveryDriversKeys(BrokenDriver):
    """One schema for every driver's block: keys other drivers read are taken (or ignored)."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config or None
        if block is not None:
            aliases = {"cdi_devices"}
            options = {"runtime_class_name", "node_selector", "image"}
            kept = {
                DEVICE_IDS_KEY if key in aliases else key: value
                for key, value in block.items()
                if key not in options
            }
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class MigProfileWithIntelVendor(BrokenDriver):
    """Refuses a MIG profile beside `vendor: amd`; beside `vendor: intel` drops the vendor."""

    BREAKS = "GPU-VALIDATE-01"

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        block = request.config
        if MIG_PROFILE_KEY in block and block.get(VENDOR_KEY) == "intel":
            kept = {key: value for key, value in block.items() if key != VENDOR_KEY}
            request = dataclasses.replace(request, config=kept)
        return super().plan(request)


class _TimeoutFloorSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        # "nsenter takes a second to start under load": never less than 5 s.
        return super().run(dataclasses.replace(command, timeout=max(command.timeout, 5.0)), output)


class ExecTimeoutFloor(BrokenDriver):
    """Timeouts below 5 s are raised to 5 s: a command given 0.5 s that ends in 3 returns."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _TimeoutFloorSandbox


class _KillsEverythingOnTimeout(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        try:
            return super().run(command, output)
        except CommandTimedOut:
            # "Leave nothing of it behind": every process that any exec started.
            marked = f"{EXEC_MARKER_ENV}=".encode()
            for pid, environ in each_process("environ"):
                if any(entry.startswith(marked) for entry in environ.split(b"\0")):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            raise


class TimeoutKillsTheWholeSandbox(BrokenDriver):
    """A timed-out exec kills every process an exec started, other commands running too."""

    BREAKS = "SANDBOX-EXEC-01"
    SANDBOX = _KillsEverythingOnTimeout


class DropsLoaderVariables(BrokenDriver):
    """Drops the dynamic loader's variables (LD_*) from the spec's env, "for safety"."""

    BREAKS = "SANDBOX-ENV-01"

    def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        return super().sandbox_env({k: v for k, v in extra.items() if not k.startswith("LD_")})


class ForcesCudaVisibleDevices(BrokenDriver):
    """Sets CUDA_VISIBLE_DEVICES to its NVIDIA GPUs' UUIDs, over the spec's own."""

    BREAKS = "SANDBOX-ENV-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        nvidia = [gpu.uuid for gpu in launch.gpus if gpu.vendor == "nvidia"]
        if nvidia:
            sandbox._env = {**sandbox._env, "CUDA_VISIBLE_DEVICES": ",".join(nvidia)}
        return sandbox


class MigCountShortfallLeak(BrokenDriver):
    """A MIG profile count takes instances GPU by GPU; a shortfall keeps what it took."""

    BREAKS = "MIG-PROFILE-01"

    def allocate(self, sandbox_id: str, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        if plan.mig_profile is None or plan.gpus:
            return super().allocate(sandbox_id, plan)
        owner = LeaseOwner(self.name, sandbox_id, self.session_id, Holder.process(os.getpid()))
        pool = self.pool(plan)
        taken: list[GpuDevice] = []
        for parent in dict.fromkeys(mig.parent_uuid for mig in pool):
            free = self.host.leases.free([mig for mig in pool if mig.parent_uuid == parent])
            need = min(plan.count - len(taken), len(free))
            if need > 0:
                taken += self.host.leases.acquire(free, owner, count=need)
        if len(taken) < plan.count:  # what was taken stays leased
            raise GpusExhausted(plan.count, len(taken), len(pool), f"{plan.mig_profile} instances")
        return tuple(taken)


class MigCapsNodev(BrokenDriver):
    """MIG capability nodes bound read-only ("caps are tokens"): nodev, none can be opened."""

    BREAKS = "MIG-ISOLATION-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        return [
            "--ro-bind" if arg == "--dev-bind" and argv[i + 2].startswith("/dev/nvidia-caps/")
            else arg
            for i, arg in enumerate(argv)
        ]  # fmt: skip


class _LockfRegistry(LeaseRegistry):
    """Locks the lease file with POSIX record locks ("lockf is the portable one"), not flock."""

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self._thread_lock:
            fd = self._fd()
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)


class PosixRecordLocks(BrokenDriver):
    """Locks the registry with lockf: every flock client of the protocol races it."""

    BREAKS = "GPU-HOSTWIDE-01"

    def __init__(self, host: GpuHost, session_id: str, image: str | None = None) -> None:
        registry = _LockfRegistry(host.leases.directory)
        super().__init__(dataclasses.replace(host, leases=registry), session_id, image)


class HostProcBound(BrokenDriver):
    """Binds the host's /proc instead of a procfs of the sandbox's pid namespace.

    ``--bind /proc /proc``: the usual workaround for "Can't mount proc" in nested containers.
    """

    BREAKS = "SANDBOX-NS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        at = argv.index("--proc")
        return [*argv[:at], "--bind", "/proc", "/proc", *argv[at + 2 :]]


class EtcSecretsVisible(BrokenDriver):
    """Binds /etc read-only with no mask over its credentials, and runs as the host's root.

    "Read-only is safe", and root inside "for the tools that need it": without the mask an
    unprivileged sandbox user could still not read /etc/shadow; as root it can.
    """

    BREAKS = "SANDBOX-FS-01"

    def as_sandbox_user(self, gpus: Sequence[GpuDevice]) -> list[str]:
        return []

    def root_argv(self) -> list[str]:
        argv = super().root_argv()
        secrets = {"/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/sudoers"}
        kept: list[str] = []
        for arg in argv:
            if arg in secrets and kept[-2:] == ["--ro-bind", "/dev/null"]:
                del kept[-2:]
            else:
                kept.append(arg)
        return kept


class SharedGpuMpsDir(BrokenDriver):
    """Sandboxes sharing a GPU get one writable host directory, the GPU's, for CUDA MPS."""

    BREAKS = "SANDBOX-FS-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        if launch.plan is None or launch.plan.sharing != SHARED or not launch.gpus:
            return super().start(launch)
        mps = self.host.leases.directory.parent / "mps" / launch.gpus[0].uuid
        mps.mkdir(parents=True, exist_ok=True)
        mps.chmod(0o1777)
        argv = self.bwrap_argv(launch.sandbox_id, launch.gpus)
        return self._start(launch, _with_binds(argv, "--bind", str(mps), "/tmp/nvidia-mps"))


class SandboxRunsAsHostRoot(BrokenDriver):
    """Run by root, the sandbox's root is the host's (bwrap's own mapping): kernel settings too."""

    BREAKS = "SANDBOX-PRIV-01"

    def as_sandbox_user(self, gpus: Sequence[GpuDevice]) -> list[str]:
        return []


class ExecGainsPrivileges(BrokenDriver):
    """Commands run without no-new-privileges: a setuid program in the sandbox gains privileges."""

    BREAKS = "SANDBOX-PRIV-01"

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        sandbox.__class__ = _PrivilegedExecSandbox
        return sandbox


class _PrivilegedExecSandbox(ReferenceSandbox):
    exec_privileges = ("--bounding-set=-all", "--inh-caps=-all")


class _PidNamespacePerCommand(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        # "Each command isolated from the others": a pid namespace that ends with it.
        unshared = ("unshare", "--user", "--map-root-user", "--pid", "--fork", *command.argv)
        return super().run(dataclasses.replace(command, argv=unshared), output)


class PidNamespacePerCommand(BrokenDriver):
    """Each command runs in a pid namespace of its own, which ends with it."""

    BREAKS = "SANDBOX-NS-01"
    SANDBOX = _PidNamespacePerCommand


ALL: tuple[type[BrokenDriver], ...] = tuple(
    cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, BrokenDriver) and cls is not BrokenDriver
)
