"""The reference driver's own guarantees, beyond what the catalogue asks of every driver."""

from __future__ import annotations

import dataclasses
import os
import pwd
import subprocess
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from drivers import reference as reference_module
from drivers.base import Launch
from drivers.reference import SANDBOX_ENV, SESSION_ENV, ReferenceDriver, ReferenceSandbox
from gpuhost import simulated
from gpuhost.devices import DeviceNode, GpuDevice
from gpuhost.errors import SandboxExecError, SandboxStartError
from gpuhost.host import GpuHost, HostConfig
from gpuhost.spec import SandboxSpec
from gpuhost.uids import SANDBOX_UIDS, runs_a_process
from gpuhost.wait import wait_for
from tests.other_user import setpriv


@pytest.fixture
def reference(sim_host: simulated.SimulatedHost) -> Iterator[ReferenceDriver]:
    # A session of this test's own: under xdist another worker reaps its own concurrently.
    session = f"reference-self-test-{uuid.uuid4().hex[:8]}"
    driver = ReferenceDriver(GpuHost.open(HostConfig(sim_root=sim_host.root)), session)
    if not driver.probe().ok:
        pytest.skip(driver.probe().reason)
    yield driver
    driver.reap(session)


def test_commands_run_without_capabilities(reference: ReferenceDriver) -> None:
    with reference.create(SandboxSpec.with_gpus()) as sandbox:
        status = sandbox.exec(["cat", "/proc/self/status"]).check().stdout
        assert "CapEff:\t0000000000000000" in status
        # Root in the sandbox's user namespace could otherwise re-bind another GPU's node.
        remount = sandbox.exec(["mount", "-t", "tmpfs", "none", "/tmp"])
        assert remount.returncode != 0


def test_the_spec_environment_reaches_the_command_only(reference: ReferenceDriver) -> None:
    spec = dataclasses.replace(SandboxSpec(), env={"FOO": "bar", "PATH": "/nonexistent"})
    with reference.create(spec) as sandbox:
        result = sandbox.exec(["/usr/bin/printenv", "FOO", "PATH"]).check()
        assert result.stdout.split() == ["bar", "/nonexistent"]


def test_exec_after_close_or_kill_is_an_error(reference: ReferenceDriver) -> None:
    sandbox = reference.create(SandboxSpec())
    sandbox.close()
    sandbox.close()
    with pytest.raises(SandboxExecError, match="is closed"):
        sandbox.exec(["true"])
    killed = reference.create(SandboxSpec())
    assert isinstance(killed, ReferenceSandbox)
    killed.kill()
    killed._process.wait()
    with pytest.raises(SandboxExecError, match="not running"):
        killed.exec(["true"])
    killed.close()


def test_a_failed_start_leaves_nothing(reference: ReferenceDriver) -> None:
    missing = DeviceNode("/dev/nvidiactl", 195, 255, "/nonexistent/nvidiactl")
    broken = ReferenceDriver(
        dataclasses.replace(reference.host, control_nodes=(missing,)), reference.session_id
    )
    with pytest.raises(SandboxStartError, match="nonexistent"):
        broken.create(SandboxSpec.with_gpus())
    assert reference.host.leases.leases() == []
    assert reference.sandboxes(reference.session_id) == []


def test_a_sandbox_outlives_the_thread_that_created_it(reference: ReferenceDriver) -> None:
    created = []
    thread = threading.Thread(target=lambda: created.append(reference.create(SandboxSpec())))
    thread.start()
    thread.join()
    with created[0] as sandbox:
        assert sandbox.exec(["true"]).returncode == 0


def test_sys_shows_neither_the_hosts_cgroups_nor_its_network_interfaces(
    reference: ReferenceDriver,
) -> None:
    """Before: /sys/fs/cgroup listed every service of the host, /sys/class/net its NICs."""
    host_side = sorted(os.listdir("/sys/class/net")), sorted(os.listdir("/sys/fs/cgroup"))
    assert all(host_side), "the host shows interfaces and cgroups: the test needs both"
    with reference.create(SandboxSpec()) as sandbox:
        for view in ("/sys/fs/cgroup", "/sys/class/net", "/sys/devices/virtual/net"):
            listing = sandbox.exec(["ls", "-A", view]).check().stdout
            assert listing == "", f"{view} inside shows the host's: {listing!r}"
        # What a GPU's user needs of /sys stays: the PCI devices, for NVML.
        assert sandbox.exec(["ls", "/sys/bus/pci/devices"]).check().stdout.strip()


