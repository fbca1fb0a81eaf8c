"""What the conformance and workload tests observe inside a sandbox, and how."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from conformance.bounds import unpaced
from drivers.base import Driver, Sandbox
from drivers.commands import DEFAULT_EXEC_TIMEOUT_S, ExecResult
from gpuhost.devices import DRM_MAJORS, NVIDIA_GPU_MAJORS, GpuDevice
from gpuhost.errors import GpuAllocationError, GpusExhausted, RequestError
from gpuhost.simulated import SANDBOX_SHARE
from gpuhost.spec import SandboxSpec
from gpuhost.wait import wait_until

NVIDIA_SMI_NO_DEVICES = 6
"""nvidia-smi's exit code when it finds no GPU (NVML_ERROR_NOT_FOUND)."""
NVIDIA_SMI_NO_DRIVER = 9
"""nvidia-smi's exit code when it cannot reach the driver: a sandbox given no GPU has no
/dev/nvidiactl on a real host (seen on an H100 host, driver 580)."""
_COMMAND_NOT_FOUND = (126, 127)
"""A shell's "not found", and the engines' exit code when exec cannot find the program."""
# Minors of NVIDIA's major that are not GPUs: nvidia-modeset and nvidiactl.
_NVIDIA_CONTROL_MINORS = {254, 255}


def visible_gpu_uuids(sandbox: Sandbox) -> list[str]:
    """UUIDs ``nvidia-smi`` lists inside the sandbox, in its order (duplicates kept).

    A sandbox with no ``nvidia-smi`` at all sees no GPU: container engines mount it with the
    GPUs' CDI devices (the NVIDIA toolkit does the same), so a container given none has none.
    Nor does one whose ``nvidia-smi`` cannot reach the driver (no ``/dev/nvidiactl``).
    """
    __tracebackhide__ = True
    output = _nvidia_smi(sandbox, "--query-gpu=uuid", "--format=csv,noheader")
    return [line.strip() for line in output.splitlines() if line.strip()]


def visible_mig_uuids(sandbox: Sandbox) -> list[str]:
    """UUIDs of the MIG instances ``nvidia-smi -L`` lists inside the sandbox, under any GPU."""
    __tracebackhide__ = True
    listed = parse_list(_nvidia_smi(sandbox, "-L"))
    return [mig.uuid for gpu in listed for mig in gpu.mig_devices]


def cuda_visible_uuids(sandbox: Sandbox, listed: Sequence[str]) -> list[str]:
    """Of ``listed`` (what nvidia-smi lists, in its order), the GPUs CUDA would use inside.

    ``CUDA_VISIBLE_DEVICES`` (set by the driver, or by the spec's env) selects among them as
    CUDA reads it: indices into the sandbox's own GPUs (0..n-1, never the host's), or UUID
    prefixes; the first entry that names none ends the list. Unset, CUDA uses them all.
    """
    __tracebackhide__ = True
    script = 'if [ "${CUDA_VISIBLE_DEVICES+set}" ]; then echo "=$CUDA_VISIBLE_DEVICES"; fi'
    said = sandbox.exec(["sh", "-c", script]).check().stdout.strip()
    if not said:
        return list(listed)
    chosen: list[str] = []
    for entry in (part.strip() for part in said[1:].split(",")):
        if entry.isdigit() and int(entry) < len(listed):
            found = [listed[int(entry)]]
        else:
            found = [uuid for uuid in listed if entry and uuid.startswith(entry)]
        if len(found) != 1 or found[0] in chosen:
            break
        chosen.append(found[0])
    return chosen


def _nvidia_smi(sandbox: Sandbox, *args: str) -> str:
    """``nvidia-smi``'s output inside the sandbox; "" where it finds no GPU or no driver."""
    __tracebackhide__ = True
    result = sandbox.exec(["nvidia-smi", *args])
    output = result.stdout + result.stderr
    if result.returncode == NVIDIA_SMI_NO_DEVICES and "No devices were found" in output:
        return ""
    if result.returncode == NVIDIA_SMI_NO_DRIVER and "couldn't communicate" in output:
        return ""
    if result.returncode in _COMMAND_NOT_FOUND and "not found" in output:
        return ""
    result.check()
    return result.stdout


