"""JSON as a request holds it: read strictly, frozen all the way down, its kinds in words.

The one reader of JSON in requests (``gpuhost.spec.parse_spec``, the CLI's ``--request`` and
``--driver-config-json``) refuses what JSON parsers differ on or accept in silence.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from gpuhost.errors import InvalidGpuRequest, shown

MAX_DEPTH = 32
"""How deep a request's values may nest: its own shape is five levels deep, a block's
options a few more."""
MAX_INT_DIGITS = 4300
"""The longest integer a request may hold: Python's own limit for converting one to text
(``sys.get_int_max_str_digits``), past which it could be neither read nor shown."""


def read_json(
    text: str,
    field: str = "spec",
    what: str = "spec",
    error: type[InvalidGpuRequest] = InvalidGpuRequest,
) -> Any:
    """JSON text as a request holds it, or ``error`` at ``field`` saying why not.

    The one reader of JSON in requests (``parse_spec``, ``--request``,
    ``--driver-config-json``), and strict: a key given twice in one object (the last would
    win in silence), ``NaN`` and ``Infinity`` (not JSON), a number no float holds, an integer
    of more than ``MAX_INT_DIGITS`` digits and nesting past what the parser recurses into are
    refused. ``what`` names the text in the message.
    """
    try:
        return json.loads(
            text,
            object_pairs_hook=_object,
            parse_constant=_constant,
            parse_int=_integer,
            parse_float=_float,
        )
    except json.JSONDecodeError as exc:
        problem = f"is not valid JSON: {exc}"
    except (_NotStrictJson, ValueError) as exc:
        problem = f"is not strict JSON: {exc}"
    except RecursionError:
        problem = f"nests deeper than a request may ({MAX_DEPTH} levels)"
    raise error(field, text, f"{what} {problem}, in {shown(text)}") from None


class _NotStrictJson(Exception):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    made: dict[str, Any] = {}
    for key, value in pairs:
        if key in made:
            raise _NotStrictJson(f"the key {shown(key)} is given twice in one object")
        made[key] = value
    return made


def _constant(name: str) -> float:
    raise _NotStrictJson(f"{name} is not a JSON number")


def _integer(text: str) -> int:
    size = len(text.lstrip("-"))
    if size > MAX_INT_DIGITS:
        raise _NotStrictJson(f"an integer of {size} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise _NotStrictJson(f"the number {shown(text)} is too large for a float")
    return number


def deep_freeze(value: Any) -> Any:
    """Read-only copies all the way down: nothing the caller keeps can change the spec."""
    if isinstance(value, Mapping):
        return MappingProxyType({str(k): deep_freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(deep_freeze(item) for item in value)
    return value


def thawed(value: Any) -> Any:
    """The plain dicts and lists a frozen value was made from, for messages and JSON."""
    if isinstance(value, Mapping):
        return {k: thawed(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thawed(item) for item in value]
    return value


def kind(value: object) -> str:
    """A JSON value's kind in words, for messages."""
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        float: "a number",
        int: "an integer",
        type(None): "null",
    }.get(type(value), type(value).__name__)
