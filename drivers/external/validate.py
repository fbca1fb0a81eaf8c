"""Check an external driver's manifest, and show what it would run: a driver author's first step.

    python -m drivers.external.validate PATH [--probe] [--sim-root=DIR] [--image=IMAGE]

Checks the manifest against the schema (docs/external-driver.schema.json) and itself,
renders every template for a set of sample requests and prints the argv each would run
(nothing is run). Every render is held to the manifest's ``limits`` with a session id of
63 characters, the longest a session id may be (a name made of it must still fit). With
``--probe``, creates one sandbox with no GPU and runs
``sh -c 'printf o; printf e >&2; exit 42'`` in it: exit 42, stdout "o" and stderr "e"
must come back intact. Exit status: 0 valid (and the probe passed), 1 the probe failed,
2 the manifest is refused (the key and the value are named).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

from drivers.base import Command
from drivers.external import driver_class
from drivers.external.adapter import ExternalDriver
from drivers.external.driver import TemplatesSandbox
from drivers.external.manifest import ManifestError
from drivers.external.templates import CreateRequest, RefusedValue, render, render_create
from gpuhost.devices import CDI_KIND
from gpuhost.errors import DriverError

PROBE = ("sh", "-c", "printf o; printf e >&2; exit 42")
SAMPLE_ID = "0123456789ab"
SAMPLE_NATIVE = "<id printed by create>"
SAMPLE_IMAGE = "registry.example/image:tag"
"""The image of the samples when the manifest has no defaultImage: what --image would be."""
LONGEST_SESSION = "s" * 63
"""The longest session id (drivers.base.SESSION_ID): the renders held to ``limits`` use it."""


def samples(driver: type[ExternalDriver]) -> Iterator[tuple[str, CreateRequest]]:
    """The sample requests, as create sees them (GPU IDs of a host's first GPUs)."""
    forms = driver.manifest.capabilities.get("idForms", ())
    first, second = _sample_ids(forms, 0), _sample_ids(forms, 1)
    image = driver.manifest.default_image or SAMPLE_IMAGE
    if driver.manifest.host_registry:  # the adapter leases: create is handed the devices
        default = CreateRequest(image, count=1, default_gpu=True, devices=(first,))
        count = CreateRequest(image, count=2, devices=(first, second))
    else:
        default = CreateRequest(image, gpu=1, default_gpu=True)
        count = CreateRequest(image, count=2, gpu=2)
    yield "no GPU", CreateRequest(image)
    yield "default (one free GPU)", default
    yield "count 2", count
    yield "exact IDs", CreateRequest(image, count=2, devices=(first, second))
    yield "shared", dataclasses.replace(default, shared=True)
    yield (
        "env and image",
        CreateRequest("my-image:1", env={"GREETING": "hello world", "EMPTY": ""}),
    )


def _sample_ids(forms: tuple[str, ...], index: int) -> tuple[str, str]:
    uuid_ = f"GPU-0000000{index}-0000-0000-0000-000000000000"
    form = forms[0] if forms else "index"
    native = {
        "index": str(index),
        "uuid": uuid_,
        "cdi": f"{CDI_KIND}={index}",
        "pci": f"0000:0{index + 1}:00.0",
    }[form]
    return native, uuid_


def dry_run(driver: type[ExternalDriver], out: list[str]) -> None:
    """Each template's argv for the sample requests, as shell-quoted lines."""
    native = SAMPLE_ID if driver.manifest.sandbox_id == "adapter" else SAMPLE_NATIVE
    values = {"session_id": "<session>", "id": native}
    for what, argv in renders(driver, values, checked=False):
        out.append(f"{what}:\n  {shlex.join(argv)}")


def check_limits(driver: type[ExternalDriver]) -> str:
    """Which sample render breaks the manifest's ``limits``, and how; "" when none does."""
    values = {"session_id": LONGEST_SESSION, "id": SAMPLE_ID}
    try:
        for _ in renders(driver, values, checked=True):
            pass
    except RefusedValue as exc:
        return f"{exc} (rendered with a session id of {len(LONGEST_SESSION)} characters)"
    return ""


def renders(
    driver: type[ExternalDriver], given: dict[str, str], checked: bool
) -> Iterator[tuple[str, list[str]]]:
    """(what, argv) of each template for the sample requests; ``checked``: held to limits."""
    manifest = driver.manifest
    values = {"driver": manifest.name, "cdi_kind": CDI_KIND, "sandbox_id": SAMPLE_ID, **given}
    limits = manifest.limits if checked else {}
    held = dataclasses.replace(manifest, limits=limits)
    for what, request in samples(driver):
        yield f"create, {what}", render_create(held, request, values)
    for op in ("ready", "pid", "close", "kill", "list", "reap", "version", "inventory"):
        if op in manifest.templates:
            yield op, render(manifest.templates[op], values, limits=limits)
    command = Command.of(PROBE, 10)
    env = tuple({"env_key": k, "env_value": v} for k, v in command.env.items())
    argv = render(
        manifest.templates["exec"], values, {"env": env}, manifest.fragments, limits=limits
    )
    yield f"exec of {shlex.join(PROBE)}", [*argv, *PROBE]


def probe(driver: type[ExternalDriver], sim_root: Path | None, image: str | None) -> str:
    """Run the probe sandbox; "" when it came back intact, else what was wrong."""
    from gpuhost.host import GpuHost, HostConfig
    from gpuhost.spec import SandboxSpec

    session = f"validate-{uuid.uuid4().hex[:8]}"
    adapter = driver(GpuHost.open(HostConfig(sim_root)), session, image)
    try:
        sandbox = adapter.create(SandboxSpec())
        assert isinstance(sandbox, TemplatesSandbox)
        with sandbox:
            result = sandbox.exec(list(PROBE), timeout=60)
    except DriverError as exc:
        return f"the probe sandbox failed: {type(exc).__name__}: {exc}"
    finally:
        try:
            adapter.reap(session)
        except DriverError as exc:
            return f"reap of the probe's session {session} failed: {exc}"
    got = (result.returncode, result.stdout, result.stderr)
    if got != (42, "o", "e"):
        return f"the probe came back as (exit, stdout, stderr) = {got!r}, not (42, 'o', 'e')"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m drivers.external.validate", description=__doc__
    )
    parser.add_argument("path", type=Path, help="the manifest")
    parser.add_argument("--probe", action="store_true", help="run the probe sandbox too")
    parser.add_argument("--sim-root", type=Path, help="a simulated GPU host (for --probe)")
    parser.add_argument("--image", help="the image of the probe sandbox")
    args = parser.parse_args(argv)
    try:
        driver = driver_class(args.path)
    except ManifestError as exc:
        sys.stderr.write(f"invalid manifest: {exc}\n")
        return 2
    broken = check_limits(driver)
    if broken:
        sys.stderr.write(f"invalid manifest: {driver.manifest.path}: {broken}\n")
        return 2
    lines = [f"{args.path}: valid ({driver.manifest.name}, {driver.manifest.allocation})"]
    dry_run(driver, lines)
    sys.stdout.write("\n".join(lines) + "\n")
    if not args.probe:
        return 0
    problem = probe(driver, args.sim_root, args.image)
    if problem:
        sys.stdout.write(f"probe: FAILED: {problem}\n")
        return 1
    sys.stdout.write("probe: passed (exit 42, stdout 'o', stderr 'e')\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
