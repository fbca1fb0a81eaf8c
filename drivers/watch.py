"""What the contract calls around each create, exec and close: the one timing hook.

By default each call is only made. The conformance catalogue sets a watch of its own
(``watched``) that holds each call of the driver under test to the driver's pace, so that
no test patches the contract from outside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from drivers.base import Driver
    from drivers.sandbox import Sandbox
    from gpuhost.spec import SandboxSpec


class Watch:
    """Passes each call through; a subclass overrides what it watches, calling ``call()``."""

    def create(self, driver: Driver, spec: SandboxSpec, call: Callable[[], Sandbox]) -> Sandbox:
        return call()

    def exec(
        self, sandbox: Sandbox, argv: Sequence[str], timeout: float, call: Callable[[], int]
    ) -> int:
        return call()

    def close(self, sandbox: Sandbox, call: Callable[[], None]) -> None:
        call()


_watch = Watch()
W = TypeVar("W", bound=Watch)


def current() -> Watch:
    """The watch set now (by default one that only makes each call)."""
    return _watch


@contextlib.contextmanager
def watched(watch: W) -> Iterator[W]:
    """Set ``watch`` for every driver and sandbox of this process meanwhile."""
    global _watch
    previous, _watch = _watch, watch
    try:
        yield watch
    finally:
        _watch = previous
