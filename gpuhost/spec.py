"""The request model: a frozen ``SandboxSpec`` parsed strictly from the user's dict or JSON.

The request has the shape of seed 003, the shape OpenShell's gateway receives::

    {"resource_requirements": {"gpu": {"count": 1, "sharing": "exclusive"}},
     "template": {"image": "...", "env": {...},
                  "driver_config": {"docker": {"gpu_device_ids": ["nvidia.com/gpu=0"]},
                                    "vm": {"gpu_device_ids": ["0000:2d:00.0"]}}}}

Portable intent lives in ``resource_requirements.gpu`` (absent: no GPU; present with no
count: the default request of one GPU; ``count: N``: N GPUs). What the sandbox is made from
lives in ``template``: its image, its environment, and the driver-keyed envelope
``driver_config`` whose blocks are driver-native (exact devices: ``gpu_device_ids``).

The gateway (``select``) hands a driver only its own block, as a ``DriverRequest``; the
other blocks are not the driver's business and are never read. ``gpuhost.validation`` then
judges that block and the GPU request against the driver's capabilities.

``SandboxSpec`` is the request as given; ``GpuPlan`` is the request once validated.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from gpuhost import idforms
from gpuhost.devices import GpuDevice
from gpuhost.errors import (
    FIELD_LIMIT,
    InvalidDriverConfig,
    InvalidGpuRequest,
    digits,
    named,
    shown,
)
from gpuhost.requestjson import MAX_DEPTH, MAX_INT_DIGITS, deep_freeze, kind, read_json, thawed

DEFAULT_GPU_COUNT = 1
EXCLUSIVE, SHARED = "exclusive", "shared"
SHARING_MODES = (EXCLUSIVE, SHARED)
VENDORS = ("nvidia", "amd", "intel")
DEVICE_IDS_KEY = "gpu_device_ids"
MIG_PROFILE_KEY = "mig_profile"
VENDOR_KEY = "vendor"
CHOICE_KEYS = (MIG_PROFILE_KEY, VENDOR_KEY)
"""Keys of a driver's block that pick what counts and defaults choose among."""
ENVELOPE = "template.driver_config"
"""Where the driver-keyed envelope lives in a request."""
_SPEC_KEYS = frozenset({"resource_requirements", "template"})
_TEMPLATE_KEYS = frozenset({"image", "env", "driver_config"})
_MOVED_INTO_TEMPLATE = ("driver_config", "image", "env")
"""Top-level keys of the shape before seed 003, refused with where they went."""
NOT_TEXT = re.compile("[\x00\ud800-\udfff]")
"""What no process's environment can hold: NUL ends a C string, UTF-8 has no lone surrogate."""
_GPU_KEYS = frozenset({"count", "sharing"})
_SUPERSEDED_GPU_KEYS = ("device_ids", "device_id", "gpu_device_ids")
"""Seed 001's exact IDs in the portable request: they went to the driver's block."""


def block_field(driver: str, key: str | None = None) -> str:
    """The request's field for ``driver``'s block, or for ``key`` in it."""
    return f"{ENVELOPE}.{driver}" + ("" if key is None else f".{key}")


@dataclass(frozen=True)
class GpuRequest:
    """``resource_requirements.gpu`` as given: ``count=None`` is the default request.

    The count is kept as the user wrote it; validation checks it in its turn (after the
    active driver's block), so errors come in the documented order.
    """

    count: Any = None
    sharing: Any = None
    """``exclusive`` (the default: no other sandbox on the GPU) or ``shared`` (co-held with
    other shared sandboxes only, up to the host's limit); kept as written, checked later."""


@dataclass(frozen=True)
class SandboxSpec:
    """What a user asks for, as the gateway receives it; immutable once parsed.

    ``driver_config`` is the whole envelope of ``template.driver_config``, one block per
    driver; ``image`` and ``env`` are the template's.
    """

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
        """The request in seed 003's shape, which ``parse_spec`` reads back into an equal spec."""
        data: dict[str, Any] = {}
        if self.gpu is not None:
            data["resource_requirements"] = {"gpu": _gpu_dict(self.gpu)}
        template: dict[str, Any] = {}
        if self.image is not None:
            template["image"] = self.image
        if self.env:
            template["env"] = dict(self.env)
        if self.driver_config:
            template["driver_config"] = thawed(self.driver_config)
        if template:
            data["template"] = template
        return data


