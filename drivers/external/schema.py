"""The JSON Schema of an external driver's manifest, published as a file.

docs/external-driver.schema.json is it (``python -m drivers.external.schema`` prints it).

The schema is held here, in the package, so that an installed suite validates without its
docs; a self-test checks that the published file is this one.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Final

from gpuhost.idforms import ID_FORMS

API_VERSION: Final = "gpu-sandbox.dev/v1alpha1"
KIND: Final = "Driver"

OPERATIONS: Final = (
    "create", "ready", "pid", "exec", "close", "kill", "list", "reap", "version", "inventory",
)  # fmt: skip
REQUIRED_OPERATIONS: Final = ("create", "exec", "close", "list")
"""And ``reap`` unless ``sandboxId: adapter`` (then the adapter closes each sandbox list prints)."""
FRAGMENTS: Final = (
    "count", "gpu", "gpu_default", "device", "device_list", "dri_node", "tool_mount", "shared",
    "image", "env", "mig_profile", "vendor",
)  # fmt: skip
ERROR_TYPES: Final = {
    "GpusExhausted": (("requested", "available"), ("total",)),
    "GpuBusy": (("device",), ("holder",)),
    "SandboxGone": ((), ()),
}
"""What a manifest may read from a CLI's stderr, and the named groups each one needs and may
have: the typed errors of a create, and ``SandboxGone``: a close or kill that found the
sandbox gone."""
FLAG = "^--?[A-Za-z0-9][A-Za-z0-9_.-]*$"
TIMED: Final = (
    "create", "ready", "pid", "close", "kill", "list", "reap", "version", "inventory",
)  # fmt: skip
JSONL_TIMED: Final = (
    "hello", "create", "close", "kill", "list", "reap", "shutdown", "inventory",
)  # fmt: skip
"""The operations a ``jsonl`` driver answers under a timeout of the manifest's (exec's is
the caller's)."""

_ARGV: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "string", "minLength": 1},
    "description": "An argv template: a list of strings, never a shell string.",
}
_JSON_ARG: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["json"],
    "properties": {
        "json": {
            "description": (
                "One argument: this value as JSON text, each string in it a template; a "
                "string that is exactly {@device_ids} (fragment device_list) is the list of "
                "the devices create is handed."
            ),
        },
    },
}
_FRAGMENT: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {"oneOf": [{"type": "string"}, _JSON_ARG]},
    "description": "Arguments emitted only when the request sets the field.",
}
_FLAG_RULES: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "minProperties": 1,
    "properties": {
        "once": {"type": "boolean", "description": "The CLI refuses the flag given twice."},
        "maxLength": {
            "type": "integer",
            "minimum": 1,
            "description": "The CLI refuses a value longer than this, in UTF-8 bytes.",
        },
        "pattern": {
            "type": "string",
            "minLength": 1,
            "description": "The CLI refuses a value this regular expression does not match whole.",
        },
        "imageReference": {
            "type": "boolean",
            "description": (
                "The value must be an image reference (the OCI distribution grammar): the CLI "
                "reads other values as local paths (a directory to build, say)."
            ),
        },
    },
}
_SECONDS = {
    "type": "number",
    "exclusiveMinimum": 0,
    "maximum": 3600,
    "description": "Seconds: a finite number over 0, at most 3600 (NaN and infinities refused).",
}
ENV_NAME: Final = "^[A-Za-z_][A-Za-z0-9_]{0,127}$"
TEMPLATES_ONLY: Final = (
    "templates",
    "fragments",
    "sandboxId",
    "driverConfig",
    "exec",
    "defaultImage",
    "requestOnStdin",
    "limits",
    "errors",
)

