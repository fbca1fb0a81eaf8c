"""Reading CDI specs: names matched to GPUs by their device nodes, never by the name."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuhost import cdi, simulated
from gpuhost.devices import DeviceNode, GpuDevice
from gpuhost.leases import Holder

DATA = Path(__file__).parents[1] / "data" / "cdi"
T4_SPEC = DATA / "cdi-spec.nvidia-ctk.T4-g4dn.xlarge.570.133.20.yaml"
T4_UUID = "GPU-6cf00fa7-59ac-16f2-3e83-d24ccdc56f84"


def _real_gpu(index: int, uuid: str) -> GpuDevice:
    node = DeviceNode(f"/dev/nvidia{index}", 195, index)
    return GpuDevice(
        index, uuid, "Tesla T4", f"00000000:{index:02X}:1E.0", minor=index, nodes=(node,)
    )


def test_a_recorded_nvidia_ctk_spec_names_its_gpu_by_index_and_uuid(tmp_path: Path) -> None:
    shutil.copy(T4_SPEC, tmp_path / "nvidia.yaml")
    registry = cdi.load([tmp_path])
    assert registry.problems == ()
    gpu = _real_gpu(0, T4_UUID)
    assert registry.names_of(gpu) == ("nvidia.com/gpu=0", f"nvidia.com/gpu={T4_UUID}")
    assert cdi.all_devices() in registry.devices  # known, but never one GPU's own name
    assert registry.missing([gpu, _real_gpu(1, "GPU-other")]) == [_real_gpu(1, "GPU-other")]


def test_control_nodes_are_not_gpus(tmp_path: Path) -> None:
    spec = yaml.safe_load(T4_SPEC.read_text())
    spec["devices"][0]["containerEdits"]["deviceNodes"].append(
        {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}
    )
    (tmp_path / "nvidia.yaml").write_text(yaml.safe_dump(spec))
    assert cdi.load([tmp_path]).devices["nvidia.com/gpu=0"] == {("gpu", 0)}


def test_another_simulated_hosts_spec_does_not_name_our_gpus(tmp_path: Path) -> None:
    """Equal minors are not enough: the nodes must be this host's own."""
    registered = tmp_path / "cdi"
    ours = simulated.setup(tmp_path / "ours", 2)
    theirs = simulated.setup(tmp_path / "theirs", 2, cdi_dir=registered)
    # Even read under our kind: the names are another host's.
    spec = yaml.safe_load(theirs.cdi_spec.read_text())
    (registered / "theirs-as-ours.yaml").write_text(yaml.safe_dump({**spec, "kind": ours.cdi_kind}))
    registry = cdi.load([registered], ours.cdi_kind)
    assert [registry.names_of(gpu) for gpu in ours.gpus] == [(), ()]
    assert registry.missing(ours.gpus) == list(ours.gpus)
    assert cdi.load([registered], theirs.cdi_kind).names_of(theirs.gpus[1])[0] == (
        f"{theirs.cdi_kind}=1"
    )


def test_simulated_hosts_registered_at_once_keep_their_names_apart(tmp_path: Path) -> None:
    """Each host has a kind of its own: both resolve "=0" to their own GPU 0 (concurrent runs)."""
    registered = tmp_path / "cdi"
    first = simulated.setup(tmp_path / "first", 2, cdi_dir=registered)
    second = simulated.setup(tmp_path / "second", 2, cdi_dir=registered)
    assert first.cdi_kind != second.cdi_kind
    for host in (first, second):
        registry = cdi.load([registered], host.cdi_kind)
        assert registry.problems == ()
        assert registry.devices[f"{host.cdi_kind}=0"] == {("gpu", host.gpus[0].minor)}
        assert registry.missing(host.gpus) == []


