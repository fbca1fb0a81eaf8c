"""What a sandbox can learn of another through the kernel's per-user state: nothing.

Namespaces do not divide everything the kernel keeps: its keyrings are kept per host user and
are not namespaced, and a user's process limit counts every process of that user on the host.
Sandboxes that run as one host user share both: one sees the other's processes in its own
limit, and finds the keys the other added, even after the other closed.
"""

from __future__ import annotations

from uuid import uuid4

import pytest

from conformance.dimensions import declared
from conformance.fixtures import SandboxFactory
from conformance.observe import BOOT_ID
from drivers.base import Sandbox
from gpuhost.spec import SandboxSpec

NEIGHBOUR_PROCESSES = 12
"""Processes the neighbour runs while a sandbox counts against its own limit."""
PROCESS_LIMIT = 8
"""The process limit a sandbox sets itself: over its own two processes, under its neighbour's
twelve. A limit counts the processes of the host user, wherever they run."""

KEYRINGS = {"user": -4, "user-session": -5}
"""The per-user keyrings (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING)."""
DIMENSIONS = {
    "SANDBOX-PEER-01": declared(
        per_user_state=("the process limit", *(f"the {ring} keyring" for ring in KEYRINGS)),
        when=("while the other runs", "after the other closed"),
        gpus=("none", "one GPU"),
    )
}
_NEIGHBOUR = "i=0; while [ $i -lt {n} ]; do sleep 600 </dev/null >/dev/null 2>&1 & i=$((i+1)); done"
"""Leaves ``n`` processes running past the command, until the sandbox closes."""
_PROCESSES = "ls -d /proc/[0-9]* | wc -l"
_COUNTER = (
    f"ulimit -u {PROCESS_LIMIT} 2>/dev/null || ulimit -p {PROCESS_LIMIT}; (echo forked) 2>&1; true"
)
"""Lowers its own process limit (any user may), then forks once: the fork fails when the
processes of its host user, anywhere, are at the limit."""


def _on_this_kernel(sandbox: Sandbox) -> bool:
    """Whether the sandbox runs on the host's kernel (not a VM's: a kernel of its own)."""
    boot = sandbox.exec(["cat", str(BOOT_ID)]).check().stdout.strip()
    return boot == BOOT_ID.read_text().strip()


@pytest.mark.requirement("SANDBOX-PEER-01")
def test_a_neighbours_processes_do_not_count_against_a_sandbox(
    sandboxes: SandboxFactory,
) -> None:
    """A sandbox's process limit MUST NOT count another sandbox's processes."""
    neighbour = sandboxes(SandboxSpec())
    neighbour.exec(["sh", "-c", _NEIGHBOUR.format(n=NEIGHBOUR_PROCESSES)]).check()
    running = int(neighbour.exec(["sh", "-c", _PROCESSES]).check().stdout)
    if running < NEIGHBOUR_PROCESSES:
        pytest.skip(
            f"needs a command's background processes to outlive it (sandbox {neighbour.id} "
            f"had {running} processes after one started {NEIGHBOUR_PROCESSES} and ended)"
        )
    for spec in (SandboxSpec(), SandboxSpec.with_gpus()):
        sandbox = sandboxes(spec)
        counted = sandbox.exec(["sh", "-c", _COUNTER]).check().stdout
        assert "forked" in counted.splitlines(), (
            f"sandbox {sandbox.id}, its process limit set to {PROCESS_LIMIT}, could not "
            f"fork ({counted.strip()!r}) while sandbox {neighbour.id} ran "
            f"{NEIGHBOUR_PROCESSES} processes: both run as one host user, so each counts "
            "the other's processes (and spends the other's limit, and its kernel keyrings)"
        )


_KEYS = f"""
import ctypes, os, sys
calls = {{"x86_64": (248, 250), "aarch64": (217, 219)}}  # add_key, keyctl
add_key, keyctl = calls[os.uname().machine]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
action, name = sys.argv[1], sys.argv[2].encode()
for ring, spec in {KEYRINGS!r}.items():
    if action == "add":
        got = libc.syscall(add_key, b"user", name, b"secret", 6, spec)
    else:  # KEYCTL_SEARCH = 10
        got = libc.syscall(keyctl, 10, spec, b"user", name, 0)
    print(ring, "ok" if got >= 0 else "refused", ctypes.get_errno())
"""
"""Adds a key named argv[2] to each per-user keyring, or searches them for it: one line per
keyring, "ok" or "refused" and the errno."""


def _keys(sandbox: Sandbox, action: str, name: str) -> dict[str, bool]:
    """For each per-user keyring, whether ``action`` (add, find) of key ``name`` succeeded."""
    result = sandbox.exec(["python3", "-c", _KEYS, action, name]).check()
    lines = [line.split() for line in result.stdout.splitlines()]
    return {ring: said == "ok" for ring, said, _ in lines}


@pytest.mark.requirement("SANDBOX-PEER-01")
def test_a_kernel_key_one_sandbox_adds_is_not_found_by_another(
    sandboxes: SandboxFactory,
) -> None:
    """A key added to a sandbox's keyrings MUST NOT be found from another, then or later."""
    first = sandboxes(SandboxSpec())
    if first.exec(["sh", "-c", "command -v python3"]).returncode != 0:
        pytest.skip("needs python3 in the sandbox to add a kernel key (found none)")
    if not _on_this_kernel(first):
        pytest.skip("runs on a kernel of its own: no keyring of the host's to share")
    name = f"gpu-sandbox-peer-{uuid4().hex}"
    added = _keys(first, "add", name)
    beside = sandboxes(SandboxSpec())
    found_beside = _keys(beside, "find", name)
    first.close()
    # Sandboxes made one after another: one of them may get what the closed one had.
    found_after = {
        sandbox.id: _keys(sandbox, "find", name)
        for sandbox in (sandboxes(SandboxSpec()) for _ in range(3))
    }
    for where, found in [(beside.id, found_beside), *found_after.items()]:
        leaked = [ring for ring, yes in found.items() if yes and added.get(ring)]
        assert not leaked, (
            f"sandbox {where} found the key {name} that sandbox {first.id} added to its "
            f"{', '.join(leaked)} keyring: the kernel keeps keyrings per host user, and the "
            "two ran as one (a filter like the engines' refuses add_key and keyctl outright)"
        )
