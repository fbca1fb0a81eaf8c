"""A sandbox's namespaces: no network or process namespace of the host's or another's."""

from __future__ import annotations

import os
import subprocess
from uuid import uuid4

import pytest

from conformance.dimensions import declared
from conformance.fixtures import SandboxFactory
from conformance.observe import BOOT_ID, COMMAND_PATHS, Run, ways_to_run
from gpuhost.spawn import kill_group
from gpuhost.spec import SandboxSpec

KINDS = ("net", "pid")
"""Network (its loopback services, its abstract sockets) and processes (their /proc/<pid>/root
reaches their files, their signals)."""
SPECS = {
    "one GPU": SandboxSpec.with_gpus(),
    "none": SandboxSpec(),
    "none, a second": SandboxSpec(),
}
DIMENSIONS = {
    "SANDBOX-NS-01": declared(
        namespace=KINDS,
        path=COMMAND_PATHS,
        gpus=tuple(SPECS),
        not_shared_with=(
            "the host",
            "another sandbox",
            "another command of the sandbox, earlier or by another path",
        ),
        host_process=("in its /proc, by its command line",),
    )
}


def _end_group(process: subprocess.Popen[bytes]) -> None:
    kill_group(process.pid)
    process.wait()


def _namespaces(run: Run) -> dict[str, str] | None:
    """The sandbox's namespaces (``net:[<inode>]``...) a command sees; None on a kernel of its own.

    A sandbox on another kernel (a VM, a remote node) cannot share this one's namespaces.
    """
    each = f"for kind in {' '.join(KINDS)}; do readlink /proc/self/ns/$kind; done"
    inside = run(["sh", "-c", f"cat {BOOT_ID}; {each}"]).check()
    boot, *names = inside.stdout.splitlines()
    if boot.strip() != BOOT_ID.read_text().strip():
        return None
    found = dict(zip(KINDS, (name.strip() for name in names), strict=False))
    assert all(found.get(kind, "").startswith(f"{kind}:[") for kind in KINDS), (
        f"cannot read the sandbox's namespaces: {inside}"
    )
    return found


@pytest.mark.requirement("SANDBOX-NS-01")
def test_each_sandbox_has_namespaces_of_its_own(
    sandboxes: SandboxFactory, request: pytest.FixtureRequest
) -> None:
    """A sandbox MUST have network and pid namespaces of its own, not the host's or another's."""
    host = {kind: os.readlink(f"/proc/self/ns/{kind}") for kind in KINDS}
    seen: dict[str, str] = {}
    # A process of the host's, known by its command line: no sandbox's /proc may list it (a
    # sandbox given the host's /proc sees every process there, in a pid namespace of its own).
    marker = f"gpu-sandbox-host-process-{uuid4().hex}"
    # In a process group of its own, which the finalizer ends whole: the shell and its sleep.
    host_process = subprocess.Popen(["sh", "-c", "sleep 600", marker], start_new_session=True)
    request.addfinalizer(lambda: _end_group(host_process))
    for spec in SPECS.values():
        sandbox = sandboxes(spec)
        # Every path to a command: each command of a sandbox, however it came, runs in the
        # sandbox's own namespaces, the same for its whole life.
        first: dict[str, str] | None = None
        for way, run in ways_to_run(sandbox).items():
            namespaces = _namespaces(run)
            if namespaces is None:
                break  # its own kernel
            cmdlines = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; true"
            listed = marker in run(["sh", "-c", cmdlines]).stdout
            assert not listed, (
                f"through {way}, sandbox {sandbox.id} lists the host's processes in its /proc "
                f"(host pid {host_process.pid}: sh -c 'sleep 600' {marker})"
            )
            # A namespace per command ends with the command, and its number may come back as
            # another sandbox's.
            again = _namespaces(run)
            first = first or namespaces
            assert again == namespaces == first, (
                f"commands in sandbox {sandbox.id} ran in different namespaces ({first}, then "
                f"{namespaces} and {again} through {way}): every command of a sandbox must run "
                "in the sandbox's own network and pid namespaces, the same for its whole life"
            )
            for kind, namespace in namespaces.items():
                assert namespace != host[kind], (
                    f"through {way}, sandbox {sandbox.id} shares the host's {kind} namespace "
                    f"({namespace})"
                )
                assert seen.get(namespace, sandbox.id) == sandbox.id, (
                    f"sandboxes {seen.get(namespace)} and {sandbox.id} share {kind} namespace "
                    f"{namespace}"
                )
                seen[namespace] = sandbox.id
