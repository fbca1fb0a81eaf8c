"""The request model: ``parse_spec``, the gateway's ``select`` and ``validate_gpu_request``.

Every bad request must fail with its exact error type, name the field, and show the
offending value in its message. When a spec breaks two rules at once, the documented order
decides which error wins: malformed block, then count, then capability, then ID consistency.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuhost import cdi, simulated
from gpuhost.errors import (
    DuplicateGpuDevice,
    GpuCountMismatch,
    GpuDevicesWithoutRequest,
    InvalidDriverConfig,
    InvalidGpuCount,
    InvalidGpuRequest,
    InvalidGpuSharing,
    UnsupportedGpuRequest,
    shown,
)
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import (
    DEFAULT_GPU_COUNT,
    DriverCapabilities,
    DriverRequest,
    GpuPlan,
    GpuRequest,
    SandboxSpec,
    parse_spec,
    select,
)
from gpuhost.validation import validate_gpu_request

EXACT = DriverCapabilities(max_gpus_per_sandbox=8, exact_ids=True)
"""The reference driver's shape: up to 8 GPUs, exact IDs accepted."""
COUNT_ONLY = DriverCapabilities(max_gpus_per_sandbox=8, exact_ids=False)
"""A kubernetes-like driver: a count only, no exact device IDs."""

COUNT = "resource_requirements.gpu.count"
REF = "template.driver_config.reference"
REF_IDS = f"{REF}.gpu_device_ids"
PODMAN_IDS = "template.driver_config.podman.gpu_device_ids"
PODMAN_CDI = "template.driver_config.podman.cdi_devices"
KUBE_IDS = "template.driver_config.kubernetes.gpu_device_ids"
UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"

EVERYTHING = DriverCapabilities(
    max_gpus_per_sandbox=8, exact_ids=True, shared=True, mig_profiles=True,
    vendors=("nvidia", "amd", "intel"),
)  # fmt: skip
"""A driver that shares GPUs and hands out MIG instances and other vendors' GPUs."""
SHARING_OFF = DriverCapabilities(max_gpus_per_sandbox=8, exact_ids=True, shared=False)
SHARING = "resource_requirements.gpu.sharing"

_DEFAULT = object()
"""``gpu()`` without a count: the default request ``{"gpu": {}}``."""


def gpu(count: object = _DEFAULT) -> dict[str, Any]:
    """``resource_requirements`` asking for ``count`` GPUs (the default request if omitted)."""
    return {"gpu": {} if count is _DEFAULT else {"count": count}}


def request(
    count: object = _DEFAULT,
    *,
    ids: object = None,
    driver: str = "reference",
    key: str = "gpu_device_ids",
    with_gpu: bool = True,
) -> dict[str, Any]:
    """A spec dict: a GPU request, plus ``ids`` under ``template.driver_config.<driver>.<key>``."""
    spec: dict[str, Any] = {}
    if with_gpu:
        spec["resource_requirements"] = gpu(count)
    if ids is not None:
        spec["template"] = {"driver_config": {driver: {key: ids}}}
    return spec


ENV, IMAGE = "template.env", "template.image"


def tpl(**template: object) -> dict[str, Any]:
    """A request with only a template of ``template``."""
    return {"template": template}


def nested(depth: int) -> list[Any]:
    """A list ``depth`` lists deep."""
    value: list[Any] = []
    for _ in range(depth - 1):
        value = [value]
    return value


def sharing(mode: object) -> dict[str, Any]:
    return {"resource_requirements": {"gpu": {"sharing": mode}}}


def block(**keys: object) -> dict[str, Any]:
    """A default GPU request with ``keys`` in the reference driver's block."""
    return {"resource_requirements": gpu(), "template": {"driver_config": {"reference": keys}}}


def declared(driver: str, caps: DriverCapabilities) -> DriverCapabilities:
    """``caps`` with the aliases the built-in docker and podman drivers declare."""
    if driver in ("docker", "podman"):
        return dataclasses.replace(caps, device_id_aliases=("cdi_devices",))
    return caps


def validate(
    data: Mapping[str, Any] | str, driver: str, caps: DriverCapabilities
) -> GpuPlan | None:
    return validate_spec(parse_spec(data), driver, caps)


def validate_spec(spec: SandboxSpec, driver: str, caps: DriverCapabilities) -> GpuPlan | None:
    """What a driver's own validation says of what the gateway hands it."""
    return validate_gpu_request(select(spec, driver), declared(driver, caps))


# -- bad input ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Bad:
    """A spec, the driver it is validated for, and exactly how it must be refused."""

    id: str
    data: Any
    error: type[Exception]
    field: str
    shown: str
    """A substring the message must contain: the offending value, as the user wrote it."""
    driver: str = "reference"
    caps: DriverCapabilities = EXACT
    stage: str = "validate"
    """``parse``: ``parse_spec`` refuses it; ``validate``: it parses and the validator refuses."""


