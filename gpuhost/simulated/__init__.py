"""A simulated NVIDIA GPU host, for machines with no GPU.

``setup(root, count)`` makes, under ``root`` (several roots can coexist):

- ``dev/``: character devices with NVIDIA's numbers: ``nvidia<minor>`` (195:minor) per GPU,
  ``nvidiactl`` (195:255), ``nvidia-uvm`` and ``nvidia-uvm-tools``. ``stat()`` works on
  them and ``open()`` fails with ENXIO, exactly as on a host whose driver is unloaded, so a
  sandbox can be given (or denied) a GPU by its device node, as on a real host;
- ``share/inventory.tsv``: minor, UUID, name, PCI bus id and memory of every GPU; as on
  real hosts, the minors are not in PCI order (GPU 0 is not ``/dev/nvidia0``), so a driver
  must carry each GPU by its own node;
- ``share/bin/nvidia-smi``: a stand-in that reports exactly the GPUs whose
  ``/dev/nvidia<minor>`` nodes it can see (``-L``, ``-i``, ``--query-gpu``), so nothing a
  driver puts in the environment can fake visibility;
- ``cdi/nvidia-sim.yaml``: a CDI spec (cdiVersion 0.5.0, the newest podman 4.3 reads) with
  devices by index, by UUID and ``all``, for the engine lanes, under a CDI kind of this
  host's own, ``sim-<token>.nvidia.com/gpu``: engines resolve a name from every spec they
  read, so hosts sharing ``nvidia.com/gpu=0`` would make each other's names ambiguous;
- ``leases/``: the simulated host's own lease registry.

``setup(..., cdi_dir=Path("/var/run/cdi"))`` also registers the CDI spec with the container
engines, as ``gpu-sandbox-sim-<token>.yaml``; any number of simulated hosts can be
registered at once (concurrent runs, xdist workers), ``teardown`` unregisters its own, and
``setup`` removes the registrations of hosts that no longer exist.

Inside a sandbox, ``share/`` is mounted at ``/run/gpu-sim`` (``SANDBOX_SHARE``).
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from gpuhost.devices import (
    NVIDIA_MAJOR,
    NVIDIACTL_MINOR,
    DeviceNode,
    GpuDevice,
    normalize_pci_bus_id,
    sorted_by_pci,
)

DEFAULT_ROOT = Path("/run/gpu-sandbox-sim")
DEFAULT_COUNT = 8
SANDBOX_SHARE = "/run/gpu-sim"
MODEL = "NVIDIA H100 80GB HBM3"
MEMORY_MIB = 81559
# nvidia-uvm's major is assigned dynamically on real hosts; any unused major will do.
UVM_MAJOR = 511
# The bus ids of an 8-GPU DGX H100 (from recorded lspci captures), then made-up ones.
DGX_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
_MARKER = "simulated-gpu-host"
CDI_VENDOR_SUFFIX = ".nvidia.com"
REGISTERED_PREFIX = "gpu-sandbox-sim-"


class SimulatedHostError(RuntimeError):
    """The simulated host could not be set up, or a directory is not one."""


@dataclass(frozen=True)
class SimulatedHost:
    root: Path
    gpus: tuple[GpuDevice, ...]
    cdi_kind: str

    @property
    def share_dir(self) -> Path:
        return self.root / "share"

    @property
    def nvidia_smi(self) -> Path:
        return self.share_dir / "bin" / "nvidia-smi"

    @property
    def cdi_spec(self) -> Path:
        return self.root / "cdi" / "nvidia-sim.yaml"

    @property
    def lease_dir(self) -> Path:
        return self.root / "leases"

    @property
    def control_nodes(self) -> tuple[DeviceNode, ...]:
        return tuple(
            DeviceNode(f"/dev/{name}", major, minor, str(self.root / "dev" / name))
            for name, major, minor in _CONTROL_NODES
        )


_CONTROL_NODES = (
    ("nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR),
    ("nvidia-uvm", UVM_MAJOR, 0),
    ("nvidia-uvm-tools", UVM_MAJOR, 1),
)


def setup(
    root: Path = DEFAULT_ROOT, count: int = DEFAULT_COUNT, cdi_dir: Path | None = None
) -> SimulatedHost:
    """Create a simulated host of ``count`` GPUs under ``root``, replacing one already there.

    With ``cdi_dir``, its CDI spec is also written there for the container engines to read.
    """
    if count < 1:
        raise SimulatedHostError(f"count must be at least 1, got {count}")
    if root.exists():
        teardown(root)
    dev = root / "dev"
    bindir = root / "share" / "bin"
    dev.mkdir(parents=True)
    bindir.mkdir(parents=True)
    (root / _MARKER).write_text("created by gpuhost.simulated; remove with `teardown`\n")

    rows = []
    for position in range(count):
        minor = _minor(position, count)
        rows.append((minor, f"GPU-{uuid.uuid4()}", MODEL, _bus_id(position), MEMORY_MIB))
        _mknod(dev / f"nvidia{minor}", NVIDIA_MAJOR, minor)
    for name, major, minor in _CONTROL_NODES:
        _mknod(dev / name, major, minor)

    (root / "share" / "inventory.tsv").write_text(
        "# minor\tuuid\tname\tpci.bus_id\tmemory.total [MiB]\n"
        + "".join("\t".join(map(str, row)) + "\n" for row in sorted(rows))
    )
    package = resources.files(__package__)
    for name in ("nvidia-smi", "nvidia-smi.awk"):
        target = bindir / name
        target.write_bytes(package.joinpath(name).read_bytes())
        target.chmod(0o755)

    token = uuid.uuid4().hex[:8]
    (root / "cdi").mkdir()
    (root / "cdi" / "kind").write_text(f"sim-{token}{CDI_VENDOR_SUFFIX}/gpu\n")
    host = load(root)
    host.cdi_spec.write_text(yaml.safe_dump(cdi_spec(host), sort_keys=False))
    host.lease_dir.mkdir()
    if cdi_dir is not None:
        cdi_dir.mkdir(parents=True, exist_ok=True)
        _prune_registrations(cdi_dir)
        registered = cdi_dir / f"{REGISTERED_PREFIX}{token}.yaml"
        registered.with_suffix(".tmp").write_text(host.cdi_spec.read_text())
        registered.with_suffix(".tmp").rename(registered)  # engines never read half a spec
        (root / "cdi" / "registered").write_text(f"{registered}\n")
    return host


def load(root: Path = DEFAULT_ROOT) -> SimulatedHost:
    """The simulated host under ``root``, as ``setup`` left it."""
    if not (root / _MARKER).is_file():
        raise SimulatedHostError(
            f"{root} is not a simulated GPU host (no {_MARKER} marker); "
            f"create one with `python -m gpuhost.simulated setup --root {root}`"
        )
    kind = (root / "cdi" / "kind").read_text().strip()
    gpus: list[GpuDevice] = []
    for line in (root / "share" / "inventory.tsv").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        minor, gpu_uuid, name, bus, memory = line.split("\t")
        node = f"nvidia{minor}"
        gpus.append(
            GpuDevice(
                index=len(gpus),
                uuid=gpu_uuid,
                name=name,
                pci_bus_id=normalize_pci_bus_id(bus),
                memory_mib=int(memory),
                minor=int(minor),
                nodes=(
                    DeviceNode(f"/dev/{node}", NVIDIA_MAJOR, int(minor), str(root / "dev" / node)),
                ),
                cdi_kind=kind,
            )
        )
    return SimulatedHost(root=root, gpus=sorted_by_pci(gpus), cdi_kind=kind)


def teardown(root: Path = DEFAULT_ROOT) -> None:
    """Remove a simulated host; refuses a directory that ``setup`` did not make."""
    if not root.exists():
        return
    if not (root / _MARKER).is_file():
        raise SimulatedHostError(f"refusing to remove {root}: not a simulated GPU host")
    registration = root / "cdi" / "registered"
    if registration.is_file():
        Path(registration.read_text().strip()).unlink(missing_ok=True)
    shutil.rmtree(root)


def _prune_registrations(cdi_dir: Path) -> None:
    """Unregister the specs of simulated hosts that are gone (a run killed before teardown)."""
    for spec in cdi_dir.glob(f"{REGISTERED_PREFIX}*.yaml"):
        try:
            nodes = yaml.safe_load(spec.read_text())["containerEdits"]["deviceNodes"]
            gone = not Path(nodes[0]["hostPath"]).exists()
        except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError):
            continue  # not ours to judge
        if gone:
            spec.unlink(missing_ok=True)


def cdi_spec(host: SimulatedHost) -> dict[str, object]:
    """A CDI spec in nvidia-ctk's shape, pointing at the simulated nodes and nvidia-smi."""

    def node(n: DeviceNode) -> dict[str, object]:
        return {
            "path": n.path,
            "hostPath": n.source,
            "type": "c",
            "major": n.major,
            "minor": n.minor,
        }

    def mount(host_path: Path, container_path: str) -> dict[str, object]:
        return {
            "hostPath": str(host_path),
            "containerPath": container_path,
            "options": ["ro", "nosuid", "nodev", "bind"],
        }

    devices: list[dict[str, object]] = []
    for gpu in host.gpus:
        edits = {"deviceNodes": [node(n) for n in gpu.nodes]}
        devices.append({"name": str(gpu.index), "containerEdits": edits})
        devices.append({"name": gpu.uuid, "containerEdits": edits})
    devices.append(
        {
            "name": "all",
            "containerEdits": {"deviceNodes": [node(n) for gpu in host.gpus for n in gpu.nodes]},
        }
    )
    return {
        "cdiVersion": "0.5.0",
        "kind": host.cdi_kind,
        "devices": devices,
        "containerEdits": {
            "deviceNodes": [node(n) for n in host.control_nodes],
            "env": ["NVIDIA_VISIBLE_DEVICES=void"],
            "mounts": [
                mount(host.share_dir, SANDBOX_SHARE),
                mount(host.nvidia_smi, "/usr/bin/nvidia-smi"),
            ],
        },
    }


def _bus_id(position: int) -> str:
    """The DGX H100's bus ids, then made-up ones: 32 per PCI domain from bus e0."""
    if position < len(DGX_BUSES):
        return f"00000000:{DGX_BUSES[position].upper()}:00.0"
    extra = position - len(DGX_BUSES)
    return f"{extra // 32:08X}:{0xE0 + extra % 32:02X}:00.0"


def _minor(position: int, count: int) -> int:
    """The device minor of the GPU at ``position`` in PCI order: never its index.

    On real hosts the minors follow the order the driver probed the GPUs in, not PCI order
    (for two or more GPUs; one GPU is minor 0).
    """
    return (position + (count + 1) // 2) % count


def _mknod(path: Path, major: int, minor: int) -> None:
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    except PermissionError as exc:
        raise SimulatedHostError(
            f"cannot create the character device {path} ({major}:{minor}): {exc}; "
            "setting up a simulated GPU host needs root (CAP_MKNOD)"
        ) from None
    # mknod's mode is filtered by the umask; the nodes must be usable by any sandbox user.
    path.chmod(0o666)
