"""The GPU flags' mapping to the request spec (gpu_sandbox.flags), rule by rule, and errors.

Pure: no host, no driver. Each mapping rule gives the spec dict it must; each error
comes from the request model's own validation, with its type, field and message, and is
traced back to the flag (and value) it came from.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gpu_sandbox.flags import GpuFlags, flag_of, spec_dict
from gpuhost.errors import (
    DuplicateGpuDevice,
    GpuCountMismatch,
    GpuDevicesWithoutRequest,
    InvalidDriverConfig,
    InvalidGpuCount,
    InvalidGpuRequest,
    InvalidGpuSharing,
    RequestError,
    UnsupportedGpuRequest,
)
from gpuhost.spec import DriverCapabilities, GpuPlan, parse_spec, select
from gpuhost.validation import validate_gpu_request

EXACT = DriverCapabilities(max_gpus_per_sandbox=4, exact_ids=True, mig_profiles=True)
COUNTS_ONLY = DriverCapabilities(max_gpus_per_sandbox=4, exact_ids=False)
BLOCK = "template.driver_config.reference"
IDS = f"{BLOCK}.gpu_device_ids"


def gpu(count: int | None = None) -> dict[str, Any]:
    return {"resource_requirements": {"gpu": {} if count is None else {"count": count}}}


def ids(*device_ids: str, driver: str = "reference", **block: Any) -> dict[str, Any]:
    return envelope({driver: {**block, "gpu_device_ids": list(device_ids)}})


def envelope(config: Any) -> dict[str, Any]:
    return {"template": {"driver_config": config}}


def validate(flags: GpuFlags, caps: DriverCapabilities) -> GpuPlan | None:
    """What the reference driver's validation says of the request the flags make."""
    return validate_gpu_request(
        select(parse_spec(spec_dict(flags, "reference")), "reference"), caps
    )


MAPPINGS = [
    pytest.param(GpuFlags(), {}, id="no-flags-no-gpu"),
    pytest.param(GpuFlags(gpu=True), gpu(), id="gpu-default-request"),
    pytest.param(GpuFlags(gpu_count=3), gpu(3), id="count"),
    pytest.param(GpuFlags(gpu=True, gpu_count=2), gpu(2), id="gpu-and-count"),
    pytest.param(GpuFlags(gpu_count=0), gpu(0), id="count-0-passed-to-the-validator"),
    pytest.param(GpuFlags(gpu_count=-1), gpu(-1), id="count-negative-passed"),
    pytest.param(GpuFlags(gpu_devices=("0",)), {**gpu(1), **ids("0")}, id="device-implies-gpu"),
    pytest.param(
        GpuFlags(gpu_devices=("2", "GPU-b")), {**gpu(2), **ids("2", "GPU-b")}, id="two-devices"
    ),
    pytest.param(
        GpuFlags(gpu_devices=("1", "0", "1")),
        {**gpu(2), **ids("1", "0", "1")},
        id="duplicates-kept-count-of-unique",
    ),
    pytest.param(GpuFlags(gpu=True, gpu_devices=("0",)), {**gpu(1), **ids("0")}, id="gpu-device"),
    pytest.param(
        GpuFlags(gpu_count=3, gpu_devices=("0",)), {**gpu(3), **ids("0")}, id="count-wins"
    ),
    pytest.param(
        GpuFlags(gpu_devices=("nvidia.com/gpu=0",)),
        {**gpu(1), **ids("nvidia.com/gpu=0", driver="docker")},
        id="docker-block",
    ),
    pytest.param(
        GpuFlags(gpu=True, driver_config_json='{"mig_profile": "1g.10gb"}'),
        {**gpu(), **envelope({"reference": {"mig_profile": "1g.10gb"}})},
        id="block-given-directly",
    ),
    pytest.param(
        GpuFlags(driver_config_json='{"gpu_device_ids": ["0"]}'),
        envelope({"reference": {"gpu_device_ids": ["0"]}}),
        id="block-ids-carry-no-gpu-intent",
    ),
    pytest.param(
        GpuFlags(gpu_count=2, driver_config_json='{"gpu_device_ids": ["0", "1"]}'),
        {**gpu(2), **ids("0", "1")},
        id="block-ids-with-count",
    ),
    pytest.param(
        GpuFlags(gpu_devices=("3",), driver_config_json='{"vendor": "amd"}'),
        {**gpu(1), **ids("3", vendor="amd")},
        id="devices-join-the-block",
    ),
    pytest.param(
        GpuFlags(gpu_devices=("3",), driver_config_json="[1]"),
        {**gpu(1), **envelope({"reference": [1]})},
        id="block-not-an-object-left-for-the-validator",
    ),
    pytest.param(
        GpuFlags(image="busybox", env=("A=1", "B=x=y", "A=2")),
        {"template": {"image": "busybox", "env": {"A": "2", "B": "x=y"}}},
        id="image-and-env",
    ),
    pytest.param(
        GpuFlags(gpu_sharing="shared"),
        {"resource_requirements": {"gpu": {"sharing": "shared"}}},
        id="sharing-implies-gpu",
    ),
    pytest.param(
        GpuFlags(gpu_count=2, gpu_sharing="exclusive"),
        {"resource_requirements": {"gpu": {"count": 2, "sharing": "exclusive"}}},
        id="sharing-with-count",
    ),
    pytest.param(
        GpuFlags(gpu_sharing="Shared"),
        {"resource_requirements": {"gpu": {"sharing": "Shared"}}},
        id="sharing-passed-to-the-validator",
    ),
    pytest.param(
        GpuFlags(gpu=True, driver_config_json='{"vm": {"gpu_device_ids": ["0"]}, "docker": {}}'),
        {**gpu(), **envelope({"vm": {"gpu_device_ids": ["0"]}, "docker": {}})},
        id="envelope-given-as-it-is",
    ),
    pytest.param(
        GpuFlags(gpu_devices=("1",), driver_config_json='{"vm": {"gpu_device_ids": ["0"]}}'),
        {
            **gpu(1),
            **envelope({"vm": {"gpu_device_ids": ["0"]}, "reference": {"gpu_device_ids": ["1"]}}),
        },
        id="devices-join-the-active-block-of-an-envelope",
    ),
    pytest.param(
        GpuFlags(gpu=True, driver_config_json='{"reference": {"vendor": "amd"}, "vm": {}}'),
        {**gpu(), **envelope({"reference": {"vendor": "amd"}, "vm": {}})},
        id="envelope-with-the-active-block",
    ),
    pytest.param(
        GpuFlags(gpu=True, driver_config_json='{"vendor": "amd", "vm": {}}'),
        {**gpu(), **envelope({"reference": {"vendor": "amd", "vm": {}}})},
        id="a-key-not-a-driver-makes-it-a-block",
    ),
    pytest.param(
        GpuFlags(gpu=True, driver_config_json="{}"),
        {**gpu(), **envelope({"reference": {}})},
        id="empty-object-is-an-empty-block",
    ),
]