BAD: list[Bad] = [
    # -- the count (kept raw by parse_spec, checked by the validator) ---------------------
    Bad("count-zero", request(0), InvalidGpuCount, COUNT, "got 0"),
    Bad("count-negative", request(-1), InvalidGpuCount, COUNT, "got -1"),
    Bad("count-fraction", request(2.5), InvalidGpuCount, COUNT, "got 2.5"),
    Bad("count-whole-float", request(2.0), InvalidGpuCount, COUNT, "got 2.0"),
    Bad("count-word", request("two"), InvalidGpuCount, COUNT, "'two'"),
    Bad("count-numeric-string", request("2"), InvalidGpuCount, COUNT, "'2'"),
    Bad("count-true", request(True), InvalidGpuCount, COUNT, "True"),
    Bad("count-false", request(False), InvalidGpuCount, COUNT, "False"),
    Bad("count-list", request([1]), InvalidGpuCount, COUNT, "[1]"),
    Bad("count-huge", request(10**6), UnsupportedGpuRequest, COUNT, "1000000"),
    Bad("count-over-max", request(9), UnsupportedGpuRequest, COUNT, "(9)"),
    Bad("count-zero-podman", request(0), InvalidGpuCount, COUNT, "got 0", driver="podman"),
    Bad(
        "count-word-count-only",
        request("two"),
        InvalidGpuCount,
        COUNT,
        "'two'",
        driver="kubernetes",
        caps=COUNT_ONLY,
    ),
    Bad(
        "count-huge-count-only",
        request(10**6),
        UnsupportedGpuRequest,
        COUNT,
        "1000000",
        driver="kubernetes",
        caps=COUNT_ONLY,
    ),
    # -- exact IDs: consistency -----------------------------------------------------------
    Bad(
        "duplicate-id",
        request(2, ids=[UUID_A, UUID_A]),
        DuplicateGpuDevice,
        REF_IDS,
        f"'{UUID_A}'",
    ),
    Bad(
        "duplicate-id-no-count",
        request(ids=["0", "1", "0"]),
        DuplicateGpuDevice,
        REF_IDS,
        "'0'",
    ),
    Bad(
        "duplicate-id-podman-alias",
        request(2, ids=[UUID_B, UUID_B], driver="podman", key="cdi_devices"),
        DuplicateGpuDevice,
        PODMAN_CDI,
        f"'{UUID_B}'",
        driver="podman",
    ),
    Bad(
        "count-id-mismatch",
        request(3, ids=[UUID_A, UUID_B]),
        GpuCountMismatch,
        REF_IDS,
        "gpu count (3)",
    ),
    Bad(
        "count-id-mismatch-podman",
        request(1, ids=["0", "1"], driver="podman"),
        GpuCountMismatch,
        PODMAN_IDS,
        "length (2)",
        driver="podman",
    ),
    Bad(
        "ids-without-gpu-request",
        request(ids=[UUID_A], with_gpu=False),
        GpuDevicesWithoutRequest,
        REF_IDS,
        UUID_A,
    ),
    Bad(
        "ids-with-null-gpu-request",
        {
            "resource_requirements": {"gpu": None},
            "template": {"driver_config": {"reference": {"gpu_device_ids": ["0"]}}},
        },
        GpuDevicesWithoutRequest,
        REF_IDS,
        "['0']",
    ),
    Bad(
        "ids-over-max",
        request(ids=[str(i) for i in range(9)]),
        UnsupportedGpuRequest,
        REF_IDS,
        "names 9 GPUs",
    ),
    # -- exact IDs: capability ------------------------------------------------------------
    Bad(
        "exact-ids-unsupported",
        request(1, ids=["0"], driver="kubernetes"),
        UnsupportedGpuRequest,
        KUBE_IDS,
        "['0']",
        driver="kubernetes",
        caps=COUNT_ONLY,
    ),
    # -- the active driver's block --------------------------------------------------------
    Bad(
        "unknown-key-in-block",
        {
            "resource_requirements": gpu(),
            "template": {"driver_config": {"reference": {"gpu_device_idz": ["0"]}}},
        },
        InvalidDriverConfig,
        "template.driver_config.reference.gpu_device_idz",
        "'gpu_device_idz'",
    ),
    Bad(
        "unknown-key-in-podman-block",
        {
            "resource_requirements": gpu(),
            "template": {"driver_config": {"podman": {"devices": ["0"]}}},
        },
        InvalidDriverConfig,
        "template.driver_config.podman.devices",
        "'devices'",
        driver="podman",
    ),
    Bad(
        "cdi-devices-on-reference",
        request(ids=["0"], key="cdi_devices"),
        InvalidDriverConfig,
        "template.driver_config.reference.cdi_devices",
        "'cdi_devices'",
    ),
    Bad(
        "both-keys-podman",
        {
            "resource_requirements": gpu(),
            "template": {
                "driver_config": {"podman": {"gpu_device_ids": ["0"], "cdi_devices": ["0"]}}
            },
        },
        InvalidDriverConfig,
        "template.driver_config.podman",
        "gpu_device_ids and cdi_devices",
        driver="podman",
    ),
    Bad("ids-not-a-list", request(ids=UUID_A), InvalidDriverConfig, REF_IDS, f"'{UUID_A}'"),
    Bad("ids-an-object", request(ids={"0": 1}), InvalidDriverConfig, REF_IDS, "{'0': 1}"),
    Bad("empty-list", request(ids=[]), InvalidDriverConfig, REF_IDS, "[]"),
    Bad(
        "empty-list-podman-alias",
        request(ids=[], driver="podman", key="cdi_devices"),
        InvalidDriverConfig,
        PODMAN_CDI,
        "[]",
        driver="podman",
    ),
    Bad("blank-entry", request(ids=["0", "  "]), InvalidDriverConfig, REF_IDS, "'  '"),
    Bad("empty-string-entry", request(ids=[""]), InvalidDriverConfig, REF_IDS, "''"),
    Bad("non-string-entry", request(ids=[7]), InvalidDriverConfig, REF_IDS, "got 7"),
    Bad("null-entry", request(ids=["0", None]), InvalidDriverConfig, REF_IDS, "None"),
    # -- the envelope (parse_spec) --------------------------------------------------------
    Bad(
        "envelope-not-object",
        {"resource_requirements": gpu(), "template": {"driver_config": "podman"}},
        InvalidDriverConfig,
        "template.driver_config",
        "'podman'",
        stage="parse",
    ),
    Bad(
        "envelope-a-list",
        {"resource_requirements": gpu(), "template": {"driver_config": [{"reference": {}}]}},
        InvalidDriverConfig,
        "template.driver_config",
        "[{'reference': {}}]",
        stage="parse",
    ),
    Bad(
        "block-not-object",
        {"resource_requirements": gpu(), "template": {"driver_config": {"reference": ["x"]}}},
        InvalidDriverConfig,
        REF,
        "['x']",
        stage="parse",
    ),
    Bad(
        "other-block-not-object",
        {
            "resource_requirements": gpu(),
            "template": {"driver_config": {"reference": {}, "docker": "x"}},
        },
        InvalidDriverConfig,
        "template.driver_config.docker",
        "'x'",
        stage="parse",
    ),
    Bad(
        "block-null",
        {"resource_requirements": gpu(), "template": {"driver_config": {"reference": None}}},
        InvalidDriverConfig,
        REF,
        "None",
        stage="parse",
    ),
    # -- the spec itself (parse_spec) -----------------------------------------------------
    Bad("spec-a-list", [1, 2], InvalidGpuRequest, "spec", "[1, 2]", stage="parse"),
    Bad("spec-a-number", 3, InvalidGpuRequest, "spec", "3", stage="parse"),
    Bad("spec-json-a-list", "[1, 2]", InvalidGpuRequest, "spec", "[1, 2]", stage="parse"),
    Bad("spec-invalid-json", "{nope", InvalidGpuRequest, "spec", "not valid JSON", stage="parse"),
    Bad(
        "spec-unknown-key",
        {"resource_requirements": gpu(), "gpus": 2},
        InvalidGpuRequest,
        "spec.gpus",
        "'gpus'",
        stage="parse",
    ),
    Bad("env-not-a-map", tpl(env=["A=1"]), InvalidGpuRequest, ENV, "['A=1']", stage="parse"),
    Bad("env-int-value", tpl(env={"A": 1}), InvalidGpuRequest, f"{ENV}.A", "got 1", stage="parse"),
    Bad("env-null", tpl(env=None), InvalidGpuRequest, ENV, "None", stage="parse"),
    Bad(
        "env-nul-in-value",
        tpl(env={"A": "a\x00b"}),
        InvalidGpuRequest,
        f"{ENV}.A",
        "got 'a\\x00b'",
        stage="parse",
    ),
    Bad(
        "env-lone-surrogate-value",
        tpl(env={"A": "\ud800"}),
        InvalidGpuRequest,
        f"{ENV}.A",
        "got '\\ud800'",
        stage="parse",
    ),
    Bad(
        "env-nul-in-name",
        tpl(env={"A\x00": "1"}),
        InvalidGpuRequest,
        ENV,
        "'A\\x00'",
        stage="parse",
    ),
    Bad("image-blank", tpl(image=" "), InvalidGpuRequest, IMAGE, "' '", stage="parse"),
    Bad("image-not-string", tpl(image=5), InvalidGpuRequest, IMAGE, "5", stage="parse"),
    Bad("image-nul", tpl(image="a\x00b"), InvalidGpuRequest, IMAGE, "'a\\x00b'", stage="parse"),
    Bad(
        "image-padded",
        tpl(image=" busybox\n"),
        InvalidGpuRequest,
        IMAGE,
        "' busybox\\n'",
        stage="parse",
    ),
    Bad(
        "image-space-inside",
        tpl(image="busy box"),
        InvalidGpuRequest,
        IMAGE,
        "'busy box'",
        stage="parse",
    ),
    # -- what JSON text leaves open: one strict reader ------------------------------------
    Bad(
        "json-duplicate-key",
        '{"resource_requirements": {"gpu": {}}, "template": {"driver_config": '
        '{"reference": {"gpu_device_ids": ["3"]}}, "driver_config": {}}}',
        InvalidGpuRequest,
        "spec",
        "the key 'driver_config' is given twice",
        stage="parse",
    ),
    Bad(
        "json-nan",
        '{"resource_requirements": {"gpu": {"count": NaN}}}',
        InvalidGpuRequest,
        "spec",
        "NaN is not a JSON number",
        stage="parse",
    ),
    Bad(
        "json-minus-infinity",
        '{"template": {"driver_config": {"vm": {"x": -Infinity}}}}',
        InvalidGpuRequest,
        "spec",
        "-Infinity is not a JSON number",
        stage="parse",
    ),
    Bad(
        "json-float-overflow",
        '{"resource_requirements": {"gpu": {"count": 1e400}}}',
        InvalidGpuRequest,
        "spec",
        "the number '1e400' is too large for a float",
        stage="parse",
    ),
    Bad(
        "json-huge-integer",
        '{"resource_requirements": {"gpu": {"count": %s}}}' % ("9" * 5000),
        InvalidGpuRequest,
        "spec",
        "an integer of 5000 digits (at most 4300)",
        stage="parse",
    ),
    Bad(
        "json-deep",
        "[" * 100_000 + "]" * 100_000,
        InvalidGpuRequest,
        "spec",
        "nests deeper than a request may",
        stage="parse",
    ),
    # -- a dict is held to what its JSON text would be -------------------------------------
    Bad(
        "dict-huge-integer",
        request(10**5000),
        InvalidGpuRequest,
        COUNT,
        "an integer of 5001 digits",
        stage="parse",
    ),
    Bad(
        "dict-nan",
        tpl(driver_config={"vm": {"x": float("nan")}}),
        InvalidDriverConfig,
        "template.driver_config.vm.x",
        "nan, which is not a JSON number",
        stage="parse",
    ),
    Bad(
        "dict-set",
        tpl(driver_config={"vm": {"x": [{1}]}}),
        InvalidDriverConfig,
        "template.driver_config.vm.x[0]",
        "set {1}, which is not a JSON value",
        stage="parse",
    ),
    Bad("dict-key-not-a-string", tpl(env={1: "x"}), InvalidGpuRequest, ENV, "key 1", stage="parse"),
    Bad(
        "dict-key-with-a-newline",
        tpl(driver_config={"a\nb": {}}),
        InvalidDriverConfig,
        "template.driver_config",
        "key 'a\\nb'",
        stage="parse",
    ),
    Bad(
        "dict-deep",
        tpl(driver_config={"vm": {"x": nested(40)}}),
        InvalidDriverConfig,
        "template.driver_config.vm.x" + "[0]" * 29,
        "nests deeper than a request may (32 levels)",
        stage="parse",
    ),
    Bad(
        "template-not-object", {"template": []}, InvalidGpuRequest, "template", "[]", stage="parse"
    ),
    Bad(
        "template-unknown-key",
        tpl(labels={"a": "b"}),
        InvalidGpuRequest,
        "template.labels",
        "'labels'",
        stage="parse",
    ),
    # -- shapes before seed 003: refused, saying what replaced them -------------------------
    Bad(
        "top-level-driver-config",
        {"resource_requirements": gpu(), "driver_config": {"reference": {}}},
        InvalidDriverConfig,
        "driver_config",
        "moved to template.driver_config",
        stage="parse",
    ),
    Bad(
        "top-level-image",
        {"image": "busybox"},
        InvalidGpuRequest,
        "image",
        "template.image",
        stage="parse",
    ),
    Bad(
        "top-level-env",
        {"env": {"A": "1"}},
        InvalidGpuRequest,
        "env",
        "template.env",
        stage="parse",
    ),
    Bad(
        "seed-001-gpu-device-ids",
        {"resource_requirements": {"gpu": {"count": 1, "device_ids": ["0"]}}},
        InvalidGpuRequest,
        "resource_requirements.gpu.device_ids",
        "replaced by template.driver_config.<driver>.gpu_device_ids",
        stage="parse",
    ),
    Bad(
        "seed-001-gpu-device-id",
        {"resource_requirements": {"gpu": {"device_id": ["0"]}}},
        InvalidGpuRequest,
        "resource_requirements.gpu.device_id",
        "['0']",
        stage="parse",
    ),
    Bad(
        "seed-001-block-device-ids",
        request(1, ids=["nvidia.com/gpu=0"], driver="docker", key="device_ids"),
        InvalidDriverConfig,
        "template.driver_config.docker.device_ids",
        "replaced by template.driver_config.docker.gpu_device_ids",
        driver="docker",
    ),
    Bad(
        "requirements-not-object",
        {"resource_requirements": 1},
        InvalidGpuRequest,
        "resource_requirements",
        "got an integer: 1",
        stage="parse",
    ),
    Bad(
        "requirements-unknown-key",
        {"resource_requirements": {"gpu": {}, "cpu": 2}},
        InvalidGpuRequest,
        "resource_requirements.cpu",
        "'cpu'",
        stage="parse",
    ),
    Bad(
        "gpu-not-object",
        {"resource_requirements": {"gpu": 2}},
        InvalidGpuRequest,
        "resource_requirements.gpu",
        "got an integer: 2",
        stage="parse",
    ),
    Bad(
        "gpu-unknown-key",
        {"resource_requirements": {"gpu": {"count": 1, "model": "H100"}}},
        InvalidGpuRequest,
        "resource_requirements.gpu.model",
        "'model'",
        stage="parse",
    ),
    # -- sharing, MIG profiles and vendors -------------------------------------------------
    Bad("sharing-unknown", sharing("timesliced"), InvalidGpuSharing, SHARING, "'timesliced'"),
    Bad("sharing-not-text", sharing(True), InvalidGpuSharing, SHARING, "True"),
    Bad(
        "sharing-unsupported",
        sharing("shared"),
        UnsupportedGpuRequest,
        SHARING,
        "'shared'",
        caps=SHARING_OFF,
    ),
    Bad(
        "profile-unsupported",
        block(mig_profile="1g.10gb"),
        UnsupportedGpuRequest,
        "template.driver_config.reference.mig_profile",
        "'1g.10gb'",
        caps=EXACT,
    ),
    Bad(
        "profile-not-text",
        block(mig_profile=7),
        InvalidDriverConfig,
        "template.driver_config.reference.mig_profile",
        "7",
        caps=EVERYTHING,
    ),
    Bad(
        "vendor-unknown",
        block(vendor="matrox"),
        InvalidDriverConfig,
        "template.driver_config.reference.vendor",
        "'matrox'",
        caps=EVERYTHING,
    ),
    Bad(
        "vendor-unsupported",
        block(vendor="amd"),
        UnsupportedGpuRequest,
        "template.driver_config.reference.vendor",
        "'amd'",
        caps=EXACT,
    ),
    Bad(
        "profile-of-an-amd-gpu",
        block(mig_profile="1g.10gb", vendor="amd"),
        InvalidDriverConfig,
        "template.driver_config.reference.vendor",
        "'amd'",
        caps=EVERYTHING,
    ),
    Bad(
        "profile-beside-exact-ids",
        block(mig_profile="1g.10gb", gpu_device_ids=["0"]),
        InvalidDriverConfig,
        "template.driver_config.reference.mig_profile",
        "'1g.10gb'",
        caps=EVERYTHING,
    ),
]


