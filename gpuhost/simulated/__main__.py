"""``python -m gpuhost.simulated setup|teardown|show``: manage a simulated GPU host."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpuhost.devices import gpus_to_json
from gpuhost.simulated import (
    DEFAULT_COUNT,
    DEFAULT_ROOT,
    SimulatedHostError,
    load,
    parse_dri_layout,
    parse_mig_layout,
    setup,
    teardown,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuhost.simulated", description=__doc__)
    parser.add_argument("action", choices=("setup", "teardown", "show"))
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="state directory")
    parser.add_argument("--count", type=int, default=DEFAULT_COUNT, help="GPUs to simulate")
    parser.add_argument(
        "--cdi-dir",
        type=Path,
        default=None,
        help="also register the CDI spec here for the container engines (e.g. /var/run/cdi)",
    )
    parser.add_argument(
        "--mig",
        default="",
        help="MIG instances, e.g. 0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb (GPU:NxPROFILE)",
    )
    parser.add_argument("--dri", default="", help="DRI GPUs of other vendors, e.g. intel:1,amd:2")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the whole NVIDIA GPUs as JSON (what a cluster node publishes of them)",
    )
    args = parser.parse_args(argv)
    try:
        if args.action == "teardown":
            teardown(args.root)
            print(f"removed the simulated GPU host at {args.root}")
            return 0
        host = (
            setup(
                args.root,
                args.count,
                args.cdi_dir,
                parse_mig_layout(args.mig),
                parse_dri_layout(args.dri),
            )
            if args.action == "setup"
            else load(args.root)
        )
    except SimulatedHostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(gpus_to_json(host.gpus))
        return 0
    print(f"simulated GPU host at {host.root}: {len(host.gpus)} GPUs (CDI spec {host.cdi_spec})")
    for gpu in host.gpus:
        mode = ", MIG mode" if gpu.mig_enabled else ""
        print(
            f"  GPU {gpu.index}: {gpu.name} ({gpu.uuid}, {gpu.pci_bus_id}, "
            f"/dev/nvidia{gpu.minor}{mode})"
        )
    for device in (*host.mig_devices, *host.dri_gpus):
        nodes = ", ".join(node.path for node in device.nodes)
        print(f"  {device.describe()}: {nodes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
