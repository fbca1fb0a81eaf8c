"""A simulated NVIDIA GPU host, for machines with no GPU.

``setup(root, count)`` makes, under ``root`` (several roots can coexist):

- ``dev/``: character devices named and numbered as NVIDIA's, but of majors the kernel keeps
  for local use (``SIMULATED_NVIDIA_MAJOR``, 120 to 124), which no driver registers:
  ``nvidia<minor>`` (120:minor) per GPU, ``nvidiactl`` (120:255), ``nvidia-uvm`` and
  ``nvidia-uvm-tools``. ``stat()`` works on them and ``open()`` fails with ENXIO on every
  host, exactly as on a host whose driver is unloaded, so a sandbox can be given (or denied)
  a GPU by its device node, as on a real host, and a simulated node never reaches a real
  GPU, even where NVIDIA's or DRM's drivers are loaded;
- ``share/control-nodes.tsv``: name, major and minor of each control node (for a guest
  kernel to make them as the host has them);
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

Optionally (``mig``, ``dri``), as real hosts have them:

- MIG instances on some GPUs (``--mig 0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb``): the GPU is in MIG mode;
  each instance has a UUID, a profile, and the nvidia-caps nodes of its GPU and compute
  instance (``dev/nvidia-caps/nvidia-cap<minor>``, minors as in the driver's
  ``/proc/driver/nvidia-caps/mig-minors``, written to ``share/mig-minors``); the stand-in
  nvidia-smi lists exactly the instances whose cap nodes it can see, under their GPU, and the
  CDI spec names them ``<gpu>:<instance>`` and by UUID;
- DRI GPUs of other vendors (``--dri intel:1,amd:2``): card and render nodes (124:N, their
  numbers deliberately not in PCI order, card and render crossed), ``dev/dri/by-path``
  links, PCI records under ``sys/bus/pci/devices`` as sysfs has them, ``dev/kfd`` for AMD,
  and ``share/bin/dri-gpus``, a stand-in probe that reports which DRI GPUs a sandbox can
  open, identified by the numbers of the nodes it sees, as the kernel identifies them.
  With ``count`` 0 they are the host's only GPUs (``--count 0 --dri amd:2``), as on an AMD
  host: no NVIDIA node, control node or CDI device (nothing is registered with the engines).

``setup(..., cdi_dir=Path("/var/run/cdi"))`` also registers the CDI spec with the container
engines, as ``gpu-sandbox-sim-<token>.yaml``; any number of simulated hosts can be
registered at once (concurrent runs, xdist workers), ``teardown`` unregisters its own, and
``setup`` removes the registrations of hosts that no longer exist.

Inside a sandbox, ``share/`` is mounted at ``/run/gpu-sim`` (``SANDBOX_SHARE``).
"""

from __future__ import annotations

import dataclasses
import os
import stat
import uuid
from importlib import resources
from pathlib import Path

from gpuhost import strict
from gpuhost.devices import (
    DeviceNode,
    GpuDevice,
    normalize_pci_bus_id,
    sorted_by_pci,
)
from gpuhost.leases import Holder
from gpuhost.simulated.cleanup import prune_registrations
from gpuhost.simulated.cleanup import sweep as sweep
from gpuhost.simulated.cleanup import teardown as teardown
from gpuhost.simulated.host import CAPS_MAJOR as CAPS_MAJOR
from gpuhost.simulated.host import CDI_VENDOR_SUFFIX, CONTROL_NODES, MARKER, OWNER, mknod
from gpuhost.simulated.host import DEFAULT_COUNT as DEFAULT_COUNT
from gpuhost.simulated.host import DEFAULT_ROOT as DEFAULT_ROOT
from gpuhost.simulated.host import DGX_BUSES as DGX_BUSES
from gpuhost.simulated.host import DRM_MAJOR as DRM_MAJOR
from gpuhost.simulated.host import KFD_MAJOR as KFD_MAJOR
from gpuhost.simulated.host import MEMORY_MIB as MEMORY_MIB
from gpuhost.simulated.host import MODEL as MODEL
from gpuhost.simulated.host import NODE_GID as NODE_GID
from gpuhost.simulated.host import NVIDIA_MAJOR as NVIDIA_MAJOR
from gpuhost.simulated.host import REGISTERED_PREFIX as REGISTERED_PREFIX
from gpuhost.simulated.host import SANDBOX_SHARE as SANDBOX_SHARE
from gpuhost.simulated.host import UVM_MAJOR as UVM_MAJOR
from gpuhost.simulated.host import DriLayout as DriLayout
from gpuhost.simulated.host import MigLayout as MigLayout
from gpuhost.simulated.host import SimulatedHost as SimulatedHost
from gpuhost.simulated.host import SimulatedHostError as SimulatedHostError
from gpuhost.simulated.layouts import bus_id, check_layouts, gpu_minor, make_dri, make_mig
from gpuhost.simulated.layouts import parse_dri_layout as parse_dri_layout
from gpuhost.simulated.layouts import parse_mig_layout as parse_mig_layout