def test_sharing_profile_and_vendor_reach_the_plan() -> None:
    data = {
        "resource_requirements": {"gpu": {"count": 2, "sharing": "shared"}},
        "template": {"driver_config": {"reference": {"mig_profile": "1g.10gb"}}},
    }
    plan = validate(data, "reference", EVERYTHING)
    assert plan == GpuPlan(count=2, sharing="shared", mig_profile="1g.10gb")
    amd = validate(block(vendor="amd"), "reference", EVERYTHING)
    assert amd == GpuPlan(count=1, vendor="amd")
    assert parse_spec(data).to_dict() == data


def _raise(case: Bad) -> InvalidGpuRequest | UnsupportedGpuRequest:
    """Run the case through its stage and return the error it raised."""
    __tracebackhide__ = True
    if case.stage == "parse":
        with pytest.raises(InvalidGpuRequest) as parse_error:
            parse_spec(case.data)
        return parse_error.value
    spec = parse_spec(case.data)
    with pytest.raises((InvalidGpuRequest, UnsupportedGpuRequest)) as raised:
        validate_spec(spec, case.driver, case.caps)
    assert isinstance(raised.value, InvalidGpuRequest | UnsupportedGpuRequest)
    return raised.value


@pytest.mark.parametrize("case", BAD, ids=[case.id for case in BAD])
def test_bad_request_is_refused_with_its_exact_error(case: Bad) -> None:
    error = _raise(case)
    assert type(error) is case.error, f"{type(error).__name__}: {error}"
    assert error.field == case.field
    assert case.shown in str(error)


