"""What the conformance and workload tests observe inside a sandbox, and how."""

from __future__ import annotations

from dataclasses import dataclass

from drivers.base import Driver, Sandbox
from drivers.errors import GpuAllocationError
from drivers.gpus import NVIDIA_MAJOR
from drivers.spec import SandboxSpec

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
    result = sandbox.exec(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"])
    output = result.stdout + result.stderr
    if result.returncode == NVIDIA_SMI_NO_DEVICES and "No devices were found" in output:
        return []
    if result.returncode == NVIDIA_SMI_NO_DRIVER and "couldn't communicate" in output:
        return []
    if result.returncode in _COMMAND_NOT_FOUND and "not found" in output:
        return []
    result.check()
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


@dataclass(frozen=True)
class NodeSeen:
    path: str
    major: int
    minor: int


def nvidia_gpu_nodes(sandbox: Sandbox) -> list[NodeSeen]:
    """Every character device under the sandbox's /dev that is an NVIDIA GPU (195:0-253).

    All of /dev is searched, dotfiles and subdirectories included, not only /dev/nvidia*:
    a node's identity is its number. The type comes from ``stat``, not ``find -type c``,
    which trusts the directory entry: a device bind-mounted over a placeholder file (as
    bubblewrap does) is listed there as a regular file.
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
        if kind != "character special file":
            continue
        seen = NodeSeen(path, int(major, 16), int(minor, 16))
        if seen.major == NVIDIA_MAJOR and seen.minor not in _NVIDIA_CONTROL_MINORS:
            nodes.append(seen)
    return nodes


def specs_for_all_gpus(driver: Driver) -> list[SandboxSpec]:
    """Specs that together ask for every GPU of the host, within the per-sandbox maximum."""
    total = len(driver.inventory())
    per_sandbox = max(1, min(total, driver.capabilities.max_gpus_per_sandbox))
    specs = []
    while total > 0:
        specs.append(SandboxSpec.with_gpus(min(per_sandbox, total)))
        total -= per_sandbox
    return specs


def assert_all_gpus_grantable(driver: Driver, after: str) -> None:
    """Take every GPU of the host, then give them back: proves nothing is still held."""
    __tracebackhide__ = True
    taken: list[Sandbox] = []
    try:
        for spec in specs_for_all_gpus(driver):
            try:
                taken.append(driver.create(spec))
            except GpuAllocationError as exc:
                raise AssertionError(f"a GPU is still held {after}: {exc}") from None
        granted = sorted(gpu.uuid for sandbox in taken for gpu in sandbox.gpus)
        assert granted == sorted(gpu.uuid for gpu in driver.inventory()), (
            f"taking every GPU {after} granted {granted}"
        )
    finally:
        for sandbox in taken:
            sandbox.close()


def uuids(sandbox: Sandbox) -> list[str]:
    """The UUIDs the driver says it gave ``sandbox``."""
    return [gpu.uuid for gpu in sandbox.gpus]
