"""What a command in a sandbox can do to its host's kernel: nothing, and no privilege regained."""

from __future__ import annotations

from pathlib import Path

import pytest

from conformance.fixtures import SandboxFactory
from conformance.observe import BOOT_ID
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
HARMLESS_KNOB = Path("/proc/sys/kernel/printk_ratelimit_burst")
"""Written inside a sandbox with a kernel of its own, where the write is that kernel's."""

_PROBE = (
    f"cat {BOOT_ID}; "
    "grep '^NoNewPrivs:' /proc/self/status; grep '^NoNewPrivs:' /proc/1/status; "
    f"for knob in {' '.join(KERNEL_KNOBS)}; do "
    '( exec 3>>"$knob" ) 2>/dev/null && echo "writable $knob"; done; '
    "mount -o remount,rw /proc/sys 2>/dev/null && echo 'writable remount'; true"
)
"""Prints the kernel's boot id, NoNewPrivs of the command and of the sandbox's first process,
and each knob the command could open for writing."""


def _probe(sandbox: Sandbox) -> tuple[str, list[str], list[str]]:
    """(boot id, NoNewPrivs values of the command and the first process, writable knobs)."""
    lines = sandbox.exec(["sh", "-c", _PROBE]).check().stdout.splitlines()
    boot = lines[0].strip()
    nnp = [line.split(":", 1)[1].strip() for line in lines if line.startswith("NoNewPrivs:")]
    writable = [line.removeprefix("writable ") for line in lines if line.startswith("writable ")]
    return boot, nnp, writable


@pytest.mark.requirement("SANDBOX-PRIV-01")
def test_commands_cannot_change_the_hosts_kernel_or_regain_privileges(
    sandboxes: SandboxFactory,
) -> None:
    """A command MUST run with no-new-privileges and MUST NOT be able to change the host kernel."""
    for spec in (SandboxSpec.with_gpus(), SandboxSpec()):
        sandbox = sandboxes(spec)
        boot, nnp, writable = _probe(sandbox)
        assert nnp[:1] == ["1"], (
            f"a command in sandbox {sandbox.id} runs without no-new-privileges (NoNewPrivs: "
            f"{nnp[:1]}): a setuid program in it gains privileges"
        )
        if boot == BOOT_ID.read_text().strip():
            assert nnp[1:] == ["1"], (
                f"the first process of sandbox {sandbox.id} runs without no-new-privileges"
            )
            assert not writable, (
                f"a command in sandbox {sandbox.id} can open the host kernel's {writable} for "
                "writing: the sandbox can change the host's kernel settings"
            )
            continue
        # A kernel of its own (a VM): its settings are its own; the host's must not move.
        before = HARMLESS_KNOB.read_text().strip()
        other = str(int(before) + 1)
        sandbox.exec(["sh", "-c", f"echo {other} > {HARMLESS_KNOB}; true"])
        assert HARMLESS_KNOB.read_text().strip() == before, (
            f"a write to {HARMLESS_KNOB} in sandbox {sandbox.id}, on a kernel of its own, "
            "changed the host's"
        )
