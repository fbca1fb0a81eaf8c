"""A driver's settings read from the environment: typed, and refused naming the variable.

A typo in ``GPU_SANDBOX_VM_MEMORY_MIB`` must say which variable and what it held, not raise a
bare ``ValueError`` from ``int()`` deep in a driver; an unknown choice must not silently
become the default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

from gpuhost.errors import DriverError, shown


class BadEnvironmentSetting(DriverError, ValueError):
    """An environment variable a driver reads holds what it cannot use."""

    def __init__(self, name: str, value: str, wanted: str) -> None:
        super().__init__(f"{name}={shown(value)}: {wanted}")
        self.name = name
        self.value = value


def integer(
    name: str, default: int, minimum: int = 1, environ: Mapping[str, str] | None = None
) -> int:
    """``name``'s whole number, ``default`` where it is unset or empty."""
    value = (os.environ if environ is None else environ).get(name, "")
    if not value:
        return default
    try:
        number = int(value, 10)
    except ValueError:
        raise BadEnvironmentSetting(name, value, "wanted a whole number") from None
    if number < minimum:
        raise BadEnvironmentSetting(name, value, f"wanted at least {minimum}")
    return number


def seconds(name: str, default: float, environ: Mapping[str, str] | None = None) -> float:
    """``name``'s positive, finite number of seconds, ``default`` where it is unset or empty."""
    value = (os.environ if environ is None else environ).get(name, "")
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        raise BadEnvironmentSetting(name, value, "wanted a number of seconds") from None
    if not (math.isfinite(number) and number > 0):
        raise BadEnvironmentSetting(name, value, "wanted a positive, finite number of seconds")
    return number


def choice(
    name: str, choices: Sequence[str], default: str, environ: Mapping[str, str] | None = None
) -> str:
    """``name``'s value, one of ``choices`` (any letter case); ``default`` where unset or empty."""
    value = (os.environ if environ is None else environ).get(name, "")
    if not value:
        return default
    if value.lower() not in choices:
        raise BadEnvironmentSetting(name, value, f"wanted one of {', '.join(choices)}")
    return value.lower()


def flag(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``name`` is set to 1; unset, empty or 0 is off, anything else refused."""
    return choice(name, ("0", "1"), "0", environ) == "1"
