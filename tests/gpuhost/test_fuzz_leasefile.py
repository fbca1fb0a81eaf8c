"""The lease file's reader against its published schema, on generated files.

And what JSON leaves open (duplicate keys, NaN, a byte-order mark, depth), each decided once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuhost import leasefile
from gpuhost.leases import Holder, LeaseFileCorrupt, LeaseOwner, LeaseRegistry, boot_id
from tests.gpuhost.test_lease_protocol import CLIENT, INVENTORY, SCHEMA

pytestmark = pytest.mark.fuzz

ME = Holder.process(os.getpid())


def _pattern(
    validator: Any, pattern: str, instance: object, schema: object
) -> Iterator[jsonschema.ValidationError]:
    # JSON Schema's patterns are ECMA-262's, whose "$" is the end of the string: Python's
    # would also match before a final newline.
    if isinstance(instance, str) and not re.search(pattern.replace("$", r"\Z"), instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


SchemaValidator = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator, {"pattern": _pattern}
)
VALIDATOR = SchemaValidator(SCHEMA)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
"""Any JSON value: what a field holds when the file is not what the schema says."""


def _rarely(usual: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly ``usual``, one time in twenty ``odd``: most files are near misses, not noise."""
    return st.integers(0, 19).flatmap(lambda n: odd if n == 0 else usual)


