"""The kubernetes lane once per GPU node of a cluster, nodes side by side, one fleet report.

    python -m conformance.nodes --out DIR [--jobs N] [--nodes A,B] PYTEST_ARGS...

Each node with allocatable GPUs (``GPU_SANDBOX_K8S_RESOURCE``, default ``nvidia.com/gpu``)
gets a run of the kubernetes lane of its own, every pod of it pinned to the node
(``GPU_SANDBOX_K8S_NODE``: a node affinity on the node's name, through the scheduler), up to
``--jobs`` runs at once. Each run's report names the node as its host: its name, its GPUs,
its device plugins' resources (``KubernetesDriver.runs_on``). The reports are merged as
``gpu-sandbox report merge`` merges a fleet's (``conformance.fleet``), into DIR: a column
per node, a verdict per node and one over the cluster, which passes only where every node
passed. A node whose run left no report is named, and fails the run.

The runner holds the cluster's catalogue turn meanwhile (a whole-cluster run waits for it),
and each node's run its node's own. Each run's output, JSON and JUnit reports are under
DIR/nodes/. PYTEST_ARGS go to every run (``--requirement``, ``--sim-gpus`` for the host the
runs' own checks stand on, ...).
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from conformance import fleet_render, identity
from conformance.fleet import FleetError, load
from conformance.lanes import DEFAULT_JOBS, Lane, run_lanes
from drivers.kubernetes import KubernetesDriver
from drivers.kubernetes.cluster import NODE_ENV
from gpuhost.host import GpuHost, HostConfig
from gpuhost.private import NotPrivate, private_directory

EXIT_GATE_FAILS = 1
EXIT_USAGE = 2


class NodeRun(Lane):
    """The kubernetes lane on one node: ``name`` is the node's."""

    @property
    def driver(self) -> str:
        return KubernetesDriver.name

    def options(self, at_once: int) -> list[str]:
        return [f"--driver={KubernetesDriver.name}"]

    def start(self, pytest_args: Sequence[str], env: dict[str, str], at_once: int) -> None:
        super().start(pytest_args, {**env, NODE_ENV: self.name}, at_once)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance.nodes",
        description="Run the kubernetes lane once per GPU node of the cluster, nodes side by "
        "side, and merge their reports into one fleet report. Other arguments are pytest's.",
        allow_abbrev=False,
    )
    parser.add_argument("--out", type=Path, required=True, metavar="DIR")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help="nodes at once")
    parser.add_argument("--nodes", help="which nodes, comma-separated (default: every GPU node)")
    args, pytest_args = parser.parse_known_args(None if argv is None else list(argv))
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, not {args.jobs}")
    if any(arg.startswith(("--driver", "--lane")) for arg in pytest_args):
        parser.error("--driver and --lane are the runner's: each node's run is the kubernetes lane")
    driver, names = chosen_nodes(parser, "nodes", args.nodes)
    directory = args.out / "nodes"
    directory.mkdir(parents=True, exist_ok=True)
    try:
        fd = private_directory(directory)
    except NotPrivate as exc:
        parser.error(f"--out: {exc}")
    runs = [NodeRun(name, directory, fd) for name in names]
    _say(f"{len(runs)} nodes, {min(args.jobs, len(runs))} at a time; their output in {directory}")
    with driver.catalogue_turn():
        run_lanes(list(runs), pytest_args, args.jobs)
    return _report(runs, args.out)


def chosen_nodes(
    parser: argparse.ArgumentParser, runner: str, nodes: str | None
) -> tuple[KubernetesDriver, list[str]]:
    """The cluster's driver and the GPU nodes ``--nodes`` names (default: every one)."""
    driver = KubernetesDriver(GpuHost.open(HostConfig()), f"{runner}-{uuid.uuid4().hex[:12]}")
    availability = driver.probe()
    if not availability.ok:
        parser.exit(
            EXIT_USAGE, f"{runner}: the kubernetes driver cannot run here: {availability.reason}\n"
        )
    gpu_nodes = driver.gpu_nodes()
    names = [name.strip() for name in nodes.split(",")] if nodes else gpu_nodes
    unknown = sorted(set(names) - set(gpu_nodes))
    if unknown:
        parser.error(
            f"--nodes: no GPU node {', '.join(unknown)} (GPU nodes: {', '.join(gpu_nodes)})"
        )
    return driver, names


def _report(runs: list[NodeRun], out: Path) -> int:
    """The fleet report of the nodes' reports; a node without one is named and fails."""
    missing = {}
    for run in runs:
        if run.results() is None:
            why = f"its report refused ({run.refused})" if run.refused else "no report"
            missing[run.name] = f"{why}; see {run.log}"
    reported = [run.json for run in runs if run.name not in missing]
    return fleet_report(reported, missing, out, _say)


def fleet_report(
    reported: list[Path], missing: dict[str, str], out: Path, say: Callable[[str], None]
) -> int:
    """The nodes' reports merged into ``out``; the gate's exit status.

    A node ``missing`` a report (its name: why) fails the run.
    """
    for name, why in missing.items():
        say(f"node {name}: FAILED: {why}")
    if not reported:
        say("no node's run left a report")
        return EXIT_GATE_FAILS
    try:
        fleet = load(reported)
    except FleetError as exc:
        say(f"refused: {exc}")
        return EXIT_GATE_FAILS
    paths = fleet_render.write(fleet, out)
    lines = fleet_render.text_lines(fleet, identity.catalogue_version())
    print("\n".join([*lines, f"wrote {', '.join(map(str, paths))}"]), flush=True)  # noqa: T201
    return EXIT_GATE_FAILS if fleet.gate_fails() or missing else 0


def _say(line: str) -> None:
    print(f"nodes: {line}", flush=True)  # noqa: T201


if __name__ == "__main__":
    sys.exit(main())
