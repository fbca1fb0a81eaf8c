"""``gpu-sandbox run``: create a sandbox, run a command in it, close it.

Its exit statuses are listed in ``gpu_sandbox.cli``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

from gpu_sandbox.commands.common import CommandError, gpu_flags, open_driver, refused, request_data
from gpu_sandbox.options import NO_TIMEOUT_S, PROG

if TYPE_CHECKING:
    from drivers.base import Driver
    from gpu_sandbox.flags import GpuFlags

DEFAULT_COMMAND = ("nvidia-smi", "-L")
EXIT_TIMEOUT, EXIT_NOT_CREATED, EXIT_NOT_RUN = 124, 125, 126
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived: what ``run`` made is closed, then it exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def run_command(args: argparse.Namespace) -> int:
    import uuid

    from gpuhost.errors import (
        ExecTimeout,
        GpuAllocationError,
        RequestError,
        SandboxExecError,
        SandboxStartError,
    )

    flags = gpu_flags(args)
    driver = open_driver(args, args.session or f"{PROG}-{uuid.uuid4().hex[:12]}")
    with _signals_raise():
        try:
            return _run(driver, flags, args)
        except RequestError as exc:
            raise refused(exc, flags, driver) from None
        except (GpuAllocationError, SandboxStartError) as exc:
            raise CommandError(f"{type(exc).__name__}: {exc}", EXIT_NOT_CREATED) from None
        except ExecTimeout as exc:
            raise CommandError(str(exc), EXIT_TIMEOUT) from None
        except SandboxExecError as exc:
            raise CommandError(f"{type(exc).__name__}: {exc}", EXIT_NOT_RUN) from None
        except Interrupted as exc:
            sys.stderr.write(f"{PROG}: {exc}: stopped; nothing of this run is left\n")
            return 128 + exc.signum


def _run(driver: Driver, flags: GpuFlags, args: argparse.Namespace) -> int:
    """Check, create, run, close: the request model's rules before the driver is probed."""
    from gpuhost.spec import parse_spec

    spec = parse_spec(request_data(args, flags, driver))
    driver.check_request(spec, resolve=False)
    availability = driver.probe()
    if not availability.ok:
        raise CommandError(
            f"the {args.driver} driver cannot run here: {availability.reason}", EXIT_NOT_CREATED
        )
    sandbox = None
    try:
        sandbox = driver.create(spec)
        sys.stdout.flush()
        return sandbox.exec_stream(
            args.cmd or DEFAULT_COMMAND,
            sys.stdout.fileno(),
            sys.stderr.fileno(),
            args.timeout if args.timeout is not None else NO_TIMEOUT_S,
        )
    finally:
        if sandbox is not None:
            with _signals_deferred():
                sandbox.close()


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise ``Interrupted``, so that ``finally`` closes."""
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """While a sandbox closes, another Ctrl-C waits: a close cut short would leave it."""
    arrived: list[int] = []
    previous = {
        signum: signal.signal(signum, lambda signum, frame: arrived.append(signum))
        for signum in FORWARDED_SIGNALS
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if arrived:
        raise Interrupted(arrived[0])