def test_bad_request_table_ids_are_unique() -> None:
    ids = [case.id for case in BAD]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", BAD, ids=[case.id for case in BAD])
def test_each_message_is_one_short_line_showing_the_value(case: Bad) -> None:
    message = str(_raise(case))
    assert "\n" not in message
    assert len(message) < 600, message
    assert shown(_raise(case).value) in message


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("gpu", "'gpu'"),
        ("a\nb\x00", "'a\\nb\\x00'"),
        ("\ud800", "'\\ud800'"),
        (["0", 1], "['0', 1]"),
        ({"k": (1,)}, "{'k': [1]}"),
        (10**77, str(10**77)),
        (10**78, "an integer of 79 digits"),
        (-(10**5000), "a negative integer of 5001 digits"),
        ("x" * 81, f"'{'x' * 79}… (81 characters)"),
        (["ab"] * 30, f"{str(['ab'] * 30)[:80]}… (30 items)"),
        ({str(i): i for i in range(30)}, f"{str({str(i): i for i in range(30)})[:80]}… (30 keys)"),
    ],
    ids=[
        "string",
        "control-characters",
        "lone-surrogate",
        "list",
        "frozen",
        "78-digits",
        "79-digits",
        "5001-digits",
        "long-string",
        "long-list",
        "long-object",
    ],
)
def test_a_value_is_shown_on_one_line_and_cut(value: object, text: str) -> None:
    assert shown(value) == text


