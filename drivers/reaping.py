"""Clean up after a session: what ``pytest --reap`` and ``gpu-sandbox reap`` both do."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from drivers.base import Driver
from gpuhost.host import GpuHost


@dataclass(frozen=True)
class Reaped:
    """What one driver removed of a session, or why it could not."""

    driver: str
    session_id: str
    removed: tuple[str, ...] = ()
    error: str = ""

    @property
    def line(self) -> str:
        if self.error:
            return f"{self.driver}: not reaped: {self.error}"
        return (
            f"{self.driver}: removed {len(self.removed)} sandbox(es) of session {self.session_id}"
        )


def reap_session(
    host: GpuHost,
    session_id: str,
    drivers: Mapping[str, type[Driver]],
    image: str | None = None,
) -> list[Reaped]:
    """Remove every sandbox and lease ``session_id`` left, with each of ``drivers`` in turn.

    A driver that cannot reap (an engine that is not running) says why, and the others
    still reap.
    """
    results = []
    for name, cls in drivers.items():
        try:
            removed = cls(host, session_id, image).reap(session_id)
        except Exception as exc:  # any failure of any driver: named, and the others go on
            results.append(Reaped(name, session_id, error=f"{type(exc).__name__}: {exc}"))
            continue
        results.append(Reaped(name, session_id, tuple(removed)))
    return results