SCHEMA: Final[dict[str, Any]] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://gpu-sandbox.dev/schemas/external-driver/v1alpha1.json",
    "title": "An external GPU sandbox driver, judged through command templates",
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "name", "mode", "allocation", "capabilities"],
    "if": {"properties": {"mode": {"const": "jsonl"}}, "required": ["mode"]},
    "then": {
        "required": ["command"],
        "properties": {
            "allocation": {
                "const": "driver",
                "description": "A jsonl driver plans, validates and leases its GPUs itself.",
            },
            "timeouts": {"propertyNames": {"enum": list(JSONL_TIMED)}},
            **{key: False for key in TEMPLATES_ONLY},
        },
    },
    "else": {"required": ["templates"], "properties": {"command": False, "inventory": False}},
    "properties": {
        "apiVersion": {"const": API_VERSION},
        "kind": {"const": KIND},
        "name": {
            "type": "string",
            "pattern": "^[a-z][a-z0-9-]{0,62}$",
            "description": "The driver's name: its block in template.driver_config, its leases.",
        },
        "description": {"type": "string"},
        "inventory": {
            "type": "boolean",
            "default": False,
            "description": (
                "mode jsonl: the driver answers the inventory message (which GPUs it could "
                "give, with their IDs); mode templates declares templates.inventory instead."
            ),
        },
        "mode": {
            "enum": ["templates", "jsonl"],
            "description": (
                "templates: each operation runs an argv template; jsonl: one long-lived "
                "process speaks JSON lines on its stdin and stdout (external-protocol.md)."
            ),
        },
        "command": {
            **_ARGV,
            "description": (
                "mode jsonl: the driver process's argv, run in the manifest's directory; "
                "{python} is the suite's own interpreter, {driver} the name."
            ),
        },
        "allocation": {
            "enum": ["host-registry", "driver"],
            "description": (
                "host-registry: the adapter leases the GPUs from the host-wide registry and "
                "names them to create; driver: the request goes to the driver as given."
            ),
        },
        "sandboxId": {
            "enum": ["stdout", "adapter"],
            "default": "stdout",
            "description": "stdout: create prints the driver's id; adapter: {sandbox_id} is it.",
        },
        "defaultImage": {"type": "string", "minLength": 1, "pattern": "^[^-]"},
        "passEnv": {
            "type": "array",
            "items": {"type": "string", "pattern": ENV_NAME},
            "uniqueItems": True,
            "description": (
                "The variables of the caller's environment the driver's commands are given, "
                "beside the fixed PATH and LANG; no other is passed."
            ),
        },
        "requestOnStdin": {
            "type": "boolean",
            "default": False,
            "description": (
                "create reads the request as one JSON object on its stdin: the session, the "
                "sandbox id, the request in the seeds' shape, the leased GPUs."
            ),
        },
        "capabilities": {
            "type": "object",
            "additionalProperties": False,
            "required": ["maxGpusPerSandbox", "exactIds"],
            "properties": {
                "maxGpusPerSandbox": {
                    "oneOf": [{"type": "integer", "minimum": 1}, {"const": "all"}],
                },
                "exactIds": {"type": "boolean"},
                "idForms": {
                    "type": "array",
                    "items": {"enum": list(ID_FORMS)},
                    "uniqueItems": True,
                    "minItems": 1,
                },
                "exclusive": {"type": "boolean", "default": True},
                "shared": {"type": "boolean", "default": False},
                "mig": {"type": "boolean", "default": False},
                "vendors": {
                    "type": "array",
                    "items": {"enum": ["nvidia", "amd", "intel"]},
                    "uniqueItems": True,
                    "minItems": 1,
                    "default": ["nvidia"],
                },
                "exhaustionGraceSeconds": _SECONDS,
            },
        },
        "driverConfig": {
            "type": "object",
            "description": "The keys of its own block, beside gpu_device_ids, mig_profile, vendor.",
            "propertyNames": {"pattern": "^[a-z][a-z0-9_]{0,62}$"},
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["type", "fragment"],
                "properties": {
                    "type": {"enum": ["string", "integer", "boolean", "list"]},
                    "fragment": _FRAGMENT,
                },
            },
        },
        "timeouts": {
            "type": "object",
            "additionalProperties": False,
            "properties": {name: _SECONDS for name in dict.fromkeys((*TIMED, *JSONL_TIMED))},
        },
        "templates": {
            "type": "object",
            "additionalProperties": False,
            "required": list(REQUIRED_OPERATIONS),
            "properties": {name: _ARGV for name in OPERATIONS},
        },
        "fragments": {
            "type": "object",
            "additionalProperties": False,
            "properties": {name: _FRAGMENT for name in FRAGMENTS},
        },
        "limits": {
            "type": "object",
            "description": (
                "What the CLI refuses of its flags, by flag (--name, --gpu): every rendered "
                "argv is held to it before its first '--', by validate and before each run."
            ),
            "propertyNames": {"pattern": FLAG},
            "additionalProperties": _FLAG_RULES,
        },
        "errors": {
            "type": "array",
            "description": (
                "A CLI's stderr read as the suite's typed errors: the first rule whose match "
                "is found in it (as one line: ANSI escapes dropped, line breaks and "
                "box-drawing characters read as spaces) gives its error, its named groups "
                "the error's fields: create's GpusExhausted and GpuBusy; SandboxGone, a close "
                "or kill that failed because the sandbox is already gone (done, then)."
            ),
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["match", "error"],
                "properties": {
                    "match": {"type": "string", "minLength": 1},
                    "error": {"enum": list(ERROR_TYPES)},
                },
            },
        },
        "exec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "driverErrorCodes": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 1, "maximum": 255},
                    "uniqueItems": True,
                    "description": "Exit codes of the CLI's own failures, not the command's.",
                },
            },
        },
    },
}


def main() -> None:
    sys.stdout.write(json.dumps(SCHEMA, indent=2) + "\n")


if __name__ == "__main__":
    main()
