"""Bad requests: each fails with its typed error, naming the value, and takes nothing."""

from __future__ import annotations

import contextlib
import re

import pytest

from conformance.bad_requests import (
    CONFIG_ERRORS,
    COUNT,
    COUNT_ERRORS,
    ID_ERRORS,
    OTHER_DRIVERS,
    BadRequest,
    envelope,
    gpu_request,
)
from conformance.fixtures import SandboxFactory
from conformance.observe import assert_all_gpus_grantable
from drivers.base import Driver
from gpuhost.errors import DriverError, GpusExhausted, RequestError, UnsupportedGpuRequest
from gpuhost.spec import DEVICE_IDS_KEY, parse_spec


def _check_rejected(driver: Driver, sandboxes: SandboxFactory, case: BadRequest) -> None:
    """The request fails as it must, leaving no sandbox and no lease in the host registry.

    That every GPU is still grantable through the driver (a lease kept anywhere, even in
    state of its own, would show) is checked once for all the cases of a requirement.
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
    with pytest.raises(expected) as raised:
        sandboxes(parse_spec(request))
    if expected is case.error:
        value = case.value(driver)
        assert value in str(raised.value), f"the message does not name {value!r}: {raised.value}"
    if isinstance(raised.value, RequestError):
        assert raised.value.field == field, f"the error names {raised.value.field!r}, not {field!r}"
    assert driver.sandboxes(driver.session_id) == before, "a sandbox was left behind"
    assert driver.host.leases.leases() == leases_before, f"the rejected {request} left a lease"


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
def test_other_drivers_blocks_are_never_read(driver: Driver, sandboxes: SandboxFactory) -> None:
    """Blocks for other drivers alone MUST be served as the plain request of its count."""
    # The gateway hands a driver its own block only: what the others hold, in this driver's
    # own ID forms, must change nothing. Each envelope below trips a driver that reads them:
    # a GPU another sandbox holds (busy), two GPUs for a count of one (a mismatch), keys and
    # values this driver refuses in its own block.
    inventory = driver.inventory()
    held = (
        sandboxes(parse_spec({"resource_requirements": gpu_request()}))
        if len(inventory) >= 2
        else None
    )
    taken = {gpu.uuid for gpu in held.gpus} if held is not None else set()
    named = [gpu for gpu in inventory if gpu.uuid in taken] or inventory[:1]
    free = [gpu for gpu in inventory if gpu.uuid not in taken]
    envelopes = {
        "naming a GPU another sandbox holds": {DEVICE_IDS_KEY: [driver.device_ids(named[0])[0]]},
        "naming two GPUs for a count of one": {
            DEVICE_IDS_KEY: [driver.device_ids(gpu)[0] for gpu in free[:2]]
        },
        "malformed for any driver": {
            "gpu_device_idz": [1],
            "vendor": "nvida",
            "mig_profile": "",
            DEVICE_IDS_KEY: "0",
        },
    }
    for what, block in envelopes.items():
        config = {name: block for name in OTHER_DRIVERS if name != driver.name}
        config["another-driver"] = block
        request = {"resource_requirements": gpu_request(1), **envelope(config)}
        try:
            sandbox = sandboxes(parse_spec(request))
        except DriverError as exc:
            pytest.fail(f"blocks for other drivers only, {what}, were read: {exc!r} ({config})")
        with sandbox:
            assert len(sandbox.gpus) == 1, f"{what}: a count of one got {len(sandbox.gpus)} GPUs"
            assert not taken & {gpu.uuid for gpu in sandbox.gpus}, (
                f"{what}: it got the GPU another sandbox holds"
            )


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


@pytest.mark.requirement("GPU-EXHAUST-02")
def test_more_gpus_than_exist_says_how_many_exist(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A request for more GPUs than exist MUST fail with an error saying how many exist."""
    total = len(driver.inventory())
    with pytest.raises((UnsupportedGpuRequest, GpusExhausted)) as raised:
        sandboxes(parse_spec({"resource_requirements": gpu_request(total + 1)}))
    assert re.search(rf"\b{total}\b", str(raised.value)), (
        f"the host has {total} GPUs; the error does not say so: {raised.value}"
    )
    assert_all_gpus_grantable(driver, after=f"asking for {total + 1} GPUs")