def test_a_value_too_long_to_show_is_never_written_out_whole() -> None:
    assert shown(nested(100_000)) == "[" * 80 + "… (1 item)"
    assert shown(["x" * 10**7]) == "['" + "x" * 78 + "… (1 item)"


@pytest.mark.parametrize(
    ("data", "value"),
    [
        pytest.param(request(2.5), 2.5, id="count"),
        pytest.param(request(ids=[UUID_A], with_gpu=False), [UUID_A], id="ids-without-request"),
        pytest.param(request(2, ids=["0", "0"]), "0", id="duplicate"),
        pytest.param(request(3, ids=["0", "1"]), ["0", "1"], id="mismatch"),
        pytest.param(request(ids=[7]), 7, id="non-string-entry"),
        pytest.param(request(ids=[]), [], id="empty-list"),
    ],
)
def test_error_value_is_the_offending_value(data: dict[str, Any], value: object) -> None:
    with pytest.raises(InvalidGpuRequest) as raised:
        validate(data, "reference", EXACT)
    assert raised.value.value == value


def test_invalid_json_error_keeps_the_text() -> None:
    with pytest.raises(InvalidGpuRequest) as raised:
        parse_spec("{nope")
    assert type(raised.value) is InvalidGpuRequest
    assert raised.value.value == "{nope"


# -- the order of checks ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "active", "error", "field"),
    [
        pytest.param(
            {
                "resource_requirements": gpu(0),
                "template": {"driver_config": {"reference": {"bogus": 1}}},
            },
            "reference",
            InvalidDriverConfig,
            "template.driver_config.reference.bogus",
            id="unknown-key-beats-zero-count",
        ),
        pytest.param(
            request("two", ids=[]),
            "reference",
            InvalidDriverConfig,
            REF_IDS,
            id="empty-list-beats-word-count",
        ),
        pytest.param(
            request(-1, ids=["0", " "]),
            "reference",
            InvalidDriverConfig,
            REF_IDS,
            id="blank-entry-beats-negative-count",
        ),
        pytest.param(
            request(10**6, ids=[1]),
            "reference",
            InvalidDriverConfig,
            REF_IDS,
            id="non-string-entry-beats-huge-count",
        ),
        pytest.param(
            request(10**6, ids=["0"], key="cdi_devices"),
            "reference",
            InvalidDriverConfig,
            "template.driver_config.reference.cdi_devices",
            id="unknown-alias-beats-huge-count",
        ),
        pytest.param(
            request(0, ids=["0"], driver="kubernetes"),
            "kubernetes",
            InvalidGpuCount,
            COUNT,
            id="zero-count-beats-no-exact-ids",
        ),
        pytest.param(
            request(True, ids=["0"], driver="kubernetes"),
            "kubernetes",
            InvalidGpuCount,
            COUNT,
            id="boolean-count-beats-no-exact-ids",
        ),
        pytest.param(
            request(10**6, ids=["0", "0"], driver="kubernetes"),
            "kubernetes",
            UnsupportedGpuRequest,
            COUNT,
            id="huge-count-beats-no-exact-ids",
        ),
        pytest.param(
            request(2, ids=["0", "0"], driver="kubernetes"),
            "kubernetes",
            UnsupportedGpuRequest,
            KUBE_IDS,
            id="no-exact-ids-beats-duplicate",
        ),
        pytest.param(
            request(3, ids=["0"], driver="kubernetes"),
            "kubernetes",
            UnsupportedGpuRequest,
            KUBE_IDS,
            id="no-exact-ids-beats-mismatch",
        ),
        pytest.param(
            request(ids=["0"], driver="kubernetes", with_gpu=False),
            "kubernetes",
            UnsupportedGpuRequest,
            KUBE_IDS,
            id="no-exact-ids-beats-ids-without-request",
        ),
        pytest.param(
            request(10**6, ids=["0", "0"]),
            "reference",
            UnsupportedGpuRequest,
            COUNT,
            id="huge-count-beats-duplicate",
        ),
        pytest.param(
            request(9, ids=["0"]),
            "reference",
            UnsupportedGpuRequest,
            COUNT,
            id="count-over-max-beats-mismatch",
        ),
        pytest.param(
            request(ids=["0", "0"], with_gpu=False),
            "reference",
            GpuDevicesWithoutRequest,
            REF_IDS,
            id="ids-without-request-beats-duplicate",
        ),
        pytest.param(
            request(3, ids=["0", "0"]),
            "reference",
            DuplicateGpuDevice,
            REF_IDS,
            id="duplicate-beats-mismatch",
        ),
    ],
)
def test_checks_run_in_the_documented_order(
    data: dict[str, Any], active: str, error: type[Exception], field: str
) -> None:
    """Each spec breaks two rules; the check documented first decides the error."""
    caps = COUNT_ONLY if active == "kubernetes" else EXACT
    with pytest.raises((InvalidGpuRequest, UnsupportedGpuRequest)) as raised:
        validate(data, active, caps)
    assert type(raised.value) is error, f"{type(raised.value).__name__}: {raised.value}"
    assert isinstance(raised.value, InvalidGpuRequest | UnsupportedGpuRequest)
    assert raised.value.field == field


