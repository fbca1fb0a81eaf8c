"""``gpu-sandbox``: try a GPU request on a driver by hand.

    gpu-sandbox run  [--driver D] [GPU flags] [--image I] [--env K=V]... [-- CMD...]
    gpu-sandbox run  [--driver D] --request FILE|- [-- CMD...]
    gpu-sandbox spec [--driver D] [GPU flags | --request FILE|-] [--json]
    gpu-sandbox gpus [--driver D]... [--json | --node-annotation]
    gpu-sandbox reap SESSION [--driver D]...

GPU flags: ``--gpu`` (``--gpu N``, ``--gpu=N``: a count, as OpenShell's CLI takes it),
``--gpu-count N``, ``--gpu-sharing MODE``, ``--gpu-device ID`` (repeatable),
``--driver-config-json JSON|@FILE``; ``gpu_sandbox.options`` reads them, ``gpu_sandbox.flags``
maps them to the
request, in seed 003's shape. ``--request`` takes a whole request instead, as a gateway
receives it; no flag that builds a request may stand beside it.
Every command takes ``--sim-root DIR`` (a simulated GPU host) and ``--gpu-state-dir DIR``
(where the host-wide lease registry lives), as the pytest plugin does.

Exit status of ``run``: the command's own; 2 for bad flags or a request the driver refuses
(nothing was created); 124 when the command ran past ``--timeout``; 125 when the sandbox
could not be created (the driver cannot run here, the GPUs are taken); 126 when the command
could not be run in it; 128 + the signal's number after SIGINT, SIGTERM or SIGHUP. The
sandbox is closed in every case.

Each command is a module of ``gpu_sandbox.commands``; this one reads the command line and
calls it. Modules beyond the standard library are imported by the command that needs them,
and the driver's by the driver: ``gpu-sandbox spec`` starts without any engine's client
library.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence

from gpu_sandbox.commands import report
from gpu_sandbox.commands.common import CommandError
from gpu_sandbox.commands.gpus import gpus_command
from gpu_sandbox.commands.reap import reap_command
from gpu_sandbox.commands.run import run_command
from gpu_sandbox.commands.spec import spec_command
from gpu_sandbox.options import PROG, parser


def main(argv: Sequence[str] | None = None) -> int:
    top = parser(
        {"run": run_command, "spec": spec_command, "gpus": gpus_command, "reap": reap_command},
        (report.register,),
    )
    args, extra = top.parse_known_args(argv)
    if extra:
        hint = " (put -- before the command to run)" if args.command is run_command else ""
        top.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    command: Callable[[argparse.Namespace], int] = args.command
    try:
        return command(args)
    except CommandError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return exc.status
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
