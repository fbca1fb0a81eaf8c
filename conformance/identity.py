"""What a report says of where it ran: the catalogue's version, the host, and its GPUs.

A fleet report (``conformance.fleet``) merges the reports of many hosts; these three are
what it holds them to.

- **The catalogue's version** (``catalogue``): ``sha256:`` and the first 16 hex digits of
  the SHA-256 of the golden list as it is read (``conformance/REQUIREMENTS.yaml``: its
  drivers, accepted declarations and each requirement's id, statement, drivers and optional
  drivers, as canonical JSON). Two reports of one version judged the same requirements at
  the same levels; an edit of the file's comments or layout keeps the version, and so does
  a change to a test's code that leaves the golden list as it was.
- **The host's identity** (``host_id``): the first 32 hex digits of the SHA-256 of the
  machine's id, its hostname, and the ids of its GPUs, sorted: NVIDIA's GPU UUIDs (unique
  to each GPU), the PCI addresses of its AMD and Intel GPUs, and for a simulated host its
  own CDI kind (a token drawn when it is made). The machine's id is systemd's
  ``/etc/machine-id`` (or D-Bus's), never written as it is (systemd asks that it be kept
  private): an HMAC of this application's name keyed by it, as
  ``sd_id128_get_machine_app_specific`` makes one; none where neither file exists. So the
  same machine with the same GPUs is the same host, run after run; a GPU swapped, or the
  machine renamed, makes another; a container on a node is the node's GPUs under the
  container's hostname (a pod's name), its machine id the image's, when the image has one.
  Each simulated host is a host of its own: its GPUs' UUIDs and its CDI kind are made anew.
- **Its GPUs** (``gpus``): one entry per vendor and model, with the count, how many are in
  MIG mode and their instances by profile, and the vendor's kernel driver and its version
  (``simulated`` on a simulated host).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import json
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conformance import requirements
from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost

if TYPE_CHECKING:
    from drivers.base import Elsewhere

APP_ID = b"gpu-sandbox-conformance host identity"
MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))
SYS_MODULE = Path("/sys/module")
KERNEL_MODULES = {"nvidia": ("nvidia",), "amd": ("amdgpu",), "intel": ("xe", "i915")}
"""Each vendor's kernel drivers: its version is the first of them loaded."""


@functools.cache
def catalogue_version(golden: requirements.GoldenList | None = None) -> str:
    """The version of the golden list: ``sha256:`` and 16 hex digits of its canonical JSON."""
    golden = golden or requirements.load()
    canonical = {
        "drivers": list(golden.drivers),
        "accepted_declarations": list(golden.accepted_declarations),
        "requirements": [
            [req.id, req.statement, list(req.drivers), list(req.optional)]
            for req in golden.requirements
        ],
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def machine_id(files: tuple[Path, ...] = MACHINE_ID_FILES) -> str:
    """The machine's id for this application alone (HMAC-SHA256), or "" where it has none."""
    for path in files:
        try:
            text = path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) == 32 and all(c in "0123456789abcdef" for c in text):
            return hmac.new(bytes.fromhex(text), APP_ID, hashlib.sha256).hexdigest()[:32]
    return ""


def host_id(machine: str, hostname: str, gpu_ids: list[str]) -> str:
    """The host's identity: its machine id, hostname and GPUs' ids, hashed together."""
    text = "\n".join([machine, hostname, *sorted(gpu_ids)])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def header(host: GpuHost) -> dict[str, Any]:
    """What a report's header says of the catalogue, the host's identity and its GPUs."""
    ids = [gpu.uuid for gpu in (*host.gpus, *host.dri_gpus)]
    if host.simulated is not None:
        ids.append(host.simulated.cdi_kind)
    return {
        "catalogue": catalogue_version(),
        "host_id": host_id(machine_id(), socket.gethostname(), ids),
        "gpus": gpu_groups(host),
    }


def header_elsewhere(place: Elsewhere) -> dict[str, Any]:
    """``header`` of the place a driver's sandboxes run (a cluster's node), in the host's."""
    ids = [*place.identity, *(gpu.uuid for gpu in place.gpus)]
    return {
        "catalogue": catalogue_version(),
        "host_id": host_id("", place.name, ids),
        "gpus": gpu_groups_of(
            place.gpus, (), lambda vendor: "simulated" if place.simulated else place.kernel_driver
        ),
    }


def gpu_groups(host: GpuHost) -> list[dict[str, Any]]:
    """One entry per vendor and model: count, MIG mode and instances, the kernel driver."""
    return gpu_groups_of(
        (*host.gpus, *host.dri_gpus),
        host.mig_devices,
        lambda vendor: "simulated" if host.simulated else kernel_driver(vendor),
    )


def gpu_groups_of(
    devices: Sequence[GpuDevice], mig_devices: Sequence[GpuDevice], driver: Callable[[str], str]
) -> list[dict[str, Any]]:
    """``gpu_groups`` of these GPUs and MIG instances; ``driver`` names a vendor's driver."""
    groups: dict[tuple[str, str], list[GpuDevice]] = {}
    for gpu in devices:
        groups.setdefault((gpu.vendor, gpu.name), []).append(gpu)
    entries = []
    for (vendor, model), gpus in groups.items():
        uuids = {gpu.uuid for gpu in gpus}
        instances = [mig for mig in mig_devices if mig.parent_uuid in uuids]
        profiles = collections.Counter(mig.profile for mig in instances)
        entries.append(
            {
                "vendor": vendor,
                "model": model,
                "count": len(gpus),
                "mig_gpus": sum(gpu.mig_enabled for gpu in gpus),
                "mig_instances": dict(sorted(profiles.items())),
                "driver": driver(vendor),
            }
        )
    return entries


def kernel_driver(vendor: str, sys_module: Path = SYS_MODULE) -> str:
    """The vendor's kernel driver and its version: ``nvidia 580.65.06``, ``amdgpu in Linux 6.8``.

    A driver built into the kernel (amdgpu, i915 and xe as distributions ship them) has no
    version of its own: the kernel's release stands for it.
    """
    for module in KERNEL_MODULES.get(vendor, ()):
        if not (sys_module / module).is_dir():
            continue
        try:
            version = (sys_module / module / "version").read_text(errors="replace").strip()
        except OSError:
            version = ""
        return f"{module} {version[:64]}" if version else f"{module} in Linux {os.uname().release}"
    return "no driver loaded"
