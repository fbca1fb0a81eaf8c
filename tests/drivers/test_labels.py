"""Every driver stamps its sandboxes from one vocabulary: ``drivers.labels``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from drivers import labels
from drivers.external.schema import API_VERSION

DRIVERS = Path(labels.__file__).parent
SPELLED = re.compile(r"io\.gpu-sandbox\.|gpu-sandbox\.dev/")
"""A label key written out: this vocabulary's prefix, or the ``io.gpu-sandbox.`` of old."""


def spelled_out(root: Path) -> list[str]:
    """Each string under ``root`` (but ``labels.py``) that writes a label key itself."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "labels.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_bytes())):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            if SPELLED.match(node.value) and node.value != API_VERSION:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
    return found


def test_no_driver_writes_a_label_key_of_its_own() -> None:
    assert spelled_out(DRIVERS) == []


def test_a_label_written_out_is_found(tmp_path: Path) -> None:
    (tmp_path / "labels.py").write_text('LABEL_PREFIX = "gpu-sandbox.dev/"\n')
    (tmp_path / "old.py").write_text('SESSION = "io.gpu-sandbox.session"\n')
    (tmp_path / "new.py").write_text('labels = {f"gpu-sandbox.dev/{x}": 1}\n')
    assert spelled_out(tmp_path) == [
        "new.py:1: 'gpu-sandbox.dev/'",
        "old.py:1: 'io.gpu-sandbox.session'",
    ]


def test_the_keys_are_kubernetes_label_keys() -> None:
    """A DNS subdomain, ``/``, and a name of at most 63 characters: what every engine takes."""
    key = re.compile(
        r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
    )
    keys = [value for name, value in vars(labels).items() if name.endswith("_LABEL")]
    assert len(keys) == 5
    assert [k for k in keys if not key.fullmatch(k)] == []
