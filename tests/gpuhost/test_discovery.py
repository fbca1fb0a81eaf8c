from __future__ import annotations

import os
import re
import shutil
import stat
import sys
from pathlib import Path

import pytest

from conformance.observe import ListedGpu, ListedMig, parse_list
from gpuhost import discovery, simulated
from gpuhost.devices import NVIDIA_MAJOR, DeviceNode, GpuDevice
from gpuhost.discovery import (
    GPU_PCI_CLASSES,
    QUERY_FIELDS,
    DiscoveryError,
    PciDevice,
    SourceNotFound,
    discover_nvidia,
    dri_nodes_by_pci,
    from_nvidia_smi,
    from_sysfs,
    gpu_pci_devices,
    gpus_from_query_csv,
    parse_mib,
    parse_proc_driver_information,
    parse_query_csv,
    pci_gpus,
)
from tests.captures import parse_dri_by_path_listing, parse_lspci_vmm

DATA = Path(__file__).parents[1] / "data" / "discovery"
DGX_H100_BUSES = [f"0000:{bus}:00.0" for bus in ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")]
MASKED_GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"
DRI_MAJOR = 226


def read(name: str) -> str:
    return (DATA / name).read_text()


# --- nvidia-smi -L ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("capture", "count", "name", "first_uuid"),
    [
        (
            "nvidia-smi-L.multi-8xH100.txt",
            8,
            "NVIDIA H100 80GB HBM3",
            "GPU-c7a0294c-c2c2-5476-438c-fb468eaa223b",
        ),
        ("nvidia-smi-L.multi-4xL4.txt", 4, "NVIDIA L4", "GPU-c2507ce8-9002-692b-09ab-a911bef79d62"),
        (
            "nvidia-smi-L.multi-8xA100-SXM4-80GB.txt",
            8,
            "NVIDIA A100-SXM4-80GB",
            "GPU-55748b5b-32df-bbd9-d0f6-f50980c12af8",
        ),
        ("nvidia-smi-L.single-T4.txt", 1, "Tesla T4", "GPU-6cf00fa7-59ac-16f2-3e83-d24ccdc56f84"),
        (
            "nvidia-smi-L.multi-2xQuadroRTX4000.txt",
            2,
            "Quadro RTX 4000",
            "GPU-c7b57be0-94ff-d352-a59b-d0ee00aeed43",
        ),
        ("nvidia-smi-L.single-L40S.masked.txt", 1, "NVIDIA L40S", MASKED_GPU_UUID),
    ],
)
def test_parse_list_reads_every_gpu(capture: str, count: int, name: str, first_uuid: str) -> None:
    gpus = parse_list(read(capture))

    assert [gpu.index for gpu in gpus] == list(range(count))
    assert {gpu.name for gpu in gpus} == {name}
    assert gpus[0].uuid == first_uuid
    assert len({gpu.uuid for gpu in gpus}) == count
    assert all(gpu.mig_devices == () for gpu in gpus)


def test_parse_list_reads_seven_mig_devices_under_one_a100() -> None:
    (gpu,) = parse_list(read("nvidia-smi-L.mig-A100-7x1g.10gb.txt"))

    assert gpu.uuid == "GPU-7fdaf0a5-179b-f636-d15d-daf243e3ff16"
    assert [mig.index for mig in gpu.mig_devices] == list(range(7))
    assert {mig.name for mig in gpu.mig_devices} == {"MIG 1g.10gb"}
    assert {mig.profile for mig in gpu.mig_devices} == {"1g.10gb"}
    assert gpu.mig_devices[0].uuid == "MIG-feb88891-0321-5fef-9c87-d4af3b54259e"
    assert len({mig.uuid for mig in gpu.mig_devices}) == 7


def test_parse_list_attaches_mig_devices_to_their_own_gpu() -> None:
    gpus = parse_list(read("nvidia-smi-L.multi-4xA100-mig.txt"))

    assert [len(gpu.mig_devices) for gpu in gpus] == [4, 0, 0, 0]
    assert {mig.profile for mig in gpus[0].mig_devices} == {"1g.20gb"}
    assert gpus[0].mig_devices[3].uuid == "MIG-930574a9-d43a-5d2b-95da-3e68384c8d6b"
    assert gpus[3].uuid == "GPU-69ec2344-ebac-b028-f88f-452abb3d7f11"


def test_parse_list_reads_mixed_mig_profiles_of_the_masked_h100() -> None:
    (gpu,) = parse_list(read("nvidia-smi-L.mig-h100-4inst.masked.txt"))

    assert (gpu.index, gpu.name, gpu.uuid) == (0, "NVIDIA H100 80GB HBM3", MASKED_GPU_UUID)
    assert [(mig.index, mig.profile) for mig in gpu.mig_devices] == [
        (0, "3g.40gb"),
        (1, "2g.20gb"),
        (2, "1g.10gb"),
        (3, "1g.10gb"),
    ]
    assert [mig.uuid for mig in gpu.mig_devices] == [
        f"MIG-0000000{i}-0000-0000-0000-00000000000{i}" for i in range(4)
    ]


