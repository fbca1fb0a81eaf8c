"""The ``jsonl`` protocol: its messages' JSON Schema, and its typed errors both ways.

docs/external-protocol.md is the protocol; docs/external-protocol.schema.json is
``SCHEMA`` (``python -m drivers.external.protocol`` prints it). A driver written in Python
against this project's packages may use ``error_of`` to turn the suite's errors into the
protocol's; the adapter turns them back with ``raise_error``.
"""

from __future__ import annotations

import binascii
import functools
import json
import sys
from collections.abc import Mapping
from typing import Any, Final

from gpuhost.errors import (
    DriverError,
    DuplicateGpuDevice,
    GpuBusy,
    GpuCountMismatch,
    GpuDevicesWithoutRequest,
    GpusExhausted,
    InvalidDriverConfig,
    InvalidGpuCount,
    InvalidGpuRequest,
    InvalidGpuSharing,
    RequestError,
    SandboxExecError,
    SandboxStartError,
    UnknownGpuDevice,
    UnknownImage,
    UnsupportedGpuRequest,
    shown,
)

PROTOCOL_VERSION: Final = 1
OPERATIONS: Final = (
    "hello", "create", "exec", "cancel", "close", "list", "reap", "shutdown", "inventory",
)  # fmt: skip
ERROR_TYPES: Final = (
    "invalid", "exhausted", "busy", "unsupported", "unavailable", "timeout", "infra",
    "cancelled",
)  # fmt: skip
INVALID_REASONS: Mapping[str, type[RequestError]] = {
    "request": InvalidGpuRequest,
    "config": InvalidDriverConfig,
    "count": InvalidGpuCount,
    "sharing": InvalidGpuSharing,
    "duplicate": DuplicateGpuDevice,
    "ids-without-request": GpuDevicesWithoutRequest,
    "count-mismatch": GpuCountMismatch,
    "unknown-device": UnknownGpuDevice,
    "image": UnknownImage,
}
"""``invalid``'s ``reason``: which of the request model's refusals it is."""


class ProtocolError(DriverError):
    """A message outside the protocol, or an answer the adapter cannot take.

    ``field`` is where in the message the fault is (``data``, ``op``, ``result.exit_code``;
    empty: the message as a whole), ``value`` what was found there; the message names both.
    """

    def __init__(self, problem: str, field: str = "", value: object = None) -> None:
        super().__init__(problem)
        self.field = field
        self.value = value


def answer_error(message: dict[str, Any], op: str) -> ProtocolError | None:
    """What is wrong with ``message``, read as an answer to a request of ``op``; None: nothing.

    A message of the protocol answers ``op``: a reply of that op, or an event of an exec.
    It is held to the one shape of ``$defs.fromDriver`` that what it is (its ``event``, its
    ``error``, its ``op``) says it has, so that the fault is named where it is.
    """
    import jsonschema

    event = message.get("event")
    if event is not None and op != "exec":
        return ProtocolError(
            f"event {shown(event)}: an event answers an exec, not {op}", "event", event
        )
    key = (
        ("event", event)
        if "event" in message
        else ("error" if "error" in message else "result", message.get("op"))
    )
    shape = _shapes().get(key) if key[0] != "error" else _shapes()[("error", None)]
    if shape is None:
        field = key[0] if key[0] == "event" else "op"
        return ProtocolError(f"{field} {shown(key[1])}: not one of the protocol's", field, key[1])
    error = jsonschema.exceptions.best_match(shape.iter_errors(message))
    if error is not None:
        field = ".".join(str(part) for part in error.absolute_path)
        return ProtocolError(
            f"{field or 'the message'} {shown(error.instance)}: {error.message}",
            field,
            error.instance,
        )
    if "event" not in message and message["op"] != op:
        return ProtocolError(
            f"op {shown(message['op'])}: the request was {op}", "op", message["op"]
        )
    return None


@functools.cache
def _shapes() -> dict[tuple[str, Any], Any]:
    """A validator of each shape of ``$defs.fromDriver``, by what tells it from the others."""
    import jsonschema

    shapes = {}
    for shape in SCHEMA["$defs"]["fromDriver"]["oneOf"]:
        fields = shape["properties"]
        if "event" in fields:
            key = ("event", fields["event"]["const"])
        elif "error" in fields:
            key = ("error", None)
        else:
            key = ("result", fields["op"]["const"])
        shapes[key] = jsonschema.Draft202012Validator(shape)
    return shapes


