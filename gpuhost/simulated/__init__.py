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

``setup(..., cdi_dir=Path("/var/run/cdi"))`` also registers the CDI spec with the container
engines, as ``gpu-sandbox-sim-<token>.yaml``; any number of simulated hosts can be
registered at once (concurrent runs, xdist workers), ``teardown`` unregisters its own, and
``setup`` removes the registrations of hosts that no longer exist.

Inside a sandbox, ``share/`` is mounted at ``/run/gpu-sim`` (``SANDBOX_SHARE``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gpuhost.devices import (
    NVIDIACTL_MINOR,
    SIMULATED_DRM_MAJOR,
    SIMULATED_NVIDIA_MAJOR,
    DeviceNode,
    GpuDevice,
    normalize_pci_bus_id,
    sorted_by_pci,
)
from gpuhost.leases import Holder, liveness_check

DEFAULT_ROOT = Path("/run/gpu-sandbox-sim")
DEFAULT_COUNT = 8
SANDBOX_SHARE = "/run/gpu-sim"
MODEL = "NVIDIA H100 80GB HBM3"
MEMORY_MIB = 81559
# nvidia-uvm's major is assigned dynamically on real hosts; one kept for local use here.
NVIDIA_MAJOR = SIMULATED_NVIDIA_MAJOR
UVM_MAJOR = 121
# The bus ids of an 8-GPU DGX H100 (from recorded lspci captures), then made-up ones.
DGX_BUSES = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
# nvidia-caps and kfd have dynamic majors on real hosts too.
CAPS_MAJOR = 122
KFD_MAJOR = 123
DRM_MAJOR = SIMULATED_DRM_MAJOR
# /proc/driver/nvidia-caps/mig-minors: config 1, monitor 2, then per GPU minor 15 GPU
# instances of 9 minors each (the GI's access, then its 8 compute instances').
_CAPS_PER_GPU, _CAPS_PER_GI = 135, 9
MIG_PROFILE = re.compile(r"^(?P<slices>[1-8])g\.(?P<gb>\d+)gb$")
DRI_VENDORS = {
    "intel": ("8086", "56a0", "Intel Arc A770", 16384),
    "amd": ("1002", "740f", "AMD Instinct MI210", 65520),
}
# Where the simulated DRI GPUs sit on the PCI bus, per vendor, and how their nodes are
# numbered: not in PCI order, and the render nodes crossed against the cards.
DRI_BUSES = {"intel": ("0000:00:02.0", "0000:00:03.0"), "amd": ("0000:c1:00.0", "0000:c3:00.0")}
_MARKER = "simulated-gpu-host"
_OWNER = "owner"
"""The lease holder (kind and ref) whose end ends the host, for ``sweep``."""
CDI_VENDOR_SUFFIX = ".nvidia.com"
REGISTERED_PREFIX = "gpu-sandbox-sim-"


class SimulatedHostError(RuntimeError):
    """The simulated host could not be set up, or a directory is not one."""


@dataclass(frozen=True)
class SimulatedHost:
    root: Path
    gpus: tuple[GpuDevice, ...]
    cdi_kind: str
    mig_devices: tuple[GpuDevice, ...] = ()
    dri_gpus: tuple[GpuDevice, ...] = ()

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


MigLayout = Mapping[int, Sequence[str]]
"""GPU position (PCI order) → the profiles of its MIG instances, e.g. {0: ["1g.10gb"] * 7}."""
DriLayout = Mapping[str, int]
"""Vendor (``intel``, ``amd``) → how many DRI GPUs of it."""


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
    if count < 1:
        raise SimulatedHostError(f"count must be at least 1, got {count}")
    _check_layouts(count, mig, dri)
    if root.exists():
        teardown(root)
    dev = root / "dev"
    bindir = root / "share" / "bin"
    dev.mkdir(parents=True)
    bindir.mkdir(parents=True)
    (root / _MARKER).write_text("created by gpuhost.simulated; remove with `teardown`\n")
    if owner is not None:
        (root / _OWNER).write_text(f"{owner.kind} {owner.ref}\n")

    rows = []
    for position in range(count):
        minor = _minor(position, count)
        rows.append((minor, f"GPU-{uuid.uuid4()}", MODEL, _bus_id(position), MEMORY_MIB))
        _mknod(dev / f"nvidia{minor}", NVIDIA_MAJOR, minor)
    for name, major, minor in _CONTROL_NODES:
        _mknod(dev / name, major, minor)
    (root / "share" / "control-nodes.tsv").write_text(
        "# name\tmajor\tminor\n" + "".join(f"{n}\t{ma}\t{mi}\n" for n, ma, mi in _CONTROL_NODES)
    )
    (root / "share" / "inventory.tsv").write_text(
        "# minor\tuuid\tname\tpci.bus_id\tmemory.total [MiB]\n"
        + "".join("\t".join(map(str, row)) + "\n" for row in sorted(rows))
    )
    _make_mig(root, {_minor(p, count): profiles for p, profiles in mig.items()})
    _make_dri(root, dri)
    package = resources.files(__package__)
    for name in ("nvidia-smi", "nvidia-smi.awk", "dri-gpus"):
        target = bindir / name
        target.write_bytes(package.joinpath(name).read_bytes())
        target.chmod(0o755)

    token = uuid.uuid4().hex[:8]
    (root / "cdi").mkdir()
    (root / "cdi" / "kind").write_text(f"sim-{token}{CDI_VENDOR_SUFFIX}/gpu\n")
    host = load(root)
    import yaml  # slow to import: only setting a host up needs it, not loading one

    host.cdi_spec.write_text(yaml.safe_dump(cdi_spec(host), sort_keys=False))
    host.lease_dir.mkdir()
    host.lease_dir.chmod(0o1777)  # every user's sandboxes may take its GPUs (lease protocol)
    if cdi_dir is not None:
        cdi_dir.mkdir(parents=True, exist_ok=True)
        _prune_registrations(cdi_dir)
        registered = cdi_dir / f"{REGISTERED_PREFIX}{token}.yaml"
        registered.with_suffix(".tmp").write_text(host.cdi_spec.read_text())
        registered.with_suffix(".tmp").rename(registered)  # engines never read half a spec
        (root / "cdi" / "registered").write_text(f"{registered}\n")
    return host


def parse_mig_layout(text: str) -> dict[int, list[str]]:
    """``0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb`` (GPU position:count x profile) as a layout.

    A GPU may be named again: its instances add up (GPU 1 there has three 2g and one 1g).
    """
    layout: dict[int, list[str]] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        match = re.fullmatch(r"(?P<gpu>\d+):(?:(?P<count>\d+)x)?(?P<profile>\S+)", entry)
        if not match:
            raise SimulatedHostError(f"not a MIG layout entry: {entry!r} (e.g. 0:7x1g.10gb)")
        profiles = [match["profile"]] * int(match["count"] or 1)
        layout.setdefault(int(match["gpu"]), []).extend(profiles)
    return layout


def parse_dri_layout(text: str) -> dict[str, int]:
    """``intel:1,amd:2`` (vendor:count) as a layout."""
    layout: dict[str, int] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        vendor, _, number = entry.partition(":")
        if not number.isdigit():
            raise SimulatedHostError(f"not a DRI layout entry: {entry!r} (e.g. amd:2)")
        layout[vendor] = layout.get(vendor, 0) + int(number)
    return layout


def _check_layouts(count: int, mig: MigLayout, dri: DriLayout) -> None:
    for position, profiles in mig.items():
        if not 0 <= position < count:
            raise SimulatedHostError(f"MIG on GPU {position}, but the host has {count} GPUs")
        if not profiles or len(profiles) > 7:
            raise SimulatedHostError(f"GPU {position}: 1 to 7 MIG instances, got {profiles}")
        for profile in profiles:
            if not MIG_PROFILE.match(profile):
                raise SimulatedHostError(f"not a MIG profile: {profile!r} (e.g. 1g.10gb)")
    for vendor, number in dri.items():
        if vendor not in DRI_BUSES:
            raise SimulatedHostError(f"DRI GPUs of {vendor!r}: choose {', '.join(DRI_BUSES)}")
        if not 1 <= number <= len(DRI_BUSES[vendor]):
            raise SimulatedHostError(
                f"{number} {vendor} GPUs: 1 to {len(DRI_BUSES[vendor])} can be simulated"
            )


def _caps_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The nvidia-caps minor of a GPU instance's access, or of its compute instance's."""
    base = 3 + gpu_minor * _CAPS_PER_GPU + gi * _CAPS_PER_GI
    return base if ci is None else base + 1 + ci


def _make_mig(root: Path, mig: Mapping[int, Sequence[str]]) -> None:
    """The MIG instances of each GPU minor: cap nodes, share/mig.tsv, share/mig-minors."""
    caps = root / "dev" / "nvidia-caps"
    if mig:
        caps.mkdir()
    rows, minors = [], ["config 1", "monitor 2"]
    for gpu_minor, profiles in sorted(mig.items()):
        for index, profile in enumerate(profiles):
            gi, ci = index + 1, 0  # GPU instance 0 is the whole GPU's: real ones start at 1
            gi_minor, ci_minor = _caps_minor(gpu_minor, gi), _caps_minor(gpu_minor, gi, ci)
            for minor in (gi_minor, ci_minor):
                _mknod(caps / f"nvidia-cap{minor}", CAPS_MAJOR, minor)
            minors += [
                f"gpu{gpu_minor}/gi{gi}/access {gi_minor}",
                f"gpu{gpu_minor}/gi{gi}/ci{ci}/access {ci_minor}",
            ]
            memory = int(MIG_PROFILE.match(profile)["gb"]) * 1024  # type: ignore[index]
            rows.append((gpu_minor, index, gi, ci, profile, f"MIG-{uuid.uuid4()}",
                         gi_minor, ci_minor, memory))  # fmt: skip
    (root / "share" / "mig.tsv").write_text(
        "# gpu minor\tindex\tgi\tci\tprofile\tuuid\tgi cap minor\tci cap minor\t"
        f"memory [MiB]\tcaps major {CAPS_MAJOR}\tgpu major {NVIDIA_MAJOR}\n"
        + "".join("\t".join(map(str, row)) + "\n" for row in rows)
    )
    (root / "share" / "mig-minors").write_text("".join(f"{line}\n" for line in minors))


def _make_dri(root: Path, dri: DriLayout) -> None:
    """DRI GPUs: card and render nodes, by-path links, PCI records, kfd, share/dri.tsv."""
    buses = [
        (bus, vendor) for vendor in DRI_BUSES for bus in DRI_BUSES[vendor][: dri.get(vendor, 0)]
    ]
    count = len(buses)
    drm = root / "dev" / "dri"
    if buses:
        (drm / "by-path").mkdir(parents=True)
    rows = []
    for position, (bus, vendor) in enumerate(sorted(buses)):
        vendor_id, device_id, name, memory = DRI_VENDORS[vendor]
        # Cards in reverse PCI order; render nodes rotated against them: card and render
        # numbers tell nothing of which belong together, only the PCI address does.
        card, render = count - 1 - position, 128 + (position + 1) % count
        _mknod(drm / f"card{card}", DRM_MAJOR, card)
        _mknod(drm / f"renderD{render}", DRM_MAJOR, render)
        (drm / "by-path" / f"pci-{bus}-card").symlink_to(f"../card{card}")
        (drm / "by-path" / f"pci-{bus}-render").symlink_to(f"../renderD{render}")
        device = root / "sys" / "bus" / "pci" / "devices" / bus
        device.mkdir(parents=True)
        for field, value in (("vendor", vendor_id), ("device", device_id), ("class", "030000")):
            (device / field).write_text(f"0x{value}\n")
        rows.append((bus, vendor, name, card, render, memory))
    if any(vendor == "amd" for _, vendor in buses):
        _mknod(root / "dev" / "kfd", KFD_MAJOR, 0)
    (root / "share" / "dri.tsv").write_text(
        "# pci.bus_id\tvendor\tname\tcard\trender\tmemory [MiB]\t"
        f"kfd major {KFD_MAJOR}\tdrm major {DRM_MAJOR}\n"
        + "".join("\t".join(map(str, row)) + "\n" for row in rows)
    )


def load(root: Path = DEFAULT_ROOT) -> SimulatedHost:
    """The simulated host under ``root``, as ``setup`` left it."""
    if not (root / _MARKER).is_file():
        raise SimulatedHostError(
            f"{root} is not a simulated GPU host (no {_MARKER} marker); "
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
    for gpu_minor, index, _, _, profile, mig_uuid, gi_minor, ci_minor, memory in mig_rows:
        parent = by_minor[int(gpu_minor)]
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


def teardown(root: Path = DEFAULT_ROOT) -> None:
    """Remove a simulated host; refuses a directory that ``setup`` did not make."""
    if not root.exists():
        return
    if not (root / _MARKER).is_file():
        raise SimulatedHostError(f"refusing to remove {root}: not a simulated GPU host")
    registration = root / "cdi" / "registered"
    if registration.is_file():
        _unregister(Path(registration.read_text().strip()), root)
    shutil.rmtree(root)


def _unregister(registered: Path, root: Path) -> None:
    """Remove the host's CDI registration: only a file of ours, named as ``setup`` names it.

    The path is read from the host's own directory, which its maker may have changed: a
    file of another name, a link, or one whose spec is not this host's stays where it is.
    """
    if not re.fullmatch(rf"{re.escape(REGISTERED_PREFIX)}[0-9a-f]+\.yaml", registered.name):
        return
    try:
        with open(registered, "rb", opener=_no_follow) as spec:
            ours = spec.read() == (root / "cdi" / "nvidia-sim.yaml").read_bytes()
    except OSError:  # gone, a link (ELOOP), unreadable: not ours to remove
        return
    if ours:
        registered.unlink(missing_ok=True)


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def sweep(base: Path) -> list[Path]:
    """Remove the simulated hosts under ``base`` whose owner is gone; return their roots.

    Runs killed before their teardown leave theirs behind. Hosts with no owner, or an owner
    of a kind with no liveness check, stay.
    """
    gone = [root for root in sorted(base.glob("*/")) if _owner_gone(root)]
    for root in gone:
        teardown(root)
    return gone


def _root_of(node: Path) -> Path | None:
    return next((parent for parent in node.parents if (parent / _MARKER).is_file()), None)


def _owner_gone(root: Path) -> bool:
    try:
        kind, ref = (root / _OWNER).read_text().split()
    except (OSError, ValueError):
        return False  # no owner: not ours to judge
    check = liveness_check(kind)
    return check is not None and not check(Holder(kind, ref)) and (root / _MARKER).is_file()


def _prune_registrations(cdi_dir: Path) -> None:
    """Unregister the specs of simulated hosts that are gone, or whose owner is gone.

    Both are left by runs killed before their teardown; a host whose owner is gone goes too.
    """
    import yaml

    for spec in cdi_dir.glob(f"{REGISTERED_PREFIX}*.yaml"):
        try:
            nodes = yaml.safe_load(spec.read_text())["containerEdits"]["deviceNodes"]
            node = Path(nodes[0]["hostPath"])
        except (OSError, yaml.YAMLError, KeyError, IndexError, TypeError):
            continue  # not ours to judge
        if not node.exists():
            spec.unlink(missing_ok=True)
        elif (root := _root_of(node)) is not None and _owner_gone(root):
            teardown(root)


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


NODE_GID = 1_999_000_001
"""The group of the simulated nodes, mode 0660: root, and the sandboxes given them (a root-run
reference sandbox gets its nodes' groups), may open them; no other local user. Their majors
are the real drivers' (the suite tells NVIDIA's nodes by them): on a host where those drivers
are loaded, they open real devices, so a GPU host is never simulated by the suite."""


def _mknod(path: Path, major: int, minor: int) -> None:
    try:
        os.mknod(path, 0o660 | stat.S_IFCHR, os.makedev(major, minor))
    except PermissionError as exc:
        raise SimulatedHostError(
            f"cannot create the character device {path} ({major}:{minor}): {exc}; "
            "setting up a simulated GPU host needs root (CAP_MKNOD)"
        ) from None
    os.chown(path, 0, NODE_GID)
    path.chmod(0o660)  # mknod's mode is filtered by the umask
