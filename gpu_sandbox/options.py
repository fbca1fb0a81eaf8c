"""The ``gpu-sandbox`` command line's options, as argparse reads them; gpu_sandbox.cli runs them..

``--gpu`` takes an optional count, as OpenShell's CLI does since v0.0.69 (``--gpu``,
``--gpu 2``, ``--gpu=2``); ``--gpu-count N`` is the seeds' spelling of the same count.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from gpuhost.errors import shown
from gpuhost.requestjson import MAX_INT_DIGITS

Command = Callable[[argparse.Namespace], int]
DEFAULT_DRIVER = "reference"
EXIT_USAGE = 2
PROG = "gpu-sandbox"
DEFAULT_REQUEST = True
"""``--gpu`` alone: the driver's default request (a count is an int)."""

NO_TIMEOUT_S = 20 * 24 * 3600.0
"""``run`` without ``--timeout``: a command run by hand runs as long as its user wants, and
Ctrl-C ends it. The drivers take a number: 20 days is below poll(2)'s maximum (24.8 days),
through which a driver may wait for the command's output."""

_INTEGER = re.compile(r"-?[0-9]+")
_SECONDS = re.compile(r"[0-9]{1,7}(\.[0-9]{1,9})?")

EPILOG = """\
GPU flags (run, spec), and the request each one makes (seed 003's shape):
  --gpu                    resource_requirements.gpu = {} (the default request)
  --gpu N, --gpu=N         resource_requirements.gpu.count = N (OpenShell's CLI, v0.0.69 on)
  --gpu-count N            resource_requirements.gpu.count = N (the seeds' flag)
  --gpu-sharing MODE       resource_requirements.gpu.sharing = MODE (exclusive, shared)
  --gpu-device ID          template.driver_config.<driver>.gpu_device_ids += [ID], and GPU
                           intent; the count is the number of unique IDs unless --gpu-count
  --driver-config-json B   template.driver_config = B when B's keys are all driver names
                           (the envelope, as OpenShell's CLI takes it: {"docker":
                           {"cdi_devices": [...]}}), else template.driver_config.<driver> = B
                           (JSON, or @FILE)
  --image I, --env K=V     template.image, template.env
  --request FILE|-         the whole request, as JSON (- for stdin); no flag above with it
The driver is handed only its own block of template.driver_config; the others are ignored.

exit status of run: the command's own; 2 bad flags or a refused request (nothing was
created); 124 timeout; 125 no sandbox (the driver cannot run here, the GPUs are taken);
126 the command could not be run; 128+N after signal N (the sandbox is closed)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, as every other refusal of the command, instead of the usage first."""
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def parser(
    handlers: Mapping[str, Command], modules: Sequence[Callable[[Any], None]] = ()
) -> argparse.ArgumentParser:
    """The command line's parser; ``handlers`` the function of each command, by name.

    ``modules``: a command in a module of its own adds itself (``gpu_sandbox.commands.report``).
    """
    host = _Parser(add_help=False)
    group = host.add_argument_group("the GPU host")
    group.add_argument(
        "--sim-root",
        type=Path,
        metavar="DIR",
        help="the simulated GPU host under DIR (python -m gpuhost.simulated setup)",
    )
    group.add_argument(
        "--gpu-state-dir",
        type=Path,
        metavar="DIR",
        help="where the host-wide lease registry lives (default: /run/gpu-sandbox, or "
        "$GPU_SANDBOX_STATE_DIR; a simulated host's own)",
    )

    request = _Parser(add_help=False)
    group = request.add_argument_group("the request")
    group.add_argument(
        "--driver",
        default=DEFAULT_DRIVER,
        metavar="NAME|module:Class",
        help=f"a built-in driver or an import path (default: {DEFAULT_DRIVER})",
    )
    group.add_argument(
        "--gpu",
        nargs="?",
        const=DEFAULT_REQUEST,
        type=_gpu,
        action=_OnceAction,
        metavar="N",
        help="a GPU request: alone, the driver's default (one free GPU); with N (--gpu 2, "
        "--gpu=2), N GPUs, as OpenShell's CLI takes it since v0.0.69",
    )
    group.add_argument("--gpu-count", type=_count, metavar="N", help="N GPUs (the seeds' flag)")
    group.add_argument(
        "--gpu-sharing",
        metavar="MODE",
        help="exclusive (the default: no other sandbox on the GPU) or shared (co-held with "
        "other shared sandboxes); GPU intent",
    )
    group.add_argument(
        "--gpu-device",
        action="append",
        default=[],
        metavar="ID",
        help="exactly this device, by the driver's native ID (repeatable); the count is "
        "the number of unique IDs unless --gpu-count is given",
    )
    group.add_argument(
        "--driver-config-json",
        metavar="JSON|@FILE",
        help="template.driver_config as JSON or from FILE: the envelope (keys are driver "
        "names) or the active driver's block; IDs in it need --gpu or --gpu-count, and "
        "cannot be given with --gpu-device too",
    )
    group.add_argument("--image", help="the image, for drivers that take one")
    group.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="(repeatable)"
    )
    group.add_argument(
        "--request",
        metavar="FILE|-",
        help="the whole request as JSON, as a gateway receives it (- reads stdin); the flags "
        "that build a request cannot be given beside it",
    )

    top = _Parser(
        prog=PROG,
        description="Try a GPU request on a driver by hand: run a command in a sandbox, see\n"
        "the spec the flags make, list the host's GPUs and who holds them, clean up a session.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = top.add_subparsers(title="commands", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        parents=[request, host],
        help="create a sandbox, run a command in it, close it",
        description="Create a sandbox, run CMD in it with its output streamed, exit with "
        "its exit status, and close the sandbox, on Ctrl-C too. CMD defaults to "
        "nvidia-smi -L.",
    )
    run.add_argument(
        "--session",
        help="the session id stamped on the sandbox (default: a new one), for "
        "gpu-sandbox reap after a crash",
    )
    run.add_argument(
        "--timeout", type=_seconds, metavar="SECONDS", help="kill CMD after SECONDS (exit 124)"
    )
    run.add_argument("cmd", nargs="*", metavar="-- CMD", help="the command and its arguments")
    run.set_defaults(command=handlers["run"])

    spec = commands.add_parser(
        "spec",
        parents=[request, host],
        help="print the spec the flags make and the driver's verdict",
        description="Print the request spec the flags make, and what the driver's "
        "validation says of it: valid (and the GPUs exact IDs name here), or the typed "
        "error with its field. Exits 2 when the driver refuses it. Creates nothing.",
    )
    spec.add_argument("--json", action="store_true", help="one JSON object")
    spec.set_defaults(command=handlers["spec"])

    gpus = commands.add_parser(
        "gpus",
        parents=[host],
        help="the host's GPUs, each driver's IDs for them, and who holds them",
        description="The host's GPUs (what each discovery source finds, or the simulated "
        "host): index, UUID, PCI address, the exact IDs each registered driver takes for "
        "each (without asking any engine), and who holds it now (the lease registry).",
    )
    gpus.add_argument("--json", action="store_true", help="one JSON object")
    gpus.add_argument(
        "--driver",
        action="append",
        default=[],
        metavar="NAME|module:Class",
        help="list this driver's exact IDs only (repeatable, or comma-separated); a driver "
        "of your own by its import path",
    )
    gpus.add_argument(
        "--node-annotation",
        action="store_true",
        help="the value of the kubernetes driver's node annotation gpu-sandbox.dev/gpus for "
        "this host's whole NVIDIA GPUs (README: The kubernetes driver)",
    )
    gpus.set_defaults(command=handlers["gpus"])

    reap = commands.add_parser(
        "reap",
        parents=[host],
        help="remove every sandbox and lease of a session (pytest --reap)",
        description="Remove every sandbox and GPU lease SESSION left, with every built-in "
        "driver or those named. A named driver that cannot reap is an error (exit 1).",
    )
    reap.add_argument("session", metavar="SESSION")
    reap.add_argument(
        "--driver",
        action="append",
        default=[],
        metavar="NAME|module:Class",
        help="reap with this driver only (repeatable, or comma-separated)",
    )
    reap.add_argument("--image", help="the image, for drivers that take one")
    reap.set_defaults(command=handlers["reap"])
    for module in modules:
        module(commands)
    return top


