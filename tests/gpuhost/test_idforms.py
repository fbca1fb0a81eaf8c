"""The one table of ID forms: what each form writes for each kind of device, and its words."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from drivers.reference import ReferenceDriver
from drivers.vm import VmDriver
from gpuhost import simulated
from gpuhost.devices import GpuDevice
from gpuhost.host import GpuHost, HostConfig
from gpuhost.idforms import FORM_TEXT, ID_FORMS, check_forms, forms_text, ids_of
from gpuhost.simulated import parse_dri_layout, parse_mig_layout
from gpuhost.spec import DriverCapabilities

ROOT = Path(__file__).resolve().parents[2]
NATIVE_NAMES = {
    "drivers/container/driver.py": "ContainerDriver",  # the engine's CDI spec names a GPU
    "drivers/kubernetes/driver.py": "KubernetesDriver",  # a pod names none
    "drivers/external/adapter.py": "ExternalDriver",  # a driver's own list, when it gives one
}
"""The drivers whose IDs are truly native: the only ones that write ``device_ids``."""


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuHost]:
    root = tmp_path_factory.mktemp("idforms") / "sim"
    simulated.setup(root, 2, mig=parse_mig_layout("1:2x3g.40gb"), dri=parse_dri_layout("amd:1"))
    yield GpuHost.open(HostConfig(root))
    simulated.teardown(root)


def _one(host: GpuHost, vendor: str, mig: bool) -> GpuDevice:
    return next(gpu for gpu in host.devices if gpu.vendor == vendor and gpu.is_mig == mig)


def test_each_form_names_the_devices_it_can_and_no_other(host: GpuHost) -> None:
    whole, instance, amd = (
        _one(host, "nvidia", False),
        _one(host, "nvidia", True),
        _one(host, "amd", False),
    )
    dri = amd.dri_paths
    assert dri, "the simulated AMD GPU has DRI nodes"
    expected: dict[str, dict[GpuDevice, tuple[str, ...]]] = {
        "index": {whole: (str(whole.index),), instance: (), amd: ()},
        "uuid": {whole: (whole.uuid,), instance: (instance.uuid,), amd: (amd.uuid,)},
        "cdi": {whole: whole.cdi_names, instance: instance.cdi_names, amd: ()},
        "pci": {whole: (whole.pci_bus_id,), instance: (), amd: (amd.pci_bus_id,)},
        "dri": {whole: (), instance: (), amd: dri},
    }
    assert set(expected) == set(ID_FORMS) == set(FORM_TEXT)
    for form, by_device in expected.items():
        for gpu, ids in by_device.items():
            assert ids_of(gpu, [form]) == ids, f"{form} of {gpu.describe()}"


def test_the_declared_order_is_the_order_written_each_id_once(host: GpuHost) -> None:
    whole = _one(host, "nvidia", False)
    assert ids_of(whole, ["uuid", "index"]) == (whole.uuid, str(whole.index))
    assert ids_of(whole, ["index", "uuid"])[0] == str(whole.index)
    assert ids_of(whole, ["uuid", "cdi"]).count(whole.uuid) == 1


@pytest.mark.parametrize("forms", [["serial"], ["uuid", "uuid"], ["UUID"]])
def test_a_form_outside_the_table_is_refused(forms: list[str]) -> None:
    with pytest.raises(ValueError, match="each must be one of"):
        DriverCapabilities(max_gpus_per_sandbox=1, exact_ids=True, id_forms=tuple(forms))
    with pytest.raises(ValueError, match="each must be one of"):
        check_forms(forms)


def test_other_vendors_gpus_take_the_forms_declared_for_them(host: GpuHost) -> None:
    caps = DriverCapabilities(
        max_gpus_per_sandbox=1, exact_ids=True, id_forms=("index",), other_vendor_id_forms=("pci",)
    )
    amd, whole = _one(host, "amd", False), _one(host, "nvidia", False)
    assert (caps.id_forms_of(amd), caps.id_forms_of(whole)) == (("pci",), ("index",))
    assert caps.exact_id_forms == f"{FORM_TEXT['index']}; for AMD and Intel GPUs {FORM_TEXT['pci']}"


def test_the_words_derive_from_the_declaration() -> None:
    caps = DriverCapabilities(max_gpus_per_sandbox=1, exact_ids=True, id_forms=("pci", "uuid"))
    assert caps.exact_id_forms == f"{FORM_TEXT['pci']} or {FORM_TEXT['uuid']}"
    assert forms_text(()) == "none"
    three = forms_text(("uuid", "pci", "dri"))
    assert three == f"{FORM_TEXT['uuid']}, {FORM_TEXT['pci']} or {FORM_TEXT['dri']}"


@pytest.mark.parametrize("driver_class", [ReferenceDriver, VmDriver], ids=["reference", "vm"])
def test_a_driver_says_each_form_it_takes_and_takes_each_form_it_says(
    host: GpuHost, driver_class: type[ReferenceDriver] | type[VmDriver]
) -> None:
    driver = driver_class(host, "idforms")
    caps = driver.capabilities
    assert caps.id_forms
    for form in {*caps.id_forms, *(caps.other_vendor_id_forms or ())}:
        assert FORM_TEXT[form] in caps.exact_id_forms
    for gpu in driver.exact_devices():
        assert driver.device_ids(gpu) == ids_of(gpu, caps.id_forms_of(gpu))
        assert driver.device_ids(gpu), f"{gpu.describe()} has no ID the {driver.name} takes"


def test_only_drivers_with_native_names_write_their_own_device_ids() -> None:
    writers = {}
    for path in sorted((ROOT / "drivers").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.FunctionDef) and item.name == "device_ids"
                for item in node.body
            ):
                writers[str(path.relative_to(ROOT))] = node.name
    writers.pop("drivers/base.py")  # the contract's own: the table, in the declared forms
    assert writers == NATIVE_NAMES
