"""The simulated GPU host: its files and device nodes, its CDI spec, its nvidia-smi, its CLI.

The nvidia-smi stand-in is run in a bubblewrap sandbox whose ``/dev`` holds only the nodes
a test binds there, as a driver would give them; it must report exactly those GPUs.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from drivers.bwrap import system_dirs_argv
from gpuhost.devices import NVIDIACTL_MINOR, DeviceNode, GpuDevice
from gpuhost.leases import Holder
from gpuhost.simulated import (
    CAPS_MAJOR,
    DGX_BUSES,
    DRM_MAJOR,
    KFD_MAJOR,
    MEMORY_MIB,
    MODEL,
    NODE_GID,
    NVIDIA_MAJOR,
    SANDBOX_SHARE,
    UVM_MAJOR,
    SimulatedHost,
    SimulatedHostError,
    load,
    parse_dri_layout,
    parse_mig_layout,
    setup,
    sweep,
    teardown,
)
from gpuhost.simulated.__main__ import main

BWRAP = shutil.which("bwrap")
BUSYBOX = Path("/bin/busybox")
SMI = f"{SANDBOX_SHARE}/bin/nvidia-smi"
NO_DEVICES = 6
BAD_ARGUMENTS = 2
QUERY = "--query-gpu=index,uuid,name,pci.bus_id,memory.total"

Bind = tuple[str, str]
"""A node bound into the sandbox: (host source, path inside)."""


def make_host(root: Path, count: int) -> SimulatedHost:
    """``setup``, or skip where this process may not create device nodes."""
    try:
        return setup(root, count)
    except SimulatedHostError as exc:
        if "CAP_MKNOD" in str(exc):
            pytest.skip(str(exc))
        raise


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatedHost]:
    """Four simulated GPUs, shared by the tests that only read them."""
    root = tmp_path_factory.mktemp("simhost") / "root"
    sim = make_host(root, 4)
    yield sim
    teardown(root)


@pytest.fixture(scope="module")
def sandbox() -> None:
    """Skip unless bubblewrap can start a sandbox here."""
    if BWRAP is None:
        pytest.skip("needs bwrap (apt-get install bubblewrap)")
    trial = subprocess.run(
        [BWRAP, *system_dirs_argv(), "--dev", "/dev", "true"],
        capture_output=True,
        text=True,
        check=False,
    )
    if trial.returncode != 0:
        pytest.skip(f"bwrap cannot start a sandbox here: {trial.stderr.strip()}")


def own(host: SimulatedHost, *indices: int) -> list[Bind]:
    """The nodes of the host's GPUs ``indices`` (PCI order), bound at their own names."""
    return [(node(host, i), f"/dev/nvidia{nth(host, i).minor}") for i in indices]


def nth(host: SimulatedHost, index: int) -> GpuDevice:
    """The host's GPU ``index``, in PCI order (its minor is another number)."""
    return host.gpus[index]


def node(host: SimulatedHost, index: int) -> str:
    """The host path of GPU ``index``'s node."""
    return str(host.root / "dev" / f"nvidia{nth(host, index).minor}")


def smi_bus(gpu: GpuDevice) -> str:
    """The PCI bus id as nvidia-smi prints it: an 8-digit domain, upper case."""
    return f"0000{gpu.pci_bus_id.upper()}"


