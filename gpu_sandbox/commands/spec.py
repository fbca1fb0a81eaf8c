"""``gpu-sandbox spec``: the request the flags make, and whether the driver takes it."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from gpu_sandbox.commands.common import (
    error_flag,
    gpu_flags,
    open_driver,
    print_line,
    refused,
    request_data,
)
from gpu_sandbox.options import PROG
from gpuhost.errors import shown

if TYPE_CHECKING:
    from drivers.base import Driver
    from gpu_sandbox.flags import GpuFlags
    from gpuhost.errors import RequestError
    from gpuhost.spec import GpuPlan, SandboxSpec


def spec_command(args: argparse.Namespace) -> int:
    from gpuhost.errors import RequestError
    from gpuhost.spec import parse_spec

    flags = gpu_flags(args)
    driver = open_driver(args, f"{PROG}-spec")
    report: dict[str, Any] = {"driver": args.driver, "spec": None, "received": None}
    report["valid"] = False
    try:
        report["spec"] = data = request_data(args, flags, driver)
        spec = parse_spec(data)
        report["received"] = driver.select(spec).to_dict()  # shown when a check refuses it too
        _, plan = driver.check_request(spec, resolve=False)
        report.update(valid=True, plan=_plan_json(plan), **_resolved(spec, driver))
    except RequestError as exc:
        report["error"] = _error_json(exc, flags, driver)
        _print_spec(report, args.json)
        raise refused(exc, flags, driver) from None
    _print_spec(report, args.json)
    return 0


def _resolved(spec: SandboxSpec, driver: Driver) -> dict[str, Any]:
    """The devices the request names on this host, from the driver's whole ``plan``.

    Exact IDs are resolved as the driver resolves them, which may need its engine: when it
    cannot be asked, the request is still valid, and the reason is given.
    """
    from gpuhost.errors import RequestError

    try:
        _, plan = driver.check_request(spec)
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
        print_line(json.dumps(report, indent=2, allow_nan=False))
        return
    name = report["driver"]
    if report["spec"] is not None:
        print_line(json.dumps(report["spec"], indent=2, allow_nan=False))
    if report["received"] is not None:
        block = json.dumps(report["received"]["driver_config"], allow_nan=False)
        print_line(f"{name}: the gateway hands the driver its own block: {block}")
    if not report["valid"]:
        error = report["error"]
        print_line(f"{name}: invalid: {error['type']} at {error['field']}: {error['message']}")
        return
    print_line(f"{name}: valid: {_describe_plan(report['plan'])}")
    if report["unresolved"]:
        print_line(f"{name}: the exact IDs were not resolved here: {report['unresolved']}")
    elif report["resolved"]:
        devices = ", ".join(device["description"] for device in report["resolved"])
        print_line(f"{name}: on this host: {devices}")


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
        "flag": error_flag(error, flags, driver) or None,
    }
