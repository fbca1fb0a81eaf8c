"""gpuhost.strict: YAML and JSON read strictly, each refusal naming the file, key and line."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path

import pytest

from gpuhost.strict import (
    InvalidFile,
    Kind,
    MapOf,
    NotStrict,
    parse_json,
    parse_yaml,
    read_json,
    read_record,
    read_yaml,
    record,
)


def alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes of YAML whose aliases expand to 9**levels strings."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    names = "abcdefghijklmnop"[:levels]
    for before, name in itertools.pairwise(names):
        lines.append(f"{name}: &{name} [{','.join(['*' + before] * 9)}]")
    return "\n".join(lines) + "\n"


REFUSED = {
    "a key twice": (
        "templates:\n  create: [podman, run]\n  exec: [x]\n  create: [sh, -c, evil]\n",
        "templates.create",
        "line 4, column 3: the key 'create' is given twice",
    ),
    "an alias bomb": (
        "timeouts:\n" + "".join(f"  {line}\n" for line in alias_bomb().splitlines()),
        "timeouts.a",
        "line 2, column 6: an anchor '&a': anchors and aliases are not allowed",
    ),
    "an alias": (
        "a: 1\nb: *x\n",
        "b",
        "line 2, column 4: an alias '*x': anchors and aliases are not allowed",
    ),
    "a tag": (
        "a: !!python/object:os.system 'id'\n",
        "a",
        "line 1, column 4: the tag 'tag:yaml.org,2002:python/object:os.system': tags are not "
        "allowed",
    ),
    "a merge key": (
        "a: {<<: {b: 1}, b: 2}\n",
        "a['<<']",
        "line 1, column 5: the merge key '<<': merge keys are not allowed",
    ),
    "NaN": (
        "timeouts:\n  create: .nan\n",
        "timeouts.create",
        "line 2, column 11: .nan is not a finite number",
    ),
    "infinity": (
        "timeouts: [1, -.Inf]\n",
        "timeouts[1]",
        "line 1, column 15: -.Inf is not a finite number",
    ),
    "a float past a double": (
        "t: 1.0e+400\n",
        "t",
        "line 1, column 4: 1.0e+400 is not a finite number",
    ),
    "a list as a key": (
        "a:\n  ? [b]\n  : 1\n",
        "a",
        "line 2, column 5: a key must be a plain value, not a list or a mapping",
    ),
    "nested too deep": (
        "a: " + "[" * 20 + "]" * 20 + "\n",
        "a" + "[0]" * 15,
        "line 1, column 19: nested over 16 deep",
    ),
    "two documents": (
        "a: 1\n---\nb: 2\n",
        "",
        "is not YAML as the suite reads it: line 2, column 1: but found another document",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("text", "field", "problem"), REFUSED.values(), ids=list(REFUSED))
def test_yaml_is_refused_naming_the_key_and_the_line(text: str, field: str, problem: str) -> None:
    with pytest.raises(NotStrict) as refused:
        parse_yaml(text)
    assert (refused.value.field, refused.value.problem) == (field, problem)


def test_an_alias_bomb_is_refused_before_anything_is_expanded() -> None:
    started = time.monotonic()
    with pytest.raises(NotStrict, match="an anchor '&a'"):
        parse_yaml(
            "x: " + "[" * 0 + "\n" + "".join(f"  {line}\n" for line in alias_bomb(12).splitlines())
        )
    assert time.monotonic() - started < 1.0


def test_a_file_is_refused_naming_itself_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("name: a\nname: b\n")
    with pytest.raises(InvalidFile) as refused:
        read_yaml(path)
    assert str(refused.value) == f"{path}: name: line 2, column 1: the key 'name' is given twice"
    assert (refused.value.field, refused.value.value) == ("name", "name")


def test_plain_yaml_is_read_as_yaml_reads_it() -> None:
    text = "a: [1, 2.5, 'x', true, null]\nb: {c: 2001-12-14}\n"
    document = parse_yaml(text)
    assert isinstance(document, dict)
    assert document["a"] == [1, 2.5, "x", True, None]
    assert str(document["b"]["c"]) == "2001-12-14"


def test_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "m.yaml"
    os.mkfifo(fifo)
    done: list[BaseException] = []

    def read() -> None:
        try:
            read_yaml(fifo)
        except InvalidFile as exc:
            done.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    assert done, "the reader waited on a FIFO"
    assert str(done[0]) == f"{fifo}: (document): is not a regular file"


def test_a_file_over_its_bound_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("a: 1\n" + "#" * 100)
    with pytest.raises(InvalidFile, match=r"\(document\): is over 64 bytes"):
        read_yaml(path, max_bytes=64)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"a": 1, "a": 2}', "is not strict JSON: the key 'a' is given twice in one object"),
        ('{"t": NaN}', "is not strict JSON: NaN is not a JSON number"),
        ('{"t": 1e999}', "is not strict JSON: the number '1e999' is too large for a float"),
        ('{"t": 1', "is not valid JSON: Expecting ',' delimiter: line 1 column 8 (char 7)"),
    ],
    ids=["key-twice", "nan", "overflow", "cut"],
)
def test_json_is_read_strictly(tmp_path: Path, text: str, problem: str) -> None:
    with pytest.raises(NotStrict) as refused:
        parse_json(text)
    assert refused.value.problem == problem
    path = tmp_path / "r.json"
    path.write_text(text)
    with pytest.raises(InvalidFile, match="is not"):
        read_json(path)


SHAPE: dict[str, Kind] = {"name": str, "count": int, "owner": {"uid": int}, "by": MapOf(str)}
GOOD = {"name": "a", "count": 2, "owner": {"uid": 0}, "by": {"x": "y"}}


@pytest.mark.parametrize(
    ("data", "field", "problem"),
    [
        ([GOOD], "", "must be an object, got [{"),
        ({**GOOD, "extra": 1}, "extra", "is not a field of it (known: ['name', 'count', 'owner'"),
        ({k: v for k, v in GOOD.items() if k != "count"}, "count", "is required"),
        ({**GOOD, "count": "2"}, "count", "must be an integer, got '2'"),
        ({**GOOD, "count": True}, "count", "must be an integer, got True"),
        ({**GOOD, "owner": {"uid": None}}, "owner.uid", "must be an integer, got None"),
        ({**GOOD, "owner": {}}, "owner.uid", "is required"),
        ({**GOOD, "by": {"x": 1}}, "by.x", "must be a string, got 1"),
        ({**GOOD, "by": {"a b": None}}, "by['a b']", "must be a string, got None"),
        ({**GOOD, "by": []}, "by", "must be an object, got []"),
    ],
    ids=[
        "not-an-object", "unknown", "missing", "str-for-int", "bool-for-int", "nested",
        "nested-missing", "map-value", "map-key-shown", "map-not-object",
    ],
)  # fmt: skip
def test_a_record_is_held_to_its_shape(
    tmp_path: Path, data: object, field: str, problem: str
) -> None:
    assert record(GOOD, SHAPE) == GOOD
    with pytest.raises(NotStrict) as refused:
        record(data, SHAPE)
    assert refused.value.field == field
    assert refused.value.problem.startswith(problem)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidFile) as caught:
        read_record(path, SHAPE)
    assert (caught.value.source, caught.value.field) == (path, field or "(document)")
    assert str(caught.value).startswith(f"{path}: {field or '(document)'}: {problem}")