def smi(
    host: SimulatedHost,
    *args: str,
    nodes: Sequence[Bind] = (),
    env: Mapping[str, str] | None = None,
    binds: Sequence[Bind] = (),
    command: Sequence[str] = (SMI,),
    control: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run the stand-in in a sandbox holding ``nodes`` and ``/dev/nvidiactl`` under /dev.

    Nothing else of /dev is there, nor nvidiactl with ``control=False``.
    /tmp and /run are private, so neither the simulated root (under /tmp here) nor any
    other simulated host is visible inside; only its share/ is, at /run/gpu-sim.
    """
    assert BWRAP is not None
    # The host's system directories, not its whole root: container mounts come and go under
    # /var/lib, and bwrap fails when one vanishes while it copies the mount tree.
    argv = [BWRAP, *system_dirs_argv(), "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run"]
    argv += ["--ro-bind", str(host.share_dir), SANDBOX_SHARE]
    if control:
        argv += ["--dev-bind", str(host.root / "dev" / "nvidiactl"), "/dev/nvidiactl"]
    for source, target in nodes:
        argv += ["--dev-bind", source, target]
    for source, target in binds:
        argv += ["--ro-bind", source, target]
    for key, value in (env or {}).items():
        argv += ["--setenv", key, value]
    argv += [*command, *args]
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"},
    )


def listing(*gpus: GpuDevice) -> str:
    """``nvidia-smi -L`` for these GPUs, numbered from 0 in the order given."""
    return "".join(f"GPU {i}: {gpu.name} (UUID: {gpu.uuid})\n" for i, gpu in enumerate(gpus))


# -- setup, load, teardown ----------------------------------------------------------------


def test_device_nodes_have_nvidias_minors_and_majors_no_driver_uses(host: SimulatedHost) -> None:
    for minor in range(4):
        st = os.stat(host.root / "dev" / f"nvidia{minor}")
        assert stat.S_ISCHR(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (NVIDIA_MAJOR, minor)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, NODE_GID)
    expected = {
        "nvidiactl": (NVIDIA_MAJOR, NVIDIACTL_MINOR),
        "nvidia-uvm": (UVM_MAJOR, 0),
        "nvidia-uvm-tools": (UVM_MAJOR, 1),
    }
    for name, numbers in expected.items():
        st = os.stat(host.root / "dev" / name)
        assert stat.S_ISCHR(st.st_mode)
        assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == numbers
    # Of the majors the kernel keeps for local use (devices.txt: 60-63, 120-127, 240-254; the
    # last are handed out to drivers without a number of their own): none opens a real device.
    assert {NVIDIA_MAJOR, UVM_MAJOR, CAPS_MAJOR, KFD_MAJOR, DRM_MAJOR} <= set(range(120, 128))
    assert sorted(path.name for path in (host.root / "dev").iterdir()) == sorted(
        [*(f"nvidia{m}" for m in range(4)), *expected]
    )
    assert host.control_nodes == tuple(
        DeviceNode(f"/dev/{name}", major, minor, str(host.root / "dev" / name))
        for name, (major, minor) in expected.items()
    )


@pytest.mark.parametrize("node", ["nvidia0", "nvidiactl", "nvidia-uvm"])
def test_opening_a_node_fails_as_with_no_driver_whatever_drivers_are_loaded(
    host: SimulatedHost, node: str
) -> None:
    """Before: the nodes were 195:N, which open a real GPU where NVIDIA's driver is loaded."""
    with pytest.raises(OSError, match="No such device or address") as raised:
        os.open(host.root / "dev" / node, os.O_RDWR)
    assert raised.value.errno == errno.ENXIO
    registered = Path("/proc/devices").read_text().split("Block devices:")[0].split()
    assert str(NVIDIA_MAJOR) not in registered[2::2]


def test_inventory(host: SimulatedHost) -> None:
    gpus = host.gpus
    assert [gpu.index for gpu in gpus] == [0, 1, 2, 3]
    # As on real hosts, no GPU's node carries its index: /dev/nvidia<index> is another GPU.
    assert sorted(gpu.minor for gpu in gpus if gpu.minor is not None) == [0, 1, 2, 3]
    assert all(gpu.minor != gpu.index for gpu in gpus)
    assert [gpu.pci_bus_id for gpu in gpus] == [f"0000:{bus}:00.0" for bus in DGX_BUSES[:4]]
    assert [gpu.pci_bus_id for gpu in gpus] == sorted(gpu.pci_bus_id for gpu in gpus)
    assert len({gpu.uuid for gpu in gpus}) == 4
    for gpu in gpus:
        assert gpu.uuid.startswith("GPU-")
        assert (gpu.name, gpu.memory_mib, gpu.vendor) == (MODEL, MEMORY_MIB, "nvidia")
        assert gpu.minor is not None
        node = f"nvidia{gpu.minor}"
        assert gpu.nodes == (
            DeviceNode(f"/dev/{node}", NVIDIA_MAJOR, gpu.minor, str(host.root / "dev" / node)),
        )
    assert load(host.root) == host


def test_shared_files(host: SimulatedHost) -> None:
    assert host.share_dir == host.root / "share"
    for path in (host.nvidia_smi, host.nvidia_smi.with_name("nvidia-smi.awk")):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755
    rows = [
        line.split("\t")
        for line in (host.share_dir / "inventory.tsv").read_text().splitlines()
        if not line.startswith("#")
    ]
    assert rows == [
        [str(gpu.minor), gpu.uuid, gpu.name, smi_bus(gpu), str(MEMORY_MIB)]
        for gpu in sorted(host.gpus, key=lambda gpu: gpu.minor or 0)
    ]
    assert host.lease_dir.is_dir()


def _shuffled_host(root: Path) -> tuple[SimulatedHost, SimulatedHost]:
    """A host as set up, and as loaded again after its inventory rows were reordered."""
    sim = make_host(root, 4)
    inventory = sim.share_dir / "inventory.tsv"
    header, *rows = inventory.read_text().splitlines(keepends=True)
    inventory.write_text(header + "".join(rows[i] for i in (2, 0, 3, 1)))
    return sim, load(root)


def test_load_orders_the_inventory_by_pci(tmp_path: Path) -> None:
    sim, reloaded = _shuffled_host(tmp_path / "root")
    assert [gpu.pci_bus_id for gpu in reloaded.gpus] == [gpu.pci_bus_id for gpu in sim.gpus]
    assert [(gpu.minor, gpu.uuid) for gpu in reloaded.gpus] == [
        (gpu.minor, gpu.uuid) for gpu in sim.gpus
    ]


def test_load_numbers_the_inventory_in_pci_order(tmp_path: Path) -> None:
    _, reloaded = _shuffled_host(tmp_path / "root")
    assert [gpu.index for gpu in reloaded.gpus] == [0, 1, 2, 3]


def test_more_gpus_than_a_dgx(tmp_path: Path) -> None:
    sim = make_host(tmp_path / "root", 10)
    assert [gpu.pci_bus_id for gpu in sim.gpus[8:]] == ["0000:e0:00.0", "0000:e1:00.0"]
    assert sorted(gpu.minor or 0 for gpu in sim.gpus) == list(range(10))
    assert [gpu.index for gpu in sim.gpus] == list(range(10))
    assert all(gpu.minor != gpu.index for gpu in sim.gpus)


def test_setup_either_makes_41_gpus_or_refuses_cleanly(tmp_path: Path) -> None:
    try:
        sim = make_host(tmp_path / "root", 41)
    except SimulatedHostError:
        assert not (tmp_path / "root").exists()
    else:
        assert len(sim.gpus) == 41
        assert len({gpu.pci_bus_id for gpu in sim.gpus}) == 41


def test_several_roots_coexist(tmp_path: Path) -> None:
    first = make_host(tmp_path / "one", 2)
    second = make_host(tmp_path / "two", 3)
    assert not {gpu.uuid for gpu in first.gpus} & {gpu.uuid for gpu in second.gpus}
    assert load(first.root) == first
    assert load(second.root) == second
    teardown(first.root)
    assert not first.root.exists()
    assert load(second.root) == second


def test_setup_replaces_a_simulated_host(tmp_path: Path) -> None:
    old = make_host(tmp_path / "root", 3)
    (old.lease_dir / "leases.json").write_text("{}")
    new = make_host(tmp_path / "root", 2)
    assert len(new.gpus) == 2
    assert not {gpu.uuid for gpu in old.gpus} & {gpu.uuid for gpu in new.gpus}
    assert not (new.lease_dir / "leases.json").exists()
    assert not (new.root / "dev" / "nvidia2").exists()


def test_sweep_removes_the_hosts_of_runs_that_are_gone(tmp_path: Path) -> None:
    """A run killed before its teardown leaves its host and CDI registration; the next sweeps."""
    registry = tmp_path / "cdi"
    ended = subprocess.Popen(["sleep", "30"])
    owner = Holder.process(ended.pid)
    gone = setup(tmp_path / "runs" / "gone", 1, registry, owner=owner)
    mine = setup(tmp_path / "runs" / "mine", 1, registry, owner=Holder.process(os.getpid()))
    unowned = setup(tmp_path / "runs" / "unowned", 1, registry)
    ended.kill()
    ended.wait()
    assert len(list(registry.iterdir())) == 3
    assert sweep(tmp_path / "runs") == [gone.root]
    assert not gone.root.exists()
    assert load(mine.root) == mine
    assert load(unowned.root) == unowned
    assert len(list(registry.iterdir())) == 2, "the gone host's CDI spec is still registered"
    assert sweep(tmp_path / "runs") == []


@pytest.mark.parametrize("count", [0, -1])
def test_count_below_one_is_rejected(tmp_path: Path, count: int) -> None:
    with pytest.raises(SimulatedHostError, match="at least 1"):
        setup(tmp_path / "root", count)
    assert not (tmp_path / "root").exists()


def test_a_host_of_amd_gpus_alone_has_nothing_of_nvidia(tmp_path: Path) -> None:
    registry = tmp_path / "cdi"
    host = setup(tmp_path / "root", 0, registry, dri=parse_dri_layout("amd:2"))
    assert host.gpus == ()
    assert host.mig_devices == ()
    assert host.control_nodes == ()
    assert [(gpu.vendor, gpu.pci_bus_id) for gpu in host.dri_gpus] == [
        ("amd", "0000:c1:00.0"),
        ("amd", "0000:c3:00.0"),
    ]
    assert sorted(p.name for p in (host.root / "dev").iterdir()) == ["dri", "kfd"]
    assert yaml.safe_load(host.cdi_spec.read_text())["devices"] == []
    assert not registry.exists(), "a spec of no device was registered with the engines"
    assert load(host.root) == host
    teardown(host.root)
    assert not host.root.exists()


def test_teardown_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep me")
    with pytest.raises(SimulatedHostError, match="refusing to remove"):
        teardown(precious)
    with pytest.raises(SimulatedHostError, match="refusing to remove"):
        setup(precious, 1)
    with pytest.raises(SimulatedHostError, match="not a simulated GPU host"):
        load(precious)
    assert (precious / "data.txt").read_text() == "keep me"


def test_teardown_of_nothing_is_harmless(tmp_path: Path) -> None:
    teardown(tmp_path / "never-made")
    with pytest.raises(SimulatedHostError, match="not a simulated GPU host"):
        load(tmp_path / "never-made")


# -- the CDI spec -------------------------------------------------------------------------


def test_cdi_spec(host: SimulatedHost) -> None:
    spec = yaml.safe_load(host.cdi_spec.read_text())
    assert host.cdi_spec == host.root / "cdi" / "nvidia-sim.yaml"
    assert spec["cdiVersion"] == "0.5.0"
    assert spec["kind"] == host.cdi_kind
    assert host.cdi_kind.startswith("sim-")
    assert host.cdi_kind.endswith(".nvidia.com/gpu")

    def gpu_node(gpu: GpuDevice) -> dict[str, object]:
        return {
            "path": f"/dev/nvidia{gpu.minor}",
            "hostPath": str(host.root / "dev" / f"nvidia{gpu.minor}"),
            "type": "c",
            "major": NVIDIA_MAJOR,
            "minor": gpu.minor,
        }

    devices = {device["name"]: device["containerEdits"] for device in spec["devices"]}
    expected_names = [name for gpu in host.gpus for name in (str(gpu.index), gpu.uuid)] + ["all"]
    assert [device["name"] for device in spec["devices"]] == expected_names
    for gpu in host.gpus:
        assert devices[str(gpu.index)] == {"deviceNodes": [gpu_node(gpu)]}
        assert devices[gpu.uuid] == {"deviceNodes": [gpu_node(gpu)]}
        assert f"{host.cdi_kind}={gpu.index}" in gpu.cdi_names
    assert devices["all"] == {"deviceNodes": [gpu_node(gpu) for gpu in host.gpus]}

    edits = spec["containerEdits"]
    assert [(n["path"], n["major"], n["minor"]) for n in edits["deviceNodes"]] == [
        ("/dev/nvidiactl", NVIDIA_MAJOR, 255),
        ("/dev/nvidia-uvm", UVM_MAJOR, 0),
        ("/dev/nvidia-uvm-tools", UVM_MAJOR, 1),
    ]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert {(m["hostPath"], m["containerPath"]) for m in edits["mounts"]} == {
        (str(host.share_dir), SANDBOX_SHARE),
        (str(host.nvidia_smi), "/usr/bin/nvidia-smi"),
    }

    nodes = [n for device in spec["devices"] for n in device["containerEdits"]["deviceNodes"]]
    host_paths = [n["hostPath"] for n in nodes + edits["deviceNodes"] + edits["mounts"]]
    for path in host_paths:
        assert path.startswith(f"{host.root}/"), path
        assert Path(path).exists(), path


# -- nvidia-smi in a sandbox --------------------------------------------------------------


@pytest.mark.usefixtures("sandbox")
def test_the_sandbox_sees_the_share_but_not_the_root(host: SimulatedHost) -> None:
    """The premise of every test below: only the bound nodes can tell it about GPUs."""
    hidden = smi(host, command=("test", "-e", str(host.root / "dev" / "nvidia0")))
    assert hidden.returncode == 1
    shared = smi(host, command=("test", "-f", f"{SANDBOX_SHARE}/inventory.tsv"))
    assert shared.returncode == 0


@pytest.mark.usefixtures("sandbox")
@pytest.mark.parametrize(
    "minors",
    [
        pytest.param((0, 1, 2, 3), id="all"),
        pytest.param((2,), id="one"),
        pytest.param((3, 1), id="two-out-of-order"),
    ],
)
def test_list_shows_exactly_the_bound_gpus(host: SimulatedHost, minors: tuple[int, ...]) -> None:
    result = smi(host, "-L", nodes=own(host, *minors))
    assert result.returncode == 0, result.stderr
    bound = sorted((nth(host, m) for m in minors), key=lambda gpu: gpu.pci_bus_id)
    assert result.stdout == listing(*bound)


@pytest.mark.usefixtures("sandbox")
def test_query_csv(host: SimulatedHost) -> None:
    result = smi(host, QUERY, "--format=csv", nodes=own(host, 1, 3))
    assert result.returncode == 0, result.stderr
    gpu1, gpu3 = nth(host, 1), nth(host, 3)
    assert result.stdout.splitlines() == [
        "index, uuid, name, pci.bus_id, memory.total [MiB]",
        f"0, {gpu1.uuid}, {MODEL}, {smi_bus(gpu1)}, {MEMORY_MIB} MiB",
        f"1, {gpu3.uuid}, {MODEL}, {smi_bus(gpu3)}, {MEMORY_MIB} MiB",
    ]
    assert smi_bus(gpu1) == "00000000:2A:00.0"


@pytest.mark.usefixtures("sandbox")
def test_query_csv_noheader_nounits(host: SimulatedHost) -> None:
    result = smi(host, QUERY, "--format=csv,noheader,nounits", nodes=own(host, 0))
    assert result.returncode == 0, result.stderr
    gpu = nth(host, 0)
    assert result.stdout == f"0, {gpu.uuid}, {MODEL}, {smi_bus(gpu)}, {MEMORY_MIB}\n"


@pytest.mark.usefixtures("sandbox")
def test_table_without_arguments(host: SimulatedHost) -> None:
    result = smi(host, nodes=own(host, 2))
    assert result.returncode == 0, result.stderr
    assert smi_bus(nth(host, 2)) in result.stdout
    assert smi_bus(nth(host, 0)) not in result.stdout


@pytest.mark.usefixtures("sandbox")
@pytest.mark.parametrize(
    ("select", "minor"),
    [
        pytest.param(["-i", "1"], 1, id="index"),
        pytest.param(["--id=2"], 2, id="id-equals-index"),
        pytest.param(["-i2"], 2, id="attached-index"),
        pytest.param(["-i", "uuid:1"], 1, id="uuid"),
        pytest.param(["-i", "00000000:2A:00.0"], 1, id="bus-nvidia-smi-form"),
        pytest.param(["-i", "0000:2a:00.0"], 1, id="bus-sysfs-form"),
        pytest.param(["--id", "0000:3a:00.0"], 2, id="bus-id-flag"),
    ],
)
def test_select_one_gpu(host: SimulatedHost, select: list[str], minor: int) -> None:
    select = [arg.replace("uuid:1", nth(host, 1).uuid) for arg in select]
    result = smi(
        host, *select, "--query-gpu=index,uuid", "--format=csv,noheader", nodes=own(host, 0, 1, 2)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{minor}, {nth(host, minor).uuid}\n"


@pytest.mark.usefixtures("sandbox")
def test_select_several_gpus(host: SimulatedHost) -> None:
    result = smi(host, "-L", "-i", f"0,{nth(host, 2).uuid}", nodes=own(host, 0, 1, 2))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"GPU 0: {MODEL} (UUID: {nth(host, 0).uuid})",
        f"GPU 2: {MODEL} (UUID: {nth(host, 2).uuid})",
    ]


@pytest.mark.usefixtures("sandbox")
def test_index_is_the_sandboxs_not_the_hosts(host: SimulatedHost) -> None:
    result = smi(
        host, "-i", "1", "--query-gpu=uuid", "--format=csv,noheader", nodes=own(host, 1, 3)
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{nth(host, 3).uuid}\n"


@pytest.mark.usefixtures("sandbox")
@pytest.mark.parametrize(
    "select",
    [
        pytest.param(["-i", "uuid:3"], id="uuid-of-an-unbound-gpu"),
        pytest.param(["-i", "0000:5d:00.0"], id="bus-of-an-unbound-gpu"),
        pytest.param(["-i", "1"], id="index-past-the-end"),
    ],
)
def test_an_unbound_gpu_cannot_be_selected(host: SimulatedHost, select: list[str]) -> None:
    select = [arg.replace("uuid:3", nth(host, 3).uuid) for arg in select]
    result = smi(host, "-L", *select, nodes=own(host, 0))
    assert result.returncode == NO_DEVICES
    assert "No devices were found" in result.stdout + result.stderr


@pytest.mark.usefixtures("sandbox")
@pytest.mark.parametrize("args", [["-L"], [QUERY, "--format=csv"], []], ids=["L", "query", "table"])
def test_no_node_means_no_devices(host: SimulatedHost, args: list[str]) -> None:
    result = smi(host, *args)
    assert result.returncode == NO_DEVICES
    assert "No devices were found" in result.stdout + result.stderr
    assert "GPU-" not in result.stdout


@pytest.mark.usefixtures("sandbox")
@pytest.mark.parametrize(
    "env",
    [
        pytest.param({"CUDA_VISIBLE_DEVICES": "0"}, id="cuda-0"),
        pytest.param({"CUDA_VISIBLE_DEVICES": ""}, id="cuda-empty"),
        pytest.param({"NVIDIA_VISIBLE_DEVICES": "all"}, id="nvidia-all"),
        pytest.param({"NVIDIA_VISIBLE_DEVICES": "none"}, id="nvidia-none"),
        pytest.param(
            {"NVIDIA_VISIBLE_DEVICES": "all", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, id="both"
        ),
    ],
)
def test_environment_changes_nothing(host: SimulatedHost, env: dict[str, str]) -> None:
    result = smi(host, "-L", nodes=own(host, 2, 3), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == listing(nth(host, 2), nth(host, 3))

    nothing = smi(host, "-L", env=env)
    assert nothing.returncode == NO_DEVICES
    assert nothing.stdout == "No devices were found\n"


@pytest.mark.usefixtures("sandbox")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--query-gpu=uuid,bogus", "--format=csv"],
            'Field "bogus" is not a valid field to query.',
            id="unknown-field",
        ),
        pytest.param(["--bogus"], "Invalid combination of input arguments", id="unknown-flag"),
        pytest.param(["-L", "-x"], "Invalid combination of input arguments", id="unknown-short"),
        pytest.param(["--query-gpu=uuid", "--format=json"], "requires 'csv'", id="bad-format"),
    ],
)
def test_bad_arguments_exit_2(host: SimulatedHost, args: list[str], message: str) -> None:
    result = smi(host, *args, nodes=own(host, 0))
    assert result.returncode == BAD_ARGUMENTS
    # nvidia-smi prints its errors on stdout.
    assert message in result.stdout
    assert result.stderr == ""


@pytest.mark.usefixtures("sandbox")
def test_minor_number_is_not_a_field(host: SimulatedHost) -> None:
    """The real nvidia-smi refuses it (driver 580).

    A simulator kinder than real hosts would let discovery rely on it.
    """
    result = smi(host, "--query-gpu=uuid,minor_number", "--format=csv", nodes=own(host, 0))
    assert result.returncode == BAD_ARGUMENTS
    assert result.stdout.strip() == 'Field "minor_number" is not a valid field to query.'


@pytest.mark.usefixtures("sandbox")
@pytest.mark.parametrize("args", [["-L"], [QUERY, "--format=csv"], []], ids=["L", "query", "table"])
def test_no_nvidiactl_means_no_driver(host: SimulatedHost, args: list[str]) -> None:
    """Without /dev/nvidiactl nvidia-smi cannot reach the driver: exit 9, as on a real host."""
    result = smi(host, *args, nodes=own(host, 0), control=False)
    assert result.returncode == 9
    assert result.stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate")
    assert "GPU-" not in result.stdout


@pytest.fixture
def wrong_major_node(tmp_path: Path) -> Path:
    """A character device 1:3 (what /dev/null is) under a GPU-like name."""
    path = tmp_path / "nvidia-impostor"
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("needs CAP_MKNOD")
    return path


@pytest.mark.usefixtures("sandbox")
def test_nodes_that_are_not_gpus_are_not_counted(
    host: SimulatedHost, tmp_path: Path, wrong_major_node: Path
) -> None:
    regular = tmp_path / "regular-file"
    regular.write_text("")
    impostors: list[Bind] = [
        ("/dev/null", "/dev/nvidia4"),
        (str(wrong_major_node), "/dev/nvidia6"),
        (str(host.root / "dev" / "nvidiactl"), "/dev/nvidia7"),
        (str(regular), "/dev/nvidia9"),
    ]
    alone = smi(host, "-L", nodes=impostors)
    assert alone.returncode == NO_DEVICES, alone.stdout
    result = smi(host, "-L", nodes=[*impostors, *own(host, 1)])
    assert result.returncode == 0, result.stderr
    assert result.stdout == listing(nth(host, 1))


@pytest.mark.usefixtures("sandbox")
def test_a_renamed_node_is_known_by_its_minor(host: SimulatedHost) -> None:
    renamed: list[Bind] = [(node(host, 3), f"/dev/nvidia{nth(host, 0).minor}")]
    result = smi(host, "-L", nodes=renamed)
    assert result.returncode == 0, result.stderr
    assert result.stdout == listing(nth(host, 3))


@pytest.fixture
def busybox_bin(tmp_path: Path) -> Path:
    """A directory where ``stat``, ``awk`` and ``sh`` are busybox applets, and nothing else."""
    if not BUSYBOX.is_file():
        pytest.skip(f"needs {BUSYBOX} (apt-get install busybox-static)")
    bindir = tmp_path / "busybox-bin"
    bindir.mkdir()
    for applet in ("stat", "awk", "sh"):
        (bindir / applet).symlink_to(BUSYBOX)
    return bindir


@pytest.mark.usefixtures("sandbox")
def test_runs_under_busybox_sh_and_awk(host: SimulatedHost, busybox_bin: Path) -> None:
    def run(*args: str, nodes: Sequence[Bind]) -> subprocess.CompletedProcess[str]:
        return smi(
            host,
            *args,
            nodes=nodes,
            binds=[(str(busybox_bin), "/run/busybox-bin")],
            env={"PATH": "/run/busybox-bin"},
            command=(str(BUSYBOX), "sh", SMI),
        )

    renamed: list[Bind] = [(node(host, 3), f"/dev/nvidia{nth(host, 0).minor}")]
    result = run("-L", nodes=[*renamed, *own(host, 1), ("/dev/null", "/dev/nvidia8")])
    assert result.returncode == 0, result.stderr
    assert result.stdout == listing(nth(host, 1), nth(host, 3))

    query = run(QUERY, "--format=csv", "-i", "0000:5d:00.0", nodes=renamed)
    assert query.returncode == 0, query.stderr
    gpu = nth(host, 3)
    assert query.stdout.splitlines() == [
        "index, uuid, name, pci.bus_id, memory.total [MiB]",
        f"0, {gpu.uuid}, {MODEL}, {smi_bus(gpu)}, {MEMORY_MIB} MiB",
    ]

    nothing = run("-L", nodes=[])
    assert nothing.returncode == NO_DEVICES


# -- python -m gpuhost.simulated -------------------------------------------------------------


def test_cli_setup_show_teardown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    code = main(["setup", "--root", str(root), "--count", "2"])
    out, err = capsys.readouterr()
    if code == 1 and "CAP_MKNOD" in err:
        pytest.skip(err)
    assert code == 0, err
    sim = load(root)
    assert f"simulated GPU host at {root}: 2 GPUs" in out
    for gpu in sim.gpus:
        assert (
            f"GPU {gpu.index}: {MODEL} ({gpu.uuid}, {gpu.pci_bus_id}, /dev/nvidia{gpu.minor})"
            in out
        )

    assert main(["show", "--root", str(root)]) == 0
    assert capsys.readouterr().out == out

    assert main(["teardown", "--root", str(root)]) == 0
    assert "removed" in capsys.readouterr().out
    assert not root.exists()
    assert main(["teardown", "--root", str(root)]) == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["show"], "not a simulated GPU host", id="show-nothing"),
        pytest.param(["setup", "--count", "0"], "count must be at least 1", id="setup-count-0"),
        pytest.param(["teardown"], "refusing to remove", id="teardown-foreign"),
    ],
)
def test_cli_errors_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    root = tmp_path / "root"
    if argv[0] == "teardown":
        root.mkdir()
        (root / "keep").write_text("")
    assert main([*argv, "--root", str(root)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert message in err
    if argv[0] == "teardown":
        assert (root / "keep").exists()


@pytest.mark.parametrize(
    "argv",
    [["bogus"], [], ["setup", "--count", "two"]],
    ids=["unknown-action", "no-action", "count-not-a-number"],
)
def test_cli_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_cli_as_a_module(tmp_path: Path) -> None:
    root = tmp_path / "root"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpuhost.simulated", *args, "--root", str(root)],
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )

    assert run("show").returncode == 1
    created = run("setup", "--count", "1")
    if created.returncode == 1 and "CAP_MKNOD" in created.stderr:
        pytest.skip(created.stderr)
    assert created.returncode == 0, created.stderr
    shown = run("show")
    assert shown.returncode == 0
    assert "1 GPUs" in shown.stdout
    assert run("teardown").returncode == 0
    assert not root.exists()


# -- MIG instances and DRI GPUs ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mig_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatedHost]:
    """Three GPUs, the first two in MIG mode, with an Intel and two AMD GPUs beside them."""
    root = tmp_path_factory.mktemp("mighost") / "root"
    try:
        sim = setup(
            root, 3, mig=parse_mig_layout("0:3x1g.10gb,1:2x3g.40gb"),
            dri=parse_dri_layout("intel:1,amd:2"),
        )  # fmt: skip
    except SimulatedHostError as exc:
        pytest.skip(str(exc))
    yield sim
    teardown(root)


def caps(mig: GpuDevice) -> list[Bind]:
    return [(n.source, n.path) for n in mig.nodes if "nvidia-caps" in n.path]


def test_mig_instances_belong_to_their_gpus(mig_host: SimulatedHost) -> None:
    first, second, whole = mig_host.gpus
    assert (first.mig_enabled, second.mig_enabled, whole.mig_enabled) == (True, True, False)
    assert [(m.parent_uuid, m.profile) for m in mig_host.mig_devices] == [
        *[(first.uuid, "1g.10gb")] * 3,
        *[(second.uuid, "3g.40gb")] * 2,
    ]
    assert all(m.uuid.startswith("MIG-") and m.is_mig for m in mig_host.mig_devices)
    caps_minors = [[n.minor for n in m.nodes[1:]] for m in mig_host.mig_devices]
    assert len({minor for pair in caps_minors for minor in pair}) == 10, caps_minors
    assert all(m.nodes[0] == first.nodes[0] for m in mig_host.mig_devices[:3])
    assert f"{mig_host.cdi_kind}=0:2" in mig_host.mig_devices[2].cdi_names


@pytest.mark.usefixtures("sandbox")
def test_list_shows_exactly_the_mig_instances_whose_caps_are_bound(mig_host: SimulatedHost) -> None:
    first = mig_host.gpus[0]
    a, b, c = mig_host.mig_devices[:3]
    gpu = [(first.nodes[0].source, first.nodes[0].path)]
    mkdir = [("/dev/null", "/dev/nvidia-caps/.keep")]  # bwrap makes the directory for binds
    result = smi(mig_host, "-L", nodes=gpu + caps(c) + caps(a))
    assert result.stdout == (
        f"GPU 0: {first.name} (UUID: {first.uuid})\n"
        f"  MIG 1g.10gb     Device  0: (UUID: {a.uuid})\n"
        f"  MIG 1g.10gb     Device  1: (UUID: {c.uuid})\n"
    )
    only_gi = [bind for bind in caps(b)[:1]]
    assert smi(mig_host, "-L", nodes=gpu + only_gi + mkdir).stdout == listing(first)
    assert smi(mig_host, "-L", nodes=caps(b)).returncode == NO_DEVICES, "caps without the GPU"


def test_dri_gpus_are_numbered_per_vendor_with_crossed_nodes(mig_host: SimulatedHost) -> None:
    dri = mig_host.dri_gpus
    assert [(gpu.vendor, gpu.index) for gpu in dri] == [("intel", 0), ("amd", 0), ("amd", 1)]
    for gpu in dri:
        card, render = (n for n in gpu.nodes if "/dri/" in n.path)
        link = mig_host.root / "dev" / "dri" / "by-path" / f"pci-{gpu.pci_bus_id}-render"
        assert link.resolve() == Path(render.source)
        assert os.stat(card.source).st_rdev == os.makedev(DRM_MAJOR, card.minor)
        assert (gpu.vendor == "amd") == any(n.path == "/dev/kfd" for n in gpu.nodes)
    pairs = [tuple(n.minor for n in gpu.nodes if "/dri/" in n.path) for gpu in dri]
    assert any(render != 128 + card for card, render in pairs), pairs


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"mig": {5: ["1g.10gb"]}}, "MIG on GPU 5, but the host has 3 GPUs"),
        ({"mig": {0: ["1g.10gb"] * 8}}, "1 to 7 MIG instances"),
        ({"mig": {0: ["big"]}}, "not a MIG profile: 'big'"),
        ({"dri": {"matrox": 1}}, "DRI GPUs of 'matrox'"),
        ({"dri": {"amd": 9}}, "9 amd GPUs"),
    ],
)
def test_bad_layouts_are_refused(tmp_path: Path, layout: dict[str, Any], message: str) -> None:
    with pytest.raises(SimulatedHostError, match=re.escape(message)):
        setup(tmp_path / "sim", 3, **layout)
    assert not (tmp_path / "sim").exists()


