"""``python -m bench.nodes`` (``make bench-nodes``): the cluster node by node, one node vs two.

The kubernetes lane, whole, through ``python -m conformance.nodes`` (or, ``--runner=job``,
``python -m conformance.job``: a Job per node, in the cluster): on the local cluster's node
alone, and on it and a second node of the same shape side by side (``--jobs=2``;
``scripts/cluster.sh add-node``, taken away again at the end). Interleaved run by run, so
both see the same machine load; wall times, medians, and the ratio two nodes / one node
(1.0 would be a second node for free; 2.0 none of the runs' waiting overlapped).

Needs the cluster answering (``make cluster``); ``--runner=job`` the image too (``make
job-image``), which is imported into the second node once it is added.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.measure import interleaved_medians

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "scripts" / "cluster.sh"
FIRST, SECOND = "localhost", "127.0.0.2"


JOB_IMAGE = ROOT / "build" / "gpu-sandbox-catalogue.oci.tar"
RUNNERS = {"nodes": [], "job": ["--api-server=127.0.0.1:6443"]}
"""Each runner's own arguments: the local cluster's pods reach its API server on the host."""


def run_nodes(runner: str, nodes: list[str], pytest_args: list[str]) -> None:
    """``conformance.<runner>`` on ``nodes``; its exit status must be 0."""
    with tempfile.TemporaryDirectory(prefix="bench-nodes-") as out:
        done = subprocess.run(
            [
                sys.executable, "-m", f"conformance.{runner}", f"--out={out}", "--jobs=2",
                f"--nodes={','.join(nodes)}", *RUNNERS[runner], *pytest_args,
            ],
            capture_output=True, text=True, cwd=ROOT, check=False,
        )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(
            f"conformance.{runner} on {nodes}: exit {done.returncode}\n{done.stdout[-3000:]}"
            f"{done.stderr[-2000:]}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nodes", description=__doc__)
    parser.add_argument("--runs", type=int, default=1, help="rounds of each (default 1)")
    parser.add_argument("--gpus", type=int, default=8, help="the second node's GPUs")
    parser.add_argument("--runner", choices=sorted(RUNNERS), default="nodes")
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = pytest_args or ["--sim-gpus=2", "-p", "no:cacheprovider"]
    if args.runner == "job" and not JOB_IMAGE.is_file():
        parser.error(f"--runner=job: no {JOB_IMAGE}: make job-image")
    subprocess.run(["bash", str(CLUSTER), "add-node", SECOND, str(args.gpus)], check=True)
    try:
        if args.runner == "job":
            subprocess.run(["bash", str(CLUSTER), "import-image", str(JOB_IMAGE)], check=True)
        two, one = interleaved_medians(
            lambda: run_nodes(args.runner, [FIRST, SECOND], pytest_args),
            lambda: run_nodes(args.runner, [FIRST], pytest_args),
            args.runs,
            warm_up=0,
        )
    finally:
        subprocess.run(["bash", str(CLUSTER), "remove-node", SECOND], check=False)
    print(f"conformance.{args.runner}, one node: median {one:.1f} s of {args.runs}")
    print(f"two nodes side by side: median {two:.1f} s of {args.runs}")
    print(f"two nodes / one node: {two / one:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