@pytest.mark.parametrize(
    ("data", "field"),
    [
        pytest.param(
            {"resource_requirements": {"gpu": 0}, "template": {"driver_config": {"reference": 5}}},
            REF,
            id="non-object-block-beats-non-object-gpu",
        ),
        pytest.param(
            {"resource_requirements": {"gpu": {"count": 0}}, "template": {"driver_config": "x"}},
            "template.driver_config",
            id="non-object-envelope-beats-bad-count",
        ),
    ],
)
def test_malformed_envelope_is_refused_before_the_count(data: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidDriverConfig) as raised:
        parse_spec(data)
    assert raised.value.field == field


# -- happy paths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param({}, id="empty-spec"),
        pytest.param(tpl(image="busybox", env={"A": "1"}), id="no-requirements"),
        pytest.param({"resource_requirements": {}}, id="empty-requirements"),
        pytest.param({"resource_requirements": {"gpu": None}}, id="null-gpu"),
        pytest.param(
            {"template": {"driver_config": {"reference": {}}}}, id="empty-reference-block"
        ),
        pytest.param("{}", id="json-text"),
    ],
)
@pytest.mark.parametrize(
    ("active", "caps"),
    [("reference", EXACT), ("podman", EXACT), ("kubernetes", COUNT_ONLY)],
)
def test_no_gpu_request_gives_no_plan(
    data: dict[str, Any] | str, active: str, caps: DriverCapabilities
) -> None:
    assert validate(data, active, caps) is None


@pytest.mark.parametrize(
    ("active", "caps"),
    [("reference", EXACT), ("podman", EXACT), ("kubernetes", COUNT_ONLY)],
)
@pytest.mark.parametrize(
    ("data", "count"),
    [
        pytest.param(request(), DEFAULT_GPU_COUNT, id="default"),
        pytest.param(request(None), DEFAULT_GPU_COUNT, id="null-count"),
        pytest.param(request(1), 1, id="one"),
        pytest.param(request(3), 3, id="three"),
        pytest.param(request(8), 8, id="the-maximum"),
    ],
)
def test_count_request_gives_a_count_plan(
    data: dict[str, Any], count: int, active: str, caps: DriverCapabilities
) -> None:
    assert validate(data, active, caps) == GpuPlan(count=count)


def test_default_request_is_one_gpu() -> None:
    plan = validate(request(), "reference", EXACT)
    assert plan == GpuPlan(count=1, device_ids=(), field="resource_requirements.gpu")


@pytest.mark.parametrize(
    ("data", "active", "plan"),
    [
        pytest.param(
            request(ids=[UUID_A]),
            "reference",
            GpuPlan(1, (UUID_A,), REF_IDS),
            id="one-id-no-count",
        ),
        pytest.param(
            request(ids=["1", "0"]),
            "reference",
            GpuPlan(2, ("1", "0"), REF_IDS),
            id="two-ids-no-count-keep-order",
        ),
        pytest.param(
            request(2, ids=[UUID_A, UUID_B]),
            "reference",
            GpuPlan(2, (UUID_A, UUID_B), REF_IDS),
            id="ids-with-matching-count",
        ),
        pytest.param(
            request(ids=[str(i) for i in range(8)]),
            "reference",
            GpuPlan(8, tuple(str(i) for i in range(8)), REF_IDS),
            id="ids-up-to-the-maximum",
        ),
        pytest.param(
            request(1, ids=["nvidia.com/gpu=0"], driver="podman"),
            "podman",
            GpuPlan(1, ("nvidia.com/gpu=0",), PODMAN_IDS),
            id="podman-gpu-device-ids",
        ),
        pytest.param(
            request(ids=["nvidia.com/gpu=all"], driver="podman", key="cdi_devices"),
            "podman",
            GpuPlan(1, ("nvidia.com/gpu=all",), PODMAN_CDI),
            id="podman-cdi-devices-alias",
        ),
        pytest.param(
            {
                "resource_requirements": gpu(1),
                "template": {
                    "driver_config": {
                        "reference": {"gpu_device_ids": [UUID_A]},
                        "docker": {"gpu_device_ids": ["0", "0", "1"], "cdi_devices": []},
                        "kubernetes": {"node_selector": {"gpu": "h100"}},
                        "vm": {},
                    }
                },
            },
            "reference",
            GpuPlan(1, (UUID_A,), REF_IDS),
            id="other-blocks-are-ignored",
        ),
        pytest.param(
            {
                "resource_requirements": gpu(),
                "template": {
                    "driver_config": {
                        "podman": {"cdi_devices": [UUID_B]},
                        "reference": {"gpu_device_ids": "not even a list", "bogus": True},
                    }
                },
            },
            "podman",
            GpuPlan(1, (UUID_B,), PODMAN_CDI),
            id="malformed-other-block-is-ignored",
        ),
    ],
)
def test_exact_ids_give_an_exact_plan(data: dict[str, Any], active: str, plan: GpuPlan) -> None:
    assert validate(data, active, EXACT) == plan


def test_exact_ids_for_other_drivers_make_a_count_request_on_a_count_only_driver() -> None:
    # Seed 003's gateway hands the kubernetes driver its own block: none, so a count of 2.
    data = {
        "resource_requirements": gpu(2),
        "template": {"driver_config": {"reference": {"gpu_device_ids": [UUID_A, UUID_B]}}},
    }
    assert validate(data, "kubernetes", COUNT_ONLY) == GpuPlan(count=2)


def test_parsed_spec_keeps_what_was_given() -> None:
    data = {
        "resource_requirements": gpu(2),
        "template": {
            "image": "busybox:1.36",
            "env": {"A": "1"},
            "driver_config": {"reference": {"gpu_device_ids": ["0", "1"]}},
        },
    }
    spec = parse_spec(json.dumps(data))
    assert spec == parse_spec(data)
    assert spec.image == "busybox:1.36"
    assert dict(spec.env) == {"A": "1"}
    assert spec.gpu == GpuRequest(2)
    # Lists become tuples: the parsed spec is read-only all the way down.
    assert dict(spec.driver_config["reference"]) == {"gpu_device_ids": ("0", "1")}