def _count(text: str) -> int:
    """``--gpu-count``: an integer in ASCII digits, as JSON writes it (no ``1_0``, no ``٣``)."""
    if not _INTEGER.fullmatch(text) or len(text) > MAX_INT_DIGITS:
        raise argparse.ArgumentTypeError(
            f"invalid int value: {shown(text)} (a count is written in ASCII digits, e.g. 2)"
        )
    return int(text)


def _seconds(text: str) -> float:
    """``--timeout``: seconds in ASCII digits, over 0 and at most ``NO_TIMEOUT_S``."""
    if _SECONDS.fullmatch(text) and 0 < (seconds := float(text)) <= NO_TIMEOUT_S:
        return seconds
    raise argparse.ArgumentTypeError(
        f"invalid value: {shown(text)} (seconds in ASCII digits, over 0 and at most "
        f"{NO_TIMEOUT_S:g}, e.g. 30 or 2.5)"
    )


def _gpu(text: str) -> int | bool:
    """``--gpu=N``: a count, as ``--gpu-count`` takes it; ``--gpu=`` is ``--gpu`` (OpenShell's)."""
    return DEFAULT_REQUEST if text == "" else _count(text)


class _OnceAction(argparse.Action):
    """``--gpu`` given twice is refused where the two disagree (OpenShell refuses any second)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
        option_string: str | None = None,
    ) -> None:  # fmt: skip
        before = getattr(namespace, self.dest, None)
        if before is not None and before != values:
            shown_before = "" if before is DEFAULT_REQUEST else f"={before}"
            shown_now = "" if values is DEFAULT_REQUEST else f"={values}"
            parser.error(
                f"{option_string}{shown_before} and {option_string}{shown_now} disagree: give "
                f"{option_string} once"
            )
        setattr(namespace, self.dest, values)
