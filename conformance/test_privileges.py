"""What a command in a sandbox can do to its host's kernel: nothing, and no privilege regained."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conformance.dimensions import declared
from conformance.fixtures import SandboxFactory
from conformance.observe import BOOT_ID, COMMAND_PATHS, Run, ways_to_run
from drivers.base import Sandbox
from gpuhost.spec import SandboxSpec

KERNEL_KNOBS = (
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/printk_ratelimit_burst",
    "/proc/sys/vm/drop_caches",
    "/proc/sysrq-trigger",
)
"""Host-wide kernel state a root shell could change (``core_pattern`` runs a program as the
host's root). Each is only opened for appending and closed again: nothing is ever written."""
DIMENSIONS = {
    "SANDBOX-PRIV-01": declared(
        path=COMMAND_PATHS,
        process=("the command", "the sandbox's first process"),
        gpus=("one GPU", "none"),
        kernel=("the host's", "a kernel of its own"),
        knob=KERNEL_KNOBS,
    )
}
HARMLESS_KNOB = Path("/proc/sys/kernel/printk_ratelimit_burst")
"""Written inside a sandbox with a kernel of its own, where the write is that kernel's."""

_PROBE = (
    f"cat {BOOT_ID}; "
    "grep '^NoNewPrivs:' /proc/self/status; grep '^NoNewPrivs:' /proc/1/status; "
    "grep '^Seccomp:' /proc/self/status; grep '^Seccomp:' /proc/1/status; "
    f"for knob in {' '.join(KERNEL_KNOBS)}; do "
    '( exec 3>>"$knob" ) 2>/dev/null && echo "writable $knob"; done; '
    "mount -o remount,rw /proc/sys 2>/dev/null && echo 'writable remount'; true"
)
"""Prints the kernel's boot id, NoNewPrivs and Seccomp of the command and of the sandbox's
first process, and each knob the command could open for writing."""
SECCOMP_FILTER = "2"
"""/proc/<pid>/status's Seccomp of a process under a filter (SECCOMP_MODE_FILTER)."""


@dataclass(frozen=True)
class _Probed:
    boot: str
    nnp: list[str]
    """NoNewPrivs of the command, then of the sandbox's first process."""
    seccomp: list[str]
    """Seccomp of the command, then of the sandbox's first process."""
    writable: list[str]


def _probe(run: Run) -> _Probed:
    lines = run(["sh", "-c", _PROBE]).check().stdout.splitlines()

    def values(key: str) -> list[str]:
        return [line.split(":", 1)[1].strip() for line in lines if line.startswith(key)]

    writable = [line.removeprefix("writable ") for line in lines if line.startswith("writable ")]
    return _Probed(lines[0].strip(), values("NoNewPrivs:"), values("Seccomp:"), writable)


@pytest.mark.requirement("SANDBOX-PRIV-01")
def test_commands_cannot_change_the_hosts_kernel_or_regain_privileges(
    sandboxes: SandboxFactory,
) -> None:
    """A command MUST run with no-new-privileges and MUST NOT be able to change the host kernel."""
    for spec in (SandboxSpec.with_gpus(), SandboxSpec()):
        sandbox = sandboxes(spec)
        for way, run in ways_to_run(sandbox).items():
            _check_privileges(sandbox, way, _probe(run))


def _check_privileges(sandbox: Sandbox, way: str, probed: _Probed) -> None:
    __tracebackhide__ = True
    command = f"a command in sandbox {sandbox.id} (through {way})"
    assert probed.nnp[:1] == ["1"], (
        f"{command} runs without no-new-privileges (NoNewPrivs: {probed.nnp[:1]}): a setuid "
        "program in it gains privileges"
    )
    if probed.boot == BOOT_ID.read_text().strip():
        assert probed.nnp[1:] == ["1"], (
            f"the first process of sandbox {sandbox.id} runs without no-new-privileges"
        )
        assert probed.seccomp[:1] == [SECCOMP_FILTER], (
            f"{command} runs under no system call filter (Seccomp: {probed.seccomp[:1]}): on "
            "the host's kernel it may add kernel keys (not namespaced), unshare, mount, load "
            "BPF..., as no engine's default profile lets a container"
        )
        assert probed.seccomp[1:] == [SECCOMP_FILTER], (
            f"the first process of sandbox {sandbox.id} runs under no system call filter "
            f"(Seccomp: {probed.seccomp[1:]})"
        )
        assert not probed.writable, (
            f"{command} can open the host kernel's {probed.writable} for writing: the sandbox "
            "can change the host's kernel settings"
        )
        return
    # A kernel of its own (a VM): its settings are its own; the host's must not move.
    before = HARMLESS_KNOB.read_text().strip()
    other = str(int(before) + 1)
    sandbox.exec(["sh", "-c", f"echo {other} > {HARMLESS_KNOB}; true"])
    assert HARMLESS_KNOB.read_text().strip() == before, (
        f"a write to {HARMLESS_KNOB} in sandbox {sandbox.id}, on a kernel of its own, "
        "changed the host's"
    )
