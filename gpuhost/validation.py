"""A driver's judgement of what the gateway hands it: its own block and the GPU request.

``validate_gpu_request`` runs before anything is allocated, in the order upstream drivers
use: malformed block, count, capability, ID consistency. The block's keys are the common
ones (``gpu_device_ids``, ``mig_profile``, ``vendor``) and those the driver declares in its
capabilities (``device_id_aliases``, ``config_keys``); anything else is refused by name.
"""

from __future__ import annotations

from typing import Any

from gpuhost.errors import (
    DuplicateGpuDevice,
    GpuCountMismatch,
    GpuDevicesWithoutRequest,
    InvalidDriverConfig,
    InvalidGpuCount,
    InvalidGpuSharing,
    UnsupportedGpuRequest,
    shown,
)
from gpuhost.requestjson import kind, thawed
from gpuhost.spec import (
    CHOICE_KEYS,
    DEFAULT_GPU_COUNT,
    DEVICE_IDS_KEY,
    EXCLUSIVE,
    MIG_PROFILE_KEY,
    SHARED,
    SHARING_MODES,
    VENDOR_KEY,
    VENDORS,
    DriverCapabilities,
    DriverRequest,
    GpuPlan,
)

SUPERSEDED_BLOCK_KEYS = {"device_ids": DEVICE_IDS_KEY, "device_id": DEVICE_IDS_KEY}
"""Seed 001's names for a block's exact devices, and what replaced them."""


def validate_gpu_request(request: DriverRequest, caps: DriverCapabilities) -> GpuPlan | None:
    """Check the driver's block and the GPU request; ``None`` means no GPU asked for."""
    driver = request.driver
    _check_block_keys(request, caps)
    ids_field, device_ids = _device_ids(request, caps)
    profile, vendor = _choice(request, device_ids)
    count = None if request.gpu is None else _checked_count(request.gpu.count)
    sharing = EXCLUSIVE if request.gpu is None else _checked_sharing(request.gpu.sharing)

    if count is not None and count > caps.max_gpus_per_sandbox:
        raise UnsupportedGpuRequest(
            "resource_requirements.gpu.count",
            count,
            f"gpu count ({shown(count)}) exceeds the {driver} driver's maximum of "
            f"{caps.max_gpus_per_sandbox} GPUs per sandbox",
        )
    if device_ids and not caps.exact_ids:
        raise UnsupportedGpuRequest(
            ids_field,
            list(device_ids),
            f"the {driver} driver does not support exact GPU device IDs; "
            f"{ids_field} = {shown(list(device_ids))}: request a count instead",
        )
    if device_ids and len(device_ids) > caps.max_gpus_per_sandbox:
        raise UnsupportedGpuRequest(
            ids_field,
            list(device_ids),
            f"{ids_field} names {len(device_ids)} GPUs ({shown(list(device_ids))}); the "
            f"{driver} driver's maximum is {caps.max_gpus_per_sandbox} per sandbox",
        )
    if sharing == SHARED and not caps.shared:
        raise UnsupportedGpuRequest(
            "resource_requirements.gpu.sharing",
            sharing,
            f"the {driver} driver does not share GPUs; resource_requirements.gpu.sharing = "
            f"{shown(sharing)}: ask for an exclusive GPU",
        )
    if profile is not None and not caps.mig_profiles:
        raise UnsupportedGpuRequest(
            request.field(MIG_PROFILE_KEY),
            profile,
            f"the {driver} driver does not hand out MIG instances by profile; "
            f"{request.field(MIG_PROFILE_KEY)} = {shown(profile)}",
        )
    if vendor is not None and vendor not in caps.vendors:
        raise UnsupportedGpuRequest(
            request.field(VENDOR_KEY),
            vendor,
            f"the {driver} driver injects {', '.join(caps.vendors)} GPUs, not {shown(vendor)} "
            f"({request.field(VENDOR_KEY)})",
        )
    if device_ids is None:
        if count is None:
            return None
        return GpuPlan(count=count, sharing=sharing, mig_profile=profile, vendor=vendor)
    if request.gpu is None:
        raise GpuDevicesWithoutRequest(
            ids_field,
            list(device_ids),
            f"{ids_field} requires a gpu request (got {shown(list(device_ids))} "
            "without resource_requirements.gpu)",
        )
    seen: set[str] = set()
    for device_id in device_ids:
        if device_id in seen:
            raise DuplicateGpuDevice(
                ids_field, device_id, f"{ids_field} contains duplicate device ID {shown(device_id)}"
            )
        seen.add(device_id)
    if request.gpu.count is not None and count != len(device_ids):
        raise GpuCountMismatch(
            ids_field,
            list(device_ids),
            f"gpu count ({shown(count)}) must match {ids_field} length ({len(device_ids)}): "
            f"{shown(list(device_ids))}",
        )
    return GpuPlan(count=len(device_ids), device_ids=device_ids, field=ids_field, sharing=sharing)


