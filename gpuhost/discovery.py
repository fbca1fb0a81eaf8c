"""Host GPU discovery: every source produces :class:`gpuhost.devices.GpuDevice`.

NVIDIA GPUs come from NVML (``from_nvml``) or ``nvidia-smi`` (``from_nvidia_smi``), and
``discover_nvidia`` tries them in that order. GPUs of any vendor come from the PCI bus
(sysfs) plus their ``/dev/dri`` nodes (``pci_gpus``, in ``gpuhost.pci`` and named here
too). The parsers are separate functions so that recorded command output can be tested
without a GPU.
"""

from __future__ import annotations

import csv
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

from gpuhost.devices import NVIDIA_MAJOR, DeviceNode, GpuDevice, normalize_pci_bus_id

# The PCI bus's names, still importable from here.
from gpuhost.pci import DRI_BY_PATH as DRI_BY_PATH
from gpuhost.pci import GPU_PCI_CLASSES as GPU_PCI_CLASSES
from gpuhost.pci import PASSTHROUGH_DRIVERS as PASSTHROUGH_DRIVERS
from gpuhost.pci import PCI_VENDORS as PCI_VENDORS
from gpuhost.pci import SYSFS_PCI_DEVICES as SYSFS_PCI_DEVICES
from gpuhost.pci import PciDevice as PciDevice
from gpuhost.pci import discover_dri as discover_dri
from gpuhost.pci import dri_nodes_by_pci as dri_nodes_by_pci
from gpuhost.pci import from_sysfs as from_sysfs
from gpuhost.pci import gpu_pci_devices as gpu_pci_devices
from gpuhost.pci import pci_gpus as pci_gpus

MIB: Final = 1024 * 1024


class DiscoveryError(RuntimeError):
    """A discovery source cannot be used, or failed in a way that may hide GPUs."""


class SourceNotFound(DiscoveryError):
    """The source is not installed (no libnvidia-ml, no nvidia-smi): normal without a GPU."""


def nvidia_nodes(minor: int | None) -> tuple[DeviceNode, ...]:
    """The ``/dev/nvidia<minor>`` node of an NVIDIA GPU; none when the minor is unknown."""
    if minor is None:
        return ()
    return (DeviceNode(f"/dev/nvidia{minor}", NVIDIA_MAJOR, minor),)


def _text(value: object) -> str:
    # pynvml returns str for strings nowadays, bytes in older releases.
    return value.decode() if isinstance(value, bytes) else str(value)


# --- NVML --------------------------------------------------------------------------------


def from_nvml() -> tuple[GpuDevice, ...]:
    """The GPUs NVML reports, then the MIG instances of those in MIG mode.

    GPUs come in NVML's index order, which is PCI bus order, like nvidia-smi's. A MIG
    instance's nodes are its GPU's and the nvidia-caps nodes of its GPU and compute
    instances (minors from /proc/driver/nvidia-caps/mig-minors). Raises ``SourceNotFound``
    when pynvml or libnvidia-ml.so.1 is missing, and ``DiscoveryError`` for any other NVML
    failure (driver not loaded, GPU lost, ...).
    """
    try:
        import pynvml
    except ImportError as exc:
        raise SourceNotFound(f"NVML: the pynvml module is not installed ({exc})") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound as exc:
        raise SourceNotFound(f"NVML: libnvidia-ml.so.1 could not be loaded ({exc})") from exc
    except pynvml.NVMLError as exc:
        raise DiscoveryError(f"NVML: nvmlInit failed: {exc}") from exc
    gpus: list[GpuDevice] = []
    migs: list[GpuDevice] = []
    try:
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                minor: int | None = int(pynvml.nvmlDeviceGetMinorNumber(handle))
            except pynvml.NVMLError_NotSupported:
                minor = None  # WSL: no /dev/nvidia<minor> nodes exist
            gpus.append(
                GpuDevice(
                    index=index,
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    pci_bus_id=normalize_pci_bus_id(
                        _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
                    ),
                    memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // MIB,
                    minor=minor,
                    nodes=nvidia_nodes(minor),
                )
            )
            instances = _nvml_mig_instances(pynvml, handle, gpus[-1])
            if instances:
                gpus[-1] = replace(gpus[-1], mig_enabled=True)
                migs += instances
    except pynvml.NVMLError as exc:
        raise DiscoveryError(f"NVML failed after {len(gpus)} GPU(s): {exc}") from exc
    finally:
        pynvml.nvmlShutdown()
    return (*gpus, *migs)


