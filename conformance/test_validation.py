"""Bad requests: each fails with its typed error, naming the value, and takes nothing.

Device IDs are tried in every form a name of a device can take and every near miss of each
(conformance/forms.py): an ID is a spelling the driver lists (a PCI address in either letter
case), and nothing else names a device.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from conformance.bad_requests import (
    CONFIG_ERRORS,
    COUNT,
    COUNT_ERRORS,
    EVERY_OTHER,
    ID_ERRORS,
    IDS_PREFIX,
    OTHER_BLOCKS,
    SHARING_MODES,
    SHARING_NEAR_MISSES,
    BadRequest,
    block_name,
    envelope,
    gpu_request,
    unknown,
)
from conformance.dimensions import declared
from conformance.fixtures import Dropped, SandboxFactory
from conformance.forms import (
    DEVICES,
    FORMS,
    INDEX_SPELLINGS,
    OF_THE_DEVICE,
    PCI_CASES,
    PCI_FORMS,
    PROFILE_TRANSFORMS,
    TRANSFORMS,
    UUID_SPELLINGS,
    is_pci_address,
    near_misses,
    pci_case,
    profile_near_miss,
    representatives,
)
from conformance.observe import assert_all_gpus_grantable, uuids
from drivers.base import Driver
from gpuhost.devices import GpuDevice
from gpuhost.errors import DriverError, RequestError, UnsupportedGpuRequest
from gpuhost.spec import DEVICE_IDS_KEY, MIG_PROFILE_KEY, SandboxSpec, parse_spec

MIG = "with --sim-mig=0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb"
COUNTS = ("none: the default request", "1")
"""The counts of a request whose only blocks are other drivers': a driver that sizes a default
request from another's block gets two GPUs for it."""
ENVELOPES = ("naming a GPU another sandbox holds", "naming two GPUs", "malformed for any driver")
"""What other drivers' blocks hold, in this driver's own ID forms: a driver that reads them
gets the held GPU (or GpuBusy), two GPUs (or a mismatch), or refuses keys and values."""
DIMENSIONS = {
    "GPU-VALIDATE-01": declared(
        bad_block=tuple(CONFIG_ERRORS),
        whose_blocks=OTHER_BLOCKS,
        count=COUNTS,
        other_blocks_hold=ENVELOPES,
        then=("every GPU grantable",),
    ),
    "GPU-VALIDATE-02": declared(
        bad_count=tuple(COUNT_ERRORS),
        sharing_near_miss=SHARING_NEAR_MISSES,
        sharing_mode=SHARING_MODES,
        then=("every GPU grantable",),
    ),
    "GPU-VALIDATE-03": declared(
        bad_ids=tuple(ID_ERRORS),
        near_miss=tuple(TRANSFORMS),
        index_as_int_reads_it=INDEX_SPELLINGS,
        pci_address_as=PCI_FORMS,
        uuid_spelled=UUID_SPELLINGS,
        form=FORMS,
        device=DEVICES,
        pci_address_case=PCI_CASES,
        then=("every GPU grantable",),
    ),
    "MIG-PROFILE-01": declared(profile_the_host_lacks=PROFILE_TRANSFORMS),
}


def _check_rejected(
    driver: Driver, sandboxes: SandboxFactory, case: BadRequest, what: str = ""
) -> DriverError:
    """The request fails as it must, leaving no sandbox and no lease in the host registry.

    That every GPU is still grantable through the driver (a lease kept anywhere, even in
    state of its own, would show) is checked once for all the cases of a requirement.
    ``what`` says, in a failure, which case of a loop this was.
    """
    __tracebackhide__ = True
    before = driver.sandboxes(driver.session_id)
    leases_before = driver.host.leases.leases()
    expected = case.error
    field = case.field(driver) if callable(case.field) else case.field.format(driver=driver.name)
    if case.needs_exact_ids and not driver.capabilities.exact_ids:
        expected = UnsupportedGpuRequest
    elif case.needs_two_per_sandbox and driver.capabilities.max_gpus_per_sandbox < 2:
        # Two GPUs in one sandbox: the driver's maximum refuses the count first.
        expected, field = UnsupportedGpuRequest, COUNT
    request = case.build(driver)
    said = f"{what}: " if what else f"{request}: "
    try:
        made = sandboxes(parse_spec(request))
    except DriverError as exc:
        raised = exc
    else:
        pytest.fail(f"{said}served, with {uuids(made)}; it must fail with {_names(expected)}")
    assert isinstance(raised, expected), f"{said}expected {_names(expected)}, got {raised!r}"
    if expected is case.error:
        value = case.value(driver)
        assert value in str(raised), f"{said}the message does not name {value!r}: {raised}"
    if isinstance(raised, RequestError):
        assert raised.field == field, f"{said}the error names {raised.field!r}, not {field!r}"
    assert driver.sandboxes(driver.session_id) == before, f"{said}a sandbox was left behind"
    left = driver.host.leases.leases() != leases_before
    assert not left, f"{said}the refusal left a lease"
    return raised