@pytest.mark.parametrize("parent", ["/var/tmp", "/opt"], ids=["outside", "in-a-system-dir"])
def test_host_state_is_hidden_from_the_sandbox(
    reference: ReferenceDriver, sim_host: simulated.SimulatedHost, parent: str
) -> None:
    """The lease registry is never visible, even where it lives in a directory that is."""
    state = Path(parent) / f"gpu-state-{id(reference)}"
    host = GpuHost.open(HostConfig(sim_root=sim_host.root, state_dir=state))
    driver = ReferenceDriver(host, reference.session_id)
    try:
        with driver.create(SandboxSpec.with_gpus()) as sandbox:
            assert driver.host.leases.path.exists()
            listing = sandbox.exec(["sh", "-c", f"ls -A {state} 2>/dev/null; true"]).stdout
            assert listing == "", f"the lease registry is visible inside: {listing!r}"
            share = sandbox.exec(["ls", simulated.SANDBOX_SHARE]).check().stdout.split()
            assert sorted(share) == [
                "bin", "control-nodes.tsv", "dri.tsv", "inventory.tsv", "mig-minors", "mig.tsv"
            ]  # fmt: skip
    finally:
        for leftover in state.iterdir():
            leftover.unlink()
        state.rmdir()


def test_probe_tries_the_sandbox_command_line_itself(reference: ReferenceDriver) -> None:
    class NeedsANewerBwrap(ReferenceDriver):
        def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
            return [*super().bwrap_argv(sandbox_id, gpus), "--option-from-the-future"]

    availability = NeedsANewerBwrap(reference.host, reference.session_id).probe()
    assert not availability.ok
    assert "--option-from-the-future" in availability.reason


