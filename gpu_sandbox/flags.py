"""The command line's GPU flags as a request, in seed 003's shape: one pure mapping.

- ``--gpu``: a GPU request with no count, the driver's default request (one free GPU);
- ``--gpu N`` or ``--gpu=N`` (OpenShell's CLI since v0.0.69), and the seeds' ``--gpu-count
  N``: ``resource_requirements.gpu.count`` is N, as given: 0 or -1 is the request model's
  to refuse, with its own message (``count_flag`` says which flag gave it);
- ``--gpu-sharing MODE``: ``resource_requirements.gpu.sharing`` (``exclusive``, the default,
  or ``shared``), and GPU intent: the per-request answer to seed 000's open question;
- ``--gpu-device ID`` (repeatable): GPU intent; the IDs, as given and in order, go into
  ``template.driver_config.<driver>.gpu_device_ids`` of the active driver, and without
  ``--gpu-count`` the count is the number of *unique* IDs, so that a duplicate stays for
  the driver to refuse by name and a count that disagrees is the user's own;
- ``--driver-config-json JSON``: either the envelope (an object whose keys are all driver
  names: ``{"docker": {...}, "vm": {...}}``), which becomes ``template.driver_config`` as
  it is, or the active driver's block directly, which becomes
  ``template.driver_config.<driver>``. It carries no GPU intent of its own (IDs in it need
  ``--gpu`` or ``--gpu-count``, as in a request). With ``--gpu-device`` the IDs join the
  active block; when that block names IDs too (``gpu_device_ids`` or an alias), that is
  refused: give them once;
- ``--image``, ``--env KEY=VALUE`` (repeatable, the last of a key wins): ``template.image``,
  ``template.env``.

Nothing that the request model checks is checked here: the request goes to the gateway and
the driver's own validation, and ``flag_of`` names the flag an error's field came from.
"""

from __future__ import annotations

import shlex
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from drivers import REGISTRY
from gpuhost.errors import (
    SHOWN_LIMIT,
    GpuCountMismatch,
    InvalidDriverConfig,
    InvalidGpuRequest,
    RequestError,
    named,
    shown,
)
from gpuhost.requestjson import read_json
from gpuhost.spec import DEVICE_IDS_KEY, ENVELOPE, block_field

REQUEST_FLAGS = (
    "--gpu",
    "--gpu-count",
    "--gpu-sharing",
    "--gpu-device",
    "--driver-config-json",
    "--image",
    "--env",
)
"""The flags that build a request, none of which may stand beside a whole one (--request)."""


@dataclass(frozen=True)
class GpuFlags:
    """The flags that make a spec, as given on the command line."""

    gpu: bool = False
    gpu_count: int | None = None
    count_flag: str = "--gpu-count"
    """The flag that gave ``gpu_count``: ``--gpu-count``, or ``--gpu`` (``--gpu=N``)."""
    gpu_sharing: str | None = None
    gpu_devices: tuple[str, ...] = ()
    driver_config_json: str | None = None
    """The text of ``--driver-config-json`` (a file's text, for ``@FILE``)."""
    driver_config_arg: str | None = None
    """``--driver-config-json`` as given, for messages: the JSON, or ``@FILE``."""
    image: str | None = None
    env: tuple[str, ...] = ()

    def given(self) -> list[str]:
        """The request flags given, by name."""
        values = [self.gpu, self.gpu_count, self.gpu_sharing, self.gpu_devices]
        values += [self.driver_config_json, self.image, self.env]
        return [
            flag
            for flag, value in zip(REQUEST_FLAGS, values, strict=True)
            if value not in (None, False, ())
        ]


def spec_dict(
    flags: GpuFlags,
    driver: str,
    id_keys: Sequence[str] = (DEVICE_IDS_KEY,),
    drivers: Collection[str] = tuple(REGISTRY),
) -> dict[str, Any]:
    """The request the flags make for ``driver`` (its ``name``), in seed 003's shape.

    ``id_keys`` are the keys the driver's block names devices by (its capabilities'
    ``id_keys``); ``drivers`` the names that make ``--driver-config-json`` an envelope.
    Raises a typed error only where the flags cannot make a request at all: the JSON is not
    JSON, IDs come from both ``--gpu-device`` and the block, an ``--env`` is not KEY=VALUE.
    """
    spec: dict[str, Any] = {}
    if (
        flags.gpu
        or flags.gpu_count is not None
        or flags.gpu_sharing is not None
        or flags.gpu_devices
    ):
        gpu: dict[str, Any] = {}
        if flags.gpu_count is not None:
            gpu["count"] = flags.gpu_count
        elif flags.gpu_devices:
            gpu["count"] = len(set(flags.gpu_devices))
        if flags.gpu_sharing is not None:
            gpu["sharing"] = flags.gpu_sharing
        spec["resource_requirements"] = {"gpu": gpu}
    template: dict[str, Any] = {}
    if flags.image is not None:
        template["image"] = flags.image
    if flags.env:
        template["env"] = _env(flags.env)
    envelope = _envelope(flags, driver, id_keys, {*drivers, driver})
    if envelope is not None:
        template["driver_config"] = envelope
    if template:
        spec["template"] = template
    return spec


