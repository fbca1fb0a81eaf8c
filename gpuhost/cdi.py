"""The CDI devices a container engine can inject, read from the specs it reads.

Container drivers name GPUs the way their engine does: by CDI name (``nvidia.com/gpu=0``,
``nvidia.com/gpu=GPU-…``, ``nvidia.com/gpu=all``; a simulated host has a kind of its own).
Which GPU a name injects is decided by the device nodes its spec lists, so the names are
matched to host GPUs by node minor, the identity the GPUs' ``/dev/nvidia<minor>`` nodes
carry, never by trusting the name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuhost.devices import CDI_KIND, NVIDIA_MAJOR, GpuDevice

DEFAULT_SPEC_DIRS = (Path("/etc/cdi"), Path("/var/run/cdi"))
"""Where CDI-enabled engines look unless configured otherwise (podman, dockerd, containerd)."""


def all_devices(kind: str = CDI_KIND) -> str:
    """The name of every GPU of ``kind`` at once, e.g. ``nvidia.com/gpu=all``."""
    return f"{kind}=all"


_GPU_NODE = re.compile(r"^/dev/nvidia(\d+)$")
_FIRST_CONTROL_MINOR = 254
"""nvidia-modeset (254) and nvidiactl (255) share the GPUs' major; they are not GPUs."""


@dataclass(frozen=True)
class CdiRegistry:
    """The devices of one kind in the specs of some directories, by GPU node minor."""

    devices: dict[str, frozenset[int]] = field(default_factory=dict)
    """Fully qualified CDI name → minors of the NVIDIA GPU nodes it injects."""
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

        A name whose node comes from another host path (another simulated host's spec) is
        not this GPU's, however equal the minor.
        """
        own = {node.source for node in gpu.nodes}
        return tuple(
            name
            for name, minors in self.devices.items()
            if name != self.all_devices
            and minors == {gpu.minor}
            and self.sources.get(name, frozenset()) <= own
        )

    def missing(self, gpus: Sequence[GpuDevice]) -> list[GpuDevice]:
        """The GPUs no CDI name injects alone."""
        return [gpu for gpu in gpus if not self.names_of(gpu)]


def load(spec_dirs: Iterable[Path] = DEFAULT_SPEC_DIRS, kind: str = CDI_KIND) -> CdiRegistry:
    """Read every ``*.yaml``/``*.json`` spec of ``kind`` in ``spec_dirs``.

    As in the CDI library, a later directory overrides an earlier one for the same name.
    """
    devices: dict[str, frozenset[int]] = {}
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
                    devices[name] = frozenset(minor for minor, _ in nodes)
                    sources[name] = frozenset(source for _, source in nodes if source)
            except (OSError, ValueError, AttributeError, TypeError, yaml.YAMLError) as exc:
                problems.append(f"{path}: {type(exc).__name__}: {exc}")
    return CdiRegistry(_index_names_first(devices), sources, tuple(problems), spec_dirs, kind)


def _read(path: Path) -> dict[str, Any]:
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError("not a CDI spec (not a mapping)")
    return data


def _gpu_nodes(edits: dict[str, Any]) -> set[tuple[int, str]]:
    """(minor, host path or "") of each NVIDIA GPU node the edits inject."""
    nodes = set()
    for node in edits.get("deviceNodes") or []:
        minor = node.get("minor")
        source = str(node.get("hostPath") or node.get("path") or "")
        if node.get("major") == NVIDIA_MAJOR and isinstance(minor, int):
            if minor < _FIRST_CONTROL_MINOR:
                nodes.add((minor, source))
        elif match := _GPU_NODE.match(str(node.get("path", ""))):
            nodes.add((int(match.group(1)), source))
    return nodes


def _index_names_first(devices: dict[str, frozenset[int]]) -> dict[str, frozenset[int]]:
    def key(name: str) -> tuple[bool, int, str]:
        suffix = name.partition("=")[2]
        return (not suffix.isdigit(), int(suffix) if suffix.isdigit() else 0, suffix)

    return {name: devices[name] for name in sorted(devices, key=key)}
