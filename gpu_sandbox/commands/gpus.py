"""``gpu-sandbox gpus``: the host's GPUs, and what each named driver sees of them."""

from __future__ import annotations

import argparse
import json

from gpu_sandbox.commands.common import driver_class, host_config, named_drivers, print_line


def gpus_command(args: argparse.Namespace) -> int:
    from gpu_sandbox.inventory import take, text

    if args.node_annotation:
        from gpuhost.devices import gpus_to_json
        from gpuhost.host import GpuHost

        host = GpuHost.open(host_config(args))
        whole = [gpu for gpu in host.gpus if not gpu.mig_enabled]
        print_line(f'{{"nvidia.com/gpu": {gpus_to_json(whole)}}}')
        return 0
    named = named_drivers(args.driver)
    for name in named:
        driver_class(name)  # an unknown one is a usage error, not a note in the listing
    inventory = take(host_config(args), named)
    if args.json:
        print_line(json.dumps(inventory.to_json(), indent=2))
    else:
        for line in text(inventory):
            print_line(line)
    return 0
