"""A driver's settings from the environment: typed, and refused naming the variable."""

from __future__ import annotations

import pytest

from gpuhost import environ
from gpuhost.environ import BadEnvironmentSetting


def test_unset_or_empty_is_the_default() -> None:
    assert environ.integer("N", 7, environ={}) == 7
    assert environ.integer("N", 7, environ={"N": ""}) == 7
    assert environ.seconds("S", 2.5, environ={}) == 2.5
    assert environ.choice("C", ("auto", "kvm"), "auto", environ={}) == "auto"
    assert environ.flag("F", environ={}) is False


def test_a_good_value_is_read() -> None:
    assert environ.integer("N", 7, environ={"N": "2048"}) == 2048
    assert environ.seconds("S", 2.5, environ={"S": "0.5"}) == 0.5
    assert environ.choice("C", ("auto", "kvm"), "auto", environ={"C": "KVM"}) == "kvm"
    assert environ.flag("F", environ={"F": "1"}) is True
    assert environ.flag("F", environ={"F": "0"}) is False


@pytest.mark.parametrize(
    ("read", "value", "said"),
    [
        (lambda env: environ.integer("GPU_SANDBOX_X", 1, environ=env), "12x", "a whole number"),
        (lambda env: environ.integer("GPU_SANDBOX_X", 1, environ=env), "1.5", "a whole number"),
        (lambda env: environ.integer("GPU_SANDBOX_X", 1, environ=env), "0", "at least 1"),
        (lambda env: environ.seconds("GPU_SANDBOX_X", 1, environ=env), "soon", "seconds"),
        (lambda env: environ.seconds("GPU_SANDBOX_X", 1, environ=env), "nan", "finite"),
        (lambda env: environ.seconds("GPU_SANDBOX_X", 1, environ=env), "-3", "positive"),
        (lambda env: environ.choice("GPU_SANDBOX_X", ("kvm",), "kvm", environ=env), "kvn",
         "one of kvm"),
        (lambda env: environ.flag("GPU_SANDBOX_X", environ=env), "yes", "one of 0, 1"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_the_variable_and_the_value(
    read: object, value: str, said: str
) -> None:
    assert callable(read)
    with pytest.raises(BadEnvironmentSetting) as refused:
        read({"GPU_SANDBOX_X": value})
    assert str(refused.value).startswith(f"GPU_SANDBOX_X={value!r}: ")
    assert said in str(refused.value)
    assert (refused.value.name, refused.value.value) == ("GPU_SANDBOX_X", value)