@dataclass(frozen=True)
class DriverRequest:
    """What the gateway hands one driver: the portable request and the driver's own block.

    ``config`` is the inner object of ``template.driver_config.<driver>`` (empty when the
    request has none); no other driver's block reaches the driver.
    """

    driver: str
    gpu: GpuRequest | None = None
    image: str | None = None
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def field(self, key: str | None = None) -> str:
        """The request's field for this driver's block, or for ``key`` in it."""
        return block_field(self.driver, key)

    def to_dict(self) -> dict[str, Any]:
        """What the driver receives, in the request's shape with the block in place."""
        data: dict[str, Any] = {}
        if self.gpu is not None:
            data["resource_requirements"] = {"gpu": _gpu_dict(self.gpu)}
        if self.image is not None:
            data["image"] = self.image
        if self.env:
            data["env"] = dict(self.env)
        data["driver_config"] = thawed(self.config)
        return data

    def to_spec(self) -> SandboxSpec:
        """The request as a spec again, its block the envelope's only one (none when empty).

        What ``select`` picked, put back: ``select(r.to_spec(), r.driver) == r`` for a
        request with a block. What an external driver is handed, in seed 003's shape.
        """
        block = {self.driver: self.config} if self.config else {}
        return SandboxSpec(image=self.image, env=self.env, gpu=self.gpu, driver_config=block)


def select(spec: SandboxSpec, driver: str) -> DriverRequest:
    """The gateway: pick ``driver``'s block of the envelope and hand on only that.

    Blocks for other drivers are dropped unread, as seed 003's gateway does: a request that
    names exact devices only for docker is, for the kubernetes driver, a plain request of
    its count. The block is not interpreted here; the driver judges it.
    """
    return DriverRequest(
        driver=driver,
        gpu=spec.gpu,
        image=spec.image,
        env=spec.env,
        config=spec.driver_config.get(driver, MappingProxyType({})),
    )


HOST_REGISTRY, DRIVER_SCHEDULER = "host registry", "driver"
ALLOCATORS = (HOST_REGISTRY, DRIVER_SCHEDULER)
"""Who allocates a sandbox's GPUs: ``DriverCapabilities.allocated_by``."""


