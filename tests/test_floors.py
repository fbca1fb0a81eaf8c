"""The floor plan: which of the project's packages each package may import.

gpuhost (floor 1) imports no driver; drivers (floor 2) import no catalogue; the catalogue
imports no workload lane; nothing imports the command (``gpu_sandbox``) but its tests. Read
from every module's imports (``ast``): ``import``, ``from ... import`` (relative ones
resolved) and ``importlib.import_module`` of a name written out, at any depth of the module
(an import inside a function counts as much as one at the top).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FLOORS: dict[str, frozenset[str]] = {
    "gpuhost": frozenset({"gpuhost"}),
    "drivers": frozenset({"gpuhost", "drivers"}),
    "conformance": frozenset({"gpuhost", "drivers", "conformance"}),
    "workloads": frozenset({"gpuhost", "drivers", "conformance", "workloads"}),
    "gpu_sandbox": frozenset({"gpuhost", "drivers", "conformance", "gpu_sandbox"}),
    "openshell_standin": frozenset({"gpuhost", "drivers", "openshell_standin"}),
    "bench": frozenset({"gpuhost", "drivers", "workloads", "bench"}),
    "examples": frozenset({"gpuhost", "drivers"}),
}
"""Each package of the project's, and the project's packages it may import (itself among them)."""
OWN = frozenset(FLOORS) | {"tests"}
"""The project's own top-level packages: an import of any other name is a library's."""


def imported(path: Path, package: str) -> set[str]:
    """The project's top-level packages the module at ``path`` (in ``package``) imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(package if node.level else (node.module or "").split(".")[0])
        elif isinstance(node, ast.Call) and _import_call(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.JoinedStr) and first.values:
                first = first.values[0]  # f"conformance.{name}": its written-out head
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value.split(".")[0])
    return names & OWN


def _import_call(func: ast.expr) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name in {"import_module", "__import__"}


def breaches(root: Path) -> list[str]:
    """Every import under ``root`` that its floor does not allow, as ``path: name``."""
    found = []
    for package, allowed in FLOORS.items():
        for path in sorted((root / package).rglob("*.py")):
            for name in sorted(imported(path, package) - allowed):
                found.append(f"{path.relative_to(root)}: {name}")
    return found


def test_every_package_keeps_to_its_floor() -> None:
    assert breaches(ROOT) == []


def test_every_package_is_on_the_plan() -> None:
    """A new top-level package gets a floor of its own before it can import anything."""
    packages = {
        path.parent.name for path in ROOT.glob("*/*.py") if not path.parent.name.startswith(".")
    }
    assert packages - OWN == set()


IMPORTLIB = "import importlib\nimportlib."


@pytest.mark.parametrize(
    ("package", "source", "breach"),
    [
        ("gpuhost", "from drivers.base import Driver\n", "drivers"),
        ("gpuhost", "def late():\n    import conformance.requirements\n", "conformance"),
        ("drivers", "from conformance import requirements\n", "conformance"),
        ("drivers", f"{IMPORTLIB}import_module('workloads.plugin')\n", "workloads"),
        ("conformance", "from gpu_sandbox.cli import main\n", "gpu_sandbox"),
        ("conformance", f"{IMPORTLIB}import_module(f'workloads.{{x}}')\n", "workloads"),
        ("workloads", "import gpu_sandbox.flags as flags\n", "gpu_sandbox"),
        ("bench", "from gpu_sandbox import cli\n", "gpu_sandbox"),
        ("drivers", "from gpu_sandbox.commands.run import run_command\n", "gpu_sandbox"),
    ],
)
def test_a_planted_import_breaks_the_plan(
    tmp_path: Path, package: str, source: str, breach: str
) -> None:
    """The check itself: each import planted in a copy of the tree is found, by file and name."""
    for name in FLOORS:
        (tmp_path / name).mkdir()
    (tmp_path / package / "planted.py").write_text(source)
    (tmp_path / package / "fine.py").write_text("from . import planted\nimport os\n")
    assert breaches(tmp_path) == [f"{package}/planted.py: {breach}"]
