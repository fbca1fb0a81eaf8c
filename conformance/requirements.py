"""The golden list of requirements and the release profile it gives each driver.

Each entry of ``REQUIREMENTS.yaml`` lists the drivers it applies to (``drivers``) and,
among those, the ones for which it is optional (``optional``). For a driver of the golden
list a requirement is therefore **mandatory** (a failure fails the release), **optional**
(a failure is reported but does not gate) or **not applicable** (its tests are skipped
as such). A driver outside the golden list, selected by import path, is held to every
requirement, and so is every driver to a requirement the list does not know.

The suite's YAML files, this list and the workload manifest, are read by the one strict
reader (``gpuhost.strict.read_yaml``) and refused with a typed error (``InvalidFile``) that
names the field and the value (``gpuhost.errors.shown``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpuhost import strict
from gpuhost.errors import shown
from gpuhost.strict import InvalidFile, member

REQUIREMENTS_FILE = Path(__file__).with_name("REQUIREMENTS.yaml")

Level = Literal["mandatory", "optional", "not applicable"]
LEVELS: tuple[Level, ...] = ("mandatory", "optional", "not applicable")
ID = re.compile(r"[A-Z][A-Z0-9-]{0,62}[A-Z0-9]")
"""A requirement id: upper case letters, digits and dashes, such as GPU-COUNT-01."""
_DRIVER = re.compile(r"[a-z][a-z0-9-]{0,62}")


class RequirementsError(InvalidFile):
    """A golden list that cannot be used; ``field`` starts with the requirement's id."""


@dataclass(frozen=True)
class Requirement:
    id: str
    statement: str
    drivers: tuple[str, ...]
    optional: tuple[str, ...] = ()


DECLARATIONS = ("exclusive=False", "shared=False", "pools=none")
"""What a driver's capabilities may declare that leaves requirements out (the catalogue's
markers exclusive, shares_gpus and chooses_pools)."""


@dataclass(frozen=True)
class GoldenList:
    drivers: tuple[str, ...]
    """The drivers with a profile: the built-in ones, present and planned."""
    requirements: tuple[Requirement, ...]
    accepted_declarations: tuple[str, ...] = ()
    """The declarations (of ``DECLARATIONS``) that may leave a requirement out."""

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


def parse(document: object, source: Path = REQUIREMENTS_FILE) -> GoldenList:
    """The golden list of a YAML document: every key present, of its type, and no other."""
    top = _mapping(source, "", document, {"drivers", "requirements"}, {"accepted_declarations"})
    drivers = _names(source, "drivers", top["drivers"], None)
    accepted = _names(
        source, "accepted_declarations", top.get("accepted_declarations", []), DECLARATIONS
    )
    found: dict[str, Requirement] = {}
    entries = listed(source, "requirements", top["requirements"], RequirementsError)
    for index, entry in enumerate(entries):
        requirement = _requirement(source, f"requirements[{index}]", entry, drivers)
        if requirement.id in found:
            raise RequirementsError(
                source,
                f"requirements[{index}].id",
                requirement.id,
                f"{requirement.id} is used twice",
            )
        found[requirement.id] = requirement
    return GoldenList(drivers, tuple(found.values()), accepted)


@functools.cache
def load(path: Path = REQUIREMENTS_FILE) -> GoldenList:
    return parse(strict.read_yaml(path, RequirementsError), path)


def _requirement(source: Path, where: str, entry: object, drivers: tuple[str, ...]) -> Requirement:
    if not isinstance(entry, dict):
        raise RequirementsError(source, where, entry, f"must be a mapping, got {shown(entry)}")
    id_ = entry.get("id")
    if not (isinstance(id_, str) and ID.fullmatch(id_)):
        raise RequirementsError(
            source, f"{where}.id", id_, f"must be an id such as GPU-COUNT-01, got {shown(id_)}"
        )
    fields = _mapping(source, id_, entry, {"id", "statement", "drivers"}, {"optional"})
    statement = fields["statement"]
    if not (isinstance(statement, str) and statement.strip()):
        raise RequirementsError(
            source, f"{id_}.statement", statement, f"must be a sentence, got {shown(statement)}"
        )
    applies = _names(source, f"{id_}.drivers", fields["drivers"], drivers)
    optional = _names(source, f"{id_}.optional", fields.get("optional", []), applies)
    return Requirement(id=id_, statement=statement, drivers=applies, optional=optional)


def _mapping(
    source: Path,
    where: str,
    value: object,
    required: Collection[str],
    optional: Collection[str] = (),
) -> Mapping[str, object]:
    field = where or "(document)"
    if not isinstance(value, dict):
        raise RequirementsError(source, field, value, f"must be a mapping, got {shown(value)}")
    known = sorted({*required, *optional})
    for key in value:
        if key not in known:
            raise RequirementsError(
                source,
                member(where, key),
                value[key],
                f"unknown key {shown(key)} (known: {', '.join(known)})",
            )
    for key in required:
        if key not in value:
            raise RequirementsError(source, member(where, key), None, "is required")
    return value


def _names(
    source: Path, field: str, value: object, allowed: Collection[str] | None
) -> tuple[str, ...]:
    """A list of distinct driver names, each one of ``allowed`` when that is given."""
    if not isinstance(value, list):
        raise RequirementsError(
            source, field, value, f"must be a list of names, got {shown(value)}"
        )
    seen: set[str] = set()
    for index, name in enumerate(value):
        if allowed is None:
            ok = isinstance(name, str) and bool(_DRIVER.fullmatch(name))
            what = "a driver's name (lower case letters, digits and dashes)"
        else:
            ok = isinstance(name, str) and name in allowed
            what = f"one of {', '.join(allowed) or 'none'}"
        if not ok:
            raise RequirementsError(
                source, f"{field}[{index}]", name, f"must be {what}, got {shown(name)}"
            )
        if name in seen:
            raise RequirementsError(source, f"{field}[{index}]", name, f"{name} is listed twice")
        seen.add(name)
    return tuple(value)


def listed(source: Path, field: str, value: object, error: type[InvalidFile]) -> list[object]:
    """``value`` as a non-empty list, else ``error``."""
    if not isinstance(value, list) or not value:
        raise error(source, field, value, f"must be a non-empty list, got {shown(value)}")
    return value