def _nvml_mig_instances(pynvml: Any, handle: Any, gpu: GpuDevice) -> list[GpuDevice]:
    """The MIG instances of ``gpu``: none unless it is in MIG mode."""
    try:
        current, _ = pynvml.nvmlDeviceGetMigMode(handle)
    except pynvml.NVMLError_NotSupported:
        return []
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return []
    minors = parse_mig_minors(_read_or_empty(MIG_MINORS))
    caps_major = char_device_major("nvidia-caps")
    instances: list[GpuDevice] = []
    for slot in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle))):
        try:
            mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except pynvml.NVMLError_NotFound:
            continue  # an empty slot
        gi = int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
        ci = int(pynvml.nvmlDeviceGetComputeInstanceId(mig))
        name = _text(pynvml.nvmlDeviceGetName(mig))
        instances.append(
            replace(
                gpu,
                uuid=_text(pynvml.nvmlDeviceGetUUID(mig)),
                name=name,
                memory_mib=int(pynvml.nvmlDeviceGetMemoryInfo(mig).total) // MIB,
                nodes=gpu.nodes + mig_cap_nodes(gpu.minor, gi, ci, minors, caps_major),
                parent_uuid=gpu.uuid,
                mig_index=len(instances),
                profile=name.rpartition("MIG ")[2],
            )
        )
    return instances


MIG_MINORS: Final = Path("/proc/driver/nvidia-caps/mig-minors")
PROC_DEVICES: Final = Path("/proc/devices")


def parse_mig_minors(text: str) -> dict[str, int]:
    """``gpu0/gi1/access 12`` lines of /proc/driver/nvidia-caps/mig-minors, by capability."""
    minors = {}
    for line in text.splitlines():
        name, _, minor = line.strip().rpartition(" ")
        if name and minor.isdigit():
            minors[name] = int(minor)
    return minors


def mig_cap_nodes(
    gpu_minor: int | None, gi: int, ci: int, minors: Mapping[str, int], caps_major: int | None
) -> tuple[DeviceNode, ...]:
    """The nvidia-caps nodes a MIG instance needs: its GPU instance's and compute instance's."""
    if gpu_minor is None or caps_major is None:
        return ()
    names = (f"gpu{gpu_minor}/gi{gi}/access", f"gpu{gpu_minor}/gi{gi}/ci{ci}/access")
    return tuple(
        DeviceNode(f"/dev/nvidia-caps/nvidia-cap{minors[name]}", caps_major, minors[name])
        for name in names
        if name in minors
    )


def char_device_major(name: str, proc_devices: Path = PROC_DEVICES) -> int | None:
    """The major number the kernel gave the character device driver ``name``, if loaded."""
    in_char = False
    for line in _read_or_empty(proc_devices).splitlines():
        if line.startswith("Character devices:"):
            in_char = True
        elif line.startswith("Block devices:"):
            in_char = False
        elif in_char and line.split()[1:2] == [name]:
            return int(line.split()[0])
    return None


def _read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# --- nvidia-smi ----------------------------------------------------------------------------

QUERY_FIELDS: Final = ("index", "uuid", "name", "pci.bus_id", "memory.total")
"""nvidia-smi has no query field for the device minor (driver 580 refuses ``minor_number``):
``from_nvidia_smi`` reads it from /proc/driver/nvidia/gpus, as nvidia-container-cli does."""
PROC_DRIVER_GPUS: Final = Path("/proc/driver/nvidia/gpus")
NVIDIA_SMI_TIMEOUT_S: Final = 60.0
"""Without persistence mode every nvidia-smi call initialises each GPU, which takes seconds
per GPU on large hosts; a hung driver must still not hang discovery."""
NVIDIA_SMI_NO_DEVICES_RC: Final = 6

_UNIT_SUFFIX = re.compile(r"\s*\[[^\]]*\]$")
_MIB_VALUE = re.compile(r"^(\d+)(?: MiB)?$")


