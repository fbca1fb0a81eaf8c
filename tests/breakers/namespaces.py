"""Planted breakers of the sandbox's namespaces: SANDBOX-NS-01.

Its network and pid namespaces are its own, for its whole life. Their tests:
conformance/test_namespaces.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from conformance.observe import COMMAND_PATHS
from drivers.base import Command, Output
from drivers.reference import ReferenceSandbox
from gpuhost.devices import GpuDevice
from tests.breakers.base import BrokenDriver, family
from tests.breakers.execution import EnteredOnOnePath, way_name


class SharesHostNetwork(BrokenDriver):
    """SANDBOX-NS-01: keeps the host's network namespace (--share-net), to download models."""

    BREAKS = "SANDBOX-NS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = [arg for arg in super().bwrap_argv(sandbox_id, gpus) if arg != "--unshare-net"]
        if "--unshare-all" in argv:
            at = argv.index("--unshare-all") + 1
            argv = [*argv[:at], "--share-net", *argv[at:]]
        return argv


class HostProcBound(BrokenDriver):
    """SANDBOX-NS-01: binds the host's /proc instead of a procfs of the sandbox's pid namespace.

    ``--bind /proc /proc``: the usual workaround for "Can't mount proc" in nested containers.
    """

    BREAKS = "SANDBOX-NS-01"

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        argv = super().bwrap_argv(sandbox_id, gpus)
        at = argv.index("--proc")
        return [*argv[:at], "--bind", "/proc", "/proc", *argv[at + 2 :]]


class _PidNamespacePerCommand(ReferenceSandbox):
    def run(self, command: Command, output: Output) -> int:
        # "Each command isolated from the others": a pid namespace that ends with it.
        unshared = ("unshare", "--user", "--map-root-user", "--pid", "--fork", *command.argv)
        return super().run(dataclasses.replace(command, argv=unshared), output)


class PidNamespacePerCommand(BrokenDriver):
    """SANDBOX-NS-01: each command runs in a pid namespace of its own, which ends with it."""

    BREAKS = "SANDBOX-NS-01"
    SANDBOX = _PidNamespacePerCommand


def _host_network_on(way: str) -> type[BrokenDriver]:
    class _Sandbox(EnteredOnOnePath):
        BROKEN_ON = way
        ENTER = tuple(arg for arg in EnteredOnOnePath.ENTER if arg != "--net")

    class HostNetwork(BrokenDriver):
        __doc__ = (
            f"SANDBOX-NS-01: a command run through {way} is entered without the sandbox's "
            "network namespace: it runs in the host's (to fetch what it streams)."
        )
        BREAKS = "SANDBOX-NS-01"
        SANDBOX = _Sandbox

    HostNetwork.__name__ = HostNetwork.__qualname__ = f"HostNetworkOn{way_name(way)}"
    return HostNetwork


HOST_NETWORK_ON = family(globals(), COMMAND_PATHS, _host_network_on)
