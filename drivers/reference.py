"""The reference driver: a bubblewrap sandbox holding exactly the GPUs it was given.

Host needs: ``bwrap`` (Debian/Ubuntu package ``bubblewrap``, 0.8 or newer), ``nsenter``
and ``setpriv`` (util-linux), and NVIDIA GPUs, real or simulated
(``gpuhost.simulated``).

Each sandbox's root is read-only and holds the host's system directories (``/usr``,
``/etc`` without its credentials, ``/opt``, ``/sys``) and nothing else of the host: a
private ``/dev`` holding only its GPUs' ``/dev/nvidia<minor>`` nodes and the control
nodes, private ``/tmp``, ``/var/tmp`` and ``/run``, no network, its own pid namespace,
and (on a real host) a ``/proc/driver/nvidia/gpus`` listing only its GPUs. It lives until
closed and dies with the process that created it. Commands run inside it with ``nsenter``
into its namespaces, with no capabilities and no-new-privileges.

Run by root, bwrap (as root) builds the sandbox's namespaces and mounts, and everything in it
runs as an unprivileged host uid and gid of the sandbox's own (``gpuhost.uids``: no other
sandbox's, no account's), with the groups of its device nodes: no host file of root's and no
kernel setting is its to read or change, and no per-user state of the kernel (keyrings,
process limits, quotas) is shared with another sandbox. Run by another user, bwrap maps that
user into a user namespace of the sandbox's own. Every process of a sandbox, its first and
each command, runs under the engines' default system call filter (``drivers.seccomp``).
GPUs come from the host-wide lease registry: exclusive, lowest free first.
"""

from __future__ import annotations

import json
import os
import select
import stat
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from drivers import seccomp
from drivers.base import (
    Availability,
    Driver,
    Launch,
)
from drivers.bwrap import hidden_gpus_argv, host_root_argv, under_system_dirs, with_parents
from drivers.host_process import (
    HOST_ENV,
    HOST_PATH,
    SandboxProcesses,
    how_to_name,
    missing_tools,
    run_tool,
    tool,
)
from drivers.reference_sandbox import CLOSE_TIMEOUT_S, ReferenceSandbox
from gpuhost import uids
from gpuhost.devices import DeviceNode, GpuDevice
from gpuhost.errors import SandboxStartError
from gpuhost.leases import (
    process_start_time,
)
from gpuhost.spawn import spawn, stop_process
from gpuhost.spec import VENDORS, DriverCapabilities, GpuPlan
from gpuhost.uids import SandboxUser

__all__ = ["SANDBOX_ENV", "SESSION_ENV", "ReferenceDriver", "ReferenceSandbox"]
"""The sandbox's class lives in drivers/reference_sandbox.py; it is named here too."""

START_TIMEOUT_S = 10.0
"""bwrap starts in ~10 ms; seconds mean it is stuck, and the error should say so."""
START_ATTEMPTS = 3
"""bwrap copies the mounts under each directory it binds and fails when one vanishes while
it does (a mount under /opt or /sys going away); the next try sees the new mount table."""
_MOUNT_CHURN = "Unable to apply mount flags: remount"
VERSION_TIMEOUT_S = 10.0
SESSION_ENV = "GPU_SANDBOX_SESSION"
SANDBOX_ENV = "GPU_SANDBOX_ID"
_TOOLS = ("bwrap", "nsenter", "setpriv", "env")
NO_GPUS_FOUND = "found none through NVML or nvidia-smi; use --sim-gpus=N for a simulated GPU host"