def setup(
    root: Path = DEFAULT_ROOT,
    count: int = DEFAULT_COUNT,
    cdi_dir: Path | None = None,
    mig: MigLayout | None = None,
    dri: DriLayout | None = None,
    owner: Holder | None = None,
) -> SimulatedHost:
    """Create a simulated host of ``count`` GPUs under ``root``, replacing one already there.

    ``mig`` puts GPUs in MIG mode with those instances; ``dri`` adds GPUs of other vendors.
    With ``cdi_dir``, its CDI spec is also written there for the container engines to read.
    With ``owner`` (a run's process), ``sweep`` removes the host once the owner is gone.
    """
    mig, dri = dict(mig or {}), dict(dri or {})
    if count < 1 and not (count == 0 and dri):
        raise SimulatedHostError(
            f"count must be at least 1, got {count} (0 only beside AMD or Intel GPUs: a host "
            "without NVIDIA's)"
        )
    check_layouts(count, mig, dri)
    if root.exists():
        teardown(root)
    dev = root / "dev"
    bindir = root / "share" / "bin"
    dev.mkdir(parents=True)
    bindir.mkdir(parents=True)
    (root / MARKER).write_text("created by gpuhost.simulated; remove with `teardown`\n")
    if owner is not None:
        (root / OWNER).write_text(f"{owner.kind} {owner.ref}\n")

    rows = []
    for position in range(count):
        minor = gpu_minor(position, count)
        rows.append((minor, f"GPU-{uuid.uuid4()}", MODEL, bus_id(position), MEMORY_MIB))
        mknod(dev / f"nvidia{minor}", NVIDIA_MAJOR, minor)
    control = CONTROL_NODES if count else ()  # a host without NVIDIA GPUs has no nvidiactl
    for name, major, minor in control:
        mknod(dev / name, major, minor)
    (root / "share" / "control-nodes.tsv").write_text(
        "# name\tmajor\tminor\n" + "".join(f"{n}\t{ma}\t{mi}\n" for n, ma, mi in control)
    )
    (root / "share" / "inventory.tsv").write_text(
        "# minor\tuuid\tname\tpci.bus_id\tmemory.total [MiB]\n"
        + "".join("\t".join(map(str, row)) + "\n" for row in sorted(rows))
    )
    make_mig(root, {gpu_minor(p, count): profiles for p, profiles in mig.items()})
    make_dri(root, dri)
    package = resources.files(__package__)
    for name in ("nvidia-smi", "nvidia-smi.awk", "dri-gpus"):
        target = bindir / name
        target.write_bytes(package.joinpath(name).read_bytes())
        target.chmod(0o755)

    token = uuid.uuid4().hex[:8]
    (root / "cdi").mkdir()
    (root / "cdi" / "kind").write_text(f"sim-{token}{CDI_VENDOR_SUFFIX}/gpu\n")
    host = load(root)
    host.cdi_spec.write_text(strict.dump_yaml(cdi_spec(host)))
    host.lease_dir.mkdir()
    host.lease_dir.chmod(0o1777)  # every user's sandboxes may take its GPUs (lease protocol)
    if cdi_dir is not None and count:  # CDI names NVIDIA's devices: none to register without
        cdi_dir.mkdir(parents=True, exist_ok=True)
        prune_registrations(cdi_dir)
        registered = cdi_dir / f"{REGISTERED_PREFIX}{token}.yaml"
        registered.with_suffix(".tmp").write_text(host.cdi_spec.read_text())
        registered.with_suffix(".tmp").rename(registered)  # engines never read half a spec
        (root / "cdi" / "registered").write_text(f"{registered}\n")
    return host


