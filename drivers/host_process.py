"""The host-side processes of drivers that run their sandboxes as processes of this host.

The reference driver (bwrap) and the vm driver (QEMU) both start host programs on a
sandbox's behalf, and both find a session's sandboxes again from any process by reading
every process's command line. What they share lives here:

- the host's fixed environment, ``HOST_ENV``: a host program runs with it, never with the
  user's (an ``LD_PRELOAD`` or a ``PATH`` of theirs would run in the host's namespaces as
  the host user), and a tool is looked up in its ``PATH`` (``tool``, ``missing_tools``);
- ``SandboxProcesses``: which host processes are a session's sandboxes, each stamped on its
  command line with its session and sandbox, and reaping them;
- ``HostProcessSandbox``: a sandbox that lives as long as a host process this one started,
  whose commands run with the sandbox's environment and their own.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from drivers.base import Command, Sandbox
from gpuhost.procfs import each_process, kill_if, owner
from gpuhost.wait import wait_for

HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_ENV = {"PATH": HOST_PATH, "LANG": "C.UTF-8"}
"""The environment of the host programs drivers run: fixed, never the user's."""
REAP_TIMEOUT_S = 10.0
"""After SIGKILL a process is gone in milliseconds; seconds mean it is stuck in the kernel."""


TOOL_ENV_PREFIX = "GPU_SANDBOX_TOOL_"
"""``GPU_SANDBOX_TOOL_BWRAP=/opt/bwrap/bin/bwrap`` names a tool outside the fixed PATH."""


def tool_env(name: str) -> str:
    """The variable that names where the tool ``name`` is: ``GPU_SANDBOX_TOOL_<NAME>``."""
    return TOOL_ENV_PREFIX + name.upper().replace("-", "_")


def _named(name: str) -> str | None:
    """The tool as its variable names it, when that is an executable file."""
    path = os.environ.get(tool_env(name), "")
    return path if os.path.isabs(path) and shutil.which(path) else None


def tool(name: str) -> str:
    """The absolute path of a host tool: as its variable names it, or in the fixed host PATH.

    Only a path given by its variable (an explicit choice of whoever runs the suite) reaches
    outside the fixed PATH: never the user's own PATH.
    """
    return _named(name) or shutil.which(name, path=HOST_PATH) or name


def missing_tools(names: Iterable[str]) -> list[str]:
    """Those of ``names`` that neither their variable nor the fixed host PATH give."""
    return [n for n in names if not _named(n) and not shutil.which(n, path=HOST_PATH)]


def how_to_name(names: Iterable[str]) -> str:
    """How to name tools found elsewhere, for a probe's reason."""
    return ", ".join(f"{tool_env(name)}=/path/to/{name}" for name in names)


def run_tool(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | None:
    """``argv`` run to its end with the host's environment, its output captured as text.

    None when it could not run, or did not end within ``timeout_s``.
    """
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, check=False, env=HOST_ENV, timeout=timeout_s
        )
    except (OSError, subprocess.SubprocessError):
        return None


SandboxOf = Callable[[list[str], str], str | None]
"""From a process's argv, the sandbox of ``session_id`` that it is; None: none of them."""


@dataclasses.dataclass(frozen=True)
class SandboxProcesses:
    """A driver's host processes, one per sandbox, found by their command lines.

    Each is a ``program`` (the end of its argv[0]) whose arguments carry its session and its
    sandbox, as ``sandbox_of`` reads them: how ``sandboxes`` and ``reap`` find a session's
    sandboxes from any process, the creator's or another.
    """

    program: str
    sandbox_of: SandboxOf
    called: str
    """What the program is called in messages: "bwrap", "QEMU"."""
    sandboxes: str = "sandboxes"
    """What its sandboxes are called in messages: "sandboxes", "VMs"."""

    def find(self, session_id: str) -> list[tuple[str, int]]:
        """(sandbox id, pid) of every process of ``session_id``: this user's processes alone.

        Another user may start a process of the same name whose arguments carry this
        session's stamp (session ids are no secret): it is not one of ours.
        """
        found = []
        for pid, cmdline in each_process("cmdline"):
            sandbox_id = self._sandbox(cmdline, session_id)
            if sandbox_id is not None and owner(pid) == os.geteuid():
                found.append((sandbox_id, pid))
        return found

    def reap(self, session_id: str) -> list[str]:
        """SIGKILL every process of ``session_id`` and wait until they are gone.

        Returns the sandboxes they were. Each process is checked again once pinned by a
        pidfd, so that a pid reused meanwhile is left alone.
        """
        found = self.find(session_id)
        for sandbox_id, pid in found:
            kill_if(pid, functools.partial(self._is, session_id=session_id, sandbox_id=sandbox_id))
        # SIGKILL is delivered asynchronously: wait until the processes are really gone.
        what = f"the {self.sandboxes} of session {session_id} to exit"
        stuck = f"a {self.called} process that outlives SIGKILL is stuck in the kernel (D state)"
        left = functools.partial(self.find, session_id)
        wait_for(left, operator.not_, timeout_s=REAP_TIMEOUT_S, what=what, hint=stuck)
        return sorted({sandbox_id for sandbox_id, _ in found})

    def _is(self, pid: int, session_id: str, sandbox_id: str) -> bool:
        """Whether ``pid`` is this user's process of ``sandbox_id`` of ``session_id``."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
        return self._sandbox(cmdline, session_id) == sandbox_id and owner(pid) == os.geteuid()

    def _sandbox(self, cmdline: bytes, session_id: str) -> str | None:
        argv = cmdline.split(b"\0")
        if not argv[0].endswith(self.program.encode()):
            return None
        return self.sandbox_of([arg.decode(errors="replace") for arg in argv], session_id)


class HostProcessSandbox(Sandbox):
    """A sandbox that lives as long as a host process this process started (bwrap, QEMU).

    Its constructor sets ``_process`` and ``_env``.
    """

    _process: subprocess.Popen[bytes]
    """The sandbox's host process."""
    _env: Mapping[str, str]
    """The sandbox's environment, which each of its commands runs with."""

    @property
    def pid(self) -> int:
        """The host pid of the sandbox's process: its bwrap, its QEMU."""
        return self._process.pid

    def command_env(self, command: Command) -> dict[str, str]:
        """The environment ``command`` runs with: the sandbox's, and the command's own."""
        return {**self._env, **command.env}