@dataclass(frozen=True)
class DriverCapabilities:
    """What a driver declares it can do; the validator and the catalogue read it."""

    max_gpus_per_sandbox: int
    exact_ids: bool
    exact_id_forms: str = ""
    """The forms accepted in ``gpu_device_ids``, in words, for error messages: by default
    ``id_forms``'s (``idforms.forms_text``)."""
    id_forms: tuple[str, ...] = ()
    """The forms it takes exact IDs in, from the one table (``gpuhost.idforms``), first the
    one a device is named by: ``Driver.device_ids`` writes each device's IDs in them."""
    other_vendor_id_forms: tuple[str, ...] | None = None
    """Those it takes for AMD and Intel GPUs, where they differ from ``id_forms``."""
    exclusive: bool = True
    shared: bool = False
    """It can serve ``sharing: shared`` requests (co-held GPUs, time-sliced)."""
    mig_profiles: bool = False
    """It can serve ``template.driver_config.<driver>.mig_profile`` (counts of MIG instances)."""
    vendors: tuple[str, ...] = ("nvidia",)
    """The GPU vendors it can inject."""
    device_id_aliases: tuple[str, ...] = ()
    """Other names its block takes for ``gpu_device_ids`` (docker and podman: upstream's
    ``cdi_devices``); giving both is refused."""
    config_keys: tuple[str, ...] = ()
    """Keys of its own block that it reads, and checks itself, beside ``gpu_device_ids``,
    ``mig_profile`` and ``vendor``; any other key is refused as unknown."""
    host_filesystem: bool = False
    """Its sandboxes see the host's files at their own paths, read-only (a jail, not an
    image): the suite's own interpreter can run inside, where ``Driver.sees`` says so."""
    allocated_by: str = HOST_REGISTRY
    """Who chooses and holds a sandbox's GPUs: the host-wide lease registry, through the
    contract (``Driver.allocate``), or the driver's own scheduler (a cluster's)."""

    def __post_init__(self) -> None:
        if self.allocated_by not in ALLOCATORS:
            raise ValueError(f"allocated_by {self.allocated_by!r} is not one of {ALLOCATORS}")
        object.__setattr__(self, "id_forms", idforms.check_forms(self.id_forms))
        other = self.other_vendor_id_forms
        if other is not None:
            object.__setattr__(self, "other_vendor_id_forms", idforms.check_forms(other))
        if not self.exact_id_forms and self.id_forms:
            words = idforms.forms_text(self.id_forms)
            if other is not None:
                words += f"; for AMD and Intel GPUs {idforms.forms_text(other)}"
            object.__setattr__(self, "exact_id_forms", words)

    def id_forms_of(self, gpu: GpuDevice) -> tuple[str, ...]:
        """The forms that name ``gpu``: ``other_vendor_id_forms`` for AMD and Intel GPUs."""
        if gpu.vendor != "nvidia" and self.other_vendor_id_forms is not None:
            return self.other_vendor_id_forms
        return self.id_forms

    @property
    def id_keys(self) -> tuple[str, ...]:
        """Every key its block names exact devices by."""
        return (DEVICE_IDS_KEY, *self.device_id_aliases)


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
    """Parse the request (a dict, or its JSON text) into a ``SandboxSpec``.

    Only the shape every driver shares is checked here; a driver's block is its own to judge.
    A dict is held to what its JSON text would be (``read_json``): keys are printable strings,
    values JSON's, nested at most ``MAX_DEPTH`` deep.
    """
    if isinstance(data, str):
        data = read_json(data)
    data = _json_value(data, "")
    if not isinstance(data, dict):
        raise InvalidGpuRequest(
            "spec", data, f"spec must be an object, got {kind(data)}: {shown(data)}"
        )
    for key in _MOVED_INTO_TEMPLATE:
        if key in data:
            error = InvalidDriverConfig if key == "driver_config" else InvalidGpuRequest
            raise error(
                key,
                data[key],
                f"spec has {key} at the top level ({shown(data[key])}); it moved to "
                f"template.{key}, as in seed 003's request",
            )
    _reject_unknown_keys("spec", data, _SPEC_KEYS, InvalidGpuRequest)
    template = data.get("template", {})
    if not isinstance(template, dict):
        raise InvalidGpuRequest(
            "template",
            template,
            f"template must be an object, got {kind(template)}: {shown(template)}",
        )
    _reject_unknown_keys("template", template, _TEMPLATE_KEYS, InvalidGpuRequest)
    image = template.get("image")
    if image is not None:
        check_image(image, "template.image")
    return SandboxSpec(
        image=image,
        env=MappingProxyType(_parse_env(template.get("env", {}))),
        driver_config=parse_envelope(template.get("driver_config", {})),
        gpu=_parse_gpu(data.get("resource_requirements")),
    )


def check_image(
    image: object, where: str, error: type[InvalidGpuRequest] = InvalidGpuRequest
) -> str:
    """An image's name, or ``error`` at ``where``: one no engine could ever find is refused.

    Names have no white space and no control characters (NUL among them); one that had would
    be refused only by the engine, once the GPUs were taken.
    """
    if (
        not isinstance(image, str)
        or not image
        or not image.isprintable()
        or any(char.isspace() for char in image)
    ):
        raise error(
            where,
            image,
            f"{where} must be an image's name: a non-empty string without white space or "
            f"control characters, got {shown(image)}",
        )
    return image


def _parse_env(env: object) -> dict[str, str]:
    """``template.env``: names (no '=') to strings, each of which a process can be given."""
    if not isinstance(env, dict):
        raise InvalidGpuRequest(
            "template.env",
            env,
            f"template.env must map variable names to strings, got {kind(env)}: {shown(env)}",
        )
    for name, value in env.items():
        if not name or "=" in name:
            raise InvalidGpuRequest(
                "template.env",
                name,
                f"template.env has a variable name {shown(name)}: names are non-empty and "
                "hold no '='",
            )
        where = f"template.env.{name}"
        if not isinstance(value, str) or NOT_TEXT.search(value):
            raise InvalidGpuRequest(
                where,
                value,
                f"{named(where, FIELD_LIMIT)} must be a string without NUL characters or lone "
                f"surrogates (text UTF-8 can carry), got {shown(value)}",
            )
    return dict(env)