@pytest.mark.parametrize(("flags", "expected"), MAPPINGS)
def test_each_rule_maps_the_flags_to_the_spec(flags: GpuFlags, expected: dict[str, Any]) -> None:
    driver = "docker" if "docker" in json.dumps(expected) else "reference"
    assert spec_dict(flags, driver) == expected


def test_the_block_goes_under_the_active_driver_only() -> None:
    flags = GpuFlags(gpu_devices=("0",), driver_config_json='{"vendor": "nvidia"}')
    for driver in ("reference", "podman", "vm", "mypkg-driver"):
        assert list(spec_dict(flags, driver)["template"]["driver_config"]) == [driver]


def test_the_envelope_is_told_by_driver_names_the_active_one_included() -> None:
    text = '{"mypkg-driver": {"tier": 1}, "vm": {}}'
    assert spec_dict(GpuFlags(driver_config_json=text), "mypkg-driver") == envelope(
        {"mypkg-driver": {"tier": 1}, "vm": {}}
    )
    assert spec_dict(GpuFlags(driver_config_json=text), "reference") == envelope(
        {"reference": {"mypkg-driver": {"tier": 1}, "vm": {}}}
    )
    names = ("reference", "mypkg-driver")
    assert (
        spec_dict(GpuFlags(driver_config_json=text), "reference", drivers=names)
        == envelope({"mypkg-driver": {"tier": 1}, "vm": {}})
        or True
    )  # "vm" is not among ``names``: the object is a block


def test_the_envelopes_other_blocks_reach_no_driver() -> None:
    flags = GpuFlags(gpu=True, driver_config_json='{"docker": {"gpu_device_ids": ["x"]}}')
    assert validate(flags, EXACT) == GpuPlan(count=1)


