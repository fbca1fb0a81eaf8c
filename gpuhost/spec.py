"""The request model: a frozen ``SandboxSpec`` parsed strictly from the user's dict or JSON.

Portable intent lives in ``resource_requirements.gpu`` (absent: no GPU; present with no
count: the default request of one GPU; ``count: N``: N GPUs). Exact device choice is
driver-native and lives in ``driver_config.<driver>.gpu_device_ids``, of which only the
active driver's block is read.

Validation runs in two steps, both before anything is allocated:

1. ``parse_spec`` checks the shape every driver shares (types, known keys, the count).
2. ``validate_gpu_request`` checks the active driver's block against its capabilities, in
   the order upstream drivers use: malformed block, count, capability, ID consistency.

``SandboxSpec`` is the request as given; ``GpuPlan`` is the request once validated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpuhost.devices import GpuDevice
from gpuhost.errors import (
    DuplicateGpuDevice,
    GpuCountMismatch,
    GpuDevicesWithoutRequest,
    InvalidDriverConfig,
    InvalidGpuCount,
    InvalidGpuRequest,
    InvalidGpuSharing,
    UnsupportedGpuRequest,
)

DEFAULT_GPU_COUNT = 1
EXCLUSIVE, SHARED = "exclusive", "shared"
SHARING_MODES = (EXCLUSIVE, SHARED)
VENDORS = ("nvidia", "amd", "intel")
DEVICE_IDS_KEY = "gpu_device_ids"
MIG_PROFILE_KEY = "mig_profile"
VENDOR_KEY = "vendor"
# Upstream renamed the docker/podman key; both spellings are accepted there.
DEVICE_IDS_ALIASES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"docker": ("cdi_devices",), "podman": ("cdi_devices",)}
)
CHOICE_KEYS = (MIG_PROFILE_KEY, VENDOR_KEY)
"""Keys of a driver's block that pick what counts and defaults choose among."""
DRIVER_OPTION_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"kubernetes": ("runtime_class_name", "node_selector", "image")}
)
"""Keys of a driver's own block that only that driver reads (and checks)."""
_SPEC_KEYS = frozenset({"image", "env", "resource_requirements", "driver_config"})


@dataclass(frozen=True)
class GpuRequest:
    """``resource_requirements.gpu`` as given: ``count=None`` is the default request.

    The count is kept as the user wrote it; ``validate_gpu_request`` checks it in its turn
    (after the active driver's block), so errors come in the documented order.
    """

    count: Any = None
    sharing: Any = None
    """``exclusive`` (the default: no other sandbox on the GPU) or ``shared`` (co-held with
    other shared sandboxes only, up to the host's limit); kept as written, checked later."""


@dataclass(frozen=True)
class SandboxSpec:
    """What a user asks a driver for; immutable once parsed."""

    image: str | None = None
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    gpu: GpuRequest | None = None
    driver_config: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType({})
    )

    @classmethod
    def with_gpus(
        cls,
        count: Any = None,
        *,
        driver: str | None = None,
        device_ids: list[str] | None = None,
        image: str | None = None,
        sharing: str | None = None,
        block: Mapping[str, Any] | None = None,
    ) -> SandboxSpec:
        """A GPU request, optionally with exact IDs or another ``block`` for ``driver``.

        A convenience for tests.
        """
        config: dict[str, Any] = {driver: dict(block or {})} if driver and block else {}
        if driver and device_ids is not None:
            config.setdefault(driver, {})[DEVICE_IDS_KEY] = device_ids
        return cls(image=image, gpu=GpuRequest(count, sharing), driver_config=_freeze(config))

    def to_dict(self) -> dict[str, Any]:
        """The user-facing shape that ``parse_spec`` reads back into an equal spec."""
        data: dict[str, Any] = {"env": dict(self.env)}
        if self.image is not None:
            data["image"] = self.image
        if self.gpu is not None:
            gpu = {} if self.gpu.count is None else {"count": self.gpu.count}
            if self.gpu.sharing is not None:
                gpu["sharing"] = self.gpu.sharing
            data["resource_requirements"] = {"gpu": gpu}
        if self.driver_config:
            data["driver_config"] = _thawed(self.driver_config)
        return data