def test_parse_list_returns_frozen_records() -> None:
    (gpu,) = parse_list(read("nvidia-smi-L.single-T4.txt"))

    assert gpu == ListedGpu(0, "Tesla T4", "GPU-6cf00fa7-59ac-16f2-3e83-d24ccdc56f84")
    with pytest.raises(AttributeError):
        gpu.index = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "text",
    [
        "Unable to determine the device handle for GPU0000:18:00.0: Unknown Error\n",
        "  MIG 1g.10gb     Device  0: (UUID: MIG-feb88891-0321-5fef-9c87-d4af3b54259e)\n",
    ],
    ids=["error-line", "mig-without-gpu"],
)
def test_parse_list_rejects_lines_it_does_not_know(text: str) -> None:
    with pytest.raises(ValueError, match="unexpected line"):
        parse_list(text)


# --- nvidia-smi --query-gpu ------------------------------------------------------------------


def test_parse_query_csv_keys_the_all_fields_h100_capture_by_header_name() -> None:
    (row,) = parse_query_csv(read("nvidia-smi-query-gpu.csv.single-H100-allfields.masked.txt"))

    assert len(row) == 212
    assert row["name"] == "NVIDIA H100 80GB HBM3"
    assert row["uuid"] == MASKED_GPU_UUID
    assert row["pci.bus_id"] == "00000000:00:09.0"
    assert row["index"] == "0"
    assert row["memory.total"] == "81559 MiB"  # the header said "memory.total [MiB]"
    assert row["hostname"] == "[N/A]"


def test_parse_query_csv_reads_the_rtx4080s_capture_with_kmd_version() -> None:
    (row,) = parse_query_csv(read("nvidia-smi-query-gpu.csv.single-RTX4080S-allfields.masked.txt"))

    assert len(row) == 202
    assert row["driver_version"] == row["kmd_version"] == "595.71.05"
    assert row["name"] == "NVIDIA GeForce RTX 4080 SUPER"
    assert parse_mib(row["memory.total"]) == 16376


def test_parse_query_csv_reads_units_in_every_row_of_the_8xa100_capture() -> None:
    rows = parse_query_csv(read("nvidia-smi-query-gpu.csv.name-memtotal-driver.8xA100.txt"))

    assert len(rows) == 8
    assert {tuple(row) for row in rows} == {("name", "memory.total", "driver_version")}
    assert {parse_mib(row["memory.total"]) for row in rows} == {81920}
    assert {row["driver_version"] for row in rows} == {"570.133.20"}


def test_parse_query_csv_reads_nounits_values_and_na() -> None:
    (row,) = parse_query_csv(read("nvidia-smi-query-gpu.csv-nounits.single-P100.txt"))

    assert row["name"] == "Tesla P100-PCIE-16GB"
    assert row["uuid"] == "GPU-ef1b2c9b-38d8-2090-2bd1-f567a3eb42a6"
    assert parse_mib(row["memory.free"]) == 16280
    assert row["fan.speed"] == "[N/A]"
    assert row["clocks.current.video"] == "835"  # the file has no final newline


def test_parse_query_csv_takes_field_names_for_noheader_output() -> None:
    text = "0, GPU-1, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559\n"

    assert parse_query_csv(text, QUERY_FIELDS) == [
        {
            "index": "0",
            "uuid": "GPU-1",
            "name": "NVIDIA H100 80GB HBM3",
            "pci.bus_id": "00000000:18:00.0",
            "memory.total": "81559",
        }
    ]


def test_parse_query_csv_rejects_a_row_of_the_wrong_width() -> None:
    with pytest.raises(ValueError, match="row 1 has 2 values for 5 fields"):
        parse_query_csv("0, GPU-1\n", QUERY_FIELDS)


@pytest.mark.parametrize(
    ("value", "mib"),
    [("81559 MiB", 81559), ("81559", 81559), ("[N/A]", None), ("N/A", None), ("", None)],
)
def test_parse_mib(value: str, mib: int | None) -> None:
    assert parse_mib(value) == mib


def test_parse_mib_rejects_other_units() -> None:
    with pytest.raises(ValueError, match="not a MiB value"):
        parse_mib("80 GiB")


@pytest.mark.parametrize(
    ("capture", "expected"),
    [
        (
            "nvidia-smi-query-gpu.csv.single-H100-allfields.masked.txt",
            GpuDevice(0, MASKED_GPU_UUID, "NVIDIA H100 80GB HBM3", "0000:00:09.0", 81559),
        ),
        (
            "nvidia-smi-query-gpu.csv.single-RTX4080S-allfields.masked.txt",
            GpuDevice(0, MASKED_GPU_UUID, "NVIDIA GeForce RTX 4080 SUPER", "0000:01:00.0", 16376),
        ),
    ],
)
def test_gpus_from_query_csv_selects_its_fields_from_all_fields_captures(
    capture: str, expected: GpuDevice
) -> None:
    assert gpus_from_query_csv(read(capture)) == (expected,)


