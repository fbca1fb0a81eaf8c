"""A stand-in gateway started as a process of its own, and OpenShell's real CLI run against it."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuhost.spawn import stop_process
from openshell_standin.__main__ import ENV_FILE
from openshell_standin.stubs import LAUNCHER, ROOT

START_TIMEOUT_S = 30.0
"""Certificates, the host and the server: a second or two; longer means it is stuck."""
CLI_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
"""Deleting its sandboxes takes a moment each."""


class GatewayStartError(RuntimeError):
    """The stand-in gateway did not say it was ready."""


@dataclass(frozen=True)
class RunningGateway:
    process: subprocess.Popen[bytes]
    state: Path
    endpoint: str
    env: Mapping[str, str]
    """What OpenShell's CLI needs in its environment to reach it."""

    def cli_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Our environment, without any OPENSHELL_* of its own, with the gateway's."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("OPENSHELL_")}
        return {**base, **self.env, **(extra or {})}

    def cli(
        self, *args: str, timeout: float = CLI_TIMEOUT_S, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``openshell ARGS`` against this gateway, no stdin, its output captured."""
        return subprocess.run(
            [str(LAUNCHER), *args],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.cli_env(env),
            check=False,
        )


def with_launcher(manifest: Path, dest: Path) -> Path:
    """A copy of ``manifest`` at ``dest`` whose ``openshell`` program is the launcher's path.

    A manifest's commands get the host's fixed PATH (drivers.external.process), where the
    CLI that scripts/openshell.sh installed is not.
    """
    text = manifest.read_text()
    text = text.replace("- openshell\n", f"- {LAUNCHER}\n").replace("[openshell,", f"[{LAUNCHER},")
    text = text.replace(" openshell sandbox ", f" {LAUNCHER} sandbox ")  # in an sh -c script
    dest.write_text(text)
    return dest


def read_env(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line)


@contextlib.contextmanager
def running(
    state: Path,
    sim_root: Path | None = None,
    driver: str = "docker",
    args: Sequence[str] = (),
    log_path: Path | None = None,
) -> Iterator[RunningGateway]:
    """A stand-in gateway for the ``with`` block: ``state`` must not exist yet.

    Its stderr goes to ``log_path`` when given (created; it must not exist).
    """
    argv = [sys.executable, "-m", "openshell_standin", f"--state-dir={state}", f"--driver={driver}"]
    if sim_root is not None:
        argv.append(f"--sim-root={sim_root}")
    opened = open(log_path, "xb+") if log_path is not None else tempfile.TemporaryFile()  # noqa: SIM115
    with opened as log:
        process = subprocess.Popen(
            [*argv, *args], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log
        )
        try:
            assert process.stdout is not None
            ready, _, _ = select.select([process.stdout], [], [], START_TIMEOUT_S)
            line = process.stdout.readline().decode() if ready else ""
            if not line.startswith("ready "):
                stop_process(process)
                log.seek(0)
                raise GatewayStartError(
                    f"the stand-in gateway did not start within {START_TIMEOUT_S:g} s "
                    f"(exit {process.returncode}): {log.read().decode(errors='replace').strip()}"
                )
            yield RunningGateway(process, state, line.split()[1], read_env(state / ENV_FILE))
        finally:
            # SIGTERM: it deletes its sandboxes; SIGKILL after that, for one that hangs.
            process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_TIMEOUT_S)
            stop_process(process)
