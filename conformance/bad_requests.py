"""The bad requests of the validation requirements, built from the driver under test.

Each case is a request and what it must fail with: the typed error, the field it names and
the value its message shows. ``conformance/test_validation.py`` makes each, one after the
other, and checks that nothing was taken.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from conformance import requirements
from drivers.base import Driver
from gpuhost.errors import (
    SHOWN_LIMIT,
    DriverError,
    DuplicateGpuDevice,
    GpuCountMismatch,
    GpuDevicesWithoutRequest,
    GpusExhausted,
    InvalidDriverConfig,
    InvalidGpuCount,
    InvalidGpuSharing,
    UnknownGpuDevice,
    UnsupportedGpuRequest,
)
from gpuhost.spec import DEVICE_IDS_KEY, ENVELOPE, VENDORS, block_field

IDS_PREFIX = f"{ENVELOPE}.{{driver}}"
"""The driver's block, as a field; ``{driver}`` stands for the driver's name."""
IDS = f"{IDS_PREFIX}.{DEVICE_IDS_KEY}"


@dataclass(frozen=True)
class BadRequest:
    """A request (built from the driver under test) and what it must fail with."""

    build: Callable[[Driver], dict[str, Any]]
    error: type[DriverError] | tuple[type[DriverError], ...]
    value: Callable[[Driver], str]
    """What the error message must contain: the offending value."""
    field: str | Callable[[Driver], str]
    """The field the error must name in ``.field``; ``{driver}`` stands for the driver."""
    needs_exact_ids: bool = False
    needs_two_per_sandbox: bool = False
    """The request names two GPUs: below that per-sandbox maximum, the count is refused first
    (``UnsupportedGpuRequest`` naming it)."""


def gpu_request(count: object = None) -> dict[str, Any]:
    return {"gpu": {} if count is None else {"count": count}}


def _ids(driver: Driver, ids: list[Any], count: object = None, gpu: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = envelope({driver.name: {"gpu_device_ids": ids}})
    if gpu:
        spec["resource_requirements"] = gpu_request(count)
    return spec


def _id(driver: Driver, index: int = 0, form: int = 0) -> str:
    return driver.device_ids(driver.inventory()[index])[form]


OTHER_DRIVERS = requirements.load().drivers
"""Every driver with a profile, present or planned: a block for any of them is not ours."""
A_DRIVER_OF_NO_PROFILE = "another-driver"
A_PROGRAM = "bwrap"
"""The name of a program a driver runs (the reference's jail), as a driver might once have
been called: to the gateway, just another driver."""
NEAR_NAMES: dict[str, Callable[[str], str]] = {
    "its own name capitalised": str.capitalize,
    "its own name in upper case": str.upper,
    "its own name, versioned": lambda name: f"{name}-v2",
    "its own name with white space": lambda name: f" {name}",
}
"""Names near the driver's own (``Reference``, ``REFERENCE``, ``reference-v2``): another
driver's, since the gateway matches a block by the driver's name exactly."""
EVERY_OTHER = "every other driver's at once"
OTHER_BLOCKS = (*OTHER_DRIVERS, A_DRIVER_OF_NO_PROFILE, A_PROGRAM, *NEAR_NAMES, EVERY_OTHER)
"""Whose blocks a request holds, none of them the driver's own: each driver's alone (the
driver under test's own name left out), one no profile names, a program's, each name near the
driver's own, all of them together."""


def block_name(whose: str, driver: str) -> str:
    """The key of ``whose`` block (one of ``OTHER_BLOCKS``) in a request to ``driver``."""
    near = NEAR_NAMES.get(whose)
    return near(driver) if near is not None else whose


KEYS_SOME_DRIVER_READS = ("cdi_devices", "runtime_class_name", "node_selector", "image")
"""Keys of a block that some built-in driver declares (``DriverCapabilities``): unknown to a
driver that does not declare them itself."""


def _own_keys(driver: Driver) -> set[str]:
    caps = driver.capabilities
    return {*caps.device_id_aliases, *caps.config_keys}


def _key_of_another_driver(key: str) -> BadRequest:
    """``key`` in the driver's own block, where the driver is not one that reads it.

    A driver that reads it is given the key with a letter more, a key no driver reads.
    """

    def named(driver: Driver) -> str:
        return f"{key}x" if key in _own_keys(driver) else key

    def build(driver: Driver) -> dict[str, Any]:
        block = {named(driver): [_id(driver)]}
        return {"resource_requirements": gpu_request(), **envelope({driver.name: block})}

    return BadRequest(build, InvalidDriverConfig, named, lambda d: _block_field(d, named(d)))


def _alias(driver: Driver) -> str:
    """The driver's other name for its device IDs (an unknown key for one with none)."""
    return (*driver.capabilities.device_id_aliases, "cdi_devices")[0]


def _alias_field(driver: Driver) -> str:
    """The field refused: the block giving both names, or the unknown key."""
    own = bool(driver.capabilities.device_id_aliases)
    return _block_field(driver, None if own else _alias(driver))


def envelope(config: object) -> dict[str, Any]:
    """The request's part that holds ``config`` as its ``template.driver_config``."""
    return {"template": {"driver_config": config}}


def _block_field(driver: Driver, key: str | None = None) -> str:
    return block_field(driver.name, key)


def _choice(block: dict[str, Any], key: str, value: str, ids: bool = False) -> BadRequest:
    """``block`` in the driver's own config (beside an exact ID when ``ids``): ``key`` refused."""

    def build(driver: Driver) -> dict[str, Any]:
        exact = {"gpu_device_ids": [_id(driver)]} if ids else {}
        return {
            "resource_requirements": gpu_request(),
            **envelope({driver.name: {**exact, **block}}),
        }

    return BadRequest(build, InvalidDriverConfig, lambda d: value, field=f"{IDS_PREFIX}.{key}")


CONFIG_ERRORS = {
    "envelope-not-object": BadRequest(
        lambda d: {"resource_requirements": gpu_request(), **envelope("podman")},
        InvalidDriverConfig,
        lambda d: "'podman'",
        field=ENVELOPE,
    ),
    "block-not-object": BadRequest(
        lambda d: {"resource_requirements": gpu_request(), **envelope({d.name: ["x"]})},
        InvalidDriverConfig,
        lambda d: "['x']",
        field=IDS_PREFIX,
    ),
    "unknown-key": BadRequest(
        lambda d: {
            "resource_requirements": gpu_request(),
            **envelope({d.name: {"gpu_device_idz": [_id(d)]}}),
        },
        InvalidDriverConfig,
        lambda d: "gpu_device_idz",
        field=f"{IDS_PREFIX}.gpu_device_idz",
    ),
    # Seed 001's name for the IDs: refused, saying what replaced it.
    "superseded-device-ids": BadRequest(
        lambda d: {
            "resource_requirements": gpu_request(),
            **envelope({d.name: {"device_ids": [_id(d)]}}),
        },
        InvalidDriverConfig,
        lambda d: DEVICE_IDS_KEY,
        field=f"{IDS_PREFIX}.device_ids",
    ),
    # Device IDs under both names of a driver that reads two: refused, neither one dropped.
    "ids-under-both-names": BadRequest(
        lambda d: {
            "resource_requirements": gpu_request(),
            **envelope({d.name: {DEVICE_IDS_KEY: [_id(d)], _alias(d): [_id(d)]}}),
        },
        InvalidDriverConfig,
        _alias,
        _alias_field,
    ),
    "ids-not-a-list": BadRequest(
        lambda d: _ids(d, _id(d)),  # type: ignore[arg-type]
        InvalidDriverConfig,
        lambda d: _id(d),
        field=IDS,
    ),
    "empty-list": BadRequest(
        lambda d: _ids(d, []),
        InvalidDriverConfig,
        lambda d: "[]",
        field=IDS,
    ),
    "blank-entry": BadRequest(
        lambda d: _ids(d, ["  "]),
        InvalidDriverConfig,
        lambda d: "'  '",
        field=IDS,
    ),
    "unknown-vendor": BadRequest(
        lambda d: {
            "resource_requirements": gpu_request(),
            **envelope({d.name: {"vendor": "nvida"}}),
        },
        InvalidDriverConfig,
        lambda d: "'nvida'",
        field=f"{IDS_PREFIX}.vendor",
    ),
    "non-string-entry": BadRequest(
        lambda d: _ids(d, [7]),
        InvalidDriverConfig,
        lambda d: "got 7",
        field=IDS,
    ),
    # A choice given empty, or not as a string, is refused: not read as no choice at all.
    "empty-mig-profile": _choice({"mig_profile": ""}, "mig_profile", "''"),
    "blank-vendor": _choice({"vendor": "  "}, "vendor", "'  '"),
    "mig-profile-not-a-string": _choice({"mig_profile": 7}, "mig_profile", "got 7"),
    # Exact devices decide what a sandbox gets: beside them, a choice is refused, not dropped.
    "ids-and-mig-profile": _choice(
        {"mig_profile": "1g.10gb"}, "mig_profile", "'1g.10gb'", ids=True
    ),
    "ids-and-vendor": _choice({"vendor": "nvidia"}, "vendor", "'nvidia'", ids=True),
    # MIG is NVIDIA's: a profile beside any other vendor is refused.
    **{
        f"mig-profile-of-{vendor}": _choice(
            {"mig_profile": "1g.10gb", "vendor": vendor}, "vendor", f"'{vendor}'"
        )
        for vendor in VENDORS
        if vendor != "nvidia"
    },
    # A key only another driver reads, in this driver's own block: unknown here.
    **{
        f"key-of-another-driver-{key}": _key_of_another_driver(key)
        for key in KEYS_SOME_DRIVER_READS
    },
}

COUNT = "resource_requirements.gpu.count"
EXHAUSTED_FIELDS = ("requested", "available", "total")
"""What GpusExhausted says, each checked by value (GPU-EXHAUST-01, GPU-EXHAUST-02)."""
SHARING = "resource_requirements.gpu.sharing"


def _sharing(value: object) -> BadRequest:
    return BadRequest(
        lambda d: {"resource_requirements": {"gpu": {"sharing": value}}},
        InvalidGpuSharing,
        lambda d: f"got {value!r}",
        field=SHARING,
    )


SHARING_MODES = ("exclusive", "shared")
SHARING_NEAR_MISSES = (
    "capitalised",
    "upper case",
    "white space before",
    "a line break after",
    "a prefix",
)
"""How a sharing that is neither mode can look like one (``Shared``, ``EXCLUSIVE``, `` shared``,
``exclusive\\n``, ``excl``): a driver that folds case, trims or takes a prefix serves it."""


def sharing_near_miss(mode: str, how: str) -> str:
    """``mode`` (one of ``SHARING_MODES``) as ``how`` (one of ``SHARING_NEAR_MISSES``) spells it."""
    return {
        SHARING_NEAR_MISSES[0]: mode.capitalize(),
        SHARING_NEAR_MISSES[1]: mode.upper(),
        SHARING_NEAR_MISSES[2]: f" {mode}",
        SHARING_NEAR_MISSES[3]: f"{mode}\n",
        SHARING_NEAR_MISSES[4]: mode[:4],
    }[how]


COUNT_ERRORS = {
    "zero": BadRequest(
        lambda d: {"resource_requirements": gpu_request(0)},
        InvalidGpuCount,
        lambda d: "got 0",
        field=COUNT,
    ),
    "negative": BadRequest(
        lambda d: {"resource_requirements": gpu_request(-1)},
        InvalidGpuCount,
        lambda d: "got -1",
        field=COUNT,
    ),
    "fraction": BadRequest(
        lambda d: {"resource_requirements": gpu_request(2.5)},
        InvalidGpuCount,
        lambda d: "got 2.5",
        field=COUNT,
    ),
    # A number of another JSON type with an integer's value: a count is an integer.
    "integral-float": BadRequest(
        lambda d: {"resource_requirements": gpu_request(2.0)},
        InvalidGpuCount,
        lambda d: "got 2.0",
        field=COUNT,
    ),
    "word": BadRequest(
        lambda d: {"resource_requirements": gpu_request("two")},
        InvalidGpuCount,
        lambda d: "got 'two'",
        field=COUNT,
    ),
    "numeric-string": BadRequest(
        lambda d: {"resource_requirements": gpu_request("2")},
        InvalidGpuCount,
        lambda d: "got '2'",
        field=COUNT,
    ),
    "boolean": BadRequest(
        lambda d: {"resource_requirements": gpu_request(True)},
        InvalidGpuCount,
        lambda d: "got True",
        field=COUNT,
    ),
    "above-the-maximum": BadRequest(
        lambda d: {"resource_requirements": gpu_request(d.capabilities.max_gpus_per_sandbox + 1)},
        UnsupportedGpuRequest,
        lambda d: str(d.capabilities.max_gpus_per_sandbox + 1),
        field=COUNT,
    ),
    "huge": BadRequest(
        lambda d: {"resource_requirements": gpu_request(10**6)},
        (UnsupportedGpuRequest, GpusExhausted),
        lambda d: "1000000",
        field=COUNT,
    ),
    # A sharing that is neither mode is refused, never served as an exclusive GPU, nor as
    # the mode it looks like.
    **{
        f"sharing-{mode}-{how.replace(' ', '-')}": _sharing(sharing_near_miss(mode, how))
        for how in SHARING_NEAR_MISSES
        for mode in SHARING_MODES
    },
    "sharing-misspelt": _sharing("exclusve"),
    "sharing-empty": _sharing(""),
    "sharing-boolean": _sharing(True),
}


def _past_the_last(driver: Driver) -> str:
    """The first index that names no GPU (the host's GPU count), in the driver's index form."""
    gpu = max(driver.inventory(), key=lambda gpu: gpu.index)
    first, index = driver.device_ids(gpu)[0], str(gpu.index)
    past = str(max(g.index for g in driver.host.gpus) + 1)
    if first == index or first.endswith(f"={index}"):  # a bare index, or a CDI name's
        return first.removesuffix(index) + past
    return "no-such-gpu-1"  # no index form (a PCI address): any unknown name will do


def unknown(device_id: str) -> BadRequest:
    """``device_id``, which names no device: refused with UnknownGpuDevice naming it.

    As messages show values (``shown``): as ``repr`` writes it (a tab escaped), a long one by
    its start.
    """
    written = repr(device_id)[1:-1]
    said = written if len(written) + 2 <= SHOWN_LIMIT else written[: SHOWN_LIMIT // 2]
    return BadRequest(
        lambda d: _ids(d, [device_id]),
        UnknownGpuDevice,
        lambda d: said,
        needs_exact_ids=True,
        field=IDS,
    )


ID_ERRORS = {
    "duplicate": BadRequest(
        lambda d: _ids(d, [_id(d), _id(d)], count=2),
        DuplicateGpuDevice,
        lambda d: f"'{_id(d)}'",
        needs_exact_ids=True,
        needs_two_per_sandbox=True,
        field=IDS,
    ),
    "duplicate-by-alias": BadRequest(
        lambda d: _ids(d, [_id(d, form=0), _id(d, form=-1)], count=2),
        DuplicateGpuDevice,
        lambda d: f"'{_id(d, form=-1)}'",
        needs_exact_ids=True,
        needs_two_per_sandbox=True,
        field=IDS,
    ),
    "count-mismatch": BadRequest(
        lambda d: _ids(d, [_id(d)], count=2),
        GpuCountMismatch,
        lambda d: "gpu count (2) must match",
        needs_exact_ids=True,
        needs_two_per_sandbox=True,
        field=IDS,
    ),
    "ids-without-gpu-request": BadRequest(
        lambda d: _ids(d, [_id(d)], gpu=False),
        GpuDevicesWithoutRequest,
        lambda d: _id(d),
        needs_exact_ids=True,
        field=IDS,
    ),
    # Neither an index counted from the end, nor a prefix that several UUIDs share.
    "negative-index": unknown("-1"),
    "uuid-prefix-of-every-gpu": unknown("GPU-"),
    "unknown-id": BadRequest(
        lambda d: _ids(d, ["no-such-gpu-0"]),
        UnknownGpuDevice,
        lambda d: "no-such-gpu-0",
        needs_exact_ids=True,
        field=IDS,
    ),
    "unknown-beside-known": BadRequest(
        lambda d: _ids(d, [_id(d), "no-such-gpu-0"], count=2),
        UnknownGpuDevice,
        lambda d: "no-such-gpu-0",
        needs_exact_ids=True,
        needs_two_per_sandbox=True,
        field=IDS,
    ),
    "index-out-of-range": BadRequest(
        lambda d: _ids(d, [str(len(d.inventory()) + 10)]),
        UnknownGpuDevice,
        lambda d: str(len(d.inventory()) + 10),
        needs_exact_ids=True,
        field=IDS,
    ),
    "index-one-past-the-last": BadRequest(
        lambda d: _ids(d, [_past_the_last(d)]),
        UnknownGpuDevice,
        _past_the_last,
        needs_exact_ids=True,
        field=IDS,
    ),
}