@pytest.mark.parametrize(
    ("capture", "missing"),
    [
        ("nvidia-smi-query-gpu.csv.name-memtotal-driver.8xA100.txt", "uuid, pci.bus_id"),
        ("nvidia-smi-query-gpu.csv-nounits.single-P100.txt", "pci.bus_id"),
    ],
)
def test_gpus_from_query_csv_names_the_identity_fields_a_capture_lacks(
    capture: str, missing: str
) -> None:
    with pytest.raises(ValueError, match=f"row 1 has no {missing}$"):
        gpus_from_query_csv(read(capture))


def test_gpus_from_query_csv_reads_noheader_nounits_with_minor_numbers() -> None:
    text = (
        "0, GPU-a, NVIDIA H100 80GB HBM3, 00000000:18:00.0, 81559, 2\n"
        "1, GPU-b, NVIDIA H100 80GB HBM3, 00000000:2A:00.0, 81559, [N/A]\n"
    )

    first, second = gpus_from_query_csv(text, (*QUERY_FIELDS, "minor_number"), header=False)

    assert first == GpuDevice(
        0,
        "GPU-a",
        "NVIDIA H100 80GB HBM3",
        "0000:18:00.0",
        81559,
        minor=2,
        nodes=(DeviceNode("/dev/nvidia2", NVIDIA_MAJOR, 2),),
    )
    assert (second.pci_bus_id, second.minor, second.nodes) == ("0000:2a:00.0", None, ())


# --- from_nvidia_smi with a fake executable --------------------------------------------------

NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)


def fake_nvidia_smi(directory: Path, stdout: str, rc: int = 0, stderr: str = "") -> Path:
    """Write an executable that records its arguments and prints ``stdout``."""
    (directory / "stdout").write_text(stdout)
    (directory / "stderr").write_text(stderr)
    script = directory / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > "{directory}/argv"\n'
        f'cat "{directory}/stdout"\n'
        f'cat "{directory}/stderr" >&2\n'
        f"exit {rc}\n"
    )
    script.chmod(0o755)
    return script


def _proc_gpus(root: Path, minors: dict[str, str]) -> Path:
    """A /proc/driver/nvidia/gpus tree whose entries give each bus id its Device Minor."""
    template = read("proc-driver-nvidia-gpus-information.H100.txt")
    for bus, minor in minors.items():
        entry = root / bus
        entry.mkdir(parents=True)
        text = template.replace("0000:00:06.0", bus).replace("Device Minor: \t 0", minor)
        (entry / "information").write_text(text)
    return root


