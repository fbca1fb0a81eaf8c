"""Drivers for testing the plugin itself."""

from __future__ import annotations

from drivers.base import Availability
from drivers.reference import ReferenceDriver


class UnavailableDriver(ReferenceDriver):
    """A driver whose host requirements are never met."""

    def probe(self) -> Availability:
        return Availability(False, "needed the frobnicator service (found: nothing listening)")


class NotADriver:
    """Importable, but not a drivers.base.Driver."""
