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

Modules beyond the standard library are imported by the command that needs them, and the
driver's by the driver: ``gpu-sandbox spec`` starts without any engine's client library.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from gpu_sandbox import report
from gpu_sandbox.flags import GpuFlags, flag_of, flag_text, spec_dict
from gpu_sandbox.options import DEFAULT_REQUEST, EXIT_USAGE, NO_TIMEOUT_S, PROG, parser
from gpuhost.errors import FIELD_LIMIT, PATH_LIMIT, named, shown

if TYPE_CHECKING:
    from drivers.base import Driver
    from gpuhost.errors import RequestError
    from gpuhost.host import GpuHost
    from gpuhost.spec import DriverRequest, GpuPlan

DEFAULT_COMMAND = ("nvidia-smi", "-L")
EXIT_TIMEOUT, EXIT_NOT_CREATED, EXIT_NOT_RUN = 124, 125, 126
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class CommandError(Exception):
    """The command cannot go on: one line for stderr, and the exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived: what ``run`` made is closed, then it exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


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


# -- run -----------------------------------------------------------------------------------


def run_command(args: argparse.Namespace) -> int:
    import uuid

    from gpuhost.errors import (
        ExecTimeout,
        GpuAllocationError,
        RequestError,
        SandboxExecError,
        SandboxStartError,
    )

    flags = _flags(args)
    driver = _driver(args, args.session or f"{PROG}-{uuid.uuid4().hex[:12]}")
    with _signals_raise():
        try:
            return _run(driver, flags, args)
        except RequestError as exc:
            raise _refused(exc, flags, driver) from None
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
    from gpuhost.spec import parse_spec, select
    from gpuhost.validation import validate_gpu_request

    spec = parse_spec(_request(args, flags, driver))
    validate_gpu_request(select(spec, driver.name), driver.capabilities)
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


# -- spec ----------------------------------------------------------------------------------


def spec_command(args: argparse.Namespace) -> int:
    from gpuhost.errors import RequestError
    from gpuhost.spec import parse_spec, select
    from gpuhost.validation import validate_gpu_request

    flags = _flags(args)
    driver = _driver(args, f"{PROG}-spec")
    report: dict[str, Any] = {"driver": args.driver, "spec": None, "received": None}
    report["valid"] = False
    try:
        report["spec"] = data = _request(args, flags, driver)
        request = select(parse_spec(data), driver.name)
        report["received"] = request.to_dict()
        plan = validate_gpu_request(request, driver.capabilities)
        report.update(valid=True, plan=_plan_json(plan), **_resolved(request, driver))
    except RequestError as exc:
        report["error"] = _error_json(exc, flags, driver)
        _print_spec(report, args.json)
        raise _refused(exc, flags, driver) from None
    _print_spec(report, args.json)
    return 0


def _resolved(request: DriverRequest, driver: Driver) -> dict[str, Any]:
    """The devices the request names on this host, from the driver's whole ``plan``.

    Exact IDs are resolved as the driver resolves them, which may need its engine: when it
    cannot be asked, the request is still valid, and the reason is given.
    """
    from gpuhost.errors import RequestError

    try:
        plan = driver.plan(request)
    except RequestError:
        raise
    except Exception as exc:  # an engine that does not answer, in any client's words
        return {"resolved": None, "unresolved": f"{type(exc).__name__}: {exc}"}
    devices = () if plan is None else plan.gpus
    return {
        "resolved": [{"uuid": gpu.uuid, "description": gpu.describe()} for gpu in devices],
        "unresolved": None,
    }


def _print_spec(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print(json.dumps(report, indent=2, allow_nan=False))
        return
    name = report["driver"]
    if report["spec"] is not None:
        _print(json.dumps(report["spec"], indent=2, allow_nan=False))
    if report["received"] is not None:
        block = json.dumps(report["received"]["driver_config"], allow_nan=False)
        _print(f"{name}: the gateway hands the driver its own block: {block}")
    if not report["valid"]:
        error = report["error"]
        _print(f"{name}: invalid: {error['type']} at {error['field']}: {error['message']}")
        return
    _print(f"{name}: valid: {_describe_plan(report['plan'])}")
    if report["unresolved"]:
        _print(f"{name}: the exact IDs were not resolved here: {report['unresolved']}")
    elif report["resolved"]:
        devices = ", ".join(device["description"] for device in report["resolved"])
        _print(f"{name}: on this host: {devices}")


def _plan_json(plan: GpuPlan | None) -> dict[str, Any] | None:
    if plan is None:
        return None
    return {
        "count": plan.count,
        "device_ids": list(plan.device_ids),
        "field": plan.field,
        "sharing": plan.sharing,
        "mig_profile": plan.mig_profile,
        "vendor": plan.vendor,
    }


def _describe_plan(plan: dict[str, Any] | None) -> str:
    if plan is None:
        return "no GPU"
    gpus = f"{plan['count']} GPU{'s' if plan['count'] != 1 else ''}"
    if plan["device_ids"]:
        what = f"{gpus} by exact ID ({plan['field']}: {', '.join(plan['device_ids'])})"
    elif plan["mig_profile"]:
        what = f"{plan['count']} MIG instance(s) of profile {plan['mig_profile']}"
    else:
        what = f"{gpus}{' of ' + plan['vendor'] if plan['vendor'] else ''}"
    return f"{what}, {plan['sharing']}"


# -- gpus ----------------------------------------------------------------------------------


def gpus_command(args: argparse.Namespace) -> int:
    from gpu_sandbox.inventory import take, text

    if args.node_annotation:
        from gpuhost.devices import gpus_to_json
        from gpuhost.host import GpuHost

        host = GpuHost.open(_host_config(args))
        whole = [gpu for gpu in host.gpus if not gpu.mig_enabled]
        _print(f'{{"nvidia.com/gpu": {gpus_to_json(whole)}}}')
        return 0
    named = _named(args.driver)
    for name in named:
        _driver_class(name)  # an unknown one is a usage error, not a note in the listing
    inventory = take(_host_config(args), named)
    if args.json:
        _print(json.dumps(inventory.to_json(), indent=2))
    else:
        for line in text(inventory):
            _print(line)
    return 0


# -- reap ----------------------------------------------------------------------------------


def reap_command(args: argparse.Namespace) -> int:
    from drivers import REGISTRY, Reaped, UnknownDriver, get_driver_class, reap_session
    from drivers.base import check_session_id

    try:
        check_session_id(args.session)
    except ValueError as exc:
        raise CommandError(str(exc), EXIT_USAGE) from None
    named = _named(args.driver)
    drivers: dict[str, type[Driver]] = {}
    failed: list[Reaped] = []
    for name in named or REGISTRY:
        try:
            drivers[name] = get_driver_class(name)
        except UnknownDriver as exc:
            if named:
                raise CommandError(str(exc), EXIT_USAGE) from None
            failed.append(Reaped(name, args.session, error=str(exc)))
    results = failed + reap_session(_host(args), args.session, drivers, args.image)
    for result in results:
        _print(result.line)
    return 1 if named and any(result.error for result in results) else 0


# -- shared --------------------------------------------------------------------------------


def _named(options: Sequence[str]) -> list[str]:
    """The drivers a repeatable, comma-separated ``--driver`` names, in order."""
    return [name.strip() for option in options for name in option.split(",") if name.strip()]


def _driver_class(name: str) -> type[Driver]:
    from drivers import UnknownDriver, get_driver_class

    try:
        return get_driver_class(name)
    except UnknownDriver as exc:
        raise CommandError(f"{flag_text('--driver', name)}: {exc}", EXIT_USAGE) from None


def _flags(args: argparse.Namespace) -> GpuFlags:
    config = args.driver_config_json
    text = config
    if config is not None and config.startswith("@"):
        text = _read_text(Path(config[1:]), flag_text("--driver-config-json", config, PATH_LIMIT))
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


def _request(args: argparse.Namespace, flags: GpuFlags, driver: Driver) -> Any:
    """The request: ``--request``'s JSON, or what the flags make for ``driver``."""
    if args.request is None:
        return spec_dict(flags, driver.name, driver.capabilities.id_keys)
    from gpuhost.requestjson import read_json

    path = None if args.request == "-" else Path(args.request)
    text = _read_text(path, flag_text("--request", args.request, PATH_LIMIT))
    where = "stdin" if path is None else named(str(path), PATH_LIMIT)
    return read_json(text, what=f"the request in {where}")


