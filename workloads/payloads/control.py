"""The deliberate-failure control: a check built to fail, which the harness must report failed.

``python control.py [--terms N] [--cpu]``

Sums 1..N with a loop that stops one term short, on purpose, and compares the sum with the
closed form N(N+1)/2. The payload itself works: it prints its verdict, ``"ok": false``,
as a JSON line and exits 1. A harness that reported it passed would be reading exit codes
or output it should not trust. Standard library only, so that it runs in any image with a
Python 3; ``--cpu`` is accepted and changes nothing (it uses no device).

Prints one JSON line on stdout ({"workload", "ok", "mode", "metrics", "detail"}).
Standalone: the harness sends it as ``python -c <source> ARGS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--terms", type=int, default=1000)
    parser.add_argument("--cpu", action="store_true", help="accepted; the control uses no device")
    args = parser.parse_args(argv)
    looped = sum(range(1, args.terms))  # the planted bug: range() stops before `terms`
    closed = args.terms * (args.terms + 1) // 2
    ok = looped == closed
    detail = f"sum of 1..{args.terms} by loop is {looped}, by the closed form {closed}"
    metrics = {"looped": looped, "closed_form": closed}
    report = {"workload": "control-fails", "ok": ok, "mode": "none", "metrics": metrics}
    print(json.dumps({**report, "detail": detail}))  # noqa: T201 (stdout is the JSON line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
