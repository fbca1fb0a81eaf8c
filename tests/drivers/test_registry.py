"""Driver lookup: built-in names, ``module:Class`` import paths, and what is refused."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from drivers import REGISTRY, UnknownDriver, get_driver_class
from drivers.base import Driver
from drivers.reference import ReferenceDriver

WriteModule = Callable[[str], str]
"""Writes a module with the given source; returns its importable name."""


@pytest.fixture
def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WriteModule:
    """Modules on a private sys.path entry, with names no other test uses."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(source: str) -> str:
        name = f"registry_probe_{tmp_path.name.replace('-', '_')}_{len(written)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        monkeypatch.delitem(sys.modules, name, raising=False)
        return name

    return write


def test_reference_is_registered() -> None:
    assert REGISTRY["reference"] == "drivers.reference:ReferenceDriver"
    cls = get_driver_class("reference")
    assert cls is ReferenceDriver
    assert issubclass(cls, Driver)
    assert cls.name == "reference"


def test_every_builtin_resolves_to_a_driver_of_that_name() -> None:
    for name in REGISTRY:
        assert get_driver_class(name).name == name


def test_import_path() -> None:
    assert get_driver_class("drivers.reference:ReferenceDriver") is ReferenceDriver


def test_import_path_of_an_out_of_tree_driver(write_module: WriteModule) -> None:
    module = write_module(
        """
        from drivers.reference import ReferenceDriver

        class MyDriver(ReferenceDriver):
            name = "mine"
        """
    )
    cls = get_driver_class(f"{module}:MyDriver")
    assert cls.__name__ == "MyDriver"
    assert cls.name == "mine"
    assert issubclass(cls, Driver)


@pytest.mark.parametrize(
    "name",
    ["nope", "", "Reference", "reference ", ":ReferenceDriver", "drivers.reference:", "k8s"],
)
def test_unknown_name_lists_the_known_ones(name: str) -> None:
    with pytest.raises(UnknownDriver) as raised:
        get_driver_class(name)
    message = str(raised.value)
    assert f"unknown driver {name!r}" in message
    for known in REGISTRY:
        assert known in message
    assert "module:" in message  # it says an import path is accepted too


def test_unknown_driver_is_a_lookup_error() -> None:
    assert issubclass(UnknownDriver, LookupError)


@pytest.mark.parametrize(
    ("target", "shown"),
    [
        pytest.param(
            "gpuhost.devices:GpuDevice", "not a drivers.base.Driver subclass", id="a-class"
        ),
        pytest.param("gpuhost.spec:parse_spec", "not a drivers.base.Driver subclass", id="a-func"),
        pytest.param(
            "gpuhost.simulated:DEFAULT_COUNT", "not a drivers.base.Driver", id="a-constant"
        ),
        pytest.param("drivers.reference:NoSuchDriver", "not a drivers.base.Driver", id="missing"),
        pytest.param(
            "drivers.reference:ReferenceDriver:extra", "not a drivers.base.Driver", id="two-colons"
        ),
    ],
)
def test_a_path_to_something_else_is_refused(target: str, shown: str) -> None:
    with pytest.raises(UnknownDriver) as raised:
        get_driver_class(target)
    assert target in str(raised.value)
    assert shown in str(raised.value)


@pytest.mark.parametrize(
    "target",
    [
        pytest.param("no_such_module_anywhere:Driver", id="no-module"),
        pytest.param("drivers.no_such_driver:Driver", id="no-submodule"),
        pytest.param("drivers.reference.inner:Driver", id="not-a-package"),
    ],
)
def test_a_module_that_does_not_exist_is_refused(target: str) -> None:
    with pytest.raises(UnknownDriver) as raised:
        get_driver_class(target)
    assert "cannot import" in str(raised.value)
    assert target.partition(":")[0] in str(raised.value)
    if target != "drivers.reference.inner:Driver":  # a module, not a package: no path helps
        assert "PYTHONPATH=., or pip install the package that holds it" in str(raised.value)


def test_a_module_whose_import_fails_is_refused(write_module: WriteModule) -> None:
    module = write_module("import no_such_dependency_of_this_driver\n")
    with pytest.raises(UnknownDriver) as raised:
        get_driver_class(f"{module}:MyDriver")
    assert "cannot import" in str(raised.value)
    assert "no_such_dependency_of_this_driver" in str(raised.value)
    assert "PYTHONPATH" not in str(raised.value)  # the driver was found; its dependency not


def test_a_module_with_a_syntax_error_is_refused(write_module: WriteModule) -> None:
    module = write_module("class MyDriver(:\n")
    with pytest.raises(UnknownDriver, match="cannot import"):
        get_driver_class(f"{module}:MyDriver")


def test_a_relative_module_path_is_refused() -> None:
    with pytest.raises(UnknownDriver):
        get_driver_class(".reference:ReferenceDriver")
