"""The golden list of requirements and the release profile it gives each driver.

Each entry of ``REQUIREMENTS.yaml`` lists the drivers it applies to (``drivers``) and,
among those, the ones for which it is optional (``optional``). For a driver of the golden
list a requirement is therefore **mandatory** (a failure fails the release), **optional**
(a failure is reported but does not gate) or **not applicable** (its tests are skipped
as such). A driver outside the golden list, selected by import path, is held to every
requirement, and so is every driver to a requirement the list does not know.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

REQUIREMENTS_FILE = Path(__file__).with_name("REQUIREMENTS.yaml")

Level = Literal["mandatory", "optional", "not applicable"]
LEVELS: tuple[Level, ...] = ("mandatory", "optional", "not applicable")


@dataclass(frozen=True)
class Requirement:
    id: str
    statement: str
    drivers: tuple[str, ...]
    optional: tuple[str, ...] = ()


@dataclass(frozen=True)
class GoldenList:
    drivers: tuple[str, ...]
    """The drivers with a profile: the built-in ones, present and planned."""
    requirements: tuple[Requirement, ...]

    @functools.cached_property
    def by_id(self) -> dict[str, Requirement]:
        return {requirement.id: requirement for requirement in self.requirements}

    def level(self, requirement: str, driver: str) -> Level:
        entry = self.by_id.get(requirement)
        if entry is None or driver not in self.drivers:
            return "mandatory"
        if driver not in entry.drivers:
            return "not applicable"
        return "optional" if driver in entry.optional else "mandatory"

    def profile(self, driver: str) -> dict[str, Level]:
        """Requirement id → what it is for ``driver``."""
        return {entry.id: self.level(entry.id, driver) for entry in self.requirements}


def parse(document: dict[str, Any]) -> GoldenList:
    return GoldenList(
        drivers=tuple(document["drivers"]),
        requirements=tuple(
            Requirement(
                id=str(entry["id"]),
                statement=str(entry["statement"]),
                drivers=tuple(entry["drivers"]),
                optional=tuple(entry.get("optional", ())),
            )
            for entry in document["requirements"]
        ),
    )


@functools.cache
def load(path: Path = REQUIREMENTS_FILE) -> GoldenList:
    return parse(yaml.safe_load(path.read_text()))
