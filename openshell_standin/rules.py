"""The rules OpenShell's gateway applies to the RPCs the CLI sends, as its source has them.

Each rule cites NVIDIA/OpenShell at release v0.0.111 (the release whose CLI the stand-in
serves): ``server/`` is crates/openshell-server/src, ``core/`` crates/openshell-core/src,
``docker/`` crates/openshell-driver-docker/src, ``podman/`` crates/openshell-driver-podman/src,
``supervisor/`` crates/openshell-supervisor-process/src. A refusal is ``Refused``: the gRPC
status code the gateway returns and its message. Lengths are in bytes, as Rust's ``len()``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# server/grpc/mod.rs:126-158; server/grpc/validation.rs:31-39; server/grpc/sandbox.rs:1874
MAX_NAME_LEN = 253
MAX_ROUTABLE_NAME_LEN = 19
"""Three DNS-routable names and two '--' fit a 63-character DNS label (grpc/mod.rs:127-130)."""
MAX_ENVIRONMENT_ENTRIES = 128
MAX_MAP_KEY_LEN = 256
MAX_MAP_VALUE_LEN = 8192
MAX_TEMPLATE_STRING_LEN = 1024
MAX_TEMPLATE_MAP_ENTRIES = 128
MAX_TEMPLATE_STRUCT_SIZE = 65_536
MAX_LABEL_SELECTOR_PAIRS = 64
MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 100
MAX_EXEC_COMMAND_ARGS = 1024
MAX_EXEC_ARG_LEN = 32 * 1024
MAX_EXEC_WORKDIR_LEN = 4096
MAX_MAIN_PROCESS_ARGS = 256
MAX_MAIN_PROCESS_ARGV_SIZE = 256 * 1024
MAX_ENV_SERIALIZED_SIZE = 256 * 1024
MAX_COMMAND_STRING_LEN = 256 * 1024
TIMEOUT_EXIT_CODE = 124
"""An exec past its timeout (server/grpc/sandbox.rs:1977-1983)."""
SIGNALLED_EXIT_CODE = 1
"""A command killed by a signal has no exit code: reported as 1 (supervisor/ssh.rs:1369)."""
DEFAULT_COMMAND = ("/bin/bash", "-l")
"""The main process of a create that names none (server/grpc/sandbox.rs:225-228)."""
DEFAULT_IMAGE = "ghcr.io/nvidia/openshell-community/sandboxes/base:latest"
"""The image a create that names none gets (core/image.rs:21-23; sandbox.rs:272-276)."""
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # server/grpc/provider.rs:2124
_SAFE_WORD = re.compile(r"[A-Za-z0-9./_-]+")  # server/grpc/sandbox.rs:1866-1868


class Refused(Exception):
    """What the gateway answers instead: a gRPC status code's name and its message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> Refused:
    return Refused("INVALID_ARGUMENT", message)


def size(text: str) -> int:
    return len(text.encode())


def check_dns1123_label(name: str, field: str) -> None:
    """server/grpc/validation.rs:115-145; empty is the caller's to judge."""
    if not name:
        return
    if size(name) > MAX_NAME_LEN:
        raise invalid(f"{field} exceeds maximum length ({size(name)} > {MAX_NAME_LEN})")
    if not all(c.isascii() and (c.islower() or c.isdigit() or c == "-") for c in name):
        raise invalid(f"{field} must contain only lowercase alphanumeric characters or hyphens")
    if name.startswith("-") or name.endswith("-"):
        raise invalid(f"{field} must not start or end with a hyphen")
    if "--" in name:
        raise invalid(f"{field} must not contain consecutive hyphens")


def check_name(name: str) -> None:
    """A create's name: 19 bytes at most, a DNS-1123 label (validation.rs:157-163)."""
    if name and size(name) > MAX_ROUTABLE_NAME_LEN:
        raise invalid(f"name exceeds maximum length ({size(name)} > {MAX_ROUTABLE_NAME_LEN})")
    check_dns1123_label(name, "name")


def reject_control_chars(value: str, field: str) -> None:
    """validation.rs:80-104: no NUL, no newline, no carriage return."""
    if "\0" in value:
        raise invalid(f"{field} contains null bytes")
    if "\n" in value or "\r" in value:
        raise invalid(f"{field} contains newline or carriage return characters")


