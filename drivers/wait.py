"""Bounded waiting with a diagnostic: every wait in the suite goes through ``wait_until``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    attempt: Callable[[], T],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
    retry_on: tuple[type[BaseException], ...] = (Exception,),
) -> T:
    """Call ``attempt`` until it returns without raising one of ``retry_on``.

    Raises ``TimeoutError`` naming ``what``, the time waited and the last error.
    """
    start = time.monotonic()
    while True:
        try:
            return attempt()
        except retry_on as exc:
            elapsed = time.monotonic() - start
            if elapsed >= timeout_s:
                raise TimeoutError(
                    f"{what}: still failing after {elapsed:.1f} s "
                    f"(last error: {type(exc).__name__}: {exc})"
                ) from exc
        time.sleep(interval_s)
