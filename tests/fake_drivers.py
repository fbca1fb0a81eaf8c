"""Drivers for testing the plugin itself."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Iterator

from drivers.base import Availability, Command, Launch, Output
from drivers.reference import ReferenceDriver, ReferenceSandbox
from gpuhost.errors import InvalidDriverConfig
from gpuhost.spec import DriverCapabilities, DriverRequest, GpuPlan
from tests.breakers.exhaustion import NoLocking


class UnavailableDriver(ReferenceDriver):
    """A driver whose host requirements are never met."""

    def probe(self) -> Availability:
        return Availability(False, "needed the frobnicator service (found: nothing listening)")


class NotADriver:
    """Importable, but not a drivers.base.Driver."""


class HangsInExec(ReferenceDriver):
    """A driver whose sandboxes never return from a command: the per-test bound catches it."""

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        sandbox.__class__ = _HangingSandbox
        return sandbox


class _HangingSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        threading.Event().wait()
        raise AssertionError("unreachable")


class CountsOnlyDriver(ReferenceDriver):
    """A driver that takes GPU counts but no exact device IDs, as a Kubernetes one does."""

    name = "counts-only"

    @property
    def capabilities(self) -> DriverCapabilities:
        return dataclasses.replace(super().capabilities, exact_ids=False, exact_id_forms="")


class OutputAtTheEnd(ReferenceDriver):
    """A driver whose sandboxes give a command's output once it has ended, not as it comes.

    As a driver that can only ask for the whole output does.
    """

    def start(self, launch: Launch) -> ReferenceSandbox:
        sandbox = super().start(launch)
        sandbox.__class__ = _OutputAtTheEndSandbox
        return sandbox


class _OutputAtTheEndSandbox(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        kept = Output()
        returncode = super().run(command, kept)
        out, err = kept.kept()
        output.stdout(out)
        output.stderr(err)
        return returncode


class WaitsForItsTurn(ReferenceDriver):
    """Says, as the kubernetes driver does, that it waits for another run's turn."""

    @contextlib.contextmanager
    def catalogue_turn(self) -> Iterator[None]:
        sys.stderr.write("waiting for another conformance run (held by a test)\n")
        yield


class TieredDriver(ReferenceDriver):
    """A driver from another package, with options of its own in its block.

    It declares ``tier`` (a scheduling class it reads and checks itself) and ``image`` (a
    key the kubernetes driver reads too); nothing in ``gpuhost`` knows either.
    """

    name = "tiered"
    TIERS = ("batch", "interactive")

    @property
    def capabilities(self) -> DriverCapabilities:
        return dataclasses.replace(super().capabilities, config_keys=("tier", "image"))

    def plan(self, request: DriverRequest) -> GpuPlan | None:
        for key, allowed in (("tier", self.TIERS), ("image", None)):
            value = request.config.get(key)
            if value is None or (allowed is None and isinstance(value, str) and value):
                continue
            if allowed is not None and value in allowed:
                continue
            raise InvalidDriverConfig(
                request.field(key), value, f"{request.field(key)} is not valid: {value!r}"
            )
        return super().plan(request)


class NonExclusiveByDeclaration(NoLocking):
    """Declares ``exclusive=False``, and double-grants under a race: it must not pass by it."""

    @property
    def capabilities(self) -> DriverCapabilities:
        return dataclasses.replace(super().capabilities, exclusive=False)