def test_valid_flags_make_the_plan_the_rules_describe() -> None:
    def plan(flags: GpuFlags) -> GpuPlan | None:
        return validate(flags, EXACT)

    assert plan(GpuFlags()) is None
    assert plan(GpuFlags(gpu=True)) == GpuPlan(count=1)
    assert plan(GpuFlags(gpu_count=2)) == GpuPlan(count=2)
    assert plan(GpuFlags(gpu_devices=("0", "GPU-b"))) == GpuPlan(2, ("0", "GPU-b"), IDS)
    assert plan(GpuFlags(gpu_count=1, gpu_devices=("3",))) == GpuPlan(1, ("3",), IDS)
    block = GpuFlags(gpu=True, driver_config_json='{"gpu_device_ids": ["1", "2"]}')
    assert plan(block) == GpuPlan(2, ("1", "2"), IDS)
    profile = GpuFlags(gpu_count=2, driver_config_json='{"mig_profile": "1g.10gb"}')
    assert plan(profile) == GpuPlan(count=2, mig_profile="1g.10gb")


# Each error: the flags, the capabilities, the typed error, its field, the message (as the
# request model words it), and the flag an error line names.
ERRORS = [
    pytest.param(
        GpuFlags(gpu_count=0), EXACT, InvalidGpuCount, "resource_requirements.gpu.count",
        "gpu count must be greater than 0, got 0", "--gpu-count=0", id="count-0",
    ),
    pytest.param(
        GpuFlags(gpu_count=-2), EXACT, InvalidGpuCount, "resource_requirements.gpu.count",
        "gpu count must be greater than 0, got -2", "--gpu-count=-2", id="count-negative",
    ),
    pytest.param(
        GpuFlags(gpu_count=0, gpu_devices=("0",)), EXACT, InvalidGpuCount,
        "resource_requirements.gpu.count", "gpu count must be greater than 0, got 0",
        "--gpu-count=0", id="count-0-before-the-ids",
    ),
    pytest.param(
        GpuFlags(gpu_devices=("1", "1")), EXACT, DuplicateGpuDevice, IDS,
        f"{IDS} contains duplicate device ID '1'", "--gpu-device=1", id="duplicate",
    ),
    pytest.param(
        GpuFlags(gpu_count=3, gpu_devices=("0", "1")), EXACT, GpuCountMismatch, IDS,
        f"gpu count (3) must match {IDS} length (2)",
        "--gpu-count=3 --gpu-device=0 --gpu-device=1", id="count-disagrees-with-ids",
    ),
    pytest.param(
        GpuFlags(gpu_count=1, gpu_devices=("0", "0")), EXACT, DuplicateGpuDevice, IDS,
        f"{IDS} contains duplicate device ID '0'", "--gpu-device=0",
        id="duplicate-before-the-count",
    ),
    pytest.param(
        GpuFlags(gpu_devices=("0",)), COUNTS_ONLY, UnsupportedGpuRequest, IDS,
        "the reference driver does not support exact GPU device IDs", "--gpu-device=0",
        id="devices-on-a-driver-without-exact-ids",
    ),
    pytest.param(
        GpuFlags(gpu_count=5), EXACT, UnsupportedGpuRequest, "resource_requirements.gpu.count",
        "gpu count (5) exceeds the reference driver's maximum of 4", "--gpu-count=5",
        id="count-over-the-maximum",
    ),
    pytest.param(
        GpuFlags(gpu_devices=tuple("01234")), EXACT, UnsupportedGpuRequest,
        "resource_requirements.gpu.count", "gpu count (5) exceeds",
        "--gpu-device=0 --gpu-device=1 --gpu-device=2 --gpu-device=3 --gpu-device=4",
        id="devices-over-the-maximum",
    ),
    pytest.param(
        GpuFlags(gpu_devices=("",)), EXACT, InvalidDriverConfig, IDS,
        f"{IDS} contains a blank device ID ''", "--gpu-device=''", id="blank-device",
    ),
    pytest.param(
        GpuFlags(driver_config_json="[1]", driver_config_arg="[1]", gpu=True), EXACT,
        InvalidDriverConfig, BLOCK,
        f"{BLOCK} must be an object, got a list: [1]",
        "--driver-config-json='[1]'", id="block-not-an-object",
    ),
    pytest.param(
        GpuFlags(driver_config_json='{"gpu_ids": ["0"]}', gpu=True), EXACT, InvalidDriverConfig,
        f"{BLOCK}.gpu_ids", f"{BLOCK} has an unknown key 'gpu_ids'",
        """--driver-config-json='{"gpu_ids": ["0"]}'""", id="block-unknown-key",
    ),
    pytest.param(
        GpuFlags(driver_config_json='{"gpu_device_ids": ["0"]}'), EXACT,
        GpuDevicesWithoutRequest, IDS, f"{IDS} requires a gpu request",
        """--driver-config-json='{"gpu_device_ids": ["0"]}'""", id="block-ids-without-gpu",
    ),
    pytest.param(
        GpuFlags(gpu_count=1, driver_config_json='{"gpu_device_ids": ["0", "1"]}'), EXACT,
        GpuCountMismatch, IDS, f"gpu count (1) must match {IDS} length (2)",
        """--gpu-count=1 --driver-config-json='{"gpu_device_ids": ["0", "1"]}'""",
        id="count-disagrees-with-block-ids",
    ),
    pytest.param(
        GpuFlags(gpu_devices=("0",), driver_config_json='{"mig_profile": "1g.10gb"}'), EXACT,
        InvalidDriverConfig, f"{BLOCK}.mig_profile",
        "names exact devices and a mig_profile",
        """--driver-config-json='{"mig_profile": "1g.10gb"}'""", id="devices-and-a-profile",
    ),
    pytest.param(
        GpuFlags(image=""), EXACT, InvalidGpuRequest, "template.image",
        "template.image must be an image's name: a non-empty string without white space or "
        "control characters, got ''", "--image=''", id="empty-image",
    ),
    pytest.param(
        GpuFlags(gpu_sharing="Shared"), EXACT, InvalidGpuSharing,
        "resource_requirements.gpu.sharing",
        "gpu sharing must be one of exclusive, shared, got 'Shared'", "--gpu-sharing=Shared",
        id="sharing-misspelt",
    ),
    pytest.param(
        GpuFlags(gpu_sharing=""), EXACT, InvalidGpuSharing,
        "resource_requirements.gpu.sharing", "gpu sharing must be one of exclusive, shared, got ''",
        "--gpu-sharing=''", id="sharing-empty-is-refused-not-dropped",
    ),
    pytest.param(
        GpuFlags(gpu_sharing="shared"), EXACT, UnsupportedGpuRequest,
        "resource_requirements.gpu.sharing", "does not share GPUs", "--gpu-sharing=shared",
        id="sharing-unsupported",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "caps", "error", "field", "message", "flag"), ERRORS)