def check_string_map(
    values: Mapping[str, str], max_entries: int, max_key: int, max_value: int, field: str
) -> None:
    """validation.rs:316-344."""
    if len(values) > max_entries:
        raise invalid(f"{field} exceeds maximum entries ({len(values)} > {max_entries})")
    for key, value in values.items():
        if size(key) > max_key:
            raise invalid(f"{field} key exceeds maximum length ({size(key)} > {max_key})")
        if size(value) > max_value:
            raise invalid(f"{field} value exceeds maximum length ({size(value)} > {max_value})")


def check_env_entries(values: Mapping[str, str], field: str, allowed: Sequence[str] = ()) -> None:
    """validation.rs:398-421: keys a shell can assign, none OPENSHELL_*, values on one line."""
    for key, value in values.items():
        if not _ENV_KEY.fullmatch(key):
            raise invalid(f"{field} keys must match ^[A-Za-z_][A-Za-z0-9_]*$; got '{key}'")
        if key.startswith("OPENSHELL_") and key not in allowed:
            raise invalid(f"{field} keys starting with OPENSHELL_ are reserved; got '{key}'")
        reject_control_chars(value, f"{field} value for '{key}'")


def check_environment(values: Mapping[str, str], field: str) -> None:
    """A create's environment (validation.rs:190-197, 378-389)."""
    check_string_map(values, MAX_ENVIRONMENT_ENTRIES, MAX_MAP_KEY_LEN, MAX_MAP_VALUE_LEN, field)
    total = sum(size(k) + size(v) for k, v in values.items())
    if total > MAX_ENV_SERIALIZED_SIZE:
        raise invalid(
            f"{field} total size exceeds {MAX_ENV_SERIALIZED_SIZE} byte limit ({total} bytes)"
        )
    check_env_entries(values, field)


def check_template(image: str, environment: Mapping[str, str], driver_config_size: int) -> None:
    """validation.rs:256-311 (the fields the CLI can set) and 201: its environment's entries."""
    if size(image) > MAX_TEMPLATE_STRING_LEN:
        raise invalid(
            f"template.image exceeds maximum length ({size(image)} > {MAX_TEMPLATE_STRING_LEN})"
        )
    check_string_map(
        environment,
        MAX_TEMPLATE_MAP_ENTRIES,
        MAX_MAP_KEY_LEN,
        MAX_MAP_VALUE_LEN,
        "template.environment",
    )
    if driver_config_size > MAX_TEMPLATE_STRUCT_SIZE:
        raise invalid(
            "template.driver_config serialized size exceeds maximum "
            f"({driver_config_size} > {MAX_TEMPLATE_STRUCT_SIZE})"
        )
    check_env_entries(environment, "spec.template.environment")


def check_main_command(command: Sequence[str]) -> None:
    """validation.rs:218-245."""
    if len(command) > MAX_MAIN_PROCESS_ARGS:
        raise invalid(f"spec.command exceeds {MAX_MAIN_PROCESS_ARGS} argument limit")
    if not command[0]:
        raise invalid("spec.command[0] must not be empty")
    if sum(size(arg) for arg in command) > MAX_MAIN_PROCESS_ARGV_SIZE:
        raise invalid(f"spec.command total size exceeds {MAX_MAIN_PROCESS_ARGV_SIZE} byte limit")
    for index, arg in enumerate(command):
        if size(arg) > MAX_EXEC_ARG_LEN:
            raise invalid(f"spec.command[{index}] exceeds {MAX_EXEC_ARG_LEN} byte limit")
        if "\0" in arg:
            raise invalid(f"spec.command[{index}] contains null bytes")


def check_label_key(key: str) -> None:
    """validation.rs:597-700: an optional DNS-subdomain prefix and '/', then a name."""
    if not key:
        raise invalid("label key cannot be empty")
    if size(key) > 253:
        raise invalid(f"label key exceeds 253 characters: '{key}'")
    prefix, slash, name = key.partition("/")
    if not slash:
        prefix, name = "", key
    if not name:
        raise invalid(f"label key name segment cannot be empty: '{key}'")
    if size(name) > 63:
        raise invalid(f"label key name segment exceeds 63 characters: '{key}'")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise invalid(
            "label key name segment contains invalid characters (must be alphanumeric, '-', "
            f"'_', or '.'): '{key}'"
        )
    if not name[0].isalnum():
        raise invalid(f"label key name segment must start with alphanumeric character: '{key}'")
    if not name[-1].isalnum():
        raise invalid(f"label key name segment must end with alphanumeric character: '{key}'")
    if not slash:
        return
    if not prefix:
        raise invalid(f"label key prefix cannot be empty when '/' is present: '{key}'")
    if not all(c.isascii() and (c.islower() or c.isdigit() or c in "-.") for c in prefix):
        raise invalid(
            f"label key prefix must be a DNS subdomain (lowercase alphanumeric, '-', '.'): '{key}'"
        )
    if prefix[0] in "-." or prefix[-1] in "-.":
        raise invalid(f"label key prefix cannot start or end with '-' or '.': '{key}'")
    if ".." in prefix:
        raise invalid(f"label key prefix cannot contain consecutive dots: '{key}'")


