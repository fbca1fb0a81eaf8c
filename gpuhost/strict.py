"""YAML and JSON read strictly: nothing guessed, nothing dropped in silence, nothing expanded.

The one reader of each for what the suite reads from people and from other programs: the
golden list and the workload manifest (``conformance``), an external driver's manifest
(``drivers.external.manifest``), CDI specs (``gpuhost.cdi``), a request's JSON
(``gpuhost.requestjson``), the lanes' reports (``conformance.lanes``); and of the records
the suite writes itself and reads back (``read_record``: VFIO claims, the guest image's
metadata), each held to its shape.

Refused, with a typed error naming the file, the key (a dotted path such as
``templates.create[3]``) and, for YAML, the line and column:

- a key given twice in one mapping (the last would win in silence: a second ``create:``
  replaced the first);
- anchors and aliases (a few hundred bytes of aliases expand into gigabytes: an alias bomb
  is refused at its first anchor, before anything is expanded), and merge keys (``<<``);
- tags (``!!python/object``, ``!!int '1'``: the text choosing its own type);
- a number that is not finite (``.nan`` passes every comparison, so every range check;
  ``.inf``, ``1.0e+400``);
- nesting deeper than ``max_depth``, a file over ``max_bytes``, bytes that are not UTF-8,
  and a file that is not a regular file (a FIFO is refused, never waited on).

A YAML scalar Python cannot hold as its type (an integer of over 4,300 digits, a date of
the 13th month) is read as an ``Unreadable``, for the field that holds it to refuse.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import stat
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from gpuhost.errors import shown

MAX_BYTES = 64 << 10
"""Four times the largest YAML file of the suite's; the reader takes up to 3 s on one this size."""
MAX_DEPTH = 16
"""Deeper than any of the suite's YAML files nests, far short of Python's recursion limit."""
MAX_INT_DIGITS = 4300
"""The longest integer JSON may hold: Python's own limit for converting one to text
(``sys.get_int_max_str_digits``), past which it could be neither read nor shown."""
DOCUMENT = "(document)"
"""The field of a problem of the whole file: unreadable, too large, not YAML at all."""
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


class InvalidFile(ValueError):
    """A file read strictly that cannot be used: ``field`` is where, ``value`` what."""

    def __init__(self, source: Path, field: str, value: object, problem: str) -> None:
        super().__init__(f"{source}: {field}: {problem}")
        self.source = source
        self.field = field
        self.value = value


FileError = Callable[[Path, str, object, str], Exception]
"""What a reader raises: called with the file, the field, the value and the problem."""


class NotStrict(ValueError):
    """Text refused by a strict reader: ``field`` is where ("" for the whole text)."""

    def __init__(self, field: str, value: object, problem: str) -> None:
        super().__init__(f"{field or DOCUMENT}: {problem}")
        self.field = field
        self.value = value
        self.problem = problem


class Unreadable:
    """A YAML scalar Python cannot hold as its type, standing in for it."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return self.what


def member(where: str, key: object) -> str:
    """``where.key``, or ``where[<key shown>]`` for a key that is no plain word."""
    if isinstance(key, str) and _WORD.fullmatch(key):
        return f"{where}.{key}" if where else key
    return f"{where}[{shown(key)}]"


# -- files ------------------------------------------------------------------------------------


def read_text(path: Path, error: FileError = InvalidFile, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of the regular file ``path``, at most ``max_bytes``; else ``error``."""
    try:
        # O_NONBLOCK: a FIFO planted under the name opens at once, and is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise error(path, DOCUMENT, None, f"cannot be read: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(path, DOCUMENT, None, "is not a regular file")
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(path, DOCUMENT, None, f"is over {max_bytes} bytes")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.end]
        raise error(
            path, DOCUMENT, bad, f"is not UTF-8: {bad!r} at byte offset {exc.start}"
        ) from exc


def read_yaml(
    path: Path,
    error: FileError = InvalidFile,
    max_bytes: int = MAX_BYTES,
    max_depth: int = MAX_DEPTH,
) -> object:
    """The one YAML document of ``path``, read strictly; else ``error`` naming the field."""
    text = read_text(path, error, max_bytes)
    try:
        return parse_yaml(text, max_depth)
    except NotStrict as exc:
        raise error(path, exc.field or DOCUMENT, exc.value, exc.problem) from exc