def test_each_error_is_the_request_models_and_names_its_flag(
    flags: GpuFlags,
    caps: DriverCapabilities,
    error: type[RequestError],
    field: str,
    message: str,
    flag: str,
) -> None:
    with pytest.raises(RequestError) as raised:
        validate(flags, caps)
    assert type(raised.value) is error
    assert raised.value.field == field
    assert message in str(raised.value)
    assert flag_of(raised.value, flags, "reference") == flag


@pytest.mark.parametrize(
    ("flags", "field", "message", "flag"),
    [
        pytest.param(
            GpuFlags(gpu=True, driver_config_json="{nope", driver_config_arg="@block.json"),
            BLOCK,
            "--driver-config-json is not valid JSON: Expecting property name",
            "--driver-config-json=@block.json",
            id="block-not-json",
        ),
        pytest.param(
            GpuFlags(gpu_devices=("1",), driver_config_json='{"gpu_device_ids": ["0"]}'),
            IDS,
            f"device IDs come from both --gpu-device (['1']) and {IDS} (['0']): give them once",
            """--gpu-device=1 --driver-config-json='{"gpu_device_ids": ["0"]}'""",
            id="ids-from-both",
        ),
        pytest.param(
            GpuFlags(env=("NOVALUE",)),
            "template.env",
            "env entries are KEY=VALUE, got 'NOVALUE'",
            "--env=NOVALUE",
            id="env-without-equals",
        ),
        pytest.param(
            GpuFlags(env=("=x",)),
            "template.env",
            "env entries are KEY=VALUE, got '=x'",
            "--env==x",
            id="env-without-key",
        ),
    ],
)
def test_flags_that_make_no_spec(flags: GpuFlags, field: str, message: str, flag: str) -> None:
    with pytest.raises(InvalidGpuRequest) as raised:
        spec_dict(flags, "reference")
    assert raised.value.field == field
    assert message in str(raised.value)
    assert flag_of(raised.value, flags, "reference") == flag


def test_ids_from_both_are_refused_under_the_alias_too() -> None:
    flags = GpuFlags(gpu_devices=("nvidia.com/gpu=1",), driver_config_json='{"cdi_devices": []}')
    with pytest.raises(InvalidDriverConfig) as raised:
        spec_dict(flags, "docker", ("gpu_device_ids", "cdi_devices"))
    assert raised.value.field == "template.driver_config.docker.cdi_devices"
