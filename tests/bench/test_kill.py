"""``python -m bench.kill``: it measures against the catalogue's own bound."""

from __future__ import annotations

import pytest

from bench import kill
from conformance.bounds import SLOWEST_FACTOR, kill_bound_s


def test_the_bench_allows_what_the_catalogue_allows() -> None:
    assert kill.ROUND_TRIPS_ALLOWED == SLOWEST_FACTOR
    assert kill_bound_s(kill.TIMEOUT_S, 0.01) == kill.TIMEOUT_S + kill.ROUND_TRIPS_ALLOWED * 0.01


def test_it_times_a_kill_and_a_round_trip_on_the_reference_driver(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert kill.main(["--runs=2", "--driver=reference"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("reference")]
    past, slowest, true, _room = (float(cell) for cell in rows[0].split()[1:])
    assert 0 < past <= slowest < 1000  # ms past the timeout: the kill came, and in time
    assert true > 0