@dataclass(frozen=True)
class ListedMig:
    """A MIG device line of ``nvidia-smi -L``; ``index`` is its number within its GPU."""

    index: int
    name: str
    uuid: str

    @property
    def profile(self) -> str:
        """The MIG profile, ``1g.10gb`` for the name ``MIG 1g.10gb``."""
        return self.name.removeprefix("MIG ")


@dataclass(frozen=True)
class ListedGpu:
    """A GPU line of ``nvidia-smi -L`` with the MIG devices listed under it."""

    index: int
    name: str
    uuid: str
    mig_devices: tuple[ListedMig, ...] = ()


_LIST_GPU = re.compile(r"^GPU (?P<index>\d+): (?P<name>.+) \(UUID: (?P<uuid>[^)\s]+)\)$")
_LIST_MIG = re.compile(
    r"^\s+(?P<name>MIG \S+)\s+Device\s+(?P<index>\d+): \(UUID: (?P<uuid>[^)\s]+)\)$"
)


def parse_list(text: str) -> list[ListedGpu]:
    """Parse ``nvidia-smi -L``; any other line (an error about one GPU, say) is a ValueError."""
    gpus: list[ListedGpu] = []
    migs: list[list[ListedMig]] = []
    for line in text.splitlines():
        line = line.rstrip()
        if not line:
            continue
        if gpu := _LIST_GPU.match(line):
            gpus.append(ListedGpu(int(gpu["index"]), gpu["name"], gpu["uuid"]))
            migs.append([])
        elif (mig := _LIST_MIG.match(line)) and gpus:
            migs[-1].append(ListedMig(int(mig["index"]), mig["name"], mig["uuid"]))
        else:
            raise ValueError(f"unexpected line in nvidia-smi -L output: {line!r}")
    return [
        ListedGpu(gpu.index, gpu.name, gpu.uuid, tuple(mig_devices))
        for gpu, mig_devices in zip(gpus, migs, strict=True)
    ]


def describe_gpus(sandbox: Sandbox) -> str:
    """What a sandbox shows of its GPUs, for a failure message: its NVIDIA nodes, nvidia-smi."""
    script = 'ls -l /dev/nvidia* 2>&1; nvidia-smi -L 2>&1; echo "nvidia-smi exit $?"'
    result = sandbox.exec(["sh", "-c", script])
    return f"{result.stdout.strip()!r} (exit {result.returncode}, stderr {result.stderr.strip()!r})"


@dataclass(frozen=True)
class NodeSeen:
    path: str
    major: int
    minor: int


GPU_DEVICE_NAMES = (
    "nvidia-uvm", "nvidia-caps", "nvidia-caps-imex-channels", "nvidia-nvlink",
    "nvidia-nvswitch", "nvidia-frontend", "kfd",
)  # fmt: skip
"""/proc/devices names of the GPU drivers' dynamically numbered character devices."""


def gpu_device_majors(host_majors: Iterable[int] = ()) -> frozenset[int]:
    """Majors whose nodes reach a GPU: NVIDIA's and DRM's, and the dynamic ones of this host.

    ``host_majors`` adds others a (simulated) host uses for such nodes.
    """
    majors = {*NVIDIA_GPU_MAJORS, *DRM_MAJORS, *host_majors}
    try:
        lines = Path("/proc/devices").read_text().splitlines()
    except OSError:
        lines = []
    in_char = False
    for line in lines:
        if line.startswith("Character devices:"):
            in_char = True
        elif line.startswith("Block devices:"):
            in_char = False
        elif in_char and line.split()[1:2] and line.split()[1] in GPU_DEVICE_NAMES:
            majors.add(int(line.split()[0]))
    return frozenset(majors)