class ReferenceDriver(Driver):
    name = "reference"
    # The sandbox's init announces itself, then waits on stdin: the sandbox ends when
    # close() shuts the pipe or when the creating process dies and the pipe breaks.
    init_argv: ClassVar[tuple[str, ...]] = ("sh", "-c", "echo ready; exec cat")
    close_timeout_s: ClassVar[float] = CLOSE_TIMEOUT_S
    syscall_filter: ClassVar[bool] = True
    """Whether the sandbox's first process runs under ``drivers.seccomp``'s filter."""

    @property
    def capabilities(self) -> DriverCapabilities:
        return DriverCapabilities(
            max_gpus_per_sandbox=len(self.host.devices),
            exact_ids=True,
            id_forms=("index", "uuid", "cdi"),
            other_vendor_id_forms=("pci", "uuid"),
            exclusive=True,
            shared=True,
            mig_profiles=True,
            vendors=VENDORS,
            host_filesystem=True,
        )

    def probe(self) -> Availability:
        missing = missing_tools(_TOOLS)
        if missing:
            return Availability(
                False,
                f"needed {', '.join(missing)} in {HOST_PATH} (found none; "
                "apt-get install bubblewrap util-linux coreutils, or name where they are: "
                f"{how_to_name(missing)})",
            )
        if not self.host.gpus:
            return Availability(False, f"needed NVIDIA GPUs ({NO_GPUS_FOUND})")
        try:
            user = self.claim_user()
            filter_fd = seccomp.bpf_fd() if self.syscall_filter else -1
        except (OSError, SandboxStartError) as exc:
            return Availability(False, f"needed a sandbox user and its system call filter ({exc})")
        # The very command line a sandbox gets, so that a bwrap lacking an option it uses
        # (--disable-userns needs 0.8) fails here, with the reason, and not in every test.
        try:
            trial = subprocess.run(
                [
                    *with_parents(self.bwrap_argv("probe", ())),
                    *self.filter_argv(filter_fd),
                    *self.init_prefix((), user),
                    "true",
                ],
                capture_output=True,
                text=True,
                check=False,
                env=HOST_ENV,
                pass_fds=(filter_fd,) if filter_fd >= 0 else (),
            )
        finally:
            if user is not None:
                user.release()
            if filter_fd >= 0:
                os.close(filter_fd)
        if trial.returncode != 0:
            # bwrap's own message says why; an option it does not know means it is too old.
            hint = "; bwrap 0.8 or newer is needed" if "Unknown option" in trial.stderr else ""
            return Availability(
                False,
                f"needed bwrap able to start a sandbox (found: bwrap exited {trial.returncode}: "
                f"{trial.stderr.strip()}{hint})",
            )
        return Availability(True)

    def version(self) -> str:
        result = run_tool([tool("bwrap"), "--version"], VERSION_TIMEOUT_S)
        return result.stdout.strip() if result is not None and result.returncode == 0 else ""

    def inventory(self) -> tuple[GpuDevice, ...]:
        return self.host.default_devices

    def exact_devices(self) -> tuple[GpuDevice, ...]:
        return self.host.devices

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:
        return self.host.pool(plan.vendor, plan.mig_profile)

    def start(self, launch: Launch) -> ReferenceSandbox:
        argv = self.bwrap_argv(launch.sandbox_id, launch.gpus)
        for _ in range(START_ATTEMPTS - 1):
            try:
                return self._start(launch, argv)
            except SandboxStartError as exc:
                if _MOUNT_CHURN not in str(exc):
                    raise
        return self._start(launch, argv)

    def _start(self, launch: Launch, argv: list[str]) -> ReferenceSandbox:
        """Start bwrap and wait for its init to say it is ready."""
        argv = with_parents(argv)
        user = self.claim_user()
        try:
            return self._start_as(launch, argv, user)
        except BaseException:
            if user is not None:
                user.release()
            raise

    def _start_as(
        self, launch: Launch, argv: list[str], user: SandboxUser | None
    ) -> ReferenceSandbox:
        filter_fd = seccomp.bpf_fd() if self.syscall_filter else -1
        info_read, info_write = os.pipe()
        try:
            init = [*self.init_prefix(launch.gpus, user), *self.init_argv]
            process = spawn(
                [*argv, *self.filter_argv(filter_fd), "--info-fd", str(info_write), *init],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(info_write, filter_fd) if filter_fd >= 0 else (info_write,),
                env=HOST_ENV,
            )
        except BaseException:
            os.close(info_read)
            raise
        finally:
            # spawn returns (or raises) only once the spawner is done with the fds.
            os.close(info_write)
            if filter_fd >= 0:
                os.close(filter_fd)
        try:
            with os.fdopen(info_read, "rb") as info:
                assert process.stdout is not None
                ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
                if not ready or process.stdout.readline() != b"ready\n":
                    process.kill()
                    _, stderr = process.communicate()
                    raise SandboxStartError(
                        f"sandbox {launch.sandbox_id} did not start within "
                        f"{START_TIMEOUT_S:g} s (bwrap exit {process.returncode}): "
                        f"{stderr.decode(errors='replace').strip()}"
                    )
                try:
                    child_pid = int(json.loads(info.read())["child-pid"])
                    child_start = process_start_time(child_pid)
                except (OSError, ValueError, KeyError) as exc:
                    raise SandboxStartError(
                        f"sandbox {launch.sandbox_id} died as it started: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
        except BaseException:
            stop_process(process)
            raise
        return ReferenceSandbox(
            launch.sandbox_id,
            self.name,
            launch.gpus,
            process,
            child_pid,
            child_start,
            self.sandbox_env(launch.env),
            self.host.leases,
            self.close_timeout_s,
            self.as_sandbox_user(launch.gpus, user),
            user,
        )

    def claim_user(self) -> SandboxUser | None:
        """The host user of a new sandbox: run by root, a uid of its own.

        Run by another user, none: bwrap maps the caller into a user namespace of its own.
        """
        return uids.claim() if os.geteuid() == 0 else None

    def as_sandbox_user(self, gpus: Sequence[GpuDevice], user: SandboxUser | None) -> list[str]:
        """``setpriv``'s options that make a process of the sandbox its host user.

        Run by root: ``user``, with the groups of the device nodes of ``gpus`` that are not
        root's (a DRI node's render group); otherwise none: bwrap maps the caller.
        """
        if user is None:
            return []
        nodes = self.device_nodes(gpus)
        groups = sorted({gid for node in nodes if (gid := _gid(node.source)) > 0})
        return [
            f"--reuid={user.uid}", f"--regid={user.gid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
        ]  # fmt: skip

    def init_prefix(self, gpus: Sequence[GpuDevice], user: SandboxUser | None) -> list[str]:
        """What runs the sandbox's first process as its commands run (root-run: setpriv)."""
        if os.geteuid() != 0:
            return []
        privileges = ReferenceSandbox.exec_privileges
        return ["setpriv", *self.as_sandbox_user(gpus, user), *privileges, "--"]

    @staticmethod
    def filter_argv(filter_fd: int) -> list[str]:
        """The bwrap options that load the system call filter read from ``filter_fd``.

        bwrap loads it into the sandbox's first process last, just before it starts; none
        where ``filter_fd`` is -1.
        """
        return ["--seccomp", str(filter_fd)] if filter_fd >= 0 else []

    def sees(self, path: Path) -> bool:
        """Whether the sandbox's host user can read ``path`` bound in: always, unless run by root.

        A root-run sandbox is nobody on the host: ``path`` must be readable and searchable
        by others (the directories above it need not: bwrap binds it as root).
        """
        if os.geteuid() != 0:
            return True
        try:
            mode = path.stat().st_mode
        except OSError:
            return False
        return bool(mode & stat.S_IROTH and mode & stat.S_IXOTH)

    def device_nodes(self, gpus: Sequence[GpuDevice]) -> list[DeviceNode]:
        """The nodes a sandbox of ``gpus`` gets, each once; NVIDIA's control nodes too."""
        control = self.host.control_nodes if any(g.vendor == "nvidia" for g in gpus) else ()
        return list(dict.fromkeys([*control, *(n for gpu in gpus for n in gpu.nodes)]))

    def sandboxes(self, session_id: str) -> list[str]:
        return sorted({sandbox_id for sandbox_id, _ in _bwrap_processes(session_id)})

    def remove_session(self, session_id: str) -> list[str]:
        return BWRAP_PROCESSES.reap(session_id)

    def bwrap_argv(self, sandbox_id: str, gpus: Sequence[GpuDevice]) -> list[str]:
        """The bwrap command line of a sandbox holding ``gpus``."""
        namespaces = [
            "--unshare-all", "--unshare-user", "--disable-userns",
        ] if os.geteuid() != 0 else [
            # No user namespace: bwrap, as root, binds what root can reach; the sandbox's
            # first process takes its user from setpriv, these two capabilities with it.
            "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
        ]  # fmt: skip
        argv = [
            tool("bwrap"),
            *self.root_argv(),
            "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm",  # for PyTorch, NCCL
            "--proc", "/proc",
            "--perms", "1777", "--tmpfs", "/tmp",
            "--perms", "1777", "--tmpfs", "/run",
            *namespaces,
            "--die-with-parent",
            "--new-session",
            "--chdir", "/tmp",
            "--setenv", SESSION_ENV, self.session_id,
            "--setenv", SANDBOX_ENV, sandbox_id,
        ]  # fmt: skip
        # The host's own GPU state stays out of sight where a system directory would show it.
        for state in self.host.private_dirs:
            state.mkdir(parents=True, exist_ok=True)
            if under_system_dirs(state.resolve()):
                argv += ["--tmpfs", str(state.resolve())]
        for source, target in self.host.tool_mounts:
            argv += ["--ro-bind", str(source), target]
        # The suite's own Python, which the workload lane runs inside, after the tmpfs mounts
        # (a checkout under /tmp keeps its venv there), where the sandbox's user can read it.
        for prefix in sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}):
            if not under_system_dirs(prefix) and self.sees(prefix):
                argv += ["--ro-bind", str(prefix), str(prefix)]
        # Device binds come after `--dev /dev`, which would otherwise hide them.
        for node in self.device_nodes(gpus):
            argv += ["--dev-bind", node.source, node.path]
        argv += hidden_gpus_argv(self.host.devices, gpus)
        return [*argv, "--remount-ro", "/"]

    def root_argv(self) -> list[str]:
        """The sandbox's root: the host's system directories, read-only, and nothing else.

        Not the host's root: that would show other containers' root filesystems, the
        engines' state, home directories and the host's /run, and a container mount
        vanishing while bwrap copies the mount tree would fail the sandbox's start.
        """
        return host_root_argv()

    def sandbox_env(self, extra: Mapping[str, str]) -> dict[str, str]:
        path = ":".join([*self.host.tool_path, HOST_PATH])
        return {"PATH": path, "HOME": "/tmp", "LANG": "C.UTF-8", **extra}


def _gid(path: str) -> int:
    try:
        return os.stat(path).st_gid
    except OSError:
        return 0


def _stamped(args: list[str], session_id: str) -> str | None:
    """The sandbox a bwrap command line is stamped with (``--setenv``), if of ``session_id``."""
    pairs = {args[i + 1]: args[i + 2] for i, arg in enumerate(args[:-2]) if arg == "--setenv"}
    return (
        pairs[SANDBOX_ENV]
        if pairs.get(SESSION_ENV) == session_id and SANDBOX_ENV in pairs
        else None
    )


BWRAP_PROCESSES = SandboxProcesses("bwrap", _stamped, called="bwrap")
"""Every sandbox's bwrap process, stamped with its session and sandbox."""


def _bwrap_processes(session_id: str) -> list[tuple[str, int]]:
    """(sandbox id, pid) of every bwrap process stamped with ``session_id``."""
    return BWRAP_PROCESSES.find(session_id)