def load(root: Path = DEFAULT_ROOT) -> SimulatedHost:
    """The simulated host under ``root``, as ``setup`` left it."""
    if not (root / MARKER).is_file():
        raise SimulatedHostError(
            f"{root} is not a simulated GPU host (no {MARKER} marker); "
            f"create one with `python -m gpuhost.simulated setup --root {root}`"
        )
    kind = (root / "cdi" / "kind").read_text().strip()
    mig_rows = _rows(root / "share" / "mig.tsv")
    in_mig_mode = {int(row[0]) for row in mig_rows}
    gpus: list[GpuDevice] = []
    for minor, gpu_uuid, name, bus, memory in _rows(root / "share" / "inventory.tsv"):
        gpus.append(
            GpuDevice(
                index=len(gpus),
                uuid=gpu_uuid,
                name=name,
                pci_bus_id=normalize_pci_bus_id(bus),
                memory_mib=int(memory),
                minor=int(minor),
                nodes=(_node(root, f"nvidia{minor}", NVIDIA_MAJOR, int(minor)),),
                cdi_kind=kind,
                mig_enabled=int(minor) in in_mig_mode,
            )
        )
    ordered = sorted_by_pci(gpus)
    by_minor = {gpu.minor: gpu for gpu in ordered}
    migs = []
    for parent_minor, index, _, _, profile, mig_uuid, gi_minor, ci_minor, memory in mig_rows:
        parent = by_minor[int(parent_minor)]
        caps = tuple(
            _node(root, f"nvidia-caps/nvidia-cap{minor}", CAPS_MAJOR, int(minor))
            for minor in (gi_minor, ci_minor)
        )
        migs.append(
            dataclasses.replace(
                parent,
                uuid=mig_uuid,
                name=f"{parent.name} MIG {profile}",
                memory_mib=int(memory),
                nodes=parent.nodes + caps,
                parent_uuid=parent.uuid,
                mig_index=int(index),
                profile=profile,
                mig_enabled=False,
            )
        )
    position = {gpu.uuid: index for index, gpu in enumerate(ordered)}
    migs.sort(key=lambda mig: (position[mig.parent_uuid or ""], mig.mig_index))
    host = SimulatedHost(
        root=root,
        gpus=ordered,
        cdi_kind=kind,
        mig_devices=tuple(migs),
        dri_gpus=_load_dri(root),
    )
    _check_trusted(host)
    return host


_TRUSTED_DIRS = ("", "dev", "dev/dri", "dev/nvidia-caps", "cdi", "share", "share/bin")
"""The host's directories whose files become a sandbox's devices and tools."""


def _check_trusted(host: SimulatedHost) -> None:
    """Refuse a host that another user could have changed: its nodes are handed to sandboxes.

    Its directories must be real directories of root's (or of the user running the suite)
    that no one else may write, and each device node a character device of its own major and
    minor: not a link, nor another device (a disk, /dev/kmsg) under a GPU's name.
    """
    trusted = {0, os.geteuid()}
    for name in _TRUSTED_DIRS:
        path = host.root / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in trusted or st.st_mode & 0o022:
            raise SimulatedHostError(
                f"refusing the simulated host {host.root}: {path} is "
                f"{_described(st)}; it must be a directory of root's that no one else may write"
            )
    devices = (*host.gpus, *host.mig_devices, *host.dri_gpus)
    for node in dict.fromkeys([*host.control_nodes, *(n for gpu in devices for n in gpu.nodes)]):
        try:
            st = os.lstat(node.source)
        except FileNotFoundError:
            continue
        expected = os.makedev(node.major, node.minor)
        if not stat.S_ISCHR(st.st_mode) or st.st_rdev != expected or st.st_uid not in trusted:
            raise SimulatedHostError(
                f"refusing the simulated host {host.root}: {node.source} is {_described(st)}, "
                f"not the character device {node.major}:{node.minor} of root's it must be"
            )


def _described(st: os.stat_result) -> str:
    kind = (
        "a symbolic link" if stat.S_ISLNK(st.st_mode)
        else "a directory" if stat.S_ISDIR(st.st_mode)
        else f"the character device {os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        if stat.S_ISCHR(st.st_mode)
        else "a block device" if stat.S_ISBLK(st.st_mode)
        else "a file"
    )  # fmt: skip
    return f"{kind} of uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _load_dri(root: Path) -> tuple[GpuDevice, ...]:
    """The DRI GPUs, numbered per vendor in PCI order as each vendor's tools do."""
    gpus = []
    numbered: dict[str, int] = {}
    kfd = _node(root, "kfd", KFD_MAJOR, 0)
    for bus, vendor, name, card, render, memory in sorted(_rows(root / "share" / "dri.tsv")):
        nodes = (
            _node(root, f"dri/card{card}", DRM_MAJOR, int(card)),
            _node(root, f"dri/renderD{render}", DRM_MAJOR, int(render)),
        )
        index = numbered[vendor] = numbered.get(vendor, -1) + 1
        gpus.append(
            GpuDevice(
                index=index,
                uuid=f"PCI-{bus}",
                name=name,
                pci_bus_id=bus,
                memory_mib=int(memory),
                vendor=vendor,
                nodes=nodes + ((kfd,) if vendor == "amd" else ()),
            )
        )
    return tuple(gpus)


def _rows(path: Path) -> list[list[str]]:
    if not path.is_file():
        return []
    lines = path.read_text().splitlines()
    return [line.split("\t") for line in lines if line and not line.startswith("#")]


def _node(root: Path, name: str, major: int, minor: int) -> DeviceNode:
    return DeviceNode(f"/dev/{name}", major, minor, str(root / "dev" / name))


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
    for device in (*host.gpus, *host.mig_devices):
        edits = {"deviceNodes": [node(n) for n in device.nodes]}
        for name in device.cdi_names:
            devices.append({"name": name.partition("=")[2], "containerEdits": edits})
    if host.gpus:
        every = [node(n) for gpu in host.gpus for n in gpu.nodes]
        devices.append({"name": "all", "containerEdits": {"deviceNodes": every}})
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
