"""JSON as a request holds it: read strictly, frozen all the way down, its kinds in words.

The one reader of JSON in requests (``gpuhost.spec.parse_spec``, the CLI's ``--request`` and
``--driver-config-json``) refuses what JSON parsers differ on or accept in silence.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from gpuhost import strict
from gpuhost.errors import InvalidGpuRequest, shown
from gpuhost.strict import NotStrict, parse_json

MAX_DEPTH = 32
"""How deep a request's values may nest: its own shape is five levels deep, a block's
options a few more."""
MAX_INT_DIGITS = strict.MAX_INT_DIGITS
"""The longest integer a request may hold: Python's own limit for converting one to text."""


def read_json(
    text: str,
    field: str = "spec",
    what: str = "spec",
    error: type[InvalidGpuRequest] = InvalidGpuRequest,
) -> Any:
    """JSON text as a request holds it, or ``error`` at ``field`` saying why not.

    The one reader of JSON in requests (``parse_spec``, ``--request``,
    ``--driver-config-json``), and strict (``gpuhost.strict.parse_json``): a key given twice
    in one object (the last would win in silence), ``NaN`` and ``Infinity`` (not JSON), a
    number no float holds, an integer of more than ``MAX_INT_DIGITS`` digits and nesting past
    what the parser recurses into are refused. ``what`` names the text in the message.
    """
    try:
        return parse_json(text, MAX_DEPTH)
    except NotStrict as exc:
        problem = exc.problem.replace("than it may", "than a request may")
        raise error(field, text, f"{what} {problem}, in {shown(text)}") from None


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
