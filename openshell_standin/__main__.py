"""python -m openshell_standin: serve a stand-in OpenShell gateway until SIGTERM or SIGINT.

It writes ``<state-dir>/cli.env``, the variables the CLI needs to reach it
(``XDG_CONFIG_HOME``, ``OPENSHELL_GATEWAY``, ``OPENSHELL_GATEWAY_ENDPOINT``), then prints
``ready <endpoint>``. At its end it deletes every sandbox it made.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

from drivers.reference import ReferenceDriver
from gpuhost.host import GpuHost, HostConfig
from openshell_standin import tls
from openshell_standin.rules import DRIVER_KEYS
from openshell_standin.stubs import StubsMissing, load_api

DEFAULT_NAME = "gpu-sandbox-stand-in"
ENV_FILE = "cli.env"


def private_dir(path: Path) -> Path:
    """``path`` made afresh, readable by this user alone; an existing one is refused."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        raise SystemExit(f"--state-dir {path} exists: name a new directory") from None
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m openshell_standin",
        description="A stand-in for OpenShell's gateway (not OpenShell): the RPCs of the CLI's "
        "sandbox commands, over the reference driver's sandboxes.",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        required=True,
        help="a new directory for its certificates and the CLI's configuration",
    )
    parser.add_argument("--sim-root", type=Path, help="a simulated GPU host (default: real GPUs)")
    parser.add_argument(
        "--driver",
        choices=sorted(DRIVER_KEYS),
        default="docker",
        help="the compute driver whose driver_config block it reads (%(default)s)",
    )
    parser.add_argument("--name", default=DEFAULT_NAME, help="the gateway's name (%(default)s)")
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (default: any)")
    args = parser.parse_args(argv)
    # Its sandboxes' processes are forked from this multi-threaded gRPC server: gRPC's fork
    # handlers must stay out of it (in a child between fork and exec they logged "epoll_wait
    # error" into a command's stderr). Read when grpc is first imported, below.
    os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"
    from openshell_standin.gateway import Gateway, serve

    try:
        api = load_api()
    except StubsMissing as exc:
        sys.stderr.write(f"openshell_standin: {exc}\n")
        return 2
    state = private_dir(args.state_dir.absolute())
    materials = tls.make(state, args.name)
    host = GpuHost.open(HostConfig(sim_root=args.sim_root))
    reference = ReferenceDriver(host, f"openshell-standin-{uuid.uuid4().hex[:12]}")
    gateway = Gateway(api, reference, args.driver)
    server, port = serve(gateway, materials, args.port)
    endpoint = f"https://{tls.HOST}:{port}"
    env = {
        "XDG_CONFIG_HOME": str(materials.config_home),
        "OPENSHELL_GATEWAY": args.name,
        "OPENSHELL_GATEWAY_ENDPOINT": endpoint,
    }
    fd = os.open(state / ENV_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.writelines(f"{key}={value}\n" for key, value in env.items())
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    sys.stdout.write(f"ready {endpoint}\n")
    sys.stdout.flush()
    try:
        stop.wait()
    finally:
        server.stop(grace=1).wait()
        gateway.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