def test_version_names_the_bwrap_it_runs_on(
    reference: ReferenceDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert reference.version().startswith("bubblewrap ")
    monkeypatch.setattr("drivers.reference.tool", lambda name: "/nonexistent/bwrap")
    assert reference.version() == ""


MOUNT_RACE = (
    "bwrap: Can't bind mount /oldroot/ on /newroot/: Unable to apply mount flags: remount "
    '"/newroot/var/lib/docker/overlay2/0123/merged": Invalid argument'
)


@pytest.mark.parametrize(
    ("failures", "started"),
    [([MOUNT_RACE, MOUNT_RACE], True), (["bwrap: No permissions to create new namespace"], False)],
)
def test_only_a_start_that_lost_a_race_with_host_mounts_is_tried_again(
    reference: ReferenceDriver,
    monkeypatch: pytest.MonkeyPatch,
    failures: list[str],
    started: bool,
) -> None:
    start = ReferenceDriver._start
    pending = list(failures)

    def flaky(self: ReferenceDriver, launch: Launch, argv: list[str]) -> ReferenceSandbox:
        if pending:
            raise SandboxStartError(f"sandbox {launch.sandbox_id} did not start: {pending.pop(0)}")
        return start(self, launch, argv)

    monkeypatch.setattr(ReferenceDriver, "_start", flaky)
    if started:
        with reference.create(SandboxSpec.with_gpus()) as sandbox:
            assert sandbox.exec(["true"]).returncode == 0
    else:
        with pytest.raises(SandboxStartError, match="No permissions"):
            reference.create(SandboxSpec.with_gpus())
    assert reference.host.leases.leases() == []


def test_the_suites_python_stays_visible_from_under_tmp(
    reference: ReferenceDriver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkout under /tmp (a private tmpfs inside) keeps its venv visible, read-only."""
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "marker").write_text("venv\n")
    monkeypatch.setattr("sys.prefix", str(prefix))
    with reference.create(SandboxSpec()) as sandbox:
        seen = sandbox.exec(["cat", str(prefix / "bin" / "marker")]).check().stdout
        write = sandbox.exec(["touch", str(prefix / "bin" / "new")])
    assert seen == "venv\n"
    assert write.returncode != 0, "the suite's venv must be read-only inside"


def test_a_found_pid_is_killed_only_if_it_is_still_the_one_found() -> None:
    """Reaps and timeouts pin a pid with a pidfd, then check it: a reused pid is left alone."""
    from gpuhost.procfs import has_mark, kill_if

    marked = subprocess.Popen(["sleep", "60"], env={"GPU_SANDBOX_EXEC": "ours"})
    other = subprocess.Popen(["sleep", "60"], env={"GPU_SANDBOX_EXEC": "someone-elses"})
    try:
        for process in (marked, other):
            kill_if(process.pid, lambda pid: has_mark(pid, b"GPU_SANDBOX_EXEC=ours"))
        assert marked.wait(5) == -9
        assert other.poll() is None, "a process that is not the one found was killed"
    finally:
        other.kill()
        other.wait()


def test_the_sandbox_user_can_write_posix_shared_memory(reference: ReferenceDriver) -> None:
    """PyTorch's data loaders and NCCL put their buffers in /dev/shm."""
    with reference.create(SandboxSpec()) as sandbox:
        done = sandbox.exec(["sh", "-c", "echo x > /dev/shm/buffer && cat /dev/shm/buffer"])
        assert (done.returncode, done.stdout) == (0, "x\n"), done


def test_a_missing_tool_says_how_to_name_it(
    reference: ReferenceDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reference_module, "_TOOLS", ("no-such-bwrap",))
    reason = reference.probe().reason
    assert "GPU_SANDBOX_TOOL_NO_SUCH_BWRAP=/path/to/no-such-bwrap" in reason, reason


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, beside another user")
def test_another_users_process_carrying_the_sessions_stamp_is_no_sandbox(
    reference: ReferenceDriver,
) -> None:
    """Session ids are no secret (the lease files are 0644): only the owner tells a sandbox.

    Another user starts a process named bwrap whose arguments carry this session's stamp; it
    is not listed among the session's sandboxes, and the session's reap leaves it running.
    """
    stamp = ["--setenv", SESSION_ENV, reference.session_id, "--setenv", SANDBOX_ENV, "forged"]
    forged = subprocess.Popen(
        [*setpriv(), "bash", "-c", 'exec -a bwrap sh -c "sleep 60" "$@"', "sh", *stamp]
    )
    try:
        with reference.create(SandboxSpec()) as sandbox:
            wait_for(
                lambda: Path(f"/proc/{forged.pid}/cmdline").read_bytes(),
                lambda cmdline: cmdline.startswith(b"bwrap\0"),
                timeout_s=5,
                what="the forged process to start",
            )
            assert reference.sandboxes(reference.session_id) == [sandbox.id]
        assert reference.reap(reference.session_id) == []
        assert forged.poll() is None, "root's reap killed another user's process"
    finally:
        forged.kill()
        forged.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="sandbox users are root-run sandboxes'")
def test_each_sandbox_runs_as_a_host_user_of_its_own(reference: ReferenceDriver) -> None:
    """Not one uid for all (keyrings and process limits are per host user), nor an account's."""
    with reference.create(SandboxSpec()) as first, reference.create(SandboxSpec()) as second:
        ids = [
            sb.exec(["sh", "-c", "id -u; id -g"]).check().stdout.split() for sb in (first, second)
        ]
        assert ids[0] != ids[1]
        for uid, gid in ids:
            assert uid == gid
            assert int(uid) in SANDBOX_UIDS
            with pytest.raises(KeyError):
                pwd.getpwuid(int(uid))
        held = [int(uid) for uid, _ in ids]
        assert all(runs_a_process(uid) for uid in held)
    assert not any(runs_a_process(uid) for uid in held), "a sandbox's user outlived its close"