def check_label_value(value: str) -> None:
    """validation.rs:707-743: empty, or 63 bytes of letters, digits, '-', '_', '.'."""
    if not value:
        return
    if size(value) > 63:
        raise invalid(f"label value exceeds 63 characters: '{value}'")
    if not all(c.isalnum() or c in "-_." for c in value):
        raise invalid(
            "label value contains invalid characters (must be alphanumeric, '-', '_', or '.'): "
            f"'{value}'"
        )
    if not value[0].isalnum():
        raise invalid(f"label value must start with alphanumeric character: '{value}'")
    if not value[-1].isalnum():
        raise invalid(f"label value must end with alphanumeric character: '{value}'")


def check_labels(labels: Mapping[str, str]) -> None:
    """A create's labels (server/grpc/sandbox.rs:233-237)."""
    for key, value in labels.items():
        check_label_key(key)
        check_label_value(value)


def parse_selector(selector: str) -> list[tuple[str, str]]:
    """``k=v,k2=v2`` (validation.rs:751-798): each pair checked; empty pairs skipped."""
    pairs: list[tuple[str, str]] = []
    if not selector.strip():
        return pairs
    for raw in selector.split(","):
        pair = raw.strip()
        if not pair:
            continue
        if len(pairs) == MAX_LABEL_SELECTOR_PAIRS:
            raise invalid(f"label selector exceeds {MAX_LABEL_SELECTOR_PAIRS} pair limit")
        if "=" not in pair:
            raise invalid(f"invalid label selector: expected 'key=value', got '{pair}'")
        key, value = (part.strip() for part in pair.split("=", 1))
        if not key:
            raise invalid(f"invalid label selector: key cannot be empty in '{pair}'")
        check_label_key(key)
        check_label_value(value)
        pairs.append((key, value))
    return pairs


def clamp_limit(raw: int) -> int:
    """A list's page size: 0 is the default, at most the maximum (server/grpc/mod.rs:79)."""
    return DEFAULT_PAGE_SIZE if raw == 0 else min(raw, MAX_PAGE_SIZE)


def check_exec(command: Sequence[str], environment: Mapping[str, str], workdir: str) -> None:
    """An exec's fields (server/grpc/sandbox.rs:1180-1190; validation.rs:45-77)."""
    if not command:
        raise invalid("command is required")
    if any(not _ENV_KEY.fullmatch(key) for key in environment):
        raise invalid("environment keys must match ^[A-Za-z_][A-Za-z0-9_]*$")
    if len(command) > MAX_EXEC_COMMAND_ARGS:
        raise invalid(f"command array exceeds {MAX_EXEC_COMMAND_ARGS} argument limit")
    for index, arg in enumerate(command):
        if size(arg) > MAX_EXEC_ARG_LEN:
            raise invalid(f"command argument {index} exceeds {MAX_EXEC_ARG_LEN} byte limit")
        if "\0" in arg:
            raise invalid(f"command argument {index} contains null bytes")
    for key, value in environment.items():
        if size(value) > MAX_EXEC_ARG_LEN:
            raise invalid(f"environment value for '{key}' exceeds {MAX_EXEC_ARG_LEN} byte limit")
        reject_control_chars(value, f"environment value for '{key}'")
    check_env_entries(environment, "environment", allowed=("OPENSHELL_PYFUNC_B64",))
    if workdir:
        if size(workdir) > MAX_EXEC_WORKDIR_LEN:
            raise invalid(f"workdir exceeds {MAX_EXEC_WORKDIR_LEN} byte limit")
        reject_control_chars(workdir, "workdir")


