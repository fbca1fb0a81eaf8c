"""What the commands share: the refusal they raise, and reading the host, driver and request."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_sandbox.flags import GpuFlags, flag_of, flag_text, spec_dict
from gpu_sandbox.options import DEFAULT_REQUEST, EXIT_USAGE
from gpuhost.errors import FIELD_LIMIT, PATH_LIMIT, named

if TYPE_CHECKING:
    from drivers.base import Driver
    from gpuhost.errors import RequestError
    from gpuhost.host import GpuHost


class CommandError(Exception):
    """The command cannot go on: one line for stderr, and the exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def named_drivers(options: Sequence[str]) -> list[str]:
    """The drivers a repeatable, comma-separated ``--driver`` names, in order."""
    return [name.strip() for option in options for name in option.split(",") if name.strip()]


def driver_class(name: str) -> type[Driver]:
    from drivers import UnknownDriver, get_driver_class

    try:
        return get_driver_class(name)
    except UnknownDriver as exc:
        raise CommandError(f"{flag_text('--driver', name)}: {exc}", EXIT_USAGE) from None


def gpu_flags(args: argparse.Namespace) -> GpuFlags:
    config = args.driver_config_json
    text = config
    if config is not None and config.startswith("@"):
        text = read_text(Path(config[1:]), flag_text("--driver-config-json", config, PATH_LIMIT))
    count, count_flag = args.gpu_count, "--gpu-count"
    if isinstance(args.gpu, int) and args.gpu is not DEFAULT_REQUEST:
        if count is not None and count != args.gpu:
            raise CommandError(
                f"--gpu={args.gpu} and --gpu-count={count} both give the count: give it once",
                EXIT_USAGE,
            )
        count, count_flag = args.gpu, "--gpu"
    flags = GpuFlags(
        gpu=args.gpu is not None,
        gpu_count=count,
        count_flag=count_flag,
        gpu_sharing=args.gpu_sharing,
        gpu_devices=tuple(args.gpu_device),
        driver_config_json=text,
        driver_config_arg=config,
        image=args.image,
        env=tuple(args.env),
    )
    if args.request is not None and flags.given():
        raise CommandError(
            f"--request={args.request} is the whole request: {', '.join(flags.given())} "
            "cannot be given beside it (put it in the request)",
            EXIT_USAGE,
        )
    return flags


def request_data(args: argparse.Namespace, flags: GpuFlags, driver: Driver) -> Any:
    """The request: ``--request``'s JSON, or what the flags make for ``driver``."""
    if args.request is None:
        return spec_dict(flags, driver.name, driver.capabilities.id_keys)
    from gpuhost.requestjson import read_json

    path = None if args.request == "-" else Path(args.request)
    text = read_text(path, flag_text("--request", args.request, PATH_LIMIT))
    where = "stdin" if path is None else named(str(path), PATH_LIMIT)
    return read_json(text, what=f"the request in {where}")


def read_text(path: Path | None, flag: str) -> str:
    """The UTF-8 text of ``path`` (None: stdin), or the command's refusal naming ``flag``."""
    source = "stdin" if path is None else named(str(path), PATH_LIMIT)
    try:
        data = sys.stdin.buffer.read() if path is None else path.read_bytes()
        return data.decode()
    except OSError as exc:
        reason = exc.strerror
    except UnicodeDecodeError as exc:
        reason = f"it is not UTF-8 text ({exc.reason} at byte {exc.start})"
    raise CommandError(f"{flag}: cannot read {source}: {reason}", EXIT_USAGE)


def open_driver(args: argparse.Namespace, session: str) -> Driver:
    cls = driver_class(args.driver)
    try:
        return cls(open_host(args), session, args.image)
    except ValueError as exc:  # the session id (--session)
        raise CommandError(f"--session: {exc}", EXIT_USAGE) from None


def host_config(args: argparse.Namespace) -> Any:
    from gpuhost.host import HostConfig

    return HostConfig(args.sim_root, args.gpu_state_dir)


def open_host(args: argparse.Namespace) -> GpuHost:
    from gpuhost.host import GpuHost
    from gpuhost.simulated import SimulatedHostError

    if args.sim_root is not None:
        try:
            return GpuHost.open(host_config(args))
        except SimulatedHostError as exc:
            raise CommandError(f"--sim-root={args.sim_root}: {exc}", EXIT_USAGE) from None
    from gpuhost.discovery import DiscoveryError

    try:
        return GpuHost.open(host_config(args))
    except DiscoveryError as exc:  # GPUs on the bus that no source lists: say which
        raise CommandError(str(exc), 1) from None


def print_line(text: str) -> None:
    sys.stdout.write(f"{text}\n")


def refused(error: RequestError, flags: GpuFlags, driver: Driver) -> CommandError:
    """The one line of a refused request: the flag and its value, the message, the field."""
    flag = error_flag(error, flags, driver)
    where = f"{type(error).__name__} at {named(error.field, FIELD_LIMIT)}"
    return CommandError(f"{flag + ': ' if flag else ''}{error} ({where})", EXIT_USAGE)


def error_flag(error: RequestError, flags: GpuFlags, driver: Driver) -> str:
    return flag_of(error, flags, driver.name, driver.capabilities.id_keys)