def _names(errors: type[DriverError] | tuple[type[DriverError], ...]) -> str:
    return " or ".join(
        error.__name__ for error in (errors if isinstance(errors, tuple) else (errors,))
    )


def _all_rejected_then_every_gpu_free(
    driver: Driver, sandboxes: SandboxFactory, requirement: str, cases: dict[str, BadRequest]
) -> None:
    __tracebackhide__ = True
    for name, case in cases.items():
        with contextlib.suppress(DriverError):
            sandboxes(parse_spec(case.build(driver)))
        assert not sandboxes.open, f"the bad request {name!r} made a sandbox"
    assert_all_gpus_grantable(driver, after=f"the bad requests of {requirement}")


@pytest.mark.requirement("GPU-VALIDATE-01")
def test_bad_driver_configs_leave_every_gpu_grantable(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """Malformed driver_configs, one after the other, MUST leave every GPU grantable."""
    _all_rejected_then_every_gpu_free(driver, sandboxes, "GPU-VALIDATE-01", CONFIG_ERRORS)


@pytest.mark.requirement("GPU-VALIDATE-01")
def test_other_drivers_blocks_are_never_read(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped
) -> None:
    """Blocks for other drivers alone MUST be served as the plain request of its count."""
    # The gateway hands a driver its own block only: what the others hold, in this driver's
    # own ID forms, must change nothing. Each envelope trips a driver that reads them.
    inventory = driver.inventory()
    held = (
        sandboxes(parse_spec({"resource_requirements": gpu_request()}))
        if len(inventory) >= 2
        else None
    )
    taken = {gpu.uuid for gpu in held.gpus} if held is not None else set()
    named = [gpu for gpu in inventory if gpu.uuid in taken]
    free = [gpu for gpu in inventory if gpu.uuid not in taken]
    # Two GPUs: two free ones, or on a host of one GPU, that one in two of its forms.
    two = [driver.device_ids(gpu)[0] for gpu in free[:2]]
    if len(two) < 2:
        ids = driver.device_ids(free[0])
        two = [ids[0], ids[-1]]
    envelopes: dict[str, dict[str, Any]] = {
        ENVELOPES[1]: {DEVICE_IDS_KEY: two},
        ENVELOPES[2]: {
            "gpu_device_idz": [1],
            "vendor": "nvida",
            "mig_profile": "",
            DEVICE_IDS_KEY: "0",
        },
    }
    if named:
        envelopes[ENVELOPES[0]] = {DEVICE_IDS_KEY: [driver.device_ids(named[0])[0]]}
    else:
        dropped(f"other drivers' blocks {ENVELOPES[0]}", "one GPU: none is left to hold")
    others = [name for name in OTHER_BLOCKS if name not in (driver.name, EVERY_OTHER)]

    def config(whose: str, block: dict[str, Any]) -> dict[str, Any]:
        names = others if whose == EVERY_OTHER else [whose]
        return {block_name(name, driver.name): block for name in names}

    # Each other driver's block alone, with no count: the one a reading driver sizes from.
    tries = [(whose, COUNTS[0], ENVELOPES[1]) for whose in others]
    # All of them at once, with and without a count, holding each envelope.
    tries += [(EVERY_OTHER, count, what) for count in COUNTS for what in envelopes]
    for whose, count, what in tries:
        blocks = config(whose, envelopes[what])
        request = {
            "resource_requirements": gpu_request(None if count == COUNTS[0] else 1),
            **envelope(blocks),
        }
        case = f"the blocks of {whose}, {what}, count {count}"
        try:
            sandbox = sandboxes(parse_spec(request))
        except DriverError as exc:
            pytest.fail(f"{case}, were read: {exc!r} ({blocks})")
        with sandbox:
            assert len(sandbox.gpus) == 1, f"{case}: it got {len(sandbox.gpus)} GPUs, not one"
            assert not taken & set(uuids(sandbox)), f"{case}: it got the GPU another holds"


@pytest.mark.requirement("GPU-VALIDATE-02")
def test_bad_counts_leave_every_gpu_grantable(driver: Driver, sandboxes: SandboxFactory) -> None:
    """Bad GPU counts, one after the other, MUST leave every GPU grantable."""
    _all_rejected_then_every_gpu_free(driver, sandboxes, "GPU-VALIDATE-02", COUNT_ERRORS)


@pytest.mark.requirement("GPU-VALIDATE-03")
def test_bad_device_ids_leave_every_gpu_grantable(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """Inconsistent or unknown device IDs, one after the other, MUST leave every GPU grantable."""
    _all_rejected_then_every_gpu_free(driver, sandboxes, "GPU-VALIDATE-03", ID_ERRORS)


@pytest.mark.requirement("GPU-VALIDATE-01")
@pytest.mark.parametrize("case", CONFIG_ERRORS.values(), ids=CONFIG_ERRORS.keys())
def test_malformed_driver_config_is_rejected(
    driver: Driver, sandboxes: SandboxFactory, case: BadRequest
) -> None:
    """A malformed driver_config MUST fail with InvalidDriverConfig naming the value."""
    _check_rejected(driver, sandboxes, case)


@pytest.mark.requirement("GPU-VALIDATE-02")
@pytest.mark.parametrize("case", COUNT_ERRORS.values(), ids=COUNT_ERRORS.keys())
def test_invalid_gpu_count_is_rejected(
    driver: Driver, sandboxes: SandboxFactory, case: BadRequest
) -> None:
    """A GPU count that is not a positive integer MUST fail with a typed error naming it."""
    _check_rejected(driver, sandboxes, case)


@pytest.mark.requirement("GPU-VALIDATE-03")
@pytest.mark.parametrize("case", ID_ERRORS.values(), ids=ID_ERRORS.keys())
def test_inconsistent_device_ids_are_rejected(
    driver: Driver, sandboxes: SandboxFactory, case: BadRequest
) -> None:
    """Inconsistent or unknown device IDs MUST fail with the typed error naming the value."""
    _check_rejected(driver, sandboxes, case)


@pytest.mark.requirement("GPU-VALIDATE-03")
@pytest.mark.parametrize("kind", DEVICES)
def test_near_misses_of_every_form_name_no_device(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped, kind: str
) -> None:
    """No near miss of an ID, in any form, of any device MUST name a device: UnknownGpuDevice."""
    device = representatives(driver).get(kind)
    if device is None:
        if driver.capabilities.exact_ids:
            dropped(f"near misses of the names of {kind}", "this host has none")
        return
    for transform in TRANSFORMS:
        for spelling, form, source in near_misses(driver, device, transform):
            of = (
                f"{kind}, {source}" if transform in OF_THE_DEVICE else f"{kind}'s {form} {source!r}"
            )
            what = f"{spelling!r}, {transform} of {of}"
            raised = _check_rejected(driver, sandboxes, unknown(spelling), what)
            if isinstance(raised, RequestError) and driver.capabilities.exact_ids:
                assert raised.value == spelling, f"{what}: the error's value is {raised.value!r}"


def _named_by_a_pci_address(driver: Driver) -> tuple[GpuDevice, str] | None:
    """A device the driver names by a PCI address with letters, a representative first."""
    for device in (*representatives(driver).values(), *driver.exact_devices()):
        for device_id in driver.device_ids(device):
            if is_pci_address(device_id) and device_id.lower() != device_id.upper():
                return device, device_id
    return None


@pytest.mark.requirement("GPU-VALIDATE-03")
@pytest.mark.parametrize("case", PCI_CASES)
def test_a_pci_address_names_its_device_in_either_letter_case(
    driver: Driver, sandboxes: SandboxFactory, dropped: Dropped, case: str
) -> None:
    """A PCI address the driver lists MUST name its device in lower and in upper case."""
    named = _named_by_a_pci_address(driver)
    if named is None:
        if driver.capabilities.exact_ids:
            dropped(f"a PCI address in {case}", "the driver names no device here by one")
        else:
            with pytest.raises(UnsupportedGpuRequest):
                sandboxes(_exact(driver, pci_case(driver.inventory()[0].pci_bus_id, case)))
        return
    device, listed = named
    spelled = pci_case(listed, case)
    try:
        sandbox = sandboxes(_exact(driver, spelled))
    except DriverError as exc:
        pytest.fail(f"{spelled!r}, {listed!r} in {case}, names {device.describe()}: {exc!r}")
    with sandbox:
        assert uuids(sandbox) == [device.uuid], (
            f"{spelled!r} names {device.describe()}; the sandbox got {uuids(sandbox)}"
        )


def _exact(driver: Driver, *device_ids: str) -> SandboxSpec:
    return SandboxSpec.with_gpus(driver=driver.name, device_ids=list(device_ids))


@pytest.mark.requirement("MIG-PROFILE-01")
def test_a_near_miss_of_a_profile_is_a_profile_the_host_lacks(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A MIG profile that looks like one of the host's MUST fail as one the host lacks."""
    have = sorted({mig.profile for mig in driver.host.mig_devices})
    if not have:
        pytest.skip(f"needs MIG instances (the host has none; a simulated host gets some {MIG})")
    for profile in have:
        for transform in PROFILE_TRANSFORMS:
            spelled = profile_near_miss(profile, have, transform)
            if spelled is None:
                continue
            what = f"{spelled!r}, {transform} of the host's {profile}"
            refused = _check_rejected(driver, sandboxes, _profile(spelled), what)
            assert isinstance(refused, RequestError), what
            assert refused.value == spelled, f"{what}: the error's value is {refused.value!r}"


def _profile(profile: str) -> BadRequest:
    """``profile`` as the MIG profile of a count of one, which no instance of the host has."""
    return BadRequest(
        lambda d: {
            "resource_requirements": gpu_request(),
            **envelope({d.name: {MIG_PROFILE_KEY: profile}}),
        },
        UnsupportedGpuRequest,
        lambda d: profile,
        field=f"{IDS_PREFIX}.{MIG_PROFILE_KEY}",
    )