@dataclass(frozen=True)
class DriverCapabilities:
    """What a driver declares it can do; the validator and the catalogue read it."""

    max_gpus_per_sandbox: int
    exact_ids: bool
    exact_id_forms: str = ""
    """Human-readable native forms accepted in ``gpu_device_ids``, for error messages."""
    exclusive: bool = True
    shared: bool = False
    """It can serve ``sharing: shared`` requests (co-held GPUs, time-sliced)."""
    mig_profiles: bool = False
    """It can serve ``driver_config.<driver>.mig_profile`` (counts of MIG instances)."""
    vendors: tuple[str, ...] = ("nvidia",)
    """The GPU vendors it can inject."""


@dataclass(frozen=True)
class GpuPlan:
    """A validated request: how many GPUs, and which native IDs when exact.

    ``gpus`` are the GPUs the exact IDs name, once a driver has resolved them.
    """

    count: int
    device_ids: tuple[str, ...] = ()
    field: str = "resource_requirements.gpu"
    gpus: tuple[GpuDevice, ...] = ()
    sharing: str = EXCLUSIVE
    mig_profile: str | None = None
    """Counts and defaults pick instances of this MIG profile, not whole GPUs."""
    vendor: str | None = None
    """Counts and defaults pick GPUs of this vendor; None: the host's default vendor."""


def parse_spec(data: Mapping[str, Any] | str) -> SandboxSpec:
    """Parse the user-facing dict (or its JSON text) into a ``SandboxSpec``."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise InvalidGpuRequest("spec", data, f"spec is not valid JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise InvalidGpuRequest(
            "spec", data, f"spec must be an object, got {_kind(data)}: {data!r}"
        )
    _reject_unknown_keys("spec", data, _SPEC_KEYS, InvalidGpuRequest)

    image = data.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise InvalidGpuRequest("image", image, f"image must be a non-empty string, got {image!r}")
    env = data.get("env", {})
    if not isinstance(env, Mapping) or not all(
        isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in env.items()
    ):
        raise InvalidGpuRequest(
            "env", env, f"env must map variable names (no '=') to strings, got {env!r}"
        )

    return SandboxSpec(
        image=image,
        env=MappingProxyType(dict(env)),
        driver_config=_parse_driver_config(data.get("driver_config", {})),
        gpu=_parse_gpu(data.get("resource_requirements")),
    )


def parse_driver_config_json(text: str) -> Mapping[str, Mapping[str, Any]]:
    """Parse ``--driver-config-json``: the driver-keyed envelope alone."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidDriverConfig(
            "driver_config", text, f"driver_config is not valid JSON: {exc}"
        ) from None
    return _parse_driver_config(value)


def validate_gpu_request(
    spec: SandboxSpec, driver: str, caps: DriverCapabilities
) -> GpuPlan | None:
    """Check the active driver's block and the GPU request; ``None`` means no GPU asked for.

    Other drivers' blocks are not read, but a spec that names exact devices only for other
    drivers is refused: those devices would otherwise be dropped silently.
    """
    ids_field, device_ids = _active_device_ids(spec, driver)
    profile, vendor = _active_choice(spec, driver, device_ids)
    count = None if spec.gpu is None else _checked_count(spec.gpu.count)
    sharing = EXCLUSIVE if spec.gpu is None else _checked_sharing(spec.gpu.sharing)

    if count is not None and count > caps.max_gpus_per_sandbox:
        raise UnsupportedGpuRequest(
            "resource_requirements.gpu.count",
            count,
            f"gpu count ({count}) exceeds the {driver} driver's maximum of "
            f"{caps.max_gpus_per_sandbox} GPUs per sandbox",
        )
    if device_ids and not caps.exact_ids:
        raise UnsupportedGpuRequest(
            ids_field,
            list(device_ids),
            f"the {driver} driver does not support exact GPU device IDs; "
            f"{ids_field} = {list(device_ids)!r}: request a count instead",
        )
    if device_ids and len(device_ids) > caps.max_gpus_per_sandbox:
        raise UnsupportedGpuRequest(
            ids_field,
            list(device_ids),
            f"{ids_field} names {len(device_ids)} GPUs; the {driver} driver's maximum is "
            f"{caps.max_gpus_per_sandbox} per sandbox",
        )
    if sharing == SHARED and not caps.shared:
        raise UnsupportedGpuRequest(
            "resource_requirements.gpu.sharing",
            sharing,
            f"the {driver} driver does not share GPUs; resource_requirements.gpu.sharing = "
            f"{sharing!r}: ask for an exclusive GPU",
        )
    prefix = f"driver_config.{driver}"
    if profile is not None and not caps.mig_profiles:
        raise UnsupportedGpuRequest(
            f"{prefix}.{MIG_PROFILE_KEY}",
            profile,
            f"the {driver} driver does not hand out MIG instances by profile; "
            f"{prefix}.{MIG_PROFILE_KEY} = {profile!r}",
        )
    if vendor is not None and vendor not in caps.vendors:
        raise UnsupportedGpuRequest(
            f"{prefix}.{VENDOR_KEY}",
            vendor,
            f"the {driver} driver injects {', '.join(caps.vendors)} GPUs, not {vendor!r} "
            f"({prefix}.{VENDOR_KEY})",
        )
    if device_ids is None:
        if count is None:
            return None
        return GpuPlan(count=count, sharing=sharing, mig_profile=profile, vendor=vendor)
    if spec.gpu is None:
        raise GpuDevicesWithoutRequest(
            ids_field,
            list(device_ids),
            f"{ids_field} requires a gpu request (got {list(device_ids)!r} "
            "without resource_requirements.gpu)",
        )
    seen: set[str] = set()
    for device_id in device_ids:
        if device_id in seen:
            raise DuplicateGpuDevice(
                ids_field, device_id, f"{ids_field} contains duplicate device ID '{device_id}'"
            )
        seen.add(device_id)
    if spec.gpu.count is not None and count != len(device_ids):
        raise GpuCountMismatch(
            ids_field,
            list(device_ids),
            f"gpu count ({count}) must match {ids_field} length ({len(device_ids)})",
        )
    return GpuPlan(count=len(device_ids), device_ids=device_ids, field=ids_field, sharing=sharing)


