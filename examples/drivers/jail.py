"""An example GPU sandbox driver to copy, run as root: one bubblewrap jail per sandbox.

A jail sees the host's programs read-only, its own /dev (its GPUs' nodes), /proc, /tmp and /run,
and no network; what runs in it runs as a host uid of its own (no other jail's, owner of no host
file), without capabilities, under the container engines' default system call filter.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
from subprocess import PIPE

from drivers import seccomp
from drivers.contract import (
    VENDORS,
    Availability,
    Command,
    CommandTimedOut,
    Driver,
    DriverCapabilities,
    GpuDevice,
    GpuPlan,
    Holder,
    Launch,
    Output,
    Sandbox,
    SandboxExecError,
    SandboxStartError,
)
from gpuhost import uids
from gpuhost.procfs import each_process, kill_if, kill_marked, owner
from gpuhost.spawn import spawn, stop_process
from gpuhost.wait import wait_for

HOST_PATH = "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_ENV = {"PATH": HOST_PATH}  # bwrap's and nsenter's: never the caller's (LD_PRELOAD...)
STAMP = "JAIL_SANDBOX"  # bwrap --setenv JAIL_SANDBOX <session>/<id>: how reap finds a jail
SHOWN = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "etc", "opt")  # of the host, read-only
TOOLS = ("bwrap", "nsenter", "setpriv")
TIMEOUT_S = 10.0


class JailDriver(Driver):
    name = "jail"

    @property
    def capabilities(self) -> DriverCapabilities:
        return DriverCapabilities(
            max_gpus_per_sandbox=len(self.host.devices), exact_ids=True, mig_profiles=True,
            id_forms=("index", "uuid", "cdi"), other_vendor_id_forms=("pci", "uuid"),
            shared=True, vendors=VENDORS,  # the lease registry counts sharers: nothing to do
        )  # fmt: skip

    def probe(self) -> Availability:
        missing = [tool for tool in TOOLS if not shutil.which(tool, path=HOST_PATH)]
        ok = not missing and os.geteuid() == 0 and bool(self.host.devices)
        found = f"uid {os.geteuid()}, {len(self.host.devices)} GPUs, missing {missing or 'none'}"
        return Availability(ok, f"needed root, {', '.join(TOOLS)} and GPUs (found: {found})")

    def version(self) -> str:
        done = subprocess.run(["bwrap", "--version"], capture_output=True, env=HOST_ENV, check=True)
        return done.stdout.decode().strip()

    def inventory(self) -> tuple[GpuDevice, ...]:  # what defaults and plain counts take
        return self.host.default_devices

    def exact_devices(self) -> tuple[GpuDevice, ...]:  # MIG instances, AMD and Intel GPUs too
        return self.host.devices

    def pool(self, plan: GpuPlan) -> tuple[GpuDevice, ...]:  # a count of a profile or vendor
        return self.host.pool(plan.vendor, plan.mig_profile)

    def start(self, launch: Launch) -> Jail:
        # Each GPU's nodes (two MIG instances share their GPU's), nvidiactl and nvidia-uvm too.
        control = self.host.control_nodes if any(g.vendor == "nvidia" for g in launch.gpus) else ()
        nodes = sorted({*control, *(node for gpu in launch.gpus for node in gpu.nodes)})
        argv = [
            "bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
            "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",  # for setpriv, which drops all
            "--setenv", STAMP, f"{self.session_id}/{launch.sandbox_id}", "--chdir", "/tmp",
        ]  # fmt: skip
        for name in SHOWN:  # /bin -> usr/bin binds /usr/bin there: the same files
            argv += ["--ro-bind-try", f"/{name}", f"/{name}"]
        argv += ["--dev", "/dev", "--proc", "/proc"]
        for place in ("/tmp", "/var/tmp", "/run", "/dev/shm"):  # its own, for anyone in it
            argv += ["--perms", "1777", "--tmpfs", place]
        for source, target in self.host.tool_mounts:  # a simulated host's nvidia-smi
            argv += ["--ro-bind", str(source), target]
        for parent in sorted({os.path.dirname(node.path) for node in nodes} - {"/dev"}):
            argv += ["--perms", "0755", "--dir", parent]  # else bwrap makes it root's alone
        for node in nodes:
            argv += ["--dev-bind", node.source, node.path]
        # setpriv makes the jail's init, and each command, a uid of the jail's own with its
        # nodes' groups: the kernel keeps keyrings and process limits per uid, not per jail.
        groups = ",".join(sorted({str(os.stat(n.source).st_gid) for n in nodes} - {"0"}))
        user, bwrap = uids.claim(), None  # the uid is the jail's until its pid 1 is gone
        drop = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--no-new-privs",
                f"--groups={groups}" if groups else "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--"]  # fmt: skip
        # The init says "up" once the jail is built, then waits for EOF on its stdin: close()
        # gives it; so does the creator's death (spawn forks from a thread that lives on).
        try:
            filter_fd = seccomp.bpf_fd()  # bwrap loads the system call filter last, for the init
            try:
                argv += ["--seccomp", str(filter_fd), *drop, "sh", "-c", "echo up; exec cat"]
                bwrap = spawn(argv, stdin=PIPE, stdout=PIPE, stderr=PIPE, env=HOST_ENV,
                              pass_fds=(filter_fd,))  # fmt: skip
            finally:
                os.close(filter_fd)
            assert bwrap.stdout is not None
            ready = select.select([bwrap.stdout], [], [], TIMEOUT_S)[0]
            if not ready or bwrap.stdout.readline() != b"up\n":
                bwrap.kill()
                raise SandboxStartError(f"jail did not start: {bwrap.communicate()[1]!r}")
            # The jail's pid 1, a fork of bwrap, holds the leases: the kernel ends it last, so
            # while it lives the GPUs may be in use (bwrap itself may be gone before it).
            mine = _jails(self.session_id)
            (init,) = [pid for pid in mine if mine[pid] == launch.sandbox_id and pid != bwrap.pid]
            holder, pidfd = Holder.process(init), os.pidfd_open(init)
        except BaseException as exc:
            if bwrap is not None:
                stop_process(bwrap)  # nothing runs without its leases
            user.release()
            if isinstance(exc, (OSError, ValueError)):  # pid 1 died at once
                raise SandboxStartError(f"jail died as it started: {exc}") from exc
            raise
        jail = Jail(launch.sandbox_id, self.name, launch.gpus, holder, self.host.leases)
        path = ":".join([*self.host.tool_path, HOST_PATH])
        jail.env = {"PATH": path, "HOME": "/tmp", "LANG": "C.UTF-8", **launch.env}
        jail.bwrap, jail.init, jail.pidfd, jail.drop, jail.user = bwrap, init, pidfd, drop, user
        return jail

    def sandboxes(self, session_id: str) -> list[str]:
        return sorted(set(_jails(session_id).values()))

    def remove_session(self, session_id: str) -> list[str]:
        found = _jails(session_id)
        for pid in found:  # kill_if pins the pid: it kills that process, or none
            kill_if(pid, lambda pid: pid in _jails(session_id))
        wait_for(lambda: _jails(session_id), lambda left: not left, timeout_s=TIMEOUT_S,
                 what=f"the jails of session {session_id} to exit")  # fmt: skip
        return list(found.values())


class Jail(Sandbox):
    bwrap: subprocess.Popen[bytes]
    init: int  # the host pid of the jail's pid 1 (bwrap's child): commands enter its namespaces
    pidfd: int  # its pidfd, readable once it has exited, whoever has its pid by then
    env: dict[str, str]
    drop: list[str]
    user: uids.SandboxUser

    def run(self, command: Command, output: Output) -> int:
        # Into the jail's own namespaces (its one pid namespace: one per command fails
        # SANDBOX-NS-01, and on a real GPU CUDA after the first command), as its user; env -i
        # gives the command the jail's environment and its marker, nothing of nsenter's.
        env = [f"{key}={value}" for key, value in {**self.env, **command.env}.items()]
        enter = ["nsenter", f"--target={self.init}", "--all", "--root", "--wd"]
        stdout, stderr = output.fds or (PIPE, PIPE)
        seccomp.prepare()  # loaded by the fork before it execs nsenter: filtered from the start
        try:
            process = subprocess.Popen(
                [*enter, *self.drop, "env", "-i", *env, *command.argv], stdin=subprocess.DEVNULL,
                stdout=stdout, stderr=stderr, env=HOST_ENV, start_new_session=True,
                preexec_fn=seccomp.load_in_child,
            )  # fmt: skip
        except OSError as exc:
            raise SandboxExecError(f"cannot run {command.argv} in jail {self.id}: {exc}") from exc
        try:  # the output in parts as it comes: exec keeps only its end
            return output.read_from(process, command.timeout)
        except subprocess.TimeoutExpired:
            # nsenter's process group holds the command; the marker finds what left it (setsid).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            kill_marked(command.needle)
            stop_process(process)
            raise CommandTimedOut from None

    def running(self) -> bool:
        return self.bwrap.poll() is None and not select.select([self.pidfd], [], [], 0)[0]

    def stop(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):  # EOF on its stdin ends the init
            self.bwrap.communicate(timeout=TIMEOUT_S)
        stop_process(self.bwrap)
        # bwrap may exit before its pid 1, which the kernel ends once the rest of the jail is gone.
        if not select.select([self.pidfd], [], [], TIMEOUT_S)[0]:
            raise TimeoutError(f"pid 1 of jail {self.id} (host pid {self.init}) did not exit")
        os.close(self.pidfd)
        self.user.release()  # no process of the jail is left: another jail may have its uid

    def kill(self) -> None:
        self.bwrap.send_signal(signal.SIGKILL)  # as a crash would; --die-with-parent does the rest


def _jails(session_id: str) -> dict[int, str]:
    """Each process of the session's jails (bwrap, its fork the jail's pid 1): its sandbox id."""
    found = {}
    for pid, cmdline in each_process("cmdline"):
        args = cmdline.decode(errors="replace").split("\0")
        # Ours alone: any user may start a "bwrap" carrying the stamp (session ids are no secret).
        if args[0].endswith("bwrap") and STAMP in args[:-1] and owner(pid) == os.geteuid():
            session, _, sandbox_id = args[args.index(STAMP) + 1].partition("/")
            if session == session_id:
                found[pid] = sandbox_id
    return found