def output_data(message: Mapping[str, Any]) -> tuple[str, bytes]:
    """An exec's ``output`` event: its stream and its bytes. ``ProtocolError`` naming the field.

    The schema's rules for the event, checked here by hand: a command's output crosses in
    these events, and the schema engine would take longer over one than decoding it.
    """
    extra = sorted(set(message) - {"id", "event", "stream", "data"})
    if extra:
        key, value = extra[0], message[extra[0]]
        raise ProtocolError(f"{key} {shown(value)}: not a field of an output event", key, value)
    stream, data = message.get("stream"), message.get("data")
    if stream not in ("stdout", "stderr"):
        raise ProtocolError(f"stream {shown(stream)}: not stdout or stderr", "stream", stream)
    try:
        if not isinstance(data, str):
            raise TypeError("not a string")
        # Strict decoding still takes padding past a whole group ("AAAA=", "AAAA===="): the
        # schema's pattern does not.
        if len(data) % 4 or data.endswith("==="):
            raise ValueError("not whole groups of four characters")
        return stream, binascii.a2b_base64(data, strict_mode=True)
    except (TypeError, ValueError) as exc:  # binascii.Error is a ValueError
        raise ProtocolError(
            f"data {shown(data)}: not base64 (RFC 4648, padded): {exc}", "data", data
        ) from None