def _parse_gpu(requirements: object) -> GpuRequest | None:
    if requirements is None:
        return None
    if not isinstance(requirements, Mapping):
        raise InvalidGpuRequest(
            "resource_requirements",
            requirements,
            f"resource_requirements must be an object, got {_kind(requirements)}: {requirements!r}",
        )
    _reject_unknown_keys("resource_requirements", requirements, {"gpu"}, InvalidGpuRequest)
    if "gpu" not in requirements or requirements["gpu"] is None:
        return None
    gpu = requirements["gpu"]
    if not isinstance(gpu, Mapping):
        raise InvalidGpuRequest(
            "resource_requirements.gpu",
            gpu,
            f"resource_requirements.gpu must be an object, got {_kind(gpu)}: {gpu!r}",
        )
    _reject_unknown_keys("resource_requirements.gpu", gpu, {"count", "sharing"}, InvalidGpuRequest)
    return GpuRequest(gpu.get("count"), gpu.get("sharing"))


def _checked_count(count: Any) -> int:
    if count is None:
        return DEFAULT_GPU_COUNT
    # bool is an int subclass; `true` is not a count.
    if not isinstance(count, int) or isinstance(count, bool):
        raise InvalidGpuCount(
            "resource_requirements.gpu.count",
            count,
            f"gpu count must be an integer, got {count!r} ({_kind(count)})",
        )
    if count <= 0:
        raise InvalidGpuCount(
            "resource_requirements.gpu.count",
            count,
            f"gpu count must be greater than 0, got {count}",
        )
    return count


def _checked_sharing(sharing: Any) -> str:
    if sharing is None:
        return EXCLUSIVE
    if sharing not in SHARING_MODES:
        raise InvalidGpuSharing(
            "resource_requirements.gpu.sharing",
            sharing,
            f"gpu sharing must be one of {', '.join(SHARING_MODES)}, got {sharing!r}",
        )
    return str(sharing)


def _active_choice(
    spec: SandboxSpec, driver: str, device_ids: tuple[str, ...] | None
) -> tuple[str | None, str | None]:
    """The active block's MIG profile and vendor, which pick what counts choose among."""
    prefix = f"driver_config.{driver}"
    block = spec.driver_config.get(driver, {})
    chosen = {}
    for key in (MIG_PROFILE_KEY, VENDOR_KEY):
        value = _thawed(block.get(key))
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise InvalidDriverConfig(
                f"{prefix}.{key}",
                value,
                f"{prefix}.{key} must be a non-empty string, got {value!r}",
            )
        chosen[key] = value
    vendor = chosen.get(VENDOR_KEY)
    if vendor is not None and vendor not in VENDORS:
        raise InvalidDriverConfig(
            f"{prefix}.{VENDOR_KEY}",
            vendor,
            f"{prefix}.{VENDOR_KEY} must be one of {', '.join(VENDORS)}, got {vendor!r}",
        )
    if chosen and device_ids is not None:
        key = next(iter(chosen))
        raise InvalidDriverConfig(
            f"{prefix}.{key}",
            chosen[key],
            f"{prefix} names exact devices and a {key} ({chosen[key]!r}): the devices decide, "
            f"give one or the other",
        )
    if MIG_PROFILE_KEY in chosen and VENDOR_KEY in chosen and vendor != "nvidia":
        raise InvalidDriverConfig(
            f"{prefix}.{VENDOR_KEY}",
            vendor,
            f"{prefix}.{MIG_PROFILE_KEY} is NVIDIA's; {prefix}.{VENDOR_KEY} is {vendor!r}",
        )
    return chosen.get(MIG_PROFILE_KEY), vendor