def device_nodes(sandbox: Sandbox) -> list[NodeSeen]:
    """Every character device under the sandbox's /dev, by the numbers ``stat`` reports.

    All of /dev is searched, dotfiles and subdirectories included: a node's identity is its
    number, not its name. The type comes from ``stat``, not ``find -type c``, which trusts
    the directory entry: a device bind-mounted over a placeholder file (as bubblewrap does)
    is listed there as a regular file.
    """
    __tracebackhide__ = True
    script = "find /dev ! -type d -exec stat -c '%F|%t|%T|%n' {} + 2>/dev/null; true"
    result = sandbox.exec(["sh", "-c", script]).check()
    # /dev/null is in every sandbox: not seeing it means the search itself failed.
    assert "character special file|1|3|/dev/null" in result.stdout.splitlines(), (
        f"cannot list the sandbox's device nodes (find and stat needed): {result}"
    )
    nodes = []
    for line in result.stdout.splitlines():
        kind, major, minor, path = line.split("|", 3)
        if kind == "character special file":
            nodes.append(NodeSeen(path, int(major, 16), int(minor, 16)))
    return nodes


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
"""This kernel's boot: a sandbox that reads another runs on a kernel of its own (a VM)."""

_REFUSALS = ("Permission denied", "Operation not permitted", "Read-only file system")
"""An open refused: a nodev mount, the device cgroup, a read-only bind. A GPU that no
driver of the host drives (a simulated one) opens with ENXIO instead, which is no refusal."""


def refused_nodes(sandbox: Sandbox, paths: Iterable[str]) -> dict[str, str]:
    """Of ``paths``, the device nodes a command inside may not open read-write, and why."""
    __tracebackhide__ = True
    paths = sorted(set(paths))
    if not paths:
        return {}
    script = 'for n; do e=$( (exec 3<>"$n") 2>&1 ) || echo "$n|$e"; done; true'
    result = sandbox.exec(["sh", "-c", script, "sh", *paths]).check()
    refused = {}
    for line in result.stdout.splitlines():
        path, _, why = line.partition("|")
        if any(refusal in why for refusal in _REFUSALS):
            refused[path] = why.strip()
    return refused


def opens_a_node_it_makes(sandbox: Sandbox, major: int, minor: int) -> str | None:
    """What a command inside gets when it makes the node ``major:minor`` and opens it.

    None where it may not: making it is refused (no CAP_MKNOD), or opening it (the device
    cgroup, a nodev mount). On a kernel of the sandbox's own (a VM) the host's numbers name
    nothing of the host's: None too.
    """
    __tracebackhide__ = True
    script = (
        f'[ "$(cat {BOOT_ID})" = "$1" ] || exit 0; d=$(mktemp -d) || exit 0; '
        f'if mknod "$d/node" c {major} {minor} 2>/dev/null; then '
        'e=$( (exec 3<>"$d/node") 2>&1 ) && echo opened || echo "$e"; fi; rm -rf "$d"'
    )
    boot = BOOT_ID.read_text().strip()
    got = sandbox.exec(["sh", "-c", script, "sh", boot]).check().stdout.strip()
    if not got or any(refusal in got for refusal in _REFUSALS):
        return None
    return got


def nvidia_gpu_nodes(nodes: Sequence[NodeSeen]) -> list[NodeSeen]:
    """The NVIDIA GPU nodes (195:0-253) among a sandbox's ``nodes`` (``device_nodes``).

    Of a simulated host, its own major's (``SIMULATED_NVIDIA_MAJOR``).
    """
    return [
        node
        for node in nodes
        if node.major in NVIDIA_GPU_MAJORS and node.minor not in _NVIDIA_CONTROL_MINORS
    ]


def foreign_gpu_nodes(
    sandbox: Sandbox, driver: Driver, nodes: Sequence[NodeSeen]
) -> list[NodeSeen]:
    """Of the sandbox's ``nodes``, the GPU nodes that are neither its GPUs' own nor control nodes.

    Any node that reaches a GPU counts, whatever its kind: NVIDIA's, DRM card and render
    nodes, nvidia-caps, AMD's kfd, and the (simulated) host's own GPU-related majors.
    NVIDIA's control nodes (nvidiactl, nvidia-uvm) belong only with an NVIDIA device.
    """
    __tracebackhide__ = True
    allowed = {(n.major, n.minor) for gpu in sandbox.gpus for n in gpu.nodes}
    if any(gpu.vendor == "nvidia" for gpu in sandbox.gpus):
        allowed |= {(n.major, n.minor) for n in driver.host.control_nodes}
    majors = gpu_device_majors(driver.host.device_majors)
    return [
        node for node in nodes if node.major in majors and (node.major, node.minor) not in allowed
    ]