def test_parse_keeps_the_raw_count_for_the_validator() -> None:
    assert parse_spec(request("two")).gpu == GpuRequest("two")
    assert parse_spec(request()).gpu == GpuRequest(None)


def test_parsed_spec_mappings_are_read_only() -> None:
    spec = parse_spec(tpl(env={"A": "1"}, driver_config={"reference": {}}))
    with pytest.raises(TypeError):
        spec.env["B"] = "2"  # type: ignore[index]
    with pytest.raises(TypeError):
        spec.driver_config["docker"] = {}  # type: ignore[index]
    with pytest.raises(TypeError):
        spec.driver_config["reference"]["gpu_device_ids"] = ["0"]  # type: ignore[index]


def test_parsed_spec_does_not_alias_the_callers_env() -> None:
    env = {"A": "1"}
    spec = parse_spec(tpl(env=env))
    env["B"] = "2"
    assert dict(spec.env) == {"A": "1"}


def test_parsed_spec_does_not_alias_the_callers_device_ids() -> None:
    ids = ["0"]
    spec = parse_spec(
        {
            "resource_requirements": gpu(),
            "template": {"driver_config": {"reference": {"gpu_device_ids": ids}}},
        }
    )
    ids.append("1")
    assert validate_spec(spec, "reference", EXACT) == GpuPlan(1, ("0",), REF_IDS)


def test_an_empty_active_block_is_a_plain_request_whatever_the_others_name() -> None:
    data = {
        "resource_requirements": gpu(),
        "template": {"driver_config": {"reference": {}, "docker": {"gpu_device_ids": ["0"]}}},
    }
    assert validate(data, "reference", EXACT) == GpuPlan(count=1)


def test_with_gpus_builds_the_same_spec_as_parsing() -> None:
    built = SandboxSpec.with_gpus(2, driver="reference", device_ids=[UUID_A, UUID_B])
    parsed = parse_spec(request(2, ids=[UUID_A, UUID_B]))
    assert validate_spec(built, "reference", EXACT) == validate_spec(parsed, "reference", EXACT)
    assert validate_spec(SandboxSpec.with_gpus(), "reference", EXACT) == GpuPlan(1)
    assert validate_spec(SandboxSpec(), "reference", EXACT) is None


# -- the anchor messages ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "active", "message"),
    [
        pytest.param(request(0), "reference", "gpu count must be greater than 0", id="zero"),
        pytest.param(request(-3), "reference", "gpu count must be greater than 0", id="negative"),
        pytest.param(
            request(2, ids=[UUID_A, UUID_A]),
            "reference",
            f"{REF_IDS} contains duplicate device ID '{UUID_A}'",
            id="duplicate",
        ),
        pytest.param(
            request(2, ids=["0", "0"], driver="podman", key="cdi_devices"),
            "podman",
            f"{PODMAN_CDI} contains duplicate device ID '0'",
            id="duplicate-podman-alias",
        ),
        pytest.param(
            request(ids=["0"], with_gpu=False),
            "reference",
            f"{REF_IDS} requires a gpu request",
            id="without-request",
        ),
        pytest.param(
            request(ids=["0"], driver="podman", key="cdi_devices", with_gpu=False),
            "podman",
            f"{PODMAN_CDI} requires a gpu request",
            id="without-request-podman-alias",
        ),
        pytest.param(
            request(3, ids=["0", "1"]),
            "reference",
            f"gpu count (3) must match {REF_IDS} length (2)",
            id="mismatch",
        ),
        pytest.param(
            request(1, ids=["0", "1"], driver="podman", key="cdi_devices"),
            "podman",
            f"gpu count (1) must match {PODMAN_CDI} length (2)",
            id="mismatch-podman-alias",
        ),
    ],
)
def test_anchor_messages(data: dict[str, Any], active: str, message: str) -> None:
    with pytest.raises(InvalidGpuRequest) as raised:
        validate(data, active, EXACT)
    assert message in str(raised.value)


def test_anchor_messages_exact_wording() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        (request(0), "gpu count must be greater than 0, got 0"),
        (request(2, ids=["x", "x"]), f"{REF_IDS} contains duplicate device ID 'x'"),
        (request(3, ids=["x", "y"]), f"gpu count (3) must match {REF_IDS} length (2): ['x', 'y']"),
    ]
    for data, message in cases:
        with pytest.raises(InvalidGpuRequest) as raised:
            validate(data, "reference", EXACT)
        assert str(raised.value) == message


def test_too_many_ids_is_a_capability_error_before_consistency() -> None:
    two = DriverCapabilities(max_gpus_per_sandbox=2, exact_ids=True)
    for ids, gpu_request in (
        (["0", "0", "1"], gpu()),
        (["0", "1", "2"], None),
        (["0", "1", "2"], gpu(2)),
    ):
        data: dict[str, object] = {
            "template": {"driver_config": {"reference": {"gpu_device_ids": ids}}}
        }
        if gpu_request is not None:
            data["resource_requirements"] = gpu_request
        with pytest.raises(UnsupportedGpuRequest, match="names 3 GPUs"):
            validate(data, "reference", two)


@pytest.mark.parametrize("env", [{"": "x"}, {"A=B": "x"}, {"A\x00B": "x"}, {"\ud800": "x"}])
def test_env_names_must_be_variable_names(env: dict[str, object]) -> None:
    with pytest.raises(InvalidGpuRequest) as raised:
        parse_spec(tpl(env=env))
    assert raised.value.field == ENV