def _json_value(value: object, where: str, depth: int = 0) -> Any:
    """``value`` as plain dicts and lists, if it is what JSON text can hold; refused if not.

    ``where`` is its field ("" for the whole request). Keys must be printable, since fields
    are named by them on one line.
    """
    field = where or "spec"
    error = InvalidDriverConfig if field.startswith(ENVELOPE) else InvalidGpuRequest
    name = named(field, FIELD_LIMIT)
    if depth > MAX_DEPTH:
        raise error(
            field,
            value,
            f"{name} nests deeper than a request may ({MAX_DEPTH} levels): {shown(value)}",
        )
    if isinstance(value, Mapping):
        plain = {}
        for key, item in value.items():
            if not isinstance(key, str) or not key.isprintable():
                raise error(
                    field,
                    key,
                    f"{name} has a key {shown(key)}: keys are strings of printable characters",
                )
            plain[key] = _json_value(item, _child(where, key), depth + 1)
        return plain
    if isinstance(value, list | tuple):
        return [_json_value(item, f"{field}[{i}]", depth + 1) for i, item in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise error(field, value, f"{name} is {shown(value)}, which is not a JSON number")
    if (
        isinstance(value, int)
        and value.bit_length() > MAX_INT_DIGITS * 3
        and (digits(value) > MAX_INT_DIGITS)
    ):
        raise error(
            field,
            value,
            f"{name} is {shown(value)}; a request's integers have at most {MAX_INT_DIGITS} digits",
        )
    if value is None or isinstance(value, str | int | float):
        return value
    raise error(
        field,
        value,
        f"{name} is {type(value).__name__} {shown(value)}, which is not a JSON value",
    )


def _child(where: str, key: str) -> str:
    """The field of ``key`` in ``where``; an unknown top-level key's is under ``spec``."""
    if where:
        return f"{where}.{key}"
    return key if key in _SPEC_KEYS or key in _MOVED_INTO_TEMPLATE else f"spec.{key}"


def parse_envelope(config: object) -> Mapping[str, Mapping[str, Any]]:
    """``template.driver_config``: an object of driver names to objects, frozen."""
    if not isinstance(config, Mapping):
        raise InvalidDriverConfig(
            ENVELOPE,
            config,
            f"{ENVELOPE} must be an object, got {kind(config)}: {shown(config)}",
        )
    for driver, block in config.items():
        if not isinstance(block, Mapping):
            raise InvalidDriverConfig(
                block_field(driver),
                block,
                f"{named(block_field(driver), FIELD_LIMIT)} must be an object, got "
                f"{kind(block)}: {shown(block)}",
            )
    return _freeze(config)


def _parse_gpu(requirements: object) -> GpuRequest | None:
    if requirements is None:
        return None
    if not isinstance(requirements, Mapping):
        raise InvalidGpuRequest(
            "resource_requirements",
            requirements,
            f"resource_requirements must be an object, got {kind(requirements)}: "
            f"{shown(requirements)}",
        )
    _reject_unknown_keys("resource_requirements", requirements, {"gpu"}, InvalidGpuRequest)
    if "gpu" not in requirements or requirements["gpu"] is None:
        return None
    gpu = requirements["gpu"]
    where = "resource_requirements.gpu"
    if not isinstance(gpu, Mapping):
        raise InvalidGpuRequest(
            where, gpu, f"{where} must be an object, got {kind(gpu)}: {shown(gpu)}"
        )
    for key in _SUPERSEDED_GPU_KEYS:
        if key in gpu:
            raise InvalidGpuRequest(
                f"{where}.{key}",
                gpu[key],
                f"{where}.{key} ({shown(gpu[key])}) was replaced by "
                f"{block_field('<driver>', DEVICE_IDS_KEY)}: exact devices are driver-native, "
                f"in the block of the driver they are for",
            )
    _reject_unknown_keys(where, gpu, _GPU_KEYS, InvalidGpuRequest)
    return GpuRequest(gpu.get("count"), gpu.get("sharing"))


def _gpu_dict(gpu: GpuRequest) -> dict[str, Any]:
    data: dict[str, Any] = {} if gpu.count is None else {"count": gpu.count}
    if gpu.sharing is not None:
        data["sharing"] = gpu.sharing
    return data


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
                f"{where} has an unknown key {shown(key)} = {shown(mapping[key])} "
                f"(known: {', '.join(sorted(known))})",
            )


def _freeze(config: Mapping[str, Any]) -> Mapping[str, Mapping[str, Any]]:
    frozen: Mapping[str, Mapping[str, Any]] = deep_freeze(config)
    return frozen