def flag_of(
    error: RequestError, flags: GpuFlags, driver: str, id_keys: Sequence[str] = (DEVICE_IDS_KEY,)
) -> str:
    """The flag (with its value, as given) that ``error``'s field came from; "" if none."""
    field = error.field
    ids_fields = {block_field(driver, key) for key in id_keys}
    devices = " ".join(flag_text("--gpu-device", device) for device in flags.gpu_devices)
    config = flag_text("--driver-config-json", flags.driver_config_arg or flags.driver_config_json)
    if field == "resource_requirements.gpu.count":
        if flags.gpu_count is not None:
            return _count_flag(flags.count_flag, flags.gpu_count)
        return devices or "--gpu"
    if field == "resource_requirements.gpu.sharing":
        return flag_text("--gpu-sharing", flags.gpu_sharing)
    if isinstance(error, GpuCountMismatch) and flags.gpu_count is not None:
        return f"{_count_flag(flags.count_flag, flags.gpu_count)} {devices or config}"
    if field in ids_fields and flags.gpu_devices:
        device = error.value if isinstance(error.value, str) else None
        if device in flags.gpu_devices:
            return flag_text("--gpu-device", device)
        return f"{devices} {config}" if flags.driver_config_json is not None else devices
    if field.startswith(ENVELOPE):
        return config if flags.driver_config_json is not None else ""
    if field == "template.image":
        return flag_text("--image", flags.image)
    if field == "template.env" or field.startswith("template.env."):
        name = field.removeprefix("template.env.") if field != "template.env" else error.value
        given = [pair for pair in flags.env if pair == name or pair.partition("=")[0] == name]
        return " ".join(flag_text("--env", pair) for pair in given) or "--env"
    return ""


def _envelope(
    flags: GpuFlags, driver: str, id_keys: Sequence[str], drivers: Collection[str]
) -> Any:
    """``template.driver_config``: the JSON's envelope or block, with the IDs joined."""
    value: Any = None
    if flags.driver_config_json is not None:
        value = read_json(
            flags.driver_config_json,
            block_field(driver),
            "--driver-config-json",
            InvalidDriverConfig,
        )
    if _is_envelope(value, drivers):
        envelope = dict(value)
    elif value is None:
        envelope = {}
    else:
        envelope = {driver: value}
    if flags.gpu_devices:
        block = envelope.get(driver, {})
        if not isinstance(block, dict):
            return envelope  # the request model refuses it as it is: a block is an object
        for key in id_keys:
            if key in block:
                raise InvalidDriverConfig(
                    block_field(driver, key),
                    block[key],
                    f"device IDs come from both --gpu-device ({shown(list(flags.gpu_devices))}) "
                    f"and {block_field(driver, key)} ({shown(block[key])}): give them once",
                )
        envelope[driver] = {**block, DEVICE_IDS_KEY: list(flags.gpu_devices)}
    return envelope or None


def _is_envelope(value: Any, drivers: Collection[str]) -> bool:
    """An object whose keys are all driver names is the envelope, not one driver's block."""
    return isinstance(value, dict) and bool(value) and all(key in drivers for key in value)


def _env(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidGpuRequest(
                "template.env", pair, f"env entries are KEY=VALUE, got {shown(pair)}"
            )
        env[key] = value
    return env


def flag_text(flag: str, value: str | None, limit: int = SHOWN_LIMIT) -> str:
    """``--flag=VALUE`` as a shell would take it back, on one line and cut past ``limit``."""
    if value is None:
        return flag
    text = named(value, limit)
    return f"{flag}={shlex.quote(value) if text == value else text}"


def _count_flag(flag: str, count: int) -> str:
    # str() refuses integers of more than 4,300 digits.
    if count.bit_length() > 14_000:
        return f"{flag}={shown(count)}"
    return flag_text(flag, str(count))
