"""python -m openshell_standin.catalogue: the catalogue via OpenShell's CLI, on the stand-in.

    python -m openshell_standin.catalogue [--manifest=PATH] [--gpus=8] [--mig=...] [--dri=...]
                                          [-- PYTEST ARGS...]

A ``make conformance``-style run of an OpenShell manifest (examples/drivers/openshell.yaml
by default): a simulated GPU host of the gate's layout, a stand-in gateway on it (NOT
OpenShell: ``openshell_standin``), the manifest with its ``openshell`` program replaced by
scripts/openshell (the CLI that scripts/openshell.sh installed), and ``pytest conformance
--driver=exec:<that copy> --sim-root=<the host>`` run with the gateway's environment, which
the manifest's ``passEnv`` hands the CLI. It prints the run's matrix and verdict line and
exits with pytest's status. Everything it made (host, gateway, its sandboxes) is removed at
the end. The suite's self-test of the same run: tests/drivers/test_external_openshell.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from gpuhost import simulated
from openshell_standin.client import RunningGateway, running, with_launcher
from openshell_standin.stubs import ROOT, StubsMissing, cli_missing, load_api

MANIFEST = ROOT / "examples" / "drivers" / "openshell.yaml"
GATE_MIG = "0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb"
GATE_DRI = "intel:1,amd:2"


def missing() -> str:
    """What the run needs and this machine lacks (the CLI, its generated code), or ""."""
    if cli_missing():
        return cli_missing()
    try:
        load_api()
    except StubsMissing as exc:
        return str(exc)
    return ""


@contextlib.contextmanager
def lane(
    work: Path, sim_root: Path, manifest: Path = MANIFEST, log: Path | None = None
) -> Iterator[tuple[Path, RunningGateway]]:
    """A stand-in gateway on ``sim_root`` and the manifest's copy that reaches it, under ``work``.

    Yields the copy's path and the gateway (``gateway.env``: what the CLI's environment needs);
    the gateway's stderr goes to ``log`` when given.
    """
    copy = with_launcher(manifest, work / manifest.name)
    with running(work / "gateway", sim_root, log_path=log) as gateway:
        yield copy, gateway


def pytest_argv(copy: Path, sim_root: Path, args: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", "pytest", str(ROOT / "conformance"), f"--rootdir={ROOT}",
        "-c", str(ROOT / "pytest.ini"), "-p", "no:cacheprovider", f"--driver=exec:{copy}",
        f"--sim-root={sim_root}", *args,
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m openshell_standin.catalogue",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--manifest", type=Path, default=MANIFEST, help="%(default)s")
    parser.add_argument("--gpus", type=int, default=8, help="simulated GPUs (%(default)s)")
    parser.add_argument("--mig", default=GATE_MIG, help="their MIG layout (%(default)s)")
    parser.add_argument("--dri", default=GATE_DRI, help="AMD and Intel GPUs (%(default)s)")
    parser.add_argument("--gateway-log", type=Path, help="the gateway's stderr (a new file)")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's own arguments")
    args = parser.parse_args(argv)
    lacking = missing()
    if lacking:
        sys.stderr.write(f"openshell_standin.catalogue: {lacking}\n")
        return 2
    with tempfile.TemporaryDirectory(prefix="openshell-lane-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o700)
        sim = simulated.setup(
            work / "sim",
            args.gpus,
            mig=simulated.parse_mig_layout(args.mig) if args.mig else None,
            dri=simulated.parse_dri_layout(args.dri) if args.dri else None,
        )
        try:
            with lane(work, sim.root, args.manifest.resolve(), args.gateway_log) as (copy, gateway):
                command = pytest_argv(copy, sim.root, args.pytest_args)
                return subprocess.run(command, env=gateway.cli_env(), check=False).returncode
        finally:
            simulated.teardown(sim.root)


if __name__ == "__main__":
    sys.exit(main())