def error_of(exc: BaseException) -> dict[str, Any]:
    """The protocol's ``error`` object for one of the suite's errors (a driver's side)."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, UnsupportedGpuRequest):
        return {"type": "unsupported", "message": message, "field": exc.field, "value": exc.value}
    if isinstance(exc, RequestError):
        reason = next(
            (name for name, cls in reversed(list(INVALID_REASONS.items())) if isinstance(exc, cls)),
            "request",
        )
        return {
            "type": "invalid", "reason": reason, "message": message, "field": exc.field,
            "value": exc.value,
        }  # fmt: skip
    if isinstance(exc, GpusExhausted):
        return {
            "type": "exhausted", "message": message, "requested": exc.requested,
            "available": exc.available, "total": exc.total,
        }  # fmt: skip
    if isinstance(exc, GpuBusy):
        return {"type": "busy", "message": message, "device": exc.device, "holder": exc.holder}
    return {"type": "infra", "message": message}


def request_error(error: Mapping[str, Any], what: str) -> DriverError | None:
    """The suite's typed error of a refused create, or None for the operation's own error."""
    kind, message = error["type"], f"{what}: {error['message']}"
    if kind == "invalid":
        cls = INVALID_REASONS[error.get("reason", "request")]
        return cls(error["field"], error.get("value"), error["message"])
    if kind == "unsupported":
        return UnsupportedGpuRequest(error["field"], error.get("value"), error["message"])
    if kind == "exhausted":
        return GpusExhausted(error["requested"], error["available"], error["total"])
    if kind == "busy":
        return GpuBusy(error["device"], error["holder"])
    if kind in ("unavailable", "infra", "timeout", "cancelled"):
        return SandboxStartError(message)
    return None


def exec_error(error: Mapping[str, Any], what: str) -> SandboxExecError:
    return SandboxExecError(f"{what}: {error['type']}: {error['message']}")


# -- the schema ------------------------------------------------------------------------------

_ID = {"type": "integer", "minimum": 1, "maximum": 2**53 - 1}
BASE64: Final = "^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
"""An output event's ``data``: base64 (RFC 4648's alphabet, padded), nothing else."""
_TEXT = {"type": "string", "minLength": 1}
_STRINGS = {"type": "array", "items": {"type": "string"}}
_SESSION = {"type": "string", "pattern": "^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$"}
_SANDBOX = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"}
_SECONDS = {"type": "number", "exclusiveMinimum": 0}
_CAPABILITIES: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["maxGpusPerSandbox", "exactIds"],
    "properties": {
        "maxGpusPerSandbox": {"oneOf": [{"type": "integer", "minimum": 1}, {"const": "all"}]},
        "exactIds": {"type": "boolean"},
        "idForms": {"type": "array", "items": {"enum": ["index", "uuid", "cdi", "pci", "dri"]}},
        "exclusive": {"type": "boolean"},
        "shared": {"type": "boolean"},
        "mig": {"type": "boolean"},
        "vendors": {"type": "array", "items": {"enum": ["nvidia", "amd", "intel"]}},
        "exhaustionGraceSeconds": _SECONDS,
    },
    "description": "As the manifest's capabilities: the adapter checks they are the same.",
}


def _message(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": list(required),
        "properties": {**required, **(optional or {})},
    }


def _request(op: str, fields: dict[str, Any], optional: dict[str, Any] | None = None) -> Any:
    return _message({"id": _ID, "op": {"const": op}, **fields}, optional)


def _reply(op: str, result: dict[str, Any]) -> dict[str, Any]:
    return _message({"id": _ID, "op": {"const": op}, "result": result})


_EMPTY = _message({})
_ERROR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "message"],
    "properties": {
        "type": {"enum": list(ERROR_TYPES)},
        "message": {"type": "string"},
        "reason": {"enum": list(INVALID_REASONS)},
        "field": _TEXT,
        "value": {"description": "The value found at field, as the request gave it."},
        "requested": {"type": "integer", "minimum": 0},
        "available": {"type": "integer", "minimum": 0},
        "total": {"type": "integer", "minimum": 0},
        "device": _TEXT,
        "holder": {"type": "string"},
    },
    "allOf": [
        {
            "if": {"properties": {"type": {"enum": ["invalid", "unsupported"]}}},
            "then": {"required": ["field", "value"]},
        },
        {
            "if": {"properties": {"type": {"const": "exhausted"}}},
            "then": {"required": ["requested", "available", "total"]},
        },
        {
            "if": {"properties": {"type": {"const": "busy"}}},
            "then": {"required": ["device", "holder"]},
        },
    ],
}

SCHEMA: Final[dict[str, Any]] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://gpu-sandbox.dev/schemas/external-protocol/v1.json",
    "title": "The jsonl protocol of an external GPU sandbox driver: one message per line",
    "anyOf": [{"$ref": "#/$defs/toDriver"}, {"$ref": "#/$defs/fromDriver"}],
    "$defs": {
        "toDriver": {
            "description": "A request, from the adapter to the driver's stdin.",
            "oneOf": [
                _request(
                    "hello",
                    {
                        "protocol": {"const": PROTOCOL_VERSION},
                        "host": _message(
                            {
                                "sim_root": {"type": ["string", "null"]},
                                "state_dir": {"type": ["string", "null"]},
                                "leases_dir": _TEXT,
                                "share_limit": {"type": "integer", "minimum": 1},
                            }
                        ),
                    },
                    {"adapter": {"type": "string"}},
                ),
                _request(
                    "create",
                    {
                        "session_id": _SESSION,
                        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "request": {
                            "type": "object",
                            "description": "The request in the seeds' shape (request-model.md).",
                        },
                    },
                ),
                _request(
                    "exec",
                    {
                        "sandbox_id": _SANDBOX,
                        "argv": {**_STRINGS, "minItems": 1},
                        "env": {"type": "object", "additionalProperties": {"type": "string"}},
                        "timeout": _SECONDS,
                    },
                ),
                _request("cancel", {"target": _ID}),
                _request("close", {"sandbox_id": _SANDBOX, "kill": {"type": "boolean"}}),
                _request("list", {"session_id": _SESSION}),
                _request("reap", {"session_id": _SESSION}),
                _request("shutdown", {}),
                _request("inventory", {}),
            ],
        },
        "fromDriver": {
            "description": "A reply (result or error) or an event, from the driver's stdout.",
            "oneOf": [
                _reply(
                    "hello",
                    _message(
                        {
                            "protocol": {"const": PROTOCOL_VERSION},
                            "driver": _message({"name": _TEXT, "version": {"type": "string"}}),
                            "capabilities": _CAPABILITIES,
                        }
                    ),
                ),
                _reply(
                    "create",
                    _message({"sandbox_id": _SANDBOX, "gpus": {**_STRINGS, "uniqueItems": True}}),
                ),
                _reply(
                    "exec",
                    {
                        "oneOf": [
                            _message({"exit_code": {"type": "integer", "minimum": 0}}),
                            _message({"signal": {"type": "integer", "minimum": 1}}),
                        ]
                    },
                ),
                *(_reply(op, _EMPTY) for op in ("cancel", "close", "shutdown")),
                _reply("list", _message({"sandbox_ids": {**_STRINGS, "uniqueItems": True}})),
                _reply("reap", _message({"removed": _STRINGS})),
                _reply(
                    "inventory",
                    _message(
                        {
                            "gpus": {
                                "type": "array",
                                "items": _message({"uuid": _TEXT}, {"ids": _STRINGS}),
                            }
                        }
                    ),
                ),
                _message({"id": _ID, "op": {"enum": list(OPERATIONS)}, "error": _ERROR}),
                _message(
                    {
                        "id": _ID,
                        "event": {"const": "output"},
                        "stream": {"enum": ["stdout", "stderr"]},
                        "data": {"type": "string", "pattern": BASE64},
                    }
                ),
                _message(
                    {
                        "id": _ID,
                        "event": {"const": "started"},
                        "pid": {"type": "integer", "minimum": 2},
                    }
                ),
            ],
        },
    },
}


def validator(direction: str | None = None) -> Any:
    """A Draft 2020-12 validator of one direction's messages (``toDriver``, ``fromDriver``)."""
    import jsonschema

    schema = (
        SCHEMA if direction is None else {**SCHEMA, "anyOf": [{"$ref": f"#/$defs/{direction}"}]}
    )
    return jsonschema.Draft202012Validator(schema)


def main() -> None:
    sys.stdout.write(json.dumps(SCHEMA, indent=2) + "\n")


if __name__ == "__main__":
    main()