def _check_block_keys(request: DriverRequest, caps: DriverCapabilities) -> None:
    known = {*caps.id_keys, *CHOICE_KEYS, *caps.config_keys}
    for key, value in request.config.items():
        if key in known:
            continue
        value = thawed(value)
        replaced_by = SUPERSEDED_BLOCK_KEYS.get(key)
        if replaced_by is not None:
            raise InvalidDriverConfig(
                request.field(key),
                value,
                f"{request.field(key)} ({shown(value)}) was replaced by "
                f"{request.field(replaced_by)}",
            )
        raise InvalidDriverConfig(
            request.field(key),
            value,
            f"{request.field()} has an unknown key {shown(key)} = {shown(value)} "
            f"(the {request.driver} driver takes: {', '.join(sorted(known))})",
        )


def _device_ids(
    request: DriverRequest, caps: DriverCapabilities
) -> tuple[str, tuple[str, ...] | None]:
    """The block's device IDs and the field they came from."""
    block = request.config
    present = [key for key in caps.id_keys if key in block]
    if len(present) > 1:
        given = {key: thawed(block[key]) for key in present}
        raise InvalidDriverConfig(
            request.field(),
            given,
            f"{request.field()} gives both {' and '.join(present)} ({shown(given)}); "
            "they are aliases, use one",
        )
    if not present:
        return request.field(DEVICE_IDS_KEY), None
    ids_field = request.field(present[0])
    # Parsed specs hold read-only copies; errors show the value as the user wrote it.
    value = thawed(block[present[0]])
    if not isinstance(value, list):
        raise InvalidDriverConfig(
            ids_field,
            value,
            f"{ids_field} must be a list of strings, got {kind(value)}: {shown(value)}",
        )
    if not value:
        raise InvalidDriverConfig(ids_field, value, f"{ids_field} must not be empty, got []")
    for entry in value:
        if not isinstance(entry, str):
            raise InvalidDriverConfig(
                ids_field,
                entry,
                f"{ids_field} entries must be strings, got {shown(entry)}",
            )
        if not entry.strip():
            raise InvalidDriverConfig(
                ids_field, entry, f"{ids_field} contains a blank device ID {shown(entry)}"
            )
    return ids_field, tuple(value)


def _choice(
    request: DriverRequest, device_ids: tuple[str, ...] | None
) -> tuple[str | None, str | None]:
    """The block's MIG profile and vendor, which pick what counts choose among."""
    chosen = {}
    for key in CHOICE_KEYS:
        value = thawed(request.config.get(key))
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise InvalidDriverConfig(
                request.field(key),
                value,
                f"{request.field(key)} must be a non-empty string, got {shown(value)}",
            )
        chosen[key] = value
    vendor = chosen.get(VENDOR_KEY)
    if vendor is not None and vendor not in VENDORS:
        raise InvalidDriverConfig(
            request.field(VENDOR_KEY),
            vendor,
            f"{request.field(VENDOR_KEY)} must be one of {', '.join(VENDORS)}, got {shown(vendor)}",
        )
    if chosen and device_ids is not None:
        key = next(iter(chosen))
        raise InvalidDriverConfig(
            request.field(key),
            chosen[key],
            f"{request.field()} names exact devices and a {key} ({shown(chosen[key])}): the "
            "devices decide, give one or the other",
        )
    if MIG_PROFILE_KEY in chosen and VENDOR_KEY in chosen and vendor != "nvidia":
        raise InvalidDriverConfig(
            request.field(VENDOR_KEY),
            vendor,
            f"{request.field(MIG_PROFILE_KEY)} ({shown(chosen[MIG_PROFILE_KEY])}) is NVIDIA's; "
            f"{request.field(VENDOR_KEY)} is {shown(vendor)}",
        )
    return chosen.get(MIG_PROFILE_KEY), vendor


def _checked_count(count: Any) -> int:
    if count is None:
        return DEFAULT_GPU_COUNT
    # bool is an int subclass; `true` is not a count.
    if not isinstance(count, int) or isinstance(count, bool):
        raise InvalidGpuCount(
            "resource_requirements.gpu.count",
            count,
            f"gpu count must be an integer, got {shown(count)} ({kind(count)})",
        )
    if count <= 0:
        raise InvalidGpuCount(
            "resource_requirements.gpu.count",
            count,
            f"gpu count must be greater than 0, got {shown(count)}",
        )
    return count


def _checked_sharing(sharing: Any) -> str:
    if sharing is None:
        return EXCLUSIVE
    if sharing not in SHARING_MODES:
        raise InvalidGpuSharing(
            "resource_requirements.gpu.sharing",
            sharing,
            f"gpu sharing must be one of {', '.join(SHARING_MODES)}, got {shown(sharing)}",
        )
    return str(sharing)
