"""Where a simulated host's GPUs sit and what they hold.

Their PCI positions and device minors, and the optional MIG and DRI layouts (``--sim-mig``,
``--sim-dri``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from gpuhost.simulated.host import (
    CAPS_MAJOR,
    DGX_BUSES,
    DRI_BUSES,
    DRI_VENDORS,
    DRM_MAJOR,
    KFD_MAJOR,
    MIG_PROFILE,
    NVIDIA_MAJOR,
    DriLayout,
    MigLayout,
    SimulatedHostError,
    mknod,
)

# /proc/driver/nvidia-caps/mig-minors: config 1, monitor 2, then per GPU minor 15 GPU
# instances of 9 minors each (the GI's access, then its 8 compute instances').
_CAPS_PER_GPU, _CAPS_PER_GI = 135, 9


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


def check_layouts(count: int, mig: MigLayout, dri: DriLayout) -> None:
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


def make_mig(root: Path, mig: Mapping[int, Sequence[str]]) -> None:
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
                mknod(caps / f"nvidia-cap{minor}", CAPS_MAJOR, minor)
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


def make_dri(root: Path, dri: DriLayout) -> None:
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
        mknod(drm / f"card{card}", DRM_MAJOR, card)
        mknod(drm / f"renderD{render}", DRM_MAJOR, render)
        (drm / "by-path" / f"pci-{bus}-card").symlink_to(f"../card{card}")
        (drm / "by-path" / f"pci-{bus}-render").symlink_to(f"../renderD{render}")
        device = root / "sys" / "bus" / "pci" / "devices" / bus
        device.mkdir(parents=True)
        for field, value in (("vendor", vendor_id), ("device", device_id), ("class", "030000")):
            (device / field).write_text(f"0x{value}\n")
        rows.append((bus, vendor, name, card, render, memory))
    if any(vendor == "amd" for _, vendor in buses):
        mknod(root / "dev" / "kfd", KFD_MAJOR, 0)
    (root / "share" / "dri.tsv").write_text(
        "# pci.bus_id\tvendor\tname\tcard\trender\tmemory [MiB]\t"
        f"kfd major {KFD_MAJOR}\tdrm major {DRM_MAJOR}\n"
        + "".join("\t".join(map(str, row)) + "\n" for row in rows)
    )


def bus_id(position: int) -> str:
    """The DGX H100's bus ids, then made-up ones: 32 per PCI domain from bus e0."""
    if position < len(DGX_BUSES):
        return f"00000000:{DGX_BUSES[position].upper()}:00.0"
    extra = position - len(DGX_BUSES)
    return f"{extra // 32:08X}:{0xE0 + extra % 32:02X}:00.0"


def gpu_minor(position: int, count: int) -> int:
    """The device minor of the GPU at ``position`` in PCI order: never its index.

    On real hosts the minors follow the order the driver probed the GPUs in, not PCI order
    (for two or more GPUs; one GPU is minor 0).
    """
    return (position + (count + 1) // 2) % count