def read_json(path: Path, error: FileError = InvalidFile, max_bytes: int = MAX_BYTES) -> object:
    """The JSON value of ``path``, read strictly; else ``error``."""
    text = read_text(path, error, max_bytes)
    try:
        return parse_json(text)
    except NotStrict as exc:
        raise error(path, exc.field or DOCUMENT, exc.value, exc.problem) from exc


# -- YAML -------------------------------------------------------------------------------------


def parse_yaml(text: str, max_depth: int = MAX_DEPTH) -> object:
    """One YAML document, read strictly; ``NotStrict`` naming the field and the line if not."""
    import yaml  # slow to import: only reading YAML needs it, not reading a request

    loader = None
    try:
        loader = _loader_class()(text, max_depth)  # reads the text: may refuse it already
        return loader.get_single_data()
    except _Refused as exc:
        raise NotStrict(exc.field, exc.value, exc.problem) from None
    except yaml.YAMLError as exc:
        raise NotStrict("", None, f"is not YAML as the suite reads it: {_problem(exc)}") from None
    finally:
        if loader is not None:
            loader.dispose()


class _Refused(Exception):
    def __init__(self, field: str, value: object, mark: Any, problem: str) -> None:
        if mark is not None:
            problem = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
        super().__init__(problem)
        self.field = field
        self.value = value
        self.problem = problem


@functools.cache
def _loader_class() -> Any:
    """PyYAML's safe loader, refusing as this module says (made once YAML is first read)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def __init__(self, text: str, max_depth: int) -> None:
            super().__init__(text)
            self.max_depth = max_depth
            self.fields: list[str] = []

        def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
            field = self._field(parent, index)
            event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]
            if isinstance(event, yaml.NodeEvent) and event.anchor is not None:
                alias = isinstance(event, yaml.AliasEvent)
                sign, what = ("*", "an alias") if alias else ("&", "an anchor")
                named = sign + event.anchor
                problem = f"{what} {shown(named)}: anchors and aliases are not allowed"
                raise _Refused(field, named, event.start_mark, problem)
            if isinstance(event, yaml.ScalarEvent | yaml.CollectionStartEvent) and event.tag:
                problem = f"the tag {shown(event.tag)}: tags are not allowed"
                raise _Refused(field, event.tag, event.start_mark, problem)
            if len(self.fields) >= self.max_depth:
                raise _Refused(field, None, event.start_mark, f"nested over {self.max_depth} deep")
            self.fields.append(field)
            try:
                node = super().compose_node(parent, index)
            finally:
                self.fields.pop()
            if isinstance(node, yaml.MappingNode):
                self._check_keys(field, node)
            elif isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:float":
                number = self.construct_yaml_float(node)
                if not math.isfinite(number):
                    problem = f"{node.value} is not a finite number"
                    raise _Refused(field, number, node.start_mark, problem)
            return node

        def _field(self, parent: yaml.Node | None, index: Any) -> str:
            """The dotted path of the node composed under ``parent`` at ``index``."""
            where = self.fields[-1] if self.fields else ""
            if isinstance(parent, yaml.SequenceNode):
                return f"{where}[{index}]"
            if isinstance(index, yaml.ScalarNode):
                return member(where, index.value)
            return where  # the document, or a key (named by the mapping that holds it)

        def _check_keys(self, field: str, node: yaml.MappingNode) -> None:
            """No key twice, no merge key, every key a plain value."""
            seen: set[Hashable] = set()
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    problem = "a key must be a plain value, not a list or a mapping"
                    raise _Refused(field, None, key_node.start_mark, problem)
                if key_node.tag == "tag:yaml.org,2002:merge":
                    problem = "the merge key '<<': merge keys are not allowed"
                    raise _Refused(member(field, "<<"), "<<", key_node.start_mark, problem)
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, Hashable) and key in seen:
                    problem = f"the key {shown(key)} is given twice"
                    raise _Refused(member(field, key), key, key_node.start_mark, problem)
                seen.add(key)

    def integer(loader: Loader, node: yaml.ScalarNode) -> object:
        try:
            return loader.construct_yaml_int(node)
        except ValueError:  # over sys.get_int_max_str_digits()
            return Unreadable(f"an integer of {sum(c.isdigit() for c in node.value)} digits")

    def timestamp(loader: Loader, node: yaml.ScalarNode) -> object:
        try:
            return loader.construct_yaml_timestamp(node)
        except ValueError as exc:
            return Unreadable(f"the impossible date {shown(node.value)}: {exc}")

    Loader.add_constructor("tag:yaml.org,2002:int", integer)
    Loader.add_constructor("tag:yaml.org,2002:timestamp", timestamp)
    return Loader


def _problem(exc: Any) -> str:
    """What YAML found wrong, on one line: where and what, without its quote of the text."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        problem = " ".join(str(exc.problem).split())
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return " ".join(str(exc).split())


