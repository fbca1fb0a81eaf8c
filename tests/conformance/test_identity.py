"""What a report says of where it ran: the catalogue's version, the host's identity, its GPUs."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest

from conformance import identity, requirements
from conformance.render import gpus_of
from drivers.base import Elsewhere
from gpuhost import simulated
from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost, HostConfig

MACHINE = "0123456789abcdef0123456789abcdef"


def test_the_catalogue_version_follows_the_golden_list_not_its_layout() -> None:
    golden = requirements.load()
    version = identity.catalogue_version(golden)
    assert version.startswith("sha256:")
    assert len(version) == len("sha256:") + 16
    assert identity.catalogue_version(requirements.load()) == version
    first = golden.requirements[0]
    reworded = dataclasses.replace(first, statement=first.statement + " (reworded)")
    other = dataclasses.replace(golden, requirements=(reworded, *golden.requirements[1:]))
    assert identity.catalogue_version(other) != version


def test_the_machine_id_is_never_written_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "machine-id").write_text(MACHINE + "\n")
    derived = identity.machine_id((tmp_path / "missing", tmp_path / "machine-id"))
    assert len(derived) == 32
    assert MACHINE not in derived
    assert derived != hashlib.sha256(MACHINE.encode()).hexdigest()[:32]
    (tmp_path / "bad").write_text("not a machine id")
    assert identity.machine_id((tmp_path / "bad",)) == ""


def test_the_same_machine_and_gpus_are_one_host_and_any_change_another() -> None:
    same = identity.host_id("m", "node-1", ["GPU-b", "GPU-a"])
    assert identity.host_id("m", "node-1", ["GPU-a", "GPU-b"]) == same
    assert identity.host_id("m", "node-2", ["GPU-a", "GPU-b"]) != same
    assert identity.host_id("m", "node-1", ["GPU-a", "GPU-c"]) != same
    assert identity.host_id("n", "node-1", ["GPU-a", "GPU-b"]) != same


@pytest.mark.parametrize(
    ("count", "mig", "dri", "said"),
    [
        (
            8,
            "0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb",
            "intel:1,amd:2",
            "8 x NVIDIA H100 80GB HBM3 (nvidia; 2 in MIG mode: 8 x 1g.10gb, 3 x 2g.20gb; driver "
            "simulated), 1 x Intel Arc A770 (intel; driver simulated), 2 x AMD Instinct MI210 "
            "(amd; driver simulated) (SIMULATED)",
        ),
        (1, "", "", "1 x NVIDIA H100 80GB HBM3 (nvidia; driver simulated) (SIMULATED)"),
        (0, "", "amd:2", "2 x AMD Instinct MI210 (amd; driver simulated) (SIMULATED)"),
    ],
)
def test_each_host_is_named_with_its_gpus(
    tmp_path: Path, count: int, mig: str, dri: str, said: str
) -> None:
    sim = simulated.setup(
        tmp_path / "sim",
        count,
        mig=simulated.parse_mig_layout(mig),
        dri=simulated.parse_dri_layout(dri),
    )
    host = GpuHost.open(HostConfig(sim_root=sim.root))
    header = identity.header(host)
    assert header["catalogue"] == identity.catalogue_version()
    assert gpus_of({"simulated": True, **header}) == said
    again = GpuHost.open(HostConfig(sim_root=sim.root))
    assert identity.header(again)["host_id"] == header["host_id"], "one host, run after run"
    other = simulated.setup(
        tmp_path / "other",
        count,
        mig=simulated.parse_mig_layout(mig),
        dri=simulated.parse_dri_layout(dri),
    )
    elsewhere = identity.header(GpuHost.open(HostConfig(sim_root=other.root)))
    assert elsewhere["host_id"] != header["host_id"], "each simulated host is a host of its own"


def test_the_kernel_driver_is_named_with_its_version(tmp_path: Path) -> None:
    (tmp_path / "nvidia").mkdir()
    (tmp_path / "nvidia" / "version").write_text("580.65.06\n")
    assert identity.kernel_driver("nvidia", tmp_path) == "nvidia 580.65.06"
    (tmp_path / "amdgpu").mkdir()
    assert identity.kernel_driver("amd", tmp_path).startswith("amdgpu in Linux ")
    assert identity.kernel_driver("intel", tmp_path) == "no driver loaded"


def test_a_place_elsewhere_is_named_by_itself_its_gpus_and_what_makes_it_itself() -> None:
    """A run pinned to a cluster's node reports the node: its GPUs, its identity, its driver."""
    gpus = tuple(
        GpuDevice(index=i, uuid=f"GPU-{i}", name="NVIDIA L4", pci_bus_id="") for i in range(2)
    )
    node = Elsewhere("node-a", "node node-a of https://api", gpus, ("https://api", "uid-1"),
                     simulated=False, kernel_driver="nvidia 550.54.15")  # fmt: skip
    header = identity.header_elsewhere(node)
    assert header["gpus"] == [
        {"vendor": "nvidia", "model": "NVIDIA L4", "count": 2, "mig_gpus": 0,
         "mig_instances": {}, "driver": "nvidia 550.54.15"},
    ]  # fmt: skip
    same = identity.header_elsewhere(dataclasses.replace(node, description="said otherwise"))
    assert same["host_id"] == header["host_id"]
    for other in (
        dataclasses.replace(node, name="node-b"),
        dataclasses.replace(node, identity=("https://api", "uid-2")),  # the node made anew
        dataclasses.replace(node, gpus=gpus[:1]),
    ):
        assert identity.header_elsewhere(other)["host_id"] != header["host_id"]
    simulated_node = identity.header_elsewhere(dataclasses.replace(node, simulated=True))
    assert simulated_node["gpus"][0]["driver"] == "simulated"