def parse_query_csv(text: str, fields: Sequence[str] | None = None) -> list[dict[str, str]]:
    """Rows of ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` output.

    Without ``fields`` the first line is the header and its unit suffixes are dropped from
    the keys (``memory.total [MiB]`` becomes ``memory.total``); pass ``fields`` for
    ``noheader`` output. Values stay as printed (``81559 MiB``, ``81559`` with ``nounits``,
    ``[N/A]``); read them with ``parse_mib`` and ``is_missing``.
    """
    rows = [row for row in csv.reader(text.splitlines(), skipinitialspace=True) if row]
    if fields is None:
        if not rows:
            raise ValueError("nvidia-smi CSV has no header line")
        header, *rows = rows
        fields = [_UNIT_SUFFIX.sub("", name.strip()) for name in header]
    parsed = []
    for number, row in enumerate(rows, start=1):
        if len(row) != len(fields):
            raise ValueError(
                f"nvidia-smi CSV row {number} has {len(row)} values for {len(fields)} fields: "
                f"{row!r}"
            )
        parsed.append({field: value.strip() for field, value in zip(fields, row, strict=True)})
    return parsed


def is_missing(value: str) -> bool:
    """Whether nvidia-smi printed no value: empty, ``N/A`` or a bracketed ``[N/A]``-like note."""
    value = value.strip()
    return value in ("", "N/A") or (value.startswith("[") and value.endswith("]"))


def parse_mib(value: str) -> int | None:
    """``81559 MiB`` (or ``81559`` with ``nounits``) as 81559; None for a missing value."""
    if is_missing(value):
        return None
    match = _MIB_VALUE.match(value.strip())
    if not match:
        raise ValueError(f"not a MiB value: {value!r}")
    return int(match[1])


def gpus_from_query_csv(
    text: str, fields: Sequence[str] = QUERY_FIELDS, header: bool = True
) -> tuple[GpuDevice, ...]:
    """GPUs from ``nvidia-smi --query-gpu`` CSV; ``fields`` names the columns when not ``header``.

    Needs ``uuid``, ``name`` and ``pci.bus_id``; ``index`` defaults to the row's position
    (nvidia-smi prints GPUs in index order), ``memory.total`` is optional, and so is
    ``minor_number`` (a column of recorded and hand-made CSV; no nvidia-smi prints it).
    """
    gpus = []
    for position, row in enumerate(parse_query_csv(text, None if header else fields)):
        missing = [f for f in ("uuid", "name", "pci.bus_id") if is_missing(row.get(f, ""))]
        if missing:
            raise ValueError(f"nvidia-smi CSV row {position + 1} has no {', '.join(missing)}")
        index = row.get("index", "")
        minor_number = row.get("minor_number", "")
        minor = None if is_missing(minor_number) else int(minor_number)
        gpus.append(
            GpuDevice(
                index=position if is_missing(index) else int(index),
                uuid=row["uuid"],
                name=row["name"],
                pci_bus_id=normalize_pci_bus_id(row["pci.bus_id"]),
                memory_mib=parse_mib(row.get("memory.total", "")),
                minor=minor,
                nodes=nvidia_nodes(minor),
            )
        )
    return tuple(gpus)