def dump_yaml(data: object) -> str:
    """``data`` as YAML this module reads back: an object held twice is written out twice.

    PyYAML's own dumper writes an anchor and an alias for it, which ``parse_yaml`` refuses.
    """
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump(data, Dumper=Dumper, sort_keys=False)


# -- JSON -------------------------------------------------------------------------------------


def parse_json(text: str, max_depth: int = 32) -> Any:
    """JSON text read strictly; ``NotStrict`` saying why not.

    Refused: a key given twice in one object (the last would win in silence), ``NaN`` and
    ``Infinity`` (not JSON), a number no float holds, an integer of more than
    ``MAX_INT_DIGITS`` digits, and nesting past what the parser recurses into (``max_depth``
    names the nesting the caller documents).
    """
    try:
        return json.loads(
            text,
            object_pairs_hook=_object,
            parse_constant=_constant,
            parse_int=_json_integer,
            parse_float=_float,
        )
    except json.JSONDecodeError as exc:
        raise NotStrict("", None, f"is not valid JSON: {exc}") from None
    except NotStrict as exc:
        raise NotStrict(exc.field, exc.value, f"is not strict JSON: {exc.problem}") from None
    except ValueError as exc:
        raise NotStrict("", None, f"is not strict JSON: {exc}") from None
    except RecursionError:
        raise NotStrict("", None, f"nests deeper than it may ({max_depth} levels)") from None


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    made: dict[str, Any] = {}
    for key, value in pairs:
        if key in made:
            raise NotStrict(key, key, f"the key {shown(key)} is given twice in one object")
        made[key] = value
    return made


def _constant(name: str) -> float:
    raise NotStrict("", name, f"{name} is not a JSON number")


def _json_integer(text: str) -> int:
    size = len(text.lstrip("-"))
    if size > MAX_INT_DIGITS:
        raise NotStrict("", None, f"an integer of {size} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise NotStrict("", text, f"the number {shown(text)} is too large for a float")
    return number


# -- records: JSON objects of a known shape -----------------------------------------------


@dataclass(frozen=True)
class MapOf:
    """A JSON object of keys of its own, each value of ``kind``."""

    kind: type | tuple[type, ...]


Kind: TypeAlias = "type | tuple[type, ...] | MapOf | Mapping[str, Kind]"
"""What a field holds: a value of a type (one of several), a ``MapOf``, or a nested record."""
_NAMES = {
    str: "a string", int: "an integer", float: "a number", bool: "true or false",
    dict: "an object", list: "a list", type(None): "null",
}  # fmt: skip


def record(data: object, shape: Mapping[str, Kind], where: str = "") -> dict[str, Any]:
    """``data`` as a record of ``shape``: each field there, of its kind, and no other.

    ``NotStrict`` naming the first field that is not. A ``bool`` is no integer here.
    """
    if not isinstance(data, dict):
        raise NotStrict(where, data, f"must be an object, got {shown(data)}")
    for key in data:
        if key not in shape:
            raise NotStrict(member(where, key), key, f"is not a field of it (known: {list(shape)})")
    for key, kind in shape.items():
        field = member(where, key)
        if key not in data:
            raise NotStrict(field, None, "is required")
        _check(data[key], kind, field)
    return data


def _check(value: object, kind: Kind, field: str) -> None:
    if isinstance(kind, MapOf):
        if not isinstance(value, dict):
            raise NotStrict(field, value, f"must be an object, got {shown(value)}")
        for key, item in value.items():
            _check(item, kind.kind, member(field, key))
    elif isinstance(kind, Mapping):
        record(value, kind, field)
    else:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            what = " or ".join(_NAMES.get(k, k.__name__) for k in kinds)
            raise NotStrict(field, value, f"must be {what}, got {shown(value)}")


def read_record(
    path: Path,
    shape: Mapping[str, Kind],
    error: FileError = InvalidFile,
    max_bytes: int = MAX_BYTES,
) -> dict[str, Any]:
    """The JSON record of ``path``, read strictly and held to ``shape``; else ``error``."""
    data = read_json(path, error, max_bytes)
    try:
        return record(data, shape)
    except NotStrict as exc:
        raise error(path, exc.field or DOCUMENT, exc.value, exc.problem) from exc