@pytest.mark.parametrize("text", ["0", "x:1g.10gb", "0:"])
def test_bad_mig_layout_text_is_refused(text: str) -> None:
    with pytest.raises(SimulatedHostError, match="not a MIG layout entry"):
        parse_mig_layout(text)


def test_layout_texts() -> None:
    assert parse_mig_layout("0:7x1g.10gb, 1:2g.20gb,1:3g.40gb") == {
        0: ["1g.10gb"] * 7,
        1: ["2g.20gb", "3g.40gb"],
    }
    assert parse_dri_layout("intel:1,amd:2") == {"intel": 1, "amd": 2}
    with pytest.raises(SimulatedHostError, match="not a DRI layout entry"):
        parse_dri_layout("amd")


@pytest.mark.usefixtures("sandbox")
def test_the_dri_probe_reports_the_gpus_whose_nodes_are_bound(mig_host: SimulatedHost) -> None:
    intel, amd0, amd1 = mig_host.dri_gpus
    binds = [(n.source, n.path) for n in amd1.nodes]
    # A card bound under another name is still that card: the probe reads numbers.
    card = next(n for n in intel.nodes if "/card" in n.path)
    binds.append((card.source, "/dev/dri/card99"))
    probe = f"{SANDBOX_SHARE}/bin/dri-gpus"
    result = smi(mig_host, nodes=binds, command=(probe,), control=False)
    assert result.returncode == 0, result.stderr
    render = next(n.path for n in amd1.nodes if "/renderD" in n.path)
    own_card = next(n.path for n in amd1.nodes if "/card" in n.path)
    assert sorted(result.stdout.splitlines()) == sorted(
        [
            f"card\t{amd1.pci_bus_id}\tamd\t{own_card}",
            f"render\t{amd1.pci_bus_id}\tamd\t{render}",
            f"card\t{intel.pci_bus_id}\tintel\t/dev/dri/card99",
            "kfd\t/dev/kfd",
        ]
    )
    assert amd0.pci_bus_id not in result.stdout