def test_from_nvidia_smi_queries_csv_noheader_nounits(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(
        tmp_path,
        "0, GPU-a, NVIDIA L4, 00000000:38:00.0, 23034\n"
        "1, GPU-b, NVIDIA L4, 00000000:3A:00.0, 23034\n",
    )
    # Minors in another order than the indices, as on the recorded 8xA100 host.
    proc = _proc_gpus(
        tmp_path / "gpus",
        {"0000:38:00.0": "Device Minor: \t 5", "0000:3a:00.0": "Device Minor: \t 2"},
    )

    gpus = from_nvidia_smi(str(smi), proc_gpus=proc)

    # nvidia-smi has no minor field: asking for one fails the whole query on real drivers.
    assert (tmp_path / "argv").read_text().splitlines() == [
        "--query-gpu=index,uuid,name,pci.bus_id,memory.total",
        "--format=csv,noheader,nounits",
    ]
    assert [(gpu.uuid, gpu.pci_bus_id, gpu.memory_mib, gpu.minor) for gpu in gpus] == [
        ("GPU-a", "0000:38:00.0", 23034, 5),
        ("GPU-b", "0000:3a:00.0", 23034, 2),
    ]
    assert gpus[1].nodes == (DeviceNode("/dev/nvidia2", NVIDIA_MAJOR, 2),)


def test_from_nvidia_smi_leaves_a_gpu_without_proc_entry_without_node(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, "0, GPU-a, NVIDIA L4, 00000000:38:00.0, 23034\n")

    (gpu,) = from_nvidia_smi(str(smi), proc_gpus=tmp_path / "no-such-dir")

    assert (gpu.minor, gpu.nodes) == (None, ())


def test_proc_information_of_a_real_h100_gives_its_minor() -> None:
    info = parse_proc_driver_information(read("proc-driver-nvidia-gpus-information.H100.txt"))
    assert (info["Device Minor"], info["Bus Location"]) == ("0", "0000:00:06.0")
    assert info["GPU UUID"] == "GPU-c0baa2b5-e390-bd7a-2aa3-affa1237a2da"


def test_from_nvidia_smi_returns_nothing_when_no_devices_were_found(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, "No devices were found\n", rc=6)

    assert from_nvidia_smi(str(smi)) == ()


def test_from_nvidia_smi_reports_rc_and_message_of_a_failure(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, NO_DRIVER + "\n", rc=9, stderr="a line on stderr\n")

    with pytest.raises(DiscoveryError, match="exited with 9: NVIDIA-SMI has failed") as info:
        from_nvidia_smi(str(smi))
    assert "a line on stderr" in str(info.value)
    assert not isinstance(info.value, SourceNotFound)


def test_from_nvidia_smi_rejects_output_that_is_not_the_csv(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, 'Field "minor_number" is not a valid field to query.\n')

    with pytest.raises(DiscoveryError, match="unexpected output"):
        from_nvidia_smi(str(smi))


def test_from_nvidia_smi_reports_a_missing_executable(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match="not found") as info:
        from_nvidia_smi(str(tmp_path / "nvidia-smi"))
    assert isinstance(info.value, SourceNotFound)


def test_from_nvidia_smi_stops_a_hung_nvidia_smi(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexec sleep 30\n")
    smi.chmod(0o755)

    with pytest.raises(DiscoveryError, match=r"ran past its timeout of 0\.2 s"):
        from_nvidia_smi(str(smi), timeout_s=0.2)


# --- PCI: lspci ------------------------------------------------------------------------------

_LSPCI_NN = re.compile(r"^(?P<slot>\S+) (?P<class>.+?) \[(?P<code>[0-9a-f]{4})\]: (?P<rest>.*)$")
_LSPCI_PLAIN = re.compile(r"^(?P<slot>\S+) (?P<class>[^:]+): (?P<rest>.*)$")
_CLASS_CODES = {name: code for code, name in GPU_PCI_CLASSES.items()}


def devices_from_lspci_lines(text: str) -> list[PciDevice]:
    """PciDevices with the class only, from ``lspci [-D][-nn]`` one-line output.

    Plain output names the class without its code, so the code comes from the class name.
    """
    devices = []
    for line in text.splitlines():
        match = _LSPCI_NN.match(line) or _LSPCI_PLAIN.match(line)
        assert match, line
        code = match.groupdict().get("code") or _CLASS_CODES.get(match["class"], "")
        devices.append(PciDevice(match["slot"], code, match["class"], "", "", "", match["rest"]))
    return devices


@pytest.mark.parametrize(
    ("capture", "gpus", "vga_only"),
    [
        ("lspci-Dnn.h100-8gpu-kvm-guest.grep-nvidia.txt", 8, 0),
        ("lspci-nn.4xH100-SXM5.grep-nvidia.txt", 4, 0),
        ("lspci-nn.laptop-mx450-3d.grep-nvidia.txt", 1, 0),
        ("lspci.4xL4-aws-g6.grep-nvidia.txt", 4, 0),
        ("lspci.MI210+A100-PCIe.grep-nvidia-display.txt", 2, 0),
        ("lspci-d-03xx.intel-alderlake-display+rtx3080ti-vga.txt", 2, 1),
    ],
)
def test_gpu_class_filter_finds_3d_and_display_controllers(
    capture: str, gpus: int, vga_only: int
) -> None:
    devices = devices_from_lspci_lines(read(capture))

    found = gpu_pci_devices(devices)

    assert len(found) == gpus
    assert all("NVSwitch" not in device.device_name for device in found)
    # A filter on "VGA compatible controller" alone misses data-centre GPUs.
    assert sum(device.class_name == "VGA compatible controller" for device in devices) == vga_only


def test_parse_lspci_vmm_reads_this_machines_virtio_devices_and_finds_no_gpu() -> None:
    devices = parse_lspci_vmm(read("lspci-Dvmmnn.virtio-kvm-no-gpu.txt"))

    assert len(devices) == 6
    assert devices[0] == PciDevice(
        "0000:00:00.0", "0600", "Host bridge", "8086", "Intel Corporation", "0d57", "Device"
    )
    assert {device.vendor_id for device in devices[1:]} == {"1af4"}
    assert gpu_pci_devices(devices) == []
    assert pci_gpus(devices, {}) == ()


def test_parse_lspci_vmm_keeps_brackets_inside_names() -> None:
    devices = parse_lspci_vmm(read("lspci-Dvmmnn.CONSTRUCTED.mi210+a100-pcie.txt"))

    assert devices == [
        PciDevice(
            "0000:03:00.0",
            "0380",
            "Display controller",
            "1002",
            "Advanced Micro Devices, Inc. [AMD/ATI]",
            "740f",
            "Aldebaran",
        ),
        PciDevice(
            "0000:81:00.0",
            "0302",
            "3D controller",
            "10de",
            "NVIDIA Corporation",
            "20f1",
            "GA100 [A100 PCIe 40GB]",
        ),
    ]


def test_pci_gpus_of_a_dgx_h100_numbers_nvidia_gpus_like_nvidia_smi() -> None:
    devices = parse_lspci_vmm(read("lspci-Dvmmnn.CONSTRUCTED.dgx-h100-8gpu.txt"))

    gpus = pci_gpus(devices, {}, vendor="nvidia")

    assert [gpu.pci_bus_id for gpu in gpus] == DGX_H100_BUSES
    assert [gpu.index for gpu in gpus] == list(range(8))
    assert {gpu.name for gpu in gpus} == {"GH100 [H100 SXM5 80GB]"}
    assert gpus[0].uuid == "PCI-0000:18:00.0"
    assert all(gpu.nodes == () and gpu.vendor == "nvidia" for gpu in gpus)


def test_pci_gpus_of_a_dgx_h100_counts_the_bmc_vga_without_a_vendor_filter() -> None:
    devices = parse_lspci_vmm(read("lspci-Dvmmnn.CONSTRUCTED.dgx-h100-8gpu.txt"))

    gpus = pci_gpus(devices, {})

    assert len(devices) == 13  # BMC VGA, 4 NVSwitch bridges, 8 GPUs
    assert [(gpu.index, gpu.vendor, gpu.name) for gpu in gpus[:2]] == [
        (0, "other", "ASPEED Graphics Family"),
        (1, "nvidia", "GH100 [H100 SXM5 80GB]"),
    ]
    assert len(gpus) == 9


def test_pci_gpus_gives_amd_its_dri_nodes_and_nvidia_none() -> None:
    devices = parse_lspci_vmm(read("lspci-Dvmmnn.CONSTRUCTED.mi210+a100-pcie.txt"))
    dri = {
        "0000:03:00.0": (
            DeviceNode("/dev/dri/card1", DRI_MAJOR, 1),
            DeviceNode("/dev/dri/renderD128", DRI_MAJOR, 128),
        ),
        "0000:81:00.0": (DeviceNode("/dev/dri/card0", DRI_MAJOR, 0),),
    }

    amd, nvidia = pci_gpus(devices, dri)

    assert (amd.vendor, amd.uuid, amd.nodes) == ("amd", "PCI-0000:03:00.0", dri["0000:03:00.0"])
    assert (nvidia.vendor, nvidia.index, nvidia.nodes) == ("nvidia", 1, ())
    assert [gpu.index for gpu in pci_gpus(devices, dri, vendor="nvidia")] == [0]


def test_pci_gpus_of_a_desktop_skips_the_gpus_audio_function() -> None:
    devices = parse_lspci_vmm(read("lspci-Dvmmnn.CONSTRUCTED.intel-alderlake+rtx3080ti.txt"))

    gpus = pci_gpus(devices, {"0000:00:02.0": (DeviceNode("/dev/dri/card1", DRI_MAJOR, 1),)})

    assert [(gpu.vendor, gpu.name) for gpu in gpus] == [
        ("intel", "AlderLake-S GT1"),
        ("nvidia", "GA102 [GeForce RTX 3080 Ti]"),
    ]
    assert gpus[0].nodes == (DeviceNode("/dev/dri/card1", DRI_MAJOR, 1),)
    assert len(devices) == 3


def test_parse_lspci_vmm_asks_for_numeric_codes() -> None:
    with pytest.raises(ValueError, match="run lspci with -nn"):
        parse_lspci_vmm("Slot:\t0000:00:00.0\nClass:\tHost bridge\nVendor:\tIntel\nDevice:\tX\n")


# --- PCI: sysfs ------------------------------------------------------------------------------


def make_sysfs_device(
    root: Path, slot: str, pci_class: str, vendor: str, device: str, driver: str = ""
) -> None:
    path = root / slot
    path.mkdir(parents=True)
    (path / "class").write_text(f"{pci_class}\n")
    (path / "vendor").write_text(f"{vendor}\n")
    (path / "device").write_text(f"{device}\n")
    if driver:
        (path / "driver").symlink_to(f"../../../bus/pci/drivers/{driver}")


def test_from_sysfs_reads_class_vendor_device_and_driver(tmp_path: Path) -> None:
    make_sysfs_device(tmp_path, "0000:81:00.0", "0x030200", "0x10de", "0x20f1", "vfio-pci")
    make_sysfs_device(tmp_path, "0000:05:00.0", "0x068000", "0x10de", "0x22a3")
    make_sysfs_device(tmp_path, "0000:03:00.0", "0x038000", "0x1002", "0x740f", "amdgpu")

    devices = from_sysfs(tmp_path)

    assert devices == [
        PciDevice("0000:03:00.0", "0380", "Display controller", "1002", "", "740f", "", "amdgpu"),
        PciDevice("0000:05:00.0", "0680", "", "10de", "", "22a3", ""),
        PciDevice("0000:81:00.0", "0302", "3D controller", "10de", "", "20f1", "", "vfio-pci"),
    ]
    assert [gpu.name for gpu in pci_gpus(devices, {})] == ["1002:740f", "10de:20f1"]


def test_from_sysfs_without_a_pci_bus_finds_nothing(tmp_path: Path) -> None:
    assert from_sysfs(tmp_path / "absent") == []


# --- /dev/dri ----------------------------------------------------------------------------------


def test_parse_dri_by_path_listing_maps_bus_ids_to_crossed_nodes() -> None:
    links = parse_dri_by_path_listing(read("ls-l-dev-dri-by-path.intel-igpu+amd-radeon.txt"))

    assert links == {
        "0000:00:02.0": {"card": "card1", "render": "renderD129"},
        "0000:12:00.0": {"card": "card0", "render": "renderD128"},
    }


def test_parse_dri_by_path_listing_ignores_a_plain_dev_dri_listing() -> None:
    # `ls -lathn /dev/dri` shows the nodes and the by-path directory, but no links.
    assert parse_dri_by_path_listing(read("ls-lathn-dev-dri.nvidia+intel.cachyos.txt")) == {}


def make_node(path: Path, minor: int) -> bool:
    """A DRI character device, or a plain file where mknod is not allowed; True for a device."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(DRI_MAJOR, minor))
    except PermissionError:
        path.touch()
        return False
    return True


def test_dri_nodes_by_pci_resolves_the_recorded_by_path_layout(tmp_path: Path) -> None:
    links = parse_dri_by_path_listing(read("ls-l-dev-dri-by-path.intel-igpu+amd-radeon.txt"))
    dri = tmp_path / "dri"
    (dri / "by-path").mkdir(parents=True)
    devices = [
        make_node(dri / name, int(name.removeprefix("card").removeprefix("renderD")))
        for name in ("card0", "card1", "renderD128", "renderD129")
    ]
    for bus, nodes in links.items():
        for kind, name in nodes.items():
            (dri / "by-path" / f"pci-{bus}-{kind}").symlink_to(f"../{name}")
    (dri / "by-path" / "platform-simple-framebuffer.0-card").symlink_to("../card0")

    found = dri_nodes_by_pci(dri / "by-path")

    assert {bus: [node.path for node in nodes] for bus, nodes in found.items()} == {
        "0000:00:02.0": [str(dri / "card1"), str(dri / "renderD129")],
        "0000:12:00.0": [str(dri / "card0"), str(dri / "renderD128")],
    }
    if not all(devices):
        pytest.skip("mknod is not allowed here: major and minor numbers not checked")
    assert [(node.major, node.minor) for node in found["0000:00:02.0"]] == [
        (DRI_MAJOR, 1),
        (DRI_MAJOR, 129),
    ]


def test_dri_nodes_by_pci_without_dri_finds_nothing(tmp_path: Path) -> None:
    assert dri_nodes_by_pci(tmp_path / "absent") == {}


# --- /proc/driver/nvidia ---------------------------------------------------------------------


def test_parse_proc_driver_information_of_an_l4() -> None:
    info = parse_proc_driver_information(read("proc-driver-nvidia-gpus-information.L4.txt"))

    assert info["Model"] == "NVIDIA L4"
    assert info["GPU UUID"] == "GPU-3291dfa4-fcc4-0110-615b-c894a0d7c689"
    assert info["Bus Location"] == "0000:70:00.0"
    assert info["Device Minor"] == "0"
    assert info["DMA Mask"] == "0x7fffffffffff"
    assert info["GPU Excluded"] == "No"


# --- discover_nvidia ---------------------------------------------------------------------------


def test_discover_nvidia_finds_nothing_on_a_host_without_the_driver() -> None:
    found = [
        p for p in ("/proc/driver/nvidia", shutil.which("nvidia-smi")) if p and Path(p).exists()
    ]
    if found:
        pytest.skip(f"needs a host without the NVIDIA driver (found {', '.join(found)})")
    assert discover_nvidia() == ()


def nvml_fails(error: DiscoveryError) -> object:
    def from_nvml() -> tuple[GpuDevice, ...]:
        raise error

    return from_nvml


def test_discover_nvidia_prefers_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = GpuDevice(0, "GPU-a", "NVIDIA L4", "0000:38:00.0")
    monkeypatch.setattr(discovery, "from_nvml", lambda: (gpu,))

    assert discover_nvidia(nvidia_smi=str(tmp_path / "nvidia-smi")) == (gpu,)


def test_discover_nvidia_falls_back_to_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(discovery, "from_nvml", nvml_fails(SourceNotFound("NVML: no library")))
    smi = fake_nvidia_smi(tmp_path, "0, GPU-a, NVIDIA L4, 00000000:38:00.0, 23034\n")

    (gpu,) = discover_nvidia(nvidia_smi=str(smi))

    assert gpu.uuid == "GPU-a"


def test_discover_nvidia_gives_a_display_gpu_its_dri_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As nvidia-ctk's CDI specs do: a GPU with a display engine has card and render nodes."""
    nvidia = DeviceNode("/dev/nvidia3", NVIDIA_MAJOR, 3)
    gpu = GpuDevice(0, "GPU-a", "RTX", "0000:01:00.0", minor=3, nodes=(nvidia,))
    monkeypatch.setattr(discovery, "from_nvml", lambda: (gpu,))
    dri = tmp_path / "dri"
    (dri / "by-path").mkdir(parents=True)
    for name, minor in (("card1", 1), ("renderD128", 128)):
        make_node(dri / name, minor)
        kind = "card" if name.startswith("card") else "render"
        (dri / "by-path" / f"pci-0000:01:00.0-{kind}").symlink_to(f"../{name}")

    (found,) = discover_nvidia(nvidia_smi=str(tmp_path / "none"), dri_by_path=dri / "by-path")

    assert [node.path for node in found.nodes] == [
        "/dev/nvidia3",
        str(dri / "card1"),
        str(dri / "renderD128"),
    ]


DRIVER_NOT_LOADED = DiscoveryError("NVML: nvmlInit failed: Driver Not Loaded")


@pytest.mark.parametrize("kernel_driver", ["", "nouveau"], ids=["unbound", "nouveau"])
def test_discover_nvidia_raises_when_failing_sources_hide_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel_driver: str
) -> None:
    monkeypatch.setattr(discovery, "from_nvml", nvml_fails(DRIVER_NOT_LOADED))
    smi = fake_nvidia_smi(tmp_path, NO_DRIVER + "\n", rc=9)
    sysfs = tmp_path / "sysfs"
    make_sysfs_device(sysfs, "0000:18:00.0", "0x030200", "0x10de", "0x2330", kernel_driver)
    make_sysfs_device(sysfs, "0000:19:00.0", "0x068000", "0x10de", "0x22a3")

    with pytest.raises(DiscoveryError, match=r"GPUs at 0000:18:00\.0 are not passed") as info:
        discover_nvidia(nvidia_smi=str(smi), sysfs_root=sysfs)
    assert "Driver Not Loaded" in str(info.value)
    assert "exited with 9" in str(info.value)


def test_discover_nvidia_accepts_failing_sources_when_gpus_are_passed_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(discovery, "from_nvml", nvml_fails(DRIVER_NOT_LOADED))
    smi = fake_nvidia_smi(tmp_path, NO_DRIVER + "\n", rc=9)
    sysfs = tmp_path / "sysfs"
    make_sysfs_device(sysfs, "0000:18:00.0", "0x030200", "0x10de", "0x2330", "vfio-pci")

    assert discover_nvidia(nvidia_smi=str(smi), sysfs_root=sysfs) == ()


def test_discover_nvidia_ignores_failing_sources_without_nvidia_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(discovery, "from_nvml", nvml_fails(DRIVER_NOT_LOADED))
    sysfs = tmp_path / "sysfs"
    make_sysfs_device(sysfs, "0000:00:02.0", "0x030000", "0x8086", "0x4680", "i915")

    assert discover_nvidia(nvidia_smi=str(tmp_path / "nvidia-smi"), sysfs_root=sysfs) == ()


def test_main_reports_every_source(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mi210 = discovery.PciDevice(
        "0000:03:00.0", "0380", "Display controller", "1002", "AMD", "740f", "Aldebaran/MI200"
    )
    card = DeviceNode("/dev/dri/card1", 226, 1)
    monkeypatch.setattr(discovery, "from_sysfs", lambda: [mi210])
    monkeypatch.setattr(discovery, "dri_nodes_by_pci", lambda: {"0000:03:00.0": (card,)})
    monkeypatch.setattr(discovery, "from_nvidia_smi", lambda: ())
    assert discovery.main() == 0
    out = capsys.readouterr().out
    assert "nvidia-smi: 0 GPU(s)" in out
    assert "0000:03:00.0 amd: Aldebaran/MI200 [/dev/dri/card1 226:1]" in out


# --- MIG -------------------------------------------------------------------------------------


def test_parse_mig_minors_reads_the_recorded_h100_file() -> None:
    minors = discovery.parse_mig_minors(read("proc-driver-nvidia-caps-mig-minors.head20.H100.txt"))
    assert (minors["config"], minors["monitor"]) == (1, 2)
    assert (minors["gpu0/gi1/access"], minors["gpu0/gi1/ci0/access"]) == (12, 13)
    assert discovery.mig_cap_nodes(0, 1, 0, minors, 508) == (
        DeviceNode("/dev/nvidia-caps/nvidia-cap12", 508, 12),
        DeviceNode("/dev/nvidia-caps/nvidia-cap13", 508, 13),
    )


class FakeNvml:
    """pynvml with one H100 in MIG mode, as the recorded capture lists it, slots with gaps."""

    NVML_DEVICE_MIG_ENABLE = 1

    class NVMLError(Exception):
        pass

    class NVMLError_NotFound(NVMLError):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    NVMLError_LibraryNotFound = NVMLError_NotSupported

    def __init__(self, listed: ListedGpu) -> None:
        self.listed = listed
        # Slot -> (GPU instance, compute instance): slot 1 is empty, as after a destroy.
        self.slots = {0: (1, 0), 2: (5, 0), 3: (9, 0), 4: (10, 0)}

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return "gpu"

    def nvmlDeviceGetMinorNumber(self, handle: str) -> int:
        return 0

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        return self.listed.uuid if handle == "gpu" else self._mig(handle).uuid

    def nvmlDeviceGetName(self, handle: object) -> str:
        return (
            self.listed.name if handle == "gpu" else f"{self.listed.name} {self._mig(handle).name}"
        )

    def nvmlDeviceGetPciInfo(self, handle: object) -> object:
        return type("PciInfo", (), {"busId": b"00000000:18:00.0"})()

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> object:
        gib = 80 if handle == "gpu" else int(self._mig(handle).profile.split(".")[1][:-2])
        return type("Memory", (), {"total": gib * 1024**3})()

    def nvmlDeviceGetMigMode(self, handle: object) -> tuple[int, int]:
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: object) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: object, slot: int) -> int:
        if slot not in self.slots:
            raise self.NVMLError_NotFound(f"slot {slot}")
        return slot

    def nvmlDeviceGetGpuInstanceId(self, mig: int) -> int:
        return self.slots[mig][0]

    def nvmlDeviceGetComputeInstanceId(self, mig: int) -> int:
        return self.slots[mig][1]

    def _mig(self, slot: object) -> ListedMig:
        assert isinstance(slot, int)
        return self.listed.mig_devices[sorted(self.slots).index(slot)]