DRM_RENDER_MINORS = range(128, 256)
"""renderD128 and up; card<N> has minor N (and 64-127 were the retired control nodes)."""


def visible_dri(driver: Driver, nodes: Sequence[NodeSeen]) -> dict[str, set[str]]:
    """PCI address → which DRI nodes (``card``, ``render``) of that GPU are among ``nodes``.

    Of the host's AMD and Intel GPUs, told by the nodes' numbers as the kernel tells them,
    wherever and under whatever name they are in the sandbox's /dev (``device_nodes``).
    """
    __tracebackhide__ = True
    by_number = {
        (node.major, node.minor): (
            gpu.pci_bus_id,
            "render" if node.minor in DRM_RENDER_MINORS else "card",
        )
        for gpu in driver.host.dri_gpus
        for node in gpu.nodes
        if node.major in DRM_MAJORS
    }
    seen: dict[str, set[str]] = {}
    for node in nodes:
        if found := by_number.get((node.major, node.minor)):
            seen.setdefault(found[0], set()).add(found[1])
    return seen


def probed_dri(sandbox: Sandbox) -> dict[str, set[str]] | None:
    """What the simulated host's probe ``dri-gpus`` reports inside, as ``visible_dri`` does.

    None where there is no probe (a real host).
    """
    __tracebackhide__ = True
    probe = f"{SANDBOX_SHARE}/bin/dri-gpus"
    result = sandbox.exec(["sh", "-c", f"[ -x {probe} ] || exit 127; exec {probe}"])
    if result.returncode == 127:
        return None
    result.check()
    seen: dict[str, set[str]] = {}
    for line in result.stdout.splitlines():
        kind, _, rest = line.partition("\t")
        if kind in ("card", "render"):
            seen.setdefault(rest.split("\t")[0], set()).add(kind)
    return seen


def specs_for_all_gpus(driver: Driver) -> list[SandboxSpec]:
    """Specs that together ask for every GPU of the host, within the per-sandbox maximum."""
    return specs_for_gpus(driver, len(driver.inventory()))


def specs_for_gpus(driver: Driver, total: int) -> list[SandboxSpec]:
    """Specs that together ask for ``total`` GPUs, as few as the per-sandbox maximum allows."""
    per_sandbox = max(1, min(total, driver.capabilities.max_gpus_per_sandbox))
    specs = []
    while total > 0:
        specs.append(SandboxSpec.with_gpus(min(per_sandbox, total)))
        total -= per_sandbox
    return specs


SIDE_BY_SIDE = 4
"""Creates at once when a test fills the host: engines start containers faster a few at a
time than one by one (measured: 16 docker creates 2.4 s one by one, 1.4 s four at once)."""


def create_side_by_side(
    create: Callable[[SandboxSpec], Sandbox], specs: Iterable[SandboxSpec]
) -> list[Sandbox]:
    """``create`` each spec, a few at a time; the sandboxes in the specs' order.

    The first error is raised once every create has ended; what was created stays with
    ``create``'s owner (a ``SandboxFactory`` closes it after the test).
    """
    __tracebackhide__ = True
    with ThreadPoolExecutor(SIDE_BY_SIDE) as pool:
        attempts = [pool.submit(create, spec) for spec in specs]
    return [attempt.result() for attempt in attempts]


def exact_ids(driver: Driver, device: GpuDevice) -> list[str]:
    """The IDs to ask ``device`` by: the driver's own, and the host's in a form it takes.

    Where the driver takes CDI names, it must take those of the host's CDI spec
    (``device.cdi_names``: by index, ``<gpu>:<instance>`` for a MIG instance, and by UUID),
    not only the ones it lists: a driver that numbers them its own way agrees with itself.
    The driver's own may have mislabelled the device; the host's name it by what it is.
    """
    own = list(driver.device_ids(device))
    if not any(i.startswith(f"{device.cdi_kind}=") for i in own):
        return own
    return [*own, *(name for name in device.cdi_names if name not in own)]


