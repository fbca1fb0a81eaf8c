"""``gpu-sandbox report merge``: one report of many hosts' runs (``conformance.fleet``).

    gpu-sandbox report merge --out DIR REPORT.json...

Each REPORT is a run's ``--conformance-json`` (or a fleet report merged before). DIR gets
``conformance.json`` (the hosts under ``hosts``), ``conformance.xml``, ``conformance.html``
and ``conformance.md``; the Markdown is also appended to ``$GITHUB_STEP_SUMMARY`` when that
is set. It prints the hosts, the requirements' counts and every verdict, each driver on each
host and each over the fleet. Exit status: 0 when the fleet passes, 1 when its gate fails (a
driver failed on a host, or could not run where it was named, or nothing ran), 2 for a
report refused (named, with why) or bad arguments: nothing is written then.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from gpu_sandbox.commands.common import CommandError
from gpu_sandbox.options import EXIT_USAGE

EXIT_GATE_FAILS = 1


def register(commands: Any) -> None:
    """Add ``report`` and its ``merge`` to the command line's subcommands (``commands``)."""
    report = commands.add_parser(
        "report",
        help="merge the reports of many hosts' runs into one",
        description="Reports of runs of the catalogue, merged.",
    )
    actions = report.add_subparsers(title="actions", required=True, metavar="ACTION")
    merge = actions.add_parser(
        "merge",
        help="one fleet report of many hosts' --conformance-json reports",
        description=(__doc__ or "").split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    merge.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write")
    merge.add_argument("reports", nargs="+", type=Path, metavar="REPORT.json")
    merge.set_defaults(command=report_command)


def report_command(args: argparse.Namespace) -> int:
    from conformance import fleet_render, identity
    from conformance.fleet import FleetError, load

    try:
        fleet = load(args.reports)
    except FleetError as exc:
        raise CommandError(f"refused: {exc}", EXIT_USAGE) from None
    paths = fleet_render.write(fleet, args.out)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8", errors="backslashreplace") as file:
            file.write(fleet_render.to_markdown(fleet))
    lines = fleet_render.text_lines(fleet, identity.catalogue_version())
    sys.stdout.write("\n".join([*lines, f"wrote {', '.join(map(str, paths))}"]) + "\n")
    return EXIT_GATE_FAILS if fleet.gate_fails() else 0
