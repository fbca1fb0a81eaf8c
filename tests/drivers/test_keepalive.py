"""The container drivers' keepalive FIFOs, without an engine: a reap removes its session's only."""

from __future__ import annotations

from pathlib import Path

from conformance.test_reap import NEIGHBOURS, reaped_session
from drivers.container.keepalive import Keepalive, keepalive_directory, remove_session


def test_a_reap_removes_the_keepalives_of_its_session_and_of_no_session_beside_it(
    tmp_path: Path,
) -> None:
    """Before: session ``<id>``'s reap removed session ``<id>.1``'s FIFOs (names ``<id>.1.*``).

    A create of ``<id>.1`` in flight then failed ("the keepalive ... is gone").
    """
    directory = keepalive_directory(tmp_path)
    session = reaped_session("keepalive")
    sessions = [session, *(make(session) for make in NEIGHBOURS.values())]
    made = [Keepalive.open(directory, f"{each}.0123456789ab") for each in sessions]
    try:
        remove_session(directory, session)
        left = sorted(path.name for path in directory.iterdir())
        assert left == sorted(f"{each}.0123456789ab" for each in sessions[1:])
    finally:
        for keepalive in made:
            keepalive.close()