def test_nvml_gives_each_mig_instance_its_gpu_and_its_own_caps(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (listed,) = parse_list(read("nvidia-smi-L.mig-h100-4inst.masked.txt"))
    minors = tmp_path / "mig-minors"
    minors.write_text(
        "".join(
            f"gpu0/gi{gi}/access {3 + 9 * gi}\ngpu0/gi{gi}/ci0/access {4 + 9 * gi}\n"
            for gi in range(15)
        )
    )
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(listed))
    monkeypatch.setattr(discovery, "MIG_MINORS", minors)
    monkeypatch.setattr(discovery, "char_device_major", lambda name: 508)

    gpu, *instances = discovery.from_nvml()

    assert (gpu.uuid, gpu.mig_enabled, gpu.is_mig) == (listed.uuid, True, False)
    assert [mig.uuid for mig in instances] == [mig.uuid for mig in listed.mig_devices]
    assert [mig.profile for mig in instances] == ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]
    assert {mig.parent_uuid for mig in instances} == {gpu.uuid}
    assert [mig.mig_index for mig in instances] == [0, 1, 2, 3]
    assert instances[1].memory_mib == 20 * 1024
    caps = [[n.minor for n in mig.nodes if n.major == 508] for mig in instances]
    assert caps == [[12, 13], [48, 49], [84, 85], [93, 94]]
    assert all(mig.nodes[0] == gpu.nodes[0] for mig in instances), "an instance needs its GPU"


def test_discover_dri_pairs_nodes_by_pci_address_not_number(tmp_path: Path) -> None:
    sim = simulated.setup(tmp_path / "sim", 1, dri=simulated.parse_dri_layout("intel:1,amd:2"))
    found = discovery.discover_dri(
        tmp_path / "sim" / "sys" / "bus" / "pci" / "devices",
        tmp_path / "sim" / "dev" / "dri" / "by-path",
        tmp_path / "sim" / "dev" / "kfd",
    )

    def numbers(gpus: tuple[GpuDevice, ...]) -> dict[str, list[tuple[str, int, int]]]:
        return {
            gpu.pci_bus_id: sorted((gpu.vendor, n.major, n.minor) for n in gpu.nodes)
            for gpu in gpus
        }

    assert numbers(found) == numbers(sim.dri_gpus)
    cards = {
        gpu.pci_bus_id: [n.minor for n in gpu.nodes if n.major == simulated.DRM_MAJOR]
        for gpu in found
    }
    assert any(render - 128 != card for card, render in cards.values()), (
        "the simulated host should cross card and render numbers"
    )
    assert [(gpu.vendor, gpu.index) for gpu in found] == [("intel", 0), ("amd", 0), ("amd", 1)]