def _dropping(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """An object of ``fields``, now and then with one left out or one unknown added."""
    whole = st.fixed_dictionaries(
        {key: _rarely(value, json_values) for key, value in fields.items()}
    )
    return st.builds(
        lambda obj, drop, extra: {
            **{k: v for k, v in obj.items() if k not in drop},
            **extra,
        },
        whole,
        _rarely(st.just(set()), st.sets(st.sampled_from(sorted(fields)), min_size=1, max_size=1)),
        _rarely(
            st.just({}),
            st.dictionaries(st.sampled_from(["extra", "v5"]), json_values, min_size=1, max_size=1),
        ),
    )


refs = _rarely(st.from_regex(r"\A[a-f0-9-]{1,8}:[0-9]{1,6}:[0-9]{1,8}\Z"), st.text(max_size=12))
leases = _dropping(
    {
        "gpu_uuid": _rarely(st.sampled_from([gpu.uuid for gpu in INVENTORY]), st.text(max_size=4)),
        "driver": _rarely(st.sampled_from(["reference", "docker"]), st.just("")),
        "sandbox_id": _rarely(st.text(min_size=1, max_size=6), st.just("")),
        "session_id": st.text(max_size=6),
        "holder": _dropping({"kind": st.sampled_from(["process", "docker", "", "x"]), "ref": refs}),
        "mode": _rarely(st.sampled_from(["exclusive", "shared"]), st.just("Exclusive")),
        "acquired_at": st.floats(allow_nan=False, allow_infinity=False) | st.integers(),
        "parent_uuid": _rarely(st.just("GPU-1"), st.just("")),
        "share_limit": _rarely(st.integers(1, 9), st.sampled_from([0, -1, 2.0, 2.5])),
    }
)
documents = _dropping(
    {
        "version": _rarely(st.sampled_from([1, 2, 3, 4]), st.sampled_from([5, 0, 3.0, True])),
        "boot_id": _rarely(st.sampled_from([boot_id(), "earlier"]), st.just("")),
        "leases": st.lists(leases, max_size=3),
    }
)


def _parses(data: bytes) -> bool:
    try:
        leasefile.parse(data)
    except leasefile.InvalidLeaseFile:
        return False
    return True


@given(documents)
def test_the_reader_accepts_exactly_what_the_schema_accepts(document: dict[str, Any]) -> None:
    """Each generated file: the reader's verdict is the schema's, and its only error typed."""
    data = json.dumps(document).encode()
    assert _parses(data) == VALIDATOR.is_valid(document), (
        document,
        [e.message for e in VALIDATOR.iter_errors(document)],
    )


@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_are_read_or_refused_by_name(data: bytes) -> None:
    _parses(data)  # anything but InvalidLeaseFile fails the test


@settings(max_examples=40)
@given(documents)
def test_the_sh_client_refuses_what_the_schema_refuses(
    tmp_path_factory: pytest.TempPathFactory, document: dict[str, Any]
) -> None:
    directory = tmp_path_factory.mktemp("leases")
    (directory / leasefile.file_name(os.geteuid())).write_text(json.dumps(document))
    listed = subprocess.run(
        [str(CLIENT), "--dir", str(directory), "list"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert (listed.returncode == 0) == VALIDATOR.is_valid(document), (document, listed.stderr)
    if listed.returncode:
        assert "cannot be read" in listed.stderr


LIVE_LEASE = {
    "gpu_uuid": INVENTORY[0].uuid, "driver": "live", "sandbox_id": "live", "session_id": "",
    "holder": {"kind": "process", "ref": ME.ref}, "mode": "exclusive", "acquired_at": 1.0,
}  # fmt: skip


@pytest.mark.parametrize(
    "text",
    [
        '{"version": 3, "boot_id": null, "leases": [LIVE]}',
        '{"version": 3, "boot_id": "", "leases": [LIVE]}',
        '{"version": 3, "boot_id": {}, "leases": [LIVE]}',
        '{"version": 4, "boot_id": "BOOT", "leases": [LIVE], "leases": []}',
        '{"version": 4, "boot_id": "BOOT", "leases": {}}',
        '{"version": 4, "boot_id": "BOOT", "leases": ""}',
        '{"version": false, "boot_id": "BOOT", "leases": [LIVE]}',
        '{"version": NaN, "boot_id": "BOOT", "leases": [LIVE]}',
        '{"version": 4, "boot_id": "BOOT", "leases": [{"gpu_uuid": 0, "driver": "d", '
        '"sandbox_id": "s", "session_id": "", "holder": {"kind": "x", "ref": "r"}, '
        '"mode": "exclusive", "acquired_at": 1}]}',
    ],
    ids=["boot-null", "boot-empty", "boot-object", "leases-twice", "leases-object",
         "leases-string", "version-false", "version-nan", "uuid-number"],
)  # fmt: skip
def test_a_malformed_file_beside_a_live_lease_never_grants_its_gpu_twice(
    tmp_path: Path, text: str
) -> None:
    """Before: a ``null`` boot id or a second ``leases`` hid the live lease: GPU 0 granted."""
    registry = LeaseRegistry(tmp_path / "leases")
    registry.leases()
    text = text.replace("LIVE", json.dumps(LIVE_LEASE)).replace("BOOT", boot_id())
    registry.path.write_text(text)
    with pytest.raises(LeaseFileCorrupt, match="cannot be read"):
        registry.acquire(INVENTORY, LeaseOwner("t", "new", "", ME), exact=INVENTORY[:1])
    listed = subprocess.run(
        [str(CLIENT), "--dir", str(registry.directory), "hold", "--sandbox", "sh",
         INVENTORY[0].uuid, "--", "true"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert listed.returncode == 1, listed
    assert "cannot be read" in listed.stderr


@pytest.mark.parametrize(
    ("prefix", "accepted"),
    [(b"\xef\xbb\xbf", True), (b" \n\t", True), (b"\xef\xbb\xbf\xef\xbb\xbf", False)],
    ids=["byte-order-mark", "white-space", "two-marks"],
)
def test_a_mark_or_white_space_before_the_value_is_read(prefix: bytes, accepted: bool) -> None:
    data = prefix + json.dumps({"version": 4, "boot_id": "b", "leases": []}).encode()
    assert _parses(data) is accepted


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"[" * 100_000, "nested too deeply"),
        (b'{"version": 4, "boot_id": "b", "leases": [], "x": ' + b"9" * 5000 + b"}", "digits"),
        (b'{"version": 4, "boot_id": "\xff", "leases": []}', "not UTF-8"),
        (b'{"version": 4, "boot_id": "b", "leases": [], "version": 4}', "appears twice"),
        (b'{"version": 4, "boot_id": "b", "leases": [{"acquired_at": Infinity}]}', "not JSON"),
        (b'{"version": 1' + b"0" * 5000 + b', "boot_id": "b", "leases": []}', "digits"),
    ],
    ids=["deep", "huge-integer", "not-utf-8", "duplicate-key", "infinity", "huge-version"],
)
def test_what_json_leaves_open_is_refused_by_name(data: bytes, said: str) -> None:
    with pytest.raises(leasefile.InvalidLeaseFile, match=said):
        leasefile.parse(data)


def test_a_message_never_formats_a_long_value_whole() -> None:
    data = json.dumps({"version": 4, "boot_id": "x" * 10_000, "leases": [], "y" * 10_000: 1})
    with pytest.raises(leasefile.InvalidLeaseFile) as refused:
        leasefile.parse(data.encode())
    assert len(str(refused.value)) < 200