def shell_escape(value: str) -> str:
    """One shell word for ``value`` (server/grpc/sandbox.rs:1856-1872)."""
    if "\0" in value:
        raise invalid("command construction failed: value contains null bytes")
    if not value:
        return "''"
    if value.isascii() and _SAFE_WORD.fullmatch(value):
        return value
    return "'" + value.replace("'", "'\"'\"'") + "'"


def remote_command(command: Sequence[str], environment: Mapping[str, str], workdir: str) -> str:
    """The string the supervisor hands ``/bin/bash -lc`` (sandbox.rs:1906-1930; ssh.rs:1242).

    ``K=v`` assignments sorted by name, then each argument, every one shell-escaped.
    """
    parts = [f"{key}={shell_escape(environment[key])}" for key in sorted(environment)]
    parts += [shell_escape(arg) for arg in command]
    line = " ".join(parts)
    if workdir:
        line = f"cd {shell_escape(workdir)} && {line}"
    if size(line) > MAX_COMMAND_STRING_LEN:
        raise invalid(
            "command construction failed: assembled command string exceeds "
            f"{MAX_COMMAND_STRING_LEN} byte limit"
        )
    return line


@dataclass(frozen=True)
class DriverBlock:
    """What the active compute driver read from its block of ``template.driver_config``."""

    device_ids: tuple[str, ...] = ()
    field: str = ""


DRIVER_KEYS: Mapping[str, tuple[str, tuple[str, ...]]] = {
    # docker/lib.rs:316-324; podman/container.rs:74-82: opaque CDI names, and mounts.
    "docker": ("cdi_devices", ("cdi_devices", "mounts")),
    "podman": ("cdi_devices", ("cdi_devices", "mounts")),
}
"""Per compute driver the stand-in can be: its exact-device key, and every key it reads."""


def select_block(driver_config: Mapping[str, Any] | None, driver: str) -> Mapping[str, Any]:
    """Only the active driver's block goes on (server/compute/mod.rs:3452-3469)."""
    if not driver_config or driver not in driver_config:
        return {}
    block = driver_config[driver]
    if not isinstance(block, dict):
        raise invalid(f"template.driver_config.{driver} must be an object")
    return block


def read_block(block: Mapping[str, Any], driver: str) -> DriverBlock:
    """The driver's block read strictly (serde's deny_unknown_fields, docker/lib.rs:333-340)."""
    id_key, keys = DRIVER_KEYS[driver]
    where = f"invalid {driver} driver_config"
    for key in block:
        if key not in keys:
            expected = " or ".join(f"`{k}`" for k in keys)
            raise invalid(f"{where}: unknown field `{key}`, expected {expected}")
    if "mounts" in block:
        raise Refused(
            "FAILED_PRECONDITION",
            f"the stand-in gateway does not serve driver_config.{driver}.mounts",
        )
    if id_key not in block:
        return DriverBlock()
    ids = block[id_key]
    # core/proto_struct.rs:113-133: a present list is non-empty, of non-empty strings.
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise invalid(f"{where}: invalid type for `{id_key}`, expected a sequence of strings")
    if not ids:
        raise invalid(f"{where}: must be a non-empty list of strings")
    for index, device in enumerate(ids):
        if not device.strip():
            raise invalid(f"{where}: [{index}] must be a non-empty string")
    return DriverBlock(tuple(ids), f"driver_config.{id_key}")


def effective_gpu_count(requested: bool, count: int | None) -> int | None:
    """A GPU request with no count is one GPU (core/gpu.rs:40-51)."""
    if not requested:
        return None
    effective = 1 if count is None else count
    if effective == 0:
        raise invalid("gpu count must be greater than 0")
    return effective


def check_exact_devices(requested: bool, count: int | None, block: DriverBlock) -> None:
    """IDs against the request: no duplicates, a GPU request, its count (core/gpu.rs:314-345)."""
    if not block.device_ids:
        return
    seen: set[str] = set()
    for device in block.device_ids:
        if device in seen:
            raise invalid(f"{block.field} contains duplicate device ID '{device}'")
        seen.add(device)
    effective = effective_gpu_count(requested, count)
    if effective is None:
        raise invalid(f"{block.field} requires a gpu request")
    if effective != len(block.device_ids):
        raise invalid(
            f"gpu count ({effective}) must match {block.field} length ({len(block.device_ids)})"
        )
