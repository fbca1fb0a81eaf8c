"""The CDI devices a container engine can inject, read from the specs it reads.

Container drivers name GPUs the way their engine does: by CDI name (``nvidia.com/gpu=0``,
``nvidia.com/gpu=GPU-…``, ``nvidia.com/gpu=all``; a simulated host has a kind of its own).
Which GPU a name injects is decided by the device nodes its spec lists, so the names are
matched to host GPUs by node minor, the identity the GPUs' ``/dev/nvidia<minor>`` nodes
carry, never by trusting the name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuhost import strict
from gpuhost.devices import CDI_KIND, NVIDIA_GPU_MAJORS, GpuDevice

DEFAULT_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
SPEC_MAX_BYTES = 8 << 20
"""Far over any spec nvidia-ctk writes (5 KB a GPU, with its MIG devices a few times that)."""
"""Where CDI-enabled engines look unless configured otherwise (podman, dockerd, containerd)."""


def all_devices(kind: str = CDI_KIND) -> str:
    """The name of every GPU of ``kind`` at once, e.g. ``nvidia.com/gpu=all``."""
    return f"{kind}=all"


_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")
_CAP_NODE = re.compile(r"^/dev/nvidia-caps/nvidia-cap(\d+)$")
NodeKey = tuple[str, int]
"""What identifies a node of a device: ``("gpu", minor)`` for /dev/nvidia<minor>,
``("cap", minor)`` for a MIG instance's /dev/nvidia-caps/nvidia-cap<minor>."""
_FIRST_CONTROL_MINOR = 254
"""nvidia-modeset (254) and nvidiactl (255) share the GPUs' major; they are not GPUs."""


@dataclass(frozen=True)
class CdiRegistry:
    """The devices of one kind in the specs of some directories, by GPU node minor."""

    devices: dict[str, frozenset[NodeKey]] = field(default_factory=dict)
    """Fully qualified CDI name → the GPU and MIG capability nodes it injects."""
    sources: dict[str, frozenset[str]] = field(default_factory=dict)
    """Fully qualified CDI name → the host paths of those nodes, where the spec gives them."""
    problems: tuple[str, ...] = ()
    """Spec files that could not be read, with why."""
    spec_dirs: tuple[Path, ...] = ()
    """The directories the specs were read from."""
    kind: str = CDI_KIND

    @property
    def all_devices(self) -> str:
        return all_devices(self.kind)

    def names_of(self, gpu: GpuDevice) -> tuple[str, ...]:
        """Every name that injects exactly ``gpu``: by index first, as nvidia-ctk writes them.

        A MIG instance's name injects its GPU's node and its own capability nodes, so it is
        never taken for the whole GPU. A name whose node comes from another host path
        (another simulated host's spec) is not this device's, however equal the minor.
        """
        own = {node.source for node in gpu.nodes}
        keys = frozenset(key for node in gpu.nodes if (key := node_key(node.path)) is not None)
        return tuple(
            name
            for name, injected in self.devices.items()
            if name != self.all_devices
            and keys
            and injected == keys
            and self.sources.get(name, frozenset()) <= own
        )

    def missing(self, gpus: Sequence[GpuDevice]) -> list[GpuDevice]:
        """The GPUs no CDI name injects alone."""
        return [gpu for gpu in gpus if not self.names_of(gpu)]


def node_key(path: str) -> NodeKey | None:
    """What a node path identifies: an NVIDIA GPU's minor, or a MIG capability's."""
    if match := _GPU_NODE.match(path):
        return ("gpu", int(match.group(1)))
    if match := _CAP_NODE.match(path):
        return ("cap", int(match.group(1)))
    return None


def load(spec_dirs: Iterable[Path] = DEFAULT_SPEC_DIRS, kind: str = CDI_KIND) -> CdiRegistry:
    """Read every ``*.yaml``/``*.json`` spec of ``kind`` in ``spec_dirs``.

    As in the CDI library, a later directory overrides an earlier one for the same name.
    """
    devices: dict[str, frozenset[NodeKey]] = {}
    sources: dict[str, frozenset[str]] = {}
    problems = []
    spec_dirs = tuple(spec_dirs)
    for directory in spec_dirs:
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            if path.suffix not in (".yaml", ".yml", ".json"):
                continue
            try:
                spec = _read(path)
                if spec.get("kind") != kind:
                    continue
                common = _gpu_nodes(spec.get("containerEdits") or {})
                for device in spec.get("devices") or []:
                    nodes = common | _gpu_nodes(device.get("containerEdits") or {})
                    name = f"{kind}={device.get('name')}"
                    devices[name] = frozenset(key for key, _ in nodes)
                    sources[name] = frozenset(source for _, source in nodes if source)
            except strict.InvalidFile as exc:
                problems.append(str(exc))
            except (ValueError, AttributeError, TypeError) as exc:
                problems.append(f"{path}: {type(exc).__name__}: {exc}")
    return CdiRegistry(_index_names_first(devices), sources, tuple(problems), spec_dirs, kind)


def _read(path: Path) -> dict[str, Any]:
    """A spec, read strictly (``gpuhost.strict``): a key twice, an anchor or a tag refused."""
    if path.suffix == ".json":
        data = strict.read_json(path, max_bytes=SPEC_MAX_BYTES)
    else:
        data = strict.read_yaml(path, max_bytes=SPEC_MAX_BYTES)
    if not isinstance(data, dict):
        raise strict.InvalidFile(path, strict.DOCUMENT, data, "is not a CDI spec (not a mapping)")
    return data


def _gpu_nodes(edits: dict[str, Any]) -> set[tuple[NodeKey, str]]:
    """(what it identifies, host path or "") of each GPU or MIG capability node of the edits."""
    nodes = set()
    for node in edits.get("deviceNodes") or []:
        path, minor = str(node.get("path", "")), node.get("minor")
        source = str(node.get("hostPath") or path)
        key = node_key(path)
        if node.get("major") in NVIDIA_GPU_MAJORS and isinstance(minor, int):
            # The numbers decide, whatever the path: a GPU node renamed is still that GPU.
            key = ("gpu", minor) if minor < _FIRST_CONTROL_MINOR else None
        if key is not None:
            nodes.add((key, source))
    return nodes


def _index_names_first(
    devices: dict[str, frozenset[NodeKey]],
) -> dict[str, frozenset[NodeKey]]:
    def key(name: str) -> tuple[bool, int, str]:
        suffix = name.partition("=")[2]
        return (not suffix.isdigit(), int(suffix) if suffix.isdigit() else 0, suffix)

    return {name: devices[name] for name in sorted(devices, key=key)}
