"""``gpu-sandbox reap SESSION``: remove what a session left, in each driver named (or all)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gpu_sandbox.commands.common import CommandError, named_drivers, open_host, print_line
from gpu_sandbox.options import EXIT_USAGE

if TYPE_CHECKING:
    from drivers.base import Driver


def reap_command(args: argparse.Namespace) -> int:
    from drivers import REGISTRY, Reaped, UnknownDriver, get_driver_class, reap_session
    from drivers.base import check_session_id

    try:
        check_session_id(args.session)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    named = named_drivers(args.driver)
    drivers: dict[str, type[Driver]] = {}
    failed: list[Reaped] = []
    for name in named or REGISTRY:
        try:
            drivers[name] = get_driver_class(name)
        except UnknownDriver as exc:
            if named:
                raise CommandError(str(exc), EXIT_USAGE) from None
            failed.append(Reaped(name, args.session, error=str(exc)))
    results = failed + reap_session(open_host(args), args.session, drivers, args.image)
    for result in results:
        print_line(result.line)
    return 1 if named and any(result.error for result in results) else 0