def _read_text(path: Path | None, flag: str) -> str:
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


def _driver(args: argparse.Namespace, session: str) -> Driver:
    cls = _driver_class(args.driver)
    try:
        return cls(_host(args), session, args.image)
    except ValueError as exc:  # the session id (--session)
        raise CommandError(f"--session: {exc}", EXIT_USAGE) from None


def _host_config(args: argparse.Namespace) -> Any:
    from gpuhost.host import HostConfig

    return HostConfig(args.sim_root, args.gpu_state_dir)


def _host(args: argparse.Namespace) -> GpuHost:
    from gpuhost.host import GpuHost
    from gpuhost.simulated import SimulatedHostError

    if args.sim_root is not None:
        try:
            return GpuHost.open(_host_config(args))
        except SimulatedHostError as exc:
            raise CommandError(f"--sim-root={args.sim_root}: {exc}", EXIT_USAGE) from None
    from gpuhost.discovery import DiscoveryError

    try:
        return GpuHost.open(_host_config(args))
    except DiscoveryError as exc:  # GPUs on the bus that no source lists: say which
        raise CommandError(str(exc), 1) from None


def _print(text: str) -> None:
    sys.stdout.write(f"{text}\n")


def _refused(error: RequestError, flags: GpuFlags, driver: Driver) -> CommandError:
    """The one line of a refused request: the flag and its value, the message, the field."""
    flag = _flag_of(error, flags, driver)
    where = f"{type(error).__name__} at {named(error.field, FIELD_LIMIT)}"
    return CommandError(f"{flag + ': ' if flag else ''}{error} ({where})", EXIT_USAGE)


def _flag_of(error: RequestError, flags: GpuFlags, driver: Driver) -> str:
    return flag_of(error, flags, driver.name, driver.capabilities.id_keys)


def _error_json(error: RequestError, flags: GpuFlags, driver: Driver) -> dict[str, Any]:
    value = error.value
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):  # not JSON, or an integer too long for str()
        value = shown(value)
    return {
        "type": type(error).__name__,
        "field": error.field,
        "value": value,
        "message": str(error),
        "flag": _flag_of(error, flags, driver) or None,
    }