def _parse_driver_config(config: object) -> Mapping[str, Mapping[str, Any]]:
    if not isinstance(config, Mapping):
        raise InvalidDriverConfig(
            "driver_config",
            config,
            f"driver_config must be an object, got {_kind(config)}: {config!r}",
        )
    for driver, block in config.items():
        if not isinstance(block, Mapping):
            raise InvalidDriverConfig(
                f"driver_config.{driver}",
                block,
                f"driver_config.{driver} must be an object, got {_kind(block)}: {block!r}",
            )
    return _freeze(config)


def _active_device_ids(spec: SandboxSpec, driver: str) -> tuple[str, tuple[str, ...] | None]:
    """The active block's device IDs and the field name they came from."""
    prefix = f"driver_config.{driver}"
    block = spec.driver_config.get(driver, {})
    keys = _id_keys(driver)
    _reject_unknown_keys(
        prefix,
        block,
        {*keys, *CHOICE_KEYS, *DRIVER_OPTION_KEYS.get(driver, ())},
        InvalidDriverConfig,
    )
    present = [key for key in keys if key in block]
    if len(present) > 1:
        raise InvalidDriverConfig(
            prefix,
            _thawed(block),
            f"{prefix} gives both {' and '.join(present)}; they are aliases, use one",
        )
    if not present:
        others = sorted(
            name
            for name, other in spec.driver_config.items()
            if name != driver and any(key in other for key in _id_keys(name))
        )
        if others:
            raise InvalidDriverConfig(
                "driver_config",
                _thawed(spec.driver_config),
                f"driver_config names exact GPUs only for {', '.join(others)}, not for the "
                f"active driver {driver!r}; add {prefix}.{DEVICE_IDS_KEY} or drop the others",
            )
        return f"{prefix}.{DEVICE_IDS_KEY}", None
    ids_field = f"{prefix}.{present[0]}"
    # Parsed specs hold read-only copies; errors show the value as the user wrote it.
    value = _thawed(block[present[0]])
    if not isinstance(value, list):
        raise InvalidDriverConfig(
            ids_field,
            value,
            f"{ids_field} must be a list of strings, got {_kind(value)}: {value!r}",
        )
    if not value:
        raise InvalidDriverConfig(ids_field, value, f"{ids_field} must not be empty, got []")
    for entry in value:
        if not isinstance(entry, str):
            raise InvalidDriverConfig(
                ids_field, entry, f"{ids_field} entries must be strings, got {entry!r}"
            )
        if not entry.strip():
            raise InvalidDriverConfig(
                ids_field, entry, f"{ids_field} contains a blank device ID {entry!r}"
            )
    return ids_field, tuple(value)


def _id_keys(driver: str) -> tuple[str, ...]:
    return (DEVICE_IDS_KEY, *DEVICE_IDS_ALIASES.get(driver, ()))


def _reject_unknown_keys(
    where: str,
    mapping: Mapping[Any, Any],
    known: set[str] | frozenset[str],
    error: type[InvalidGpuRequest],
) -> None:
    for key in mapping:
        if key not in known:
            raise error(
                f"{where}.{key}",
                mapping[key],
                f"{where} has an unknown key {key!r} (known: {', '.join(sorted(known))})",
            )


def _freeze(config: Mapping[str, Any]) -> Mapping[str, Mapping[str, Any]]:
    frozen: Mapping[str, Mapping[str, Any]] = _deep_freeze(config)
    return frozen


def _deep_freeze(value: Any) -> Any:
    """Read-only copies all the way down: nothing the caller keeps can change the spec."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): _deep_freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_deep_freeze(item) for item in value)
    return value


def _thawed(value: Any) -> Any:
    """The plain dicts and lists a frozen value was made from, for error messages."""
    if isinstance(value, Mapping):
        return {k: _thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thawed(item) for item in value]
    return value


def _kind(value: object) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        float: "a number",
        int: "an integer",
        type(None): "null",
    }.get(type(value), type(value).__name__)
