"""conformance/forms.py: the forms of a device's name, and near misses that are never IDs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conformance import bad_requests, forms
from drivers.base import Driver
from drivers.reference import ReferenceDriver
from gpuhost import simulated
from gpuhost.devices import normalize_pci_bus_id, pci_spellings
from gpuhost.host import GpuHost, HostConfig
from tests.catalogue import DRI_LAYOUT, MIG_LAYOUT


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Driver]:
    root = tmp_path_factory.mktemp("forms") / "sim"
    host = simulated.setup(root, 8, mig=MIG_LAYOUT, dri=DRI_LAYOUT)
    yield ReferenceDriver(GpuHost.open(HostConfig(sim_root=host.root)), "forms")
    simulated.teardown(host.root)


def test_every_id_the_reference_lists_has_a_form_of_its_own(reference: Driver) -> None:
    devices = reference.host.devices
    found = {forms.form_of(device, i) for device in devices for i in reference.device_ids(device)}
    assert found == set(forms.FORMS) - {"DRI node"}


def test_a_representative_of_each_kind(reference: Driver) -> None:
    found = forms.representatives(reference)
    assert list(found) == list(forms.DEVICES)
    assert found[forms.DEVICES[0]] == reference.inventory()[1]  # not only the first GPU
    assert found[forms.DEVICES[2]].pci_bus_id == "0000:c3:00.0"  # an address with letters


@pytest.mark.parametrize("transform", forms.TRANSFORMS)
def test_no_near_miss_is_an_id_and_each_transform_makes_some(
    reference: Driver, transform: str
) -> None:
    index = reference.device_index()
    made = [
        spelling
        for device in forms.representatives(reference).values()
        for spelling, _, _ in forms.near_misses(reference, device, transform)
    ]
    assert made, f"{transform} makes no near miss on the gate's host layout"
    assert not set(made) & set(index)
    listed = {i.lower() for i in index if forms.is_pci_address(i)}
    assert not [spelling for spelling in made if spelling.lower() in listed]


def test_a_uuid_is_abbreviated_as_cuda_visible_devices_does(reference: Driver) -> None:
    gpu = reference.inventory()[1]
    made = {s for s, _, _ in forms.near_misses(reference, gpu, "a prefix: the UUID's first group")}
    assert gpu.uuid[: len("GPU-") + 8] in made
    shortest = forms.shortest_unique_prefix(gpu.uuid, list(reference.device_index()))
    assert shortest is not None
    assert [i for i in reference.device_index() if i.startswith(shortest)] == [gpu.uuid]


def test_the_shortest_unique_prefix() -> None:
    known = ["GPU-abc", "GPU-abd", "MIG-a", "12", "1"]
    assert forms.shortest_unique_prefix("GPU-abc", known) is None  # shares all but its last
    assert forms.shortest_unique_prefix("MIG-a", known) == "M"
    assert forms.shortest_unique_prefix("12", known) is None  # "1" is an ID of its own


def test_other_kinds_leave_out_the_hosts_own(reference: Driver) -> None:
    gpu = reference.inventory()[0]
    kinds = [f"a CDI name of another kind: {kind}" for kind in forms.OTHER_KINDS]
    made = [s for kind in kinds for s, _, _ in forms.near_misses(reference, gpu, kind)]
    assert f"amd.com/gpu={gpu.index}" in made
    assert f"nvidia.com/gpu={gpu.uuid}" in made
    assert not [spelling for spelling in made if spelling.startswith(f"{gpu.cdi_kind}=")]


def test_a_profile_near_miss_is_never_one_the_host_has() -> None:
    have = ["1g.10gb", "1g.20gb", "2g.10gb", "2g.20gb"]
    spelled = {t: forms.profile_near_miss("1g.10gb", have, t) for t in forms.PROFILE_TRANSFORMS}
    assert spelled["another memory size"] == "1g.40gb"
    assert spelled["another slice count"] == "3g.10gb"
    assert spelled["the slice alone"] == "1g"
    assert not set(spelled.values()) & set(have)
    assert forms.profile_near_miss("not-a-profile", have, "upper case") is None


def test_a_pci_address_in_either_case() -> None:
    assert forms.pci_case("0000:c3:00.0", "upper case") == "0000:C3:00.0"
    assert forms.pci_case("0000:C3:00.0", "lower case") == "0000:c3:00.0"
    assert forms.is_pci_address("0000:C3:00.0")
    assert not forms.is_pci_address("PCI-0000:c3:00.0")
    assert not forms.is_pci_address(" 0000:c3:00.0")


def test_the_host_layer_spells_a_pci_address_both_ways_and_nothing_else() -> None:
    assert pci_spellings("0000:c3:00.0") == ("0000:c3:00.0", "0000:C3:00.0")
    assert pci_spellings("0000:00:02.0") == ("0000:00:02.0",)
    assert pci_spellings("GPU-abc") == ("GPU-abc",)
    assert pci_spellings("0000:c3:00.0\n") == ("0000:c3:00.0\n",)


def _made(reference: Driver, kind: str, transform: str) -> set[str]:
    device = forms.representatives(reference)[kind]
    return {spelling for spelling, _, _ in forms.near_misses(reference, device, transform)}


def test_an_index_in_every_spelling_int_reads(reference: Driver) -> None:
    gpu = forms.representatives(reference)[forms.DEVICES[0]]
    n, cdi = str(gpu.index), gpu.cdi_names[0]
    made = set().union(
        *(_made(reference, forms.DEVICES[0], f"an index as int() reads it: {how}")
          for how in forms.INDEX_SPELLINGS)
    )  # fmt: skip
    expected = {f"0{n}", f"+{n}", f" {n}", f"\t{n}", f"{n}\n", f"0_{n}", chr(0xFF10 + int(n))}
    assert expected <= made
    assert all(int(spelling) == gpu.index for spelling in expected)
    assert f"{cdi[: -len(n)]}0{n}" in made  # a CDI name's index too


def test_a_pci_address_in_every_other_form(reference: Driver) -> None:
    made = set().union(
        *(_made(reference, forms.DEVICES[2], f"a PCI address in another form: {how}")
          for how in forms.PCI_FORMS)
    )  # fmt: skip
    for spelled in ("00000000:c3:00.0", "00000000:C3:00.0", "c3:00.0", "C3:00.0"):
        assert spelled in made
    assert {normalize_pci_bus_id(spelling) for spelling in made} == {"0000:c3:00.0"}


def test_a_uuid_spelled_otherwise(reference: Driver) -> None:
    gpu = forms.representatives(reference)[forms.DEVICES[0]]
    bare = gpu.uuid.removeprefix("GPU-")
    spelled = [f"a UUID spelled otherwise: {how}" for how in forms.UUID_SPELLINGS]
    made = [_made(reference, forms.DEVICES[0], transform) for transform in spelled]
    assert {bare, f"{gpu.cdi_kind}={bare}"} <= made[0]
    assert bare.replace("-", "") in made[1]
    assert f"MIG-{bare}" in made[2]


def test_a_profile_as_other_tools_spell_it() -> None:
    have = ["1g.10gb"]
    spelled = {t: forms.profile_near_miss("1g.10gb", have, t) for t in forms.PROFILE_TRANSFORMS}
    assert spelled["NVML's name"] == "MIG 1g.10gb"
    assert spelled["the k8s resource"] == "nvidia.com/mig-1g.10gb"
    assert spelled["the k8s resource's name"] == "mig-1g.10gb"
    assert spelled["white space before"] == " 1g.10gb"


def test_a_sharing_near_miss_is_neither_mode() -> None:
    spelled = {
        bad_requests.sharing_near_miss(mode, how)
        for mode in bad_requests.SHARING_MODES
        for how in bad_requests.SHARING_NEAR_MISSES
    }
    assert {" shared", "exclusive\n", "EXCLUSIVE", "Shared", "excl"} <= spelled
    assert not spelled & set(bad_requests.SHARING_MODES)


def test_names_near_the_drivers_own_are_never_its_own() -> None:
    names = {bad_requests.block_name(whose, "reference") for whose in bad_requests.NEAR_NAMES}
    assert names == {"Reference", "REFERENCE", "reference-v2", " reference"}
    assert bad_requests.block_name("docker", "reference") == "docker"