def test_errors_show_values_as_written_not_frozen() -> None:
    data = {
        "resource_requirements": gpu(),
        "template": {"driver_config": {"reference": {"gpu_device_ids": {"a": "0"}}}},
    }
    with pytest.raises(InvalidDriverConfig) as raised:
        validate(data, "reference", EXACT)
    assert "mappingproxy" not in str(raised.value)
    assert raised.value.value == {"a": "0"}


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"resource_requirements": {"gpu": {}}, "template": {"image": "busybox", "env": {"A": "1"}}},
        {
            "resource_requirements": {"gpu": {"count": 2}},
            "template": {
                "driver_config": {"reference": {"gpu_device_ids": ["0", "GPU-x"]}, "vm": {}}
            },
        },
    ],
)
def test_to_dict_round_trips(data: dict[str, Any]) -> None:
    spec = parse_spec(data)
    assert parse_spec(spec.to_dict()) == spec
    assert parse_spec(json.dumps(spec.to_dict())) == spec


# -- seed 003's shape and the gateway -----------------------------------------------------

SEED_003 = {
    "resource_requirements": {"gpu": {"count": 1}},
    "template": {
        "driver_config": {
            "docker": {"gpu_device_ids": ["nvidia.com/gpu=0"]},
            "podman": {"gpu_device_ids": ["nvidia.com/gpu=0"]},
            "vm": {"gpu_device_ids": ["0000:2d:00.0"]},
        }
    },
}
"""Seed 003's request, verbatim."""


@pytest.mark.parametrize(
    ("name", "block", "plan"),
    [
        ("docker", {"gpu_device_ids": ("nvidia.com/gpu=0",)}, GpuPlan(1, ("nvidia.com/gpu=0",),
         "template.driver_config.docker.gpu_device_ids")),
        ("podman", {"gpu_device_ids": ("nvidia.com/gpu=0",)}, GpuPlan(1, ("nvidia.com/gpu=0",),
         PODMAN_IDS)),
        ("vm", {"gpu_device_ids": ("0000:2d:00.0",)}, GpuPlan(1, ("0000:2d:00.0",),
         "template.driver_config.vm.gpu_device_ids")),
        ("kubernetes", {}, GpuPlan(count=1)),
        ("reference", {}, GpuPlan(count=1)),
    ],
)  # fmt: skip
def test_the_gateway_hands_each_driver_its_own_block_of_seed_003(
    name: str, block: dict[str, Any], plan: GpuPlan
) -> None:
    request = select(parse_spec(SEED_003), name)
    assert dict(request.config) == block
    assert request.to_dict()["driver_config"] == {k: list(v) for k, v in block.items()}
    caps = COUNT_ONLY if name == "kubernetes" else EXACT
    assert validate_gpu_request(request, declared(name, caps)) == plan


def test_the_driver_request_holds_nothing_of_the_other_blocks() -> None:
    request = select(parse_spec(SEED_003), "docker")
    assert request == DriverRequest(
        "docker",
        GpuRequest(1),
        config=parse_spec(SEED_003).driver_config["docker"],
    )
    assert "vm" not in json.dumps(request.to_dict())


def test_seed_003_round_trips_in_its_own_shape() -> None:
    spec = parse_spec(json.dumps(SEED_003))
    assert spec.to_dict() == SEED_003
    assert parse_spec(spec.to_dict()) == spec


def test_a_driver_declares_the_keys_of_its_own_block() -> None:
    data = {"resource_requirements": gpu(), "template": {"driver_config": {"mine": {"tier": 3}}}}
    with pytest.raises(InvalidDriverConfig, match="unknown key 'tier'"):
        validate(data, "mine", EXACT)
    own = dataclasses.replace(EXACT, config_keys=("tier",))
    assert validate(data, "mine", own) == GpuPlan(count=1)
    # Another driver's block may hold it; this driver's block may not, unless it declares it.
    other = {"resource_requirements": gpu(), "template": {"driver_config": {"mine": {"tier": 3}}}}
    assert validate(other, "reference", EXACT) == GpuPlan(count=1)


def test_a_driver_declares_its_aliases_for_the_device_ids() -> None:
    data = request(ids=["0"], driver="mine", key="devices")
    with pytest.raises(InvalidDriverConfig, match="unknown key 'devices'"):
        validate(data, "mine", EXACT)
    aliased = dataclasses.replace(EXACT, device_id_aliases=("devices",))
    plan = validate(data, "mine", aliased)
    assert plan == GpuPlan(1, ("0",), "template.driver_config.mine.devices")


def test_a_driver_from_another_package_judges_its_own_option(tmp_path: Path) -> None:
    from tests.fake_drivers import TieredDriver

    driver = TieredDriver(
        GpuHost.open(HostConfig(simulated.setup(tmp_path / "sim", 2).root)), "tiers"
    )
    good = {
        "resource_requirements": gpu(),
        "template": {"driver_config": {"tiered": {"tier": "batch"}}},
    }
    assert driver.plan(select(parse_spec(good), "tiered")) == GpuPlan(count=1)
    bad = {"resource_requirements": gpu(), "template": {"driver_config": {"tiered": {"tier": 7}}}}
    with pytest.raises(InvalidDriverConfig) as raised:
        driver.plan(select(parse_spec(bad), "tiered"))
    assert raised.value.field == "template.driver_config.tiered.tier"


@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_a_name_for_every_gpu_with_a_count_must_be_their_count(
    sim_host: simulated.SimulatedHost, engine: str
) -> None:
    """``<kind>=all`` with ``count: 1``: refused, never a plan of one holding all eight."""
    from tests.offline_drivers import OfflineDocker, OfflinePodman

    host = GpuHost.open(HostConfig(sim_host.root))
    driver = (OfflineDocker if engine == "docker" else OfflinePodman)(host, "all")
    everything = cdi.all_devices(driver.cdi_kind)
    field = f"template.driver_config.{engine}.gpu_device_ids"
    with pytest.raises(GpuCountMismatch) as raised:
        driver.plan(select(parse_spec(request(1, ids=[everything], driver=engine)), engine))
    assert str(raised.value) == (
        f"gpu count (1) must match the number of GPUs {field} names (8): ['{everything}']"
    )
    assert (raised.value.field, raised.value.value) == (field, [everything])
    plan = driver.plan(select(parse_spec(request(ids=[everything], driver=engine)), engine))
    assert plan is not None
    assert (plan.count, plan.gpus) == (8, host.gpus)
    assert host.leases.leases() == []