def test_a_later_directory_overrides_and_unreadable_specs_are_reported(tmp_path: Path) -> None:
    first, second = tmp_path / "etc", tmp_path / "run"
    first.mkdir()
    second.mkdir()
    shutil.copy(T4_SPEC, first / "nvidia.yaml")
    spec = yaml.safe_load(T4_SPEC.read_text())
    spec["devices"][0]["containerEdits"]["deviceNodes"] = [{"path": "/dev/nvidia3"}]
    (second / "nvidia.yaml").write_text(yaml.safe_dump(spec))
    (second / "broken.json").write_text("{not json")
    (second / "other.yaml").write_text(yaml.safe_dump({"kind": "example.com/fpga", "devices": []}))
    registry = cdi.load([first, second, tmp_path / "absent"])
    assert registry.devices["nvidia.com/gpu=0"] == {("gpu", 3)}
    assert len(registry.problems) == 1
    assert "broken.json" in registry.problems[0]


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ("kind: nvidia.com/gpu\n", "kind: line 194, column 1: the key 'kind' is given twice"),
        ("x: &a [1]\ny: *a\n", "x: line 1, column 4: an anchor '&a': anchors and aliases"),
        ("z: !!python/name:os.system ''\n", "z: line 1, column 4: the tag"),
    ],
    ids=["key-twice", "alias", "tag"],
)
def test_a_spec_is_read_strictly(tmp_path: Path, edit: str, said: str) -> None:
    """A second ``kind:`` would win in silence, an alias expand: the spec is refused, named."""
    (tmp_path / "nvidia.yaml").write_text(edit + T4_SPEC.read_text())
    registry = cdi.load([tmp_path])
    assert registry.devices == {}
    assert len(registry.problems) == 1
    assert registry.problems[0].startswith(f"{tmp_path / 'nvidia.yaml'}: {said}")


def test_teardown_unregisters_only_its_own_spec(tmp_path: Path) -> None:
    registered = tmp_path / "cdi"
    first = simulated.setup(tmp_path / "first", 1, cdi_dir=registered)
    second = simulated.setup(tmp_path / "second", 1, cdi_dir=registered)
    simulated.teardown(first.root)
    assert [cdi.load([registered], second.cdi_kind).names_of(g) for g in second.gpus] != [()]
    assert len(list(registered.iterdir())) == 1
    simulated.teardown(second.root)
    assert list(registered.iterdir()) == []


def test_setup_prunes_registrations_of_hosts_that_are_gone(tmp_path: Path) -> None:
    registered = tmp_path / "cdi"
    crashed = simulated.setup(tmp_path / "crashed", 1, cdi_dir=registered)
    shutil.rmtree(crashed.root)  # a run killed before its teardown
    alive = simulated.setup(tmp_path / "alive", 1, cdi_dir=registered)
    assert [p.read_text() for p in registered.iterdir()] == [alive.cdi_spec.read_text()]


def test_setup_removes_registered_hosts_whose_owner_is_gone(tmp_path: Path) -> None:
    """A host left by a killed run, still on disk (a test's kept tmp dir): owner gone, removed."""
    registered = tmp_path / "cdi"
    ended = subprocess.Popen(["sleep", "30"])
    crashed = simulated.setup(tmp_path / "crashed", 1, registered, owner=Holder.process(ended.pid))
    ended.kill()
    ended.wait()
    alive = simulated.setup(tmp_path / "alive", 1, registered, owner=Holder.process(os.getpid()))
    assert not crashed.root.exists()
    assert [p.read_text() for p in registered.iterdir()] == [alive.cdi_spec.read_text()]


def test_a_mig_instance_is_named_apart_from_its_gpu(tmp_path: Path) -> None:
    """``<gpu>:<instance>`` and the instance's UUID inject it; the GPU's own names do not."""
    sim = simulated.setup(
        tmp_path / "sim", 2, cdi_dir=tmp_path / "cdi", mig=simulated.parse_mig_layout("0:2x3g.40gb")
    )
    registry = cdi.load([tmp_path / "cdi"], sim.cdi_kind)
    gpu = sim.gpus[0]
    first, second = sim.mig_devices
    assert registry.names_of(first) == (f"{sim.cdi_kind}=0:0", f"{sim.cdi_kind}={first.uuid}")
    assert registry.names_of(second) == (f"{sim.cdi_kind}=0:1", f"{sim.cdi_kind}={second.uuid}")
    assert registry.names_of(gpu) == (f"{sim.cdi_kind}=0", f"{sim.cdi_kind}={gpu.uuid}")
    assert registry.missing([*sim.gpus, *sim.mig_devices]) == []
    keys = registry.devices[f"{sim.cdi_kind}=0:1"]
    assert keys == {("gpu", gpu.minor), *(("cap", n.minor) for n in second.nodes[1:])}
