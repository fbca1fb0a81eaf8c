"""The command line's GPU flags as a request spec: one pure mapping.

- ``--gpu``: a GPU request with no count, the driver's default request (one free GPU);
- ``--gpu-count N``: ``resource_requirements.gpu.count`` is N, as given: 0 or -1 is the
  request model's to refuse, with its own message;
- ``--gpu-device ID`` (repeatable): GPU intent; the IDs, as given and in order, go into
  ``driver_config.<driver>.gpu_device_ids`` of the active driver, and without
  ``--gpu-count`` the count is the number of *unique* IDs, so that a duplicate stays for
  the driver to refuse by name and a count that disagrees is the user's own;
- ``--driver-config-json JSON``: the active driver's block, given directly, as
  ``driver_config.<driver>``; it carries no GPU intent of its own (IDs in it need ``--gpu``
  or ``--gpu-count``, as in a spec). With ``--gpu-device`` the IDs join the block; when the
  block names IDs too (``gpu_device_ids`` or an alias), that is refused: give them once;
- ``--image``, ``--env KEY=VALUE`` (repeatable, the last of a key wins): ``image``, ``env``.

Nothing that the request model checks is checked here: the spec goes to the driver's own
validation, and ``flag_of`` names the flag an error's field came from.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpuhost.errors import GpuCountMismatch, InvalidDriverConfig, InvalidGpuRequest, RequestError
from gpuhost.spec import DEVICE_IDS_ALIASES, DEVICE_IDS_KEY, SandboxSpec, parse_spec


@dataclass(frozen=True)
class GpuFlags:
    """The flags that make a spec, as given on the command line."""

    gpu: bool = False
    gpu_count: int | None = None
    gpu_devices: tuple[str, ...] = ()
    driver_config_json: str | None = None
    """The text of ``--driver-config-json`` (a file's text, for ``@FILE``)."""
    driver_config_arg: str | None = None
    """``--driver-config-json`` as given, for messages: the JSON, or ``@FILE``."""
    image: str | None = None
    env: tuple[str, ...] = ()


def spec_dict(flags: GpuFlags, driver: str) -> dict[str, Any]:
    """The spec the flags make for ``driver`` (its ``name``), in the request model's shape.

    Raises a typed error only where the flags cannot make a spec at all: the block is not
    JSON, IDs come from both ``--gpu-device`` and the block, an ``--env`` is not KEY=VALUE.
    """
    spec: dict[str, Any] = {}
    if flags.image is not None:
        spec["image"] = flags.image
    if flags.env:
        spec["env"] = _env(flags.env)
    if flags.gpu or flags.gpu_count is not None or flags.gpu_devices:
        gpu: dict[str, Any] = {}
        if flags.gpu_count is not None:
            gpu["count"] = flags.gpu_count
        elif flags.gpu_devices:
            gpu["count"] = len(set(flags.gpu_devices))
        spec["resource_requirements"] = {"gpu": gpu}
    block = _block(flags, driver)
    if block is not None:
        spec["driver_config"] = {driver: block}
    return spec


def spec_from_flags(flags: GpuFlags, driver: str) -> SandboxSpec:
    """``spec_dict``, parsed: the shape every driver shares is checked, not the GPU request."""
    return parse_spec(spec_dict(flags, driver))


def flag_of(error: RequestError, flags: GpuFlags, driver: str) -> str:
    """The flag (with its value, as given) that ``error``'s field came from; "" if none."""
    field = error.field
    ids_fields = {f"driver_config.{driver}.{key}" for key in _id_keys(driver)}
    devices = " ".join(_flag("--gpu-device", device) for device in flags.gpu_devices)
    config = _flag("--driver-config-json", flags.driver_config_arg or flags.driver_config_json)
    if field == "resource_requirements.gpu.count":
        if flags.gpu_count is not None:
            return _flag("--gpu-count", str(flags.gpu_count))
        return devices or "--gpu"
    if isinstance(error, GpuCountMismatch) and flags.gpu_count is not None:
        return f"{_flag('--gpu-count', str(flags.gpu_count))} {devices or config}"
    if field in ids_fields and flags.gpu_devices:
        named = error.value if isinstance(error.value, str) else None
        if named in flags.gpu_devices:
            return _flag("--gpu-device", named)
        return f"{devices} {config}" if flags.driver_config_json is not None else devices
    if field.startswith("driver_config"):
        return config if flags.driver_config_json is not None else ""
    if field == "image":
        return _flag("--image", flags.image)
    if field == "env":
        return _flag("--env", error.value if isinstance(error.value, str) else None)
    return ""


def _block(flags: GpuFlags, driver: str) -> Any:
    """The active driver's block: the JSON's, with the ``--gpu-device`` IDs joined."""
    block: Any = None
    if flags.driver_config_json is not None:
        try:
            block = json.loads(flags.driver_config_json)
        except json.JSONDecodeError as exc:
            raise InvalidDriverConfig(
                f"driver_config.{driver}",
                flags.driver_config_json,
                f"driver_config.{driver} is not valid JSON: {exc}",
            ) from None
    if not flags.gpu_devices:
        return block
    if block is None:
        return {DEVICE_IDS_KEY: list(flags.gpu_devices)}
    if not isinstance(block, dict):
        return block  # the request model refuses it as it is: a block must be an object
    for key in _id_keys(driver):
        if key in block:
            raise InvalidDriverConfig(
                f"driver_config.{driver}.{key}",
                block[key],
                f"device IDs come from both --gpu-device ({list(flags.gpu_devices)!r}) and "
                f"driver_config.{driver}.{key} ({block[key]!r}): give them once",
            )
    return {**block, DEVICE_IDS_KEY: list(flags.gpu_devices)}


def _env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidGpuRequest("env", pair, f"env entries are KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _id_keys(driver: str) -> tuple[str, ...]:
    return (DEVICE_IDS_KEY, *DEVICE_IDS_ALIASES.get(driver, ()))


def _flag(flag: str, value: str | None) -> str:
    return flag if value is None else f"{flag}={shlex.quote(value)}"
