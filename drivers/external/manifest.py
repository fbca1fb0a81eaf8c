"""An external driver's manifest: read, checked against the schema, then against itself.

Every refusal is a ``ManifestError`` naming the key (a dotted path, ``templates.create[3]``)
and the value, raised before any sandbox is made.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drivers.external.schema import ERROR_TYPES, FRAGMENTS, SCHEMA, TEMPLATES_ONLY
from gpuhost import strict
from gpuhost.errors import shown

VARIABLE = re.compile(r"(?<!\{)\{([A-Za-z_][A-Za-z0-9_.]*)\}(?!\})")
"""``{name}``: a variable. Doubled braces (a Go template's ``{{.Names}}``) are left as they are."""
SPLICE = re.compile(r"\{@([a-z_]+)\}")
"""An element that is exactly ``{@fragment}``: replaced by that fragment's arguments."""
JSON_LISTS: Mapping[str, tuple[str, ...]] = {"device_list": ("device_ids",)}
"""The lists a JSON element of each fragment may name, as a string that is exactly ``{@name}``."""

COMMON = ("session_id", "sandbox_id", "driver", "cdi_kind")
AFTER_CREATE = (*COMMON, "id")
TEMPLATE_VARIABLES: Mapping[str, tuple[str, ...]] = {
    "create": (*COMMON, "image"),
    "ready": AFTER_CREATE,
    "pid": AFTER_CREATE,
    "exec": AFTER_CREATE,
    "close": AFTER_CREATE,
    "kill": AFTER_CREATE,
    "list": ("session_id", "driver", "cdi_kind"),
    "reap": ("session_id", "driver", "cdi_kind"),
    "version": ("driver",),
    "inventory": ("driver", "cdi_kind"),
}
"""The variables each template may name."""
TEMPLATE_SPLICES: Mapping[str, tuple[str, ...]] = {
    "create": (*FRAGMENTS, "config"),
    "exec": ("env",),
}
"""The fragments each template may splice in with ``{@name}``."""
FRAGMENT_VARIABLES: Mapping[str, tuple[str, ...]] = {
    "count": ("count",),
    "gpu": ("count", "cdi_kind"),
    "gpu_default": (),
    "device": ("device_id", "uuid", "cdi_kind"),
    "device_list": ("count", "cdi_kind"),
    "dri_node": ("node_path", "node_source"),
    "tool_mount": ("mount_source", "mount_target"),
    "shared": (),
    "image": ("image",),
    "env": ("env_key", "env_value"),
    "mig_profile": ("mig_profile",),
    "vendor": ("vendor",),
}
DEFAULT_TIMEOUTS: Mapping[str, float] = {
    "create": 120.0, "ready": 60.0, "pid": 30.0, "close": 60.0, "kill": 30.0, "list": 30.0,
    "reap": 120.0, "version": 10.0, "hello": 30.0, "shutdown": 10.0, "inventory": 30.0,
}  # fmt: skip
COMMAND_VARIABLES = ("python", "driver")
"""The variables a jsonl manifest's ``command`` may name."""
RESERVED_CONFIG_KEYS = ("gpu_device_ids", "mig_profile", "vendor")


class ManifestError(ValueError):
    """A manifest the adapter refuses: ``key`` is where, ``value`` what was found there."""

    def __init__(self, path: Path | str, key: str, value: object, message: str) -> None:
        super().__init__(f"{path}: {key}: {message} (got {shown(value)})")
        self.path = str(path)
        self.key = key
        self.value = value


@dataclass(frozen=True)
class ConfigKey:
    type: str
    fragment: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class JsonArg:
    """A fragment's argument written as a value: rendered as its JSON text, in one word."""

    value: Any


Arg = str | JsonArg
"""A fragment's argument: a template string, or a JSON element."""


@dataclass(frozen=True)
class FlagRule:
    """What a CLI refuses of one of its flags (``limits``)."""

    once: bool = False
    max_length: int | None = None
    pattern: re.Pattern[str] | None = None
    image_reference: bool = False

    @property
    def takes_value(self) -> bool:
        return self.max_length is not None or self.pattern is not None or self.image_reference


@dataclass(frozen=True)
class ErrorRule:
    """Create's stderr, where ``match`` is found in it, read as the typed error ``error``."""

    match: re.Pattern[str]
    error: str


@dataclass(frozen=True)
class Manifest:
    """A checked manifest (the schema's camelCase keys, as Python names)."""

    path: Path
    name: str
    allocation: str
    sandbox_id: str
    capabilities: Mapping[str, Any]
    templates: Mapping[str, tuple[str, ...]]
    fragments: Mapping[str, tuple[Arg, ...]]
    timeouts: Mapping[str, float]
    driver_error_codes: frozenset[int]
    driver_config: Mapping[str, ConfigKey] = field(default_factory=dict)
    default_image: str | None = None
    description: str = ""
    mode: str = "templates"
    command: tuple[str, ...] = ()
    """Mode jsonl: the driver process's argv."""
    inventory: bool = False
    """Whether the driver says which GPUs it could give (templates.inventory, or the message)."""
    request_on_stdin: bool = False
    """Mode templates: create reads the request as JSON on its stdin."""
    pass_env: tuple[str, ...] = ()
    """The caller's variables its commands are given, beside the fixed PATH and LANG."""
    limits: Mapping[str, FlagRule] = field(default_factory=dict)
    """What the CLI refuses of its flags, by flag: every rendered argv is held to it."""
    errors: tuple[ErrorRule, ...] = ()
    """Create's stderr read as typed errors, the first rule that matches."""

    @property
    def host_registry(self) -> bool:
        return self.allocation == "host-registry"


def load(path: Path | str) -> Manifest:
    """The manifest at ``path``, checked; ``ManifestError`` naming the key otherwise.

    Read by ``gpuhost.strict``: a key given twice, anchors and aliases, tags, merge keys and
    numbers that are not finite are refused, naming the key and its line, as is a file over
    64 KiB or not UTF-8.
    """
    path = Path(path).resolve()
    return parse(strict.read_yaml(path, ManifestError), path)


def parse(data: Any, path: Path | str = "<manifest>") -> Manifest:
    """``data`` (a manifest as YAML reads it) checked against the schema, then against itself."""
    check_schema(data, path)
    manifest = Manifest(
        path=Path(path),
        name=data["name"],
        allocation=data["allocation"],
        sandbox_id=data.get("sandboxId", "stdout"),
        capabilities=data["capabilities"],
        templates={op: tuple(argv) for op, argv in data.get("templates", {}).items()},
        fragments={
            name: tuple(JsonArg(arg["json"]) if isinstance(arg, Mapping) else arg for arg in args)
            for name, args in data.get("fragments", {}).items()
        },
        timeouts={**DEFAULT_TIMEOUTS, **data.get("timeouts", {})},
        driver_error_codes=frozenset(data.get("exec", {}).get("driverErrorCodes", ())),
        driver_config={
            key: ConfigKey(item["type"], tuple(item["fragment"]))
            for key, item in data.get("driverConfig", {}).items()
        },
        default_image=data.get("defaultImage"),
        description=data.get("description", ""),
        mode=data["mode"],
        command=tuple(data.get("command", ())),
        request_on_stdin=bool(data.get("requestOnStdin")),
        inventory=bool(data.get("inventory")) or "inventory" in data.get("templates", {}),
        pass_env=tuple(data.get("passEnv", ())),
        limits={
            flag: _flag_rule(path, flag, rules) for flag, rules in data.get("limits", {}).items()
        },
        errors=tuple(
            _error_rule(path, f"errors[{i}]", rule) for i, rule in enumerate(data.get("errors", ()))
        ),
    )
    check_coherent(manifest, path)
    return manifest


def _pattern(path: Path | str, key: str, text: str) -> re.Pattern[str]:
    try:
        return re.compile(text)
    except re.error as exc:
        raise ManifestError(path, key, text, f"not a regular expression: {exc}") from None


def _flag_rule(path: Path | str, flag: str, rules: Mapping[str, Any]) -> FlagRule:
    pattern = rules.get("pattern")
    return FlagRule(
        once=bool(rules.get("once")),
        max_length=rules.get("maxLength"),
        pattern=None if pattern is None else _pattern(path, f"limits.{flag}.pattern", pattern),
        image_reference=bool(rules.get("imageReference")),
    )


def _error_rule(path: Path | str, key: str, rule: Mapping[str, Any]) -> ErrorRule:
    match = _pattern(path, f"{key}.match", rule["match"])
    needed, optional = ERROR_TYPES[rule["error"]]
    groups = set(match.groupindex)
    if not set(needed) <= groups <= {*needed, *optional}:
        also = f" (and may have {', '.join(optional)})" if optional else ""
        raise ManifestError(
            path, f"{key}.match", rule["match"],
            f"{rule['error']} is read from the named groups {', '.join(needed) or 'none'}{also}; "
            f"the expression has {', '.join(match.groupindex) or 'none'}",
        )  # fmt: skip
    return ErrorRule(match, rule["error"])


def check_schema(data: Any, path: Path | str) -> None:
    """Every schema violation, the first one's key and value in the error's attributes."""
    import jsonschema  # imported once a manifest is read: not at every start of the suite

    if isinstance(data, Mapping):
        mode = data.get("mode")
        for key in TEMPLATES_ONLY if mode == "jsonl" else ("command", "inventory"):
            if key in data:
                other = "templates" if mode == "jsonl" else "jsonl"
                raise ManifestError(
                    path, key, data[key], f"a key of mode {other}, not of mode {mode}"
                )
    _check_finite(data, path, "")
    validator = jsonschema.Draft202012Validator(SCHEMA)
    errors = sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    if not errors:
        return
    found = [_located(error) for error in errors]
    key, value, message = found[0]
    more = "".join(f"; {k}: {m} (got {shown(v)})" for k, v, m in found[1:])
    raise ManifestError(path, key, value, message + more)


def _check_finite(data: Any, path: Path | str, at: str) -> None:
    """No NaN or infinity anywhere: NaN passes every range check of the schema."""
    if isinstance(data, float) and not math.isfinite(data):
        raise ManifestError(path, at or "(top)", data, "must be a finite number")
    if isinstance(data, Mapping):
        for key, value in data.items():
            _check_finite(value, path, f"{at}.{key}" if at else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            _check_finite(value, path, f"{at}[{i}]")


def _located(error: Any) -> tuple[str, Any, str]:
    """The key, value and message of one schema error; an unknown key is named itself."""
    at = _dotted(error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        known = set(error.schema.get("properties", {}))
        extra = sorted(str(key) for key in error.instance if key not in known)
        if extra:
            key = f"{at}.{extra[0]}" if at else extra[0]
            allowed = ", ".join(sorted(known)) or "none"
            return key, error.instance[extra[0]], f"unknown key {extra[0]!r} (known: {allowed})"
    if error.validator == "required":
        return at or "(top)", error.instance, error.message
    if error.validator == "const":
        return at, error.instance, f"must be {error.validator_value!r}"
    if error.validator == "enum":
        return at, error.instance, f"must be one of {', '.join(map(str, error.validator_value))}"
    return at or "(top)", error.instance, error.message


def _dotted(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def check_coherent(manifest: Manifest, path: Path | str) -> None:
    """What the schema cannot say: variables each template knows, splices, reserved keys."""
    for op, argv in manifest.templates.items():
        splices = TEMPLATE_SPLICES.get(op, ())
        for i, arg in enumerate(argv):
            key = f"templates.{op}[{i}]"
            splice = SPLICE.fullmatch(arg)
            if splice:
                _check_known(path, key, arg, f"fragment {{@{splice.group(1)}}}", splices)
                continue
            if "{@" in arg:
                raise ManifestError(path, key, arg, "a {@fragment} must be a whole element")
            _check_variables(path, key, arg, TEMPLATE_VARIABLES[op])
    for name, args in manifest.fragments.items():
        for i, piece in enumerate(args):
            known = (*COMMON, *FRAGMENT_VARIABLES[name])
            key = f"fragments.{name}[{i}]"
            if isinstance(piece, JsonArg):
                _check_json(path, f"{key}.json", piece.value, known, JSON_LISTS.get(name, ()))
            else:
                _check_variables(path, key, piece, known)
    for name, item in manifest.driver_config.items():
        if name in RESERVED_CONFIG_KEYS:
            raise ManifestError(
                path, f"driverConfig.{name}", name, "a key the request model reads itself"
            )
        for i, arg in enumerate(item.fragment):
            _check_variables(path, f"driverConfig.{name}.fragment[{i}]", arg, (*COMMON, "value"))
    for i, arg in enumerate(manifest.command):
        _check_variables(path, f"command[{i}]", arg, COMMAND_VARIABLES)
    no_reap = manifest.mode == "templates" and "reap" not in manifest.templates
    if no_reap and manifest.sandbox_id != "adapter":
        raise ManifestError(
                path, "templates.reap", None,
                "required unless sandboxId is adapter (the adapter then closes each sandbox "
                "list prints, naming it {id})",
            )  # fmt: skip
    caps = manifest.capabilities
    if caps["exactIds"] and not caps.get("idForms"):
        raise ManifestError(
            path, "capabilities.idForms", caps.get("idForms"), "exactIds needs the ID forms"
        )
    if manifest.host_registry and "device" not in manifest.fragments:
        raise ManifestError(
            path, "fragments.device", None,
            "allocation host-registry hands create the leased GPUs through a device fragment",
        )  # fmt: skip
    if manifest.host_registry and not caps.get("idForms"):
        raise ManifestError(
            path, "capabilities.idForms", None,
            "allocation host-registry names the leased GPUs in one of the driver's ID forms",
        )  # fmt: skip


def _check_json(
    path: Path | str, key: str, value: Any, known: tuple[str, ...], lists: tuple[str, ...]
) -> None:
    """Every string of a JSON element is a template; ``{@name}`` whole, for a list it knows."""
    if isinstance(value, str):
        splice = SPLICE.fullmatch(value)
        if splice:
            _check_known(path, key, value, f"list {{@{splice.group(1)}}}", lists)
        elif "{@" in value:
            raise ManifestError(path, key, value, "a {@list} must be a whole string")
        else:
            _check_variables(path, key, value, known)
    elif isinstance(value, Mapping):
        for name, item in value.items():
            if "{" in name:
                raise ManifestError(path, f"{key}.{name}", name, "a JSON key is not a template")
            _check_json(path, f"{key}.{name}", item, known, lists)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(path, f"{key}[{i}]", item, known, lists)


def _check_variables(path: Path | str, key: str, arg: str, known: tuple[str, ...]) -> None:
    for match in VARIABLE.finditer(arg):
        _check_known(path, key, arg, f"variable {{{match.group(1)}}}", known)


def _check_known(path: Path | str, key: str, arg: str, what: str, known: tuple[str, ...]) -> None:
    """Refuse ``what`` (a variable or a fragment, as written) unless its name is ``known``."""
    name = what.split("{", 1)[1].strip("@}")
    if name not in known:
        raise ManifestError(
            path, key, arg, f"unknown {what} here (known here: {', '.join(known) or 'none'})"
        )
