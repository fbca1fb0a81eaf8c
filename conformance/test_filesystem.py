"""What a sandbox's filesystem shows: nothing of other sandboxes, nothing of the host's state."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conformance.plugin import SandboxFactory
from drivers.base import Driver
from gpuhost.spec import SandboxSpec

ENGINE_STATE = (
    "/var/lib/docker",
    "/var/lib/containers",
    "/var/lib/containerd",
    "/var/lib/kubelet",
    "/run/containerd",
    "/run/docker.sock",
    "/run/podman",
)
"""Where container engines and kubelet keep other containers' root filesystems and sockets."""


def _host_state_dirs(driver: Driver) -> list[Path]:
    """Places on the host that are private to it: its GPU state, homes, its /run and /var."""
    places = [driver.host.leases.directory, Path.home(), Path("/var/tmp"), Path("/run")]
    if driver.host.simulated is not None:
        places.append(driver.host.simulated.root)
    return places


@contextlib.contextmanager
def _planted(places: list[Path], name: str) -> Iterator[list[Path]]:
    """A file called ``name`` in each of ``places`` that can be written; removed after."""
    planted = []
    try:
        for place in places:
            path = place / name
            with contextlib.suppress(OSError):
                path.write_text("host state a sandbox must not see\n")
                planted.append(path)
        yield planted
    finally:
        for path in planted:
            path.unlink(missing_ok=True)


@pytest.mark.requirement("SANDBOX-FS-01")
def test_nothing_of_other_sandboxes_or_the_host_is_visible(
    driver: Driver, sandboxes: SandboxFactory
) -> None:
    """A sandbox MUST see no file of another sandbox and none of the host's private state."""
    marker = f"gpu-sandbox-fs-probe-{uuid.uuid4().hex[:12]}"
    first = sandboxes(SandboxSpec())
    # Where a sandbox writes: its /tmp, its working directory, its home.
    first.exec(
        ["sh", "-c", f'for d in /tmp "$PWD" "$HOME"; do echo x > "$d/{marker}-sandbox"; done; true']
    )
    with _planted(_host_state_dirs(driver), f"{marker}-host") as planted:
        assert planted, "could not write a single probe file on the host"
        for second in (sandboxes(SandboxSpec()), sandboxes(SandboxSpec.with_gpus())):
            # Everywhere but the kernel's file systems and /usr, which only holds programs.
            search = (
                "find / \\( -path /proc -o -path /sys -o -path /usr \\) -prune -o "
                f"-name '{marker}*' -print 2>/dev/null; true"
            )
            found = second.exec(["sh", "-c", search]).check().stdout.split()
            assert found == [], (
                f"sandbox {second.id} sees files of another sandbox or of the host ({planted}): "
                f"{found}"
            )
            listing = " ".join(f'[ -e {path} ] && echo "{path}";' for path in ENGINE_STATE)
            seen = second.exec(["sh", "-c", f"{listing} true"]).check().stdout.split()
            present = [path for path in ENGINE_STATE if os.path.exists(path)]
            assert not set(seen) & set(present), (
                f"sandbox {second.id} sees the engines' state of the host: {seen}"
            )