def from_nvidia_smi(
    executable: str = "nvidia-smi",
    timeout_s: float = NVIDIA_SMI_TIMEOUT_S,
    proc_gpus: Path = PROC_DRIVER_GPUS,
) -> tuple[GpuDevice, ...]:
    """The GPUs ``nvidia-smi --query-gpu`` lists; empty when it says "No devices were found".

    Each GPU's device minor comes from ``proc_gpus/<bus id>/information`` (``Device Minor``);
    a GPU without one gets no device node. Raises ``SourceNotFound`` when the executable is
    missing and ``DiscoveryError`` with the exit code and output for any other failure.
    """
    argv = [executable, f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"]
    command = shlex.join(argv)
    try:
        result = subprocess.run(
            argv, capture_output=True, text=True, errors="replace", timeout=timeout_s, check=False
        )
    except FileNotFoundError as exc:
        raise SourceNotFound(f"{executable}: not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise DiscoveryError(f"{command} ran past its timeout of {timeout_s:g} s") from exc
    except OSError as exc:
        raise DiscoveryError(f"{command} could not be run: {exc}") from exc
    # nvidia-smi prints its errors on stdout.
    output = "\n".join(part.strip() for part in (result.stdout, result.stderr) if part.strip())
    if result.returncode == NVIDIA_SMI_NO_DEVICES_RC and "No devices were found" in output:
        return ()
    if result.returncode != 0:
        raise DiscoveryError(f"{command} exited with {result.returncode}: {output}")
    try:
        listed = gpus_from_query_csv(result.stdout, QUERY_FIELDS, header=False)
    except ValueError as exc:
        raise DiscoveryError(f"{command} printed unexpected output ({exc}): {output}") from exc
    return tuple(with_proc_minor(gpu, proc_gpus) for gpu in listed)


def with_proc_minor(gpu: GpuDevice, proc_gpus: Path = PROC_DRIVER_GPUS) -> GpuDevice:
    """``gpu`` with the minor and node that /proc/driver/nvidia gives its bus id, if any."""
    if gpu.minor is not None:
        return gpu
    try:
        information = (proc_gpus / gpu.pci_bus_id / "information").read_text()
    except OSError:
        return gpu
    minor_text = parse_proc_driver_information(information).get("Device Minor", "")
    if not minor_text.isdigit():
        return gpu
    minor = int(minor_text)
    return replace(gpu, minor=minor, nodes=nvidia_nodes(minor))


# --- /proc/driver/nvidia -------------------------------------------------------------------


def parse_proc_driver_information(text: str) -> dict[str, str]:
    """``Key: value`` lines of ``/proc/driver/nvidia/gpus/<bus id>/information``."""
    info = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    return info


# --- NVIDIA, all sources -------------------------------------------------------------------


def discover_nvidia(
    *,
    nvidia_smi: str = "nvidia-smi",
    sysfs_root: Path = SYSFS_PCI_DEVICES,
    dri_by_path: Path = DRI_BY_PATH,
) -> tuple[GpuDevice, ...]:
    """NVIDIA GPUs and MIG instances from NVML, else GPUs from nvidia-smi; () without a driver.

    Each GPU's nodes are its ``/dev/nvidia<minor>`` and, for a GPU with a display engine,
    its DRI card and render nodes (``/dev/dri/by-path``), as nvidia-ctk's CDI specs give them.

    A host without the driver has neither libnvidia-ml nor nvidia-smi: that gives ().
    When a source is installed but fails, the failure is only harmless if no NVIDIA GPU
    waits for the driver: every NVIDIA GPU on the PCI bus is passed through (bound to
    vfio-pci or pci-stub), or there is none. Otherwise GPUs are being hidden (a kernel
    module that did not load after an upgrade, device nodes missing from a container, a
    GPU fallen off the bus), and this raises ``DiscoveryError`` with every source's error.
    """
    failures: list[DiscoveryError] = []
    for source in (from_nvml, lambda: from_nvidia_smi(nvidia_smi)):
        try:
            found = source()
        except SourceNotFound:
            continue
        except DiscoveryError as exc:
            failures.append(exc)
            continue
        dri = dri_nodes_by_pci(dri_by_path)
        return tuple(
            gpu if gpu.is_mig else replace(gpu, nodes=gpu.nodes + dri.get(gpu.pci_bus_id, ()))
            for gpu in found
        )
    if not failures:
        return ()
    waiting = [
        device.slot
        for device in gpu_pci_devices(from_sysfs(sysfs_root))
        if device.vendor_id == "10de" and device.driver not in PASSTHROUGH_DRIVERS
    ]
    if not waiting:
        return ()
    raise DiscoveryError(
        f"NVIDIA GPUs at {', '.join(waiting)} are not passed through, but no discovery "
        f"source lists them: {'; '.join(str(failure) for failure in failures)}"
    )


# --- python -m gpuhost.discovery -----------------------------------------------------------


def main() -> int:
    """Print what each discovery source finds on this host, for driver authors."""
    out = sys.stdout
    for label, source in (("NVML", from_nvml), ("nvidia-smi", from_nvidia_smi)):
        try:
            found = source()
        except DiscoveryError as exc:
            out.write(f"{label}: {exc}\n")
            continue
        out.write(f"{label}: {len(found)} GPU(s)\n")
        for gpu in found:
            nodes = ", ".join(f"{n.path} {n.major}:{n.minor}" for n in gpu.nodes)
            out.write(f"  {gpu.index}: {gpu.name} {gpu.uuid} {gpu.pci_bus_id} [{nodes}]\n")
    pci = pci_gpus(from_sysfs(), dri_nodes_by_pci())
    out.write(f"PCI (sysfs, any vendor; VGA, 3D and display controllers): {len(pci)} GPU(s)\n")
    for gpu in pci:
        nodes = ", ".join(f"{n.path} {n.major}:{n.minor}" for n in gpu.nodes) or "no DRI nodes"
        out.write(f"  {gpu.pci_bus_id} {gpu.vendor}: {gpu.name} [{nodes}]\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