def kill_and_retake(
    create: Callable[[SandboxSpec], Sandbox], victim: Sandbox, spec: SandboxSpec, timeout_s: float
) -> Sandbox:
    """SIGKILL ``victim``'s processes; the sandbox ``spec`` gets once its GPUs come back."""
    __tracebackhide__ = True
    victim.kill()
    return retake(
        lambda: create(spec),
        timeout_s,
        f"the GPUs of killed sandbox {victim.id} ({', '.join(uuids(victim))}) to come back",
    )


def retake(
    create: Callable[[], Sandbox],
    timeout_s: float,
    what: str,
    retry_on: tuple[type[BaseException], ...] = (GpusExhausted,),
) -> Sandbox:
    """``create()`` again while it fails with ``retry_on``, until GPUs come back.

    A driver may also wait for them inside one create: each is bounded by the driver's pace
    and ``timeout_s``.
    """
    __tracebackhide__ = True
    with unpaced(timeout_s):
        return wait_until(create, timeout_s=timeout_s, what=what, retry_on=retry_on)


def assert_all_gpus_grantable(driver: Driver, after: str) -> None:
    """Take every GPU of the host, then give them back: proves nothing is still held.

    The sandboxes are created and closed all at once (one per GPU, where a driver takes one
    per sandbox: a VM boots in seconds).
    """
    __tracebackhide__ = True
    specs = specs_for_all_gpus(driver)
    with ThreadPoolExecutor(len(specs)) as pool:
        attempts = [pool.submit(driver.create, spec) for spec in specs]
        wait(attempts)
        taken = [a.result() for a in attempts if a.exception() is None]
        try:
            for attempt in attempts:
                if isinstance(exc := attempt.exception(), GpuAllocationError):
                    raise AssertionError(f"a GPU is still held {after}: {exc}") from None
                attempt.result()
            granted = sorted(gpu.uuid for sandbox in taken for gpu in sandbox.gpus)
            assert granted == sorted(gpu.uuid for gpu in driver.inventory()), (
                f"taking every GPU {after} granted {granted}"
            )
        finally:
            for closing in [pool.submit(sandbox.close) for sandbox in taken]:
                closing.result()


def expect_refusal(
    driver: Driver,
    create: Callable[[SandboxSpec], Sandbox],
    spec: SandboxSpec,
    error: type[RequestError],
    *,
    field: str,
    value: str,
) -> RequestError:
    """``spec`` fails with ``error`` naming ``field`` and ``value``, and takes nothing.

    Nothing: no sandbox of the session and no lease in the host registry is left behind.
    """
    __tracebackhide__ = True
    before = driver.sandboxes(driver.session_id)
    leases_before = driver.host.leases.leases()
    try:
        create(spec)
    except error as exc:
        refused = exc
    else:
        raise AssertionError(f"{spec} was granted; it must fail with {error.__name__}")
    assert refused.field == field, f"the error names {refused.field!r}, not {field!r}"
    assert value in str(refused), f"the message does not name {value!r}: {refused}"
    assert driver.sandboxes(driver.session_id) == before, "a sandbox was left behind"
    assert driver.host.leases.leases() == leases_before, f"the refused {spec} left a lease"
    return refused


ENDED_TIMEOUT_S = 60.0
"""How long a killed sandbox may take to be gone, on a loaded machine too."""
Run = Callable[..., ExecResult]
COMMAND_PATHS = ("exec", "exec_stream")
"""Every path to a command the contract has: kept, and streamed to descriptors."""


def ways_to_run(sandbox: Sandbox) -> dict[str, Run]:
    """``exec``, and ``exec_stream`` (what `gpu-sandbox run` uses) read back from its files.

    Each path to a command must give the same: a check of what a command sees runs through both.
    """

    def streamed(argv: Sequence[str], timeout: float = DEFAULT_EXEC_TIMEOUT_S) -> ExecResult:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            returncode = sandbox.exec_stream(argv, out.fileno(), err.fileno(), timeout)
            out.seek(0)
            err.seek(0)
            text = (out.read().decode(errors="replace"), err.read().decode(errors="replace"))
        return ExecResult(tuple(argv), returncode, *text)

    return dict(zip(COMMAND_PATHS, (sandbox.exec, streamed), strict=True))


def uuids(sandbox: Sandbox) -> list[str]:
    """The UUIDs the driver says it gave ``sandbox``."""
    return [gpu.uuid for gpu in sandbox.gpus]