def test_teardown_removes_only_its_own_cdi_registration(tmp_path: Path) -> None:
    """``cdi/registered`` is in the host's directory: a path put there is not root's to delete."""
    from gpuhost import simulated

    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "root-only.conf"
    victim.write_text("not the host's")
    same_name = elsewhere / f"{simulated.REGISTERED_PREFIX}0123abcd.yaml"
    same_name.write_text("another spec")
    link = cdi_dir / f"{simulated.REGISTERED_PREFIX}feedbeef.yaml"
    link.symlink_to(victim)
    for planted in (victim, same_name, link):
        host = simulated.setup(tmp_path / "sim", 2, cdi_dir=cdi_dir)
        own = Path((host.root / "cdi" / "registered").read_text().strip())
        (host.root / "cdi" / "registered").write_text(f"{planted}\n")
        simulated.teardown(host.root)
        assert planted.is_symlink() or planted.exists(), f"teardown removed {planted}"
        own.unlink()
    assert victim.read_text() == "not the host's"
    host = simulated.setup(tmp_path / "sim", 2, cdi_dir=cdi_dir)
    own = Path((host.root / "cdi" / "registered").read_text().strip())
    simulated.teardown(host.root)
    assert not own.exists(), "its own registration stayed"


_KMSG = 0o600 | stat.S_IFCHR


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: device nodes, another user's files")
@pytest.mark.parametrize(
    ("change", "said"),
    [
        pytest.param(lambda root: _replace(root, lambda p: p.symlink_to("/dev/kmsg")),
                     "is a symbolic link", id="node-a-link"),
        pytest.param(lambda root: _replace(root, lambda p: os.mknod(p, _KMSG, os.makedev(1, 11))),
                     "is the character device 1:11", id="node-another-device"),
        pytest.param(lambda root: (root / "dev").chmod(0o777), "no one else may write",
                     id="dev-writable-by-others"),
        pytest.param(lambda root: os.chown(root / "share" / "bin", 65534, 65534),
                     "of uid 65534", id="tools-of-another-user"),
    ],
)  # fmt: skip
def test_a_simulated_host_another_user_could_change_is_refused(
    tmp_path: Path, change: Any, said: str
) -> None:
    """Its nodes become sandboxes' devices: /dev/kmsg or a disk under a GPU's name never."""
    from gpuhost import simulated

    host = simulated.setup(tmp_path / "sim", 2)
    change(host.root)
    with pytest.raises(SimulatedHostError, match=said):
        simulated.load(host.root)


def _replace(root: Path, make: Any) -> None:
    """A GPU's node made anew by ``make``."""
    (root / "dev" / "nvidia1").unlink()
    make(root / "dev" / "nvidia1")
