"""``python -m conformance.hold``: create one sandbox in a process of its own and hold it.

The conformance suite uses it to contend for GPUs from separate processes, to kill a
sandbox's creator, and (``--reap``) to reap a session from a fresh process. Protocol, one
JSON object per line: it waits for a line on stdin (``go``), creates the sandbox, prints
``{"ok": true, "sandbox": ..., "gpus": [uuids], "visible": [uuids nvidia-smi lists]}`` or
``{"ok": false, "error": <type>, "message": ...}``, then holds the sandbox until stdin closes.
Before it waits for ``go`` it says ``{"ready": true}``: imported, its driver built, so that
processes told to go together create together.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from conformance.bounds import fail
from conformance.observe import describe_gpus, visible_gpu_uuids
from drivers import driver_argument, get_driver_class
from drivers.base import Driver
from drivers.reference import ReferenceDriver
from gpuhost import strict
from gpuhost.devices import GpuDevice
from gpuhost.errors import DriverError
from gpuhost.host import GpuHost, HostConfig
from gpuhost.leases import DEFAULT_SHARE_LIMIT, PROCESS, Holder, liveness_check, register_liveness
from gpuhost.spec import SandboxSpec, parse_spec

if TYPE_CHECKING:
    from conformance.bounds import Pace
    from conformance.settings import Settings

REPLY_TIMEOUT_S = 60.0
"""A holder imports the driver and creates one sandbox; a minute means it is stuck."""
RUN_HOLDER = "conformance-run"
"""A lease holder kind of the catalogue's own, neither a process nor an engine's: a lease
held by a catalogue run, for as long as that run's process lives."""


def run_alive(holder: Holder) -> bool:
    """The liveness check of ``RUN_HOLDER``, also an entry point (``gpu_sandbox.liveness``)."""
    check = liveness_check(PROCESS)
    return True if check is None else check(Holder(PROCESS, holder.ref))


register_liveness(RUN_HOLDER, run_alive)


class HeldSandbox:
    """The parent's side of ``python -m conformance.hold``: one sandbox in another process."""

    def __init__(self, process: subprocess.Popen[str], what: str, pace: Pace | None) -> None:
        self.process = process
        self._ready = False
        self._what = what
        self._pace = pace
        self._went: float | None = None
        self._bound = 0.0

    @classmethod
    def start(
        cls, driver: Driver, settings: Settings, spec: SandboxSpec, die_at_hand_over: bool = False
    ) -> HeldSandbox:
        """Start a holder process; it creates its sandbox once told to ``go``.

        Its create is bounded by the pace of the driver's creates in this run, where there is
        one. With ``die_at_hand_over`` it SIGKILLs itself once it has handed its leases to the
        sandbox in the making: a creator that dies between creating a sandbox and starting
        it, where the driver hands over first (a container driver does).
        """
        argv = [
            sys.executable, "-m", "conformance.hold",
            f"--driver={_name(driver)}", f"--session={driver.session_id}",
            f"--spec={json.dumps(spec.to_dict())}", *settings.host_config.as_args(),
        ]  # fmt: skip
        if driver.image:
            argv.append(f"--image={driver.image}")
        if die_at_hand_over:
            argv.append("--die-at-hand-over")
        process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env()
        )
        pace = settings.paces.get(driver.name)
        what = f"create of {spec.to_dict()} in holder process {process.pid}"
        return cls(process, what, pace.create if pace is not None else None)

    def wait_ready(self) -> None:
        """Return once the holder is ready to create at once (told ``go``)."""
        if not self._ready:
            said = self._read()
            assert said == {"ready": True}, f"holder process {self.process.pid} said {said}"
            self._ready = True

    def send_go(self) -> None:
        self.wait_ready()
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        if self._pace is not None:
            self._pace.started()
            self._went = time.monotonic()
            self._bound = self._pace.bound_s()  # with every create in flight now

    def result(self) -> dict[str, Any]:
        """The holder's reply: ``ok`` with its sandbox and GPUs, or the error it got.

        Within the pace's bound of a create, counted from ``go``: past it the holder is
        killed and the test fails, naming what it waited for.
        """
        __tracebackhide__ = True
        if self._pace is None or self._went is None:
            return self._read()
        pace, went, bound = self._pace, self._went, self._bound
        try:
            while True:
                # The bound grows while other creates join, and never shrinks as they end:
                # this create may have waited behind them.
                bound = max(bound, pace.bound_s())
                left = went + bound - time.monotonic()
                if self._replied(max(0.0, min(left, 1.0))):  # in time, if read late
                    return self._read()
                if left <= 0:
                    self.kill()
                    expected = "a request it cannot grant must be refused, not waited on"
                    fail(pace.late(self._what, bound, 0.0, expected))
        finally:
            self._went = None
            pace.finished()

    def _replied(self, timeout_s: float) -> bool:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        return bool(ready)

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline() if self._replied(REPLY_TIMEOUT_S) else ""
        if not line:
            self.kill()
            raise RuntimeError(
                f"holder process {self.process.pid} gave no reply within {REPLY_TIMEOUT_S:g} s "
                f"(exit code {self.process.poll()})"
            )
        reply: dict[str, Any] = json.loads(line)
        return reply

    def go(self) -> dict[str, Any]:
        self.send_go()
        return self.result()

    def kill(self) -> None:
        """SIGKILL the holder process, as a crash of a sandbox's creator would."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """SIGSTOP the holder process: alive, holding its sandbox, deaf to everything."""
        self.process.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        """Let the holder close its sandbox and exit."""
        close_all([self])

    def _let_go(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()

    def _wait_gone(self) -> None:
        try:
            self.process.wait(REPLY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.process.stdout is not None:
            self.process.stdout.close()

    def __enter__(self) -> HeldSandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


LEASE_CLIENT = resources.files("gpuhost") / "gpu-lease"
"""The lease protocol's client in POSIX sh, shipped with the host layer."""
HOLD_TIMEOUT_S = 30.0


@contextmanager
def held_by_the_sh_client(host: GpuHost, session_id: str, gpus: list[GpuDevice]) -> Iterator[None]:
    """The sh client holds ``gpus`` in the host's registry for as long as the block runs."""
    if not shutil.which("jq") or not shutil.which("flock"):
        fail("the lease protocol's sh client needs jq and flock (apt-get install jq)")
    directory = host.leases.directory
    # MIG instances of one GPU are held with it named: their leases carry it (--parent).
    parents = {gpu.parent_uuid for gpu in gpus}
    assert len(parents) == 1, f"GPUs and MIG instances of several GPUs at once: {gpus}"
    parent = [] if (of := parents.pop()) is None else ["--parent", of]
    process = subprocess.Popen(
        ["sh", str(LEASE_CLIENT), "--dir", str(directory), "hold", "--driver", "gpu-lease",
         "--session", session_id, "--sandbox", f"sh-{time.time_ns()}", *parent,
         *(gpu.uuid for gpu in gpus), "--", "sleep", "3600"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        wanted = {gpu.uuid for gpu in gpus}
        while not wanted <= {lease.gpu_uuid for lease in host.leases.leases()}:
            if process.poll() is not None or time.monotonic() > deadline:
                _, stderr = process.communicate()
                fail(f"the sh client could not hold {sorted(wanted)}: {stderr.strip()}")
            time.sleep(0.02)
        yield
    finally:
        process.kill()
        process.wait()


def refused_to_another_client(host: GpuHost, session_id: str, gpu: GpuDevice) -> DriverError | None:
    """The error the reference driver, another client of the host registry, gets for ``gpu``.

    None when it was granted (and given back at once). What the driver under test wrote in
    the registry must mean to every other client what it means to the driver itself.
    """
    client = ReferenceDriver(host, session_id)
    spec = SandboxSpec.with_gpus(driver=client.name, device_ids=[gpu.uuid])
    try:
        client.create(spec).close()
    except DriverError as exc:
        return exc
    return None


def close_all(holders: Iterable[HeldSandbox]) -> None:
    """Let every holder close its sandbox and exit, all at once; return when all are gone."""
    holders = list(holders)
    for holder in holders:
        holder._let_go()
    for holder in holders:
        holder._wait_gone()


def created_at_once(
    driver: Driver, settings: Settings, specs: Iterable[SandboxSpec]
) -> list[dict[str, Any]]:
    """Each spec created by a process of its own, all told to go at once; their replies.

    Every process is started, has imported the driver and waits before the first is told:
    the creates race, not the imports.
    """
    holders = [HeldSandbox.start(driver, settings, spec) for spec in specs]
    try:
        for holder in holders:
            holder.wait_ready()
        for holder in holders:
            holder.send_go()
        return [holder.result() for holder in holders]
    finally:
        close_all(holders)


def reap_from_a_fresh_process(driver: Driver, host: HostConfig, session_id: str) -> list[str]:
    """What ``reap`` of ``session_id`` removes when run in a process that created nothing."""
    argv = [
        sys.executable, "-m", "conformance.hold", f"--driver={_name(driver)}",
        f"--session={session_id}", "--reap", "--spec={}", *host.as_args(),
    ]  # fmt: skip
    if driver.image:
        argv.append(f"--image={driver.image}")
    done = subprocess.run(
        argv, capture_output=True, text=True, env=_env(), timeout=REPLY_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"reap from a fresh process failed ({done.returncode}): {done.stderr}")
    removed: list[str] = strict.record(strict.parse_json(done.stdout), {"removed": list})["removed"]
    return removed


def _name(driver: Driver) -> str:
    """The --driver value that makes another process build the same driver."""
    return driver_argument(type(driver))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.hold", description=__doc__)
    parser.add_argument("--driver", required=True)
    parser.add_argument("--session", required=True)
    parser.add_argument("--spec", required=True, help="the sandbox spec as JSON")
    parser.add_argument("--sim-root", type=Path)
    parser.add_argument("--gpu-state-dir", type=Path)
    parser.add_argument("--gpu-share-limit", type=int, default=DEFAULT_SHARE_LIMIT)
    parser.add_argument("--image")
    parser.add_argument("--reap", action="store_true", help="reap the session, then exit")
    parser.add_argument(
        "--die-at-hand-over", action="store_true", help="SIGKILL itself once leases are handed over"
    )
    args = parser.parse_args(argv)

    host = GpuHost.open(HostConfig(args.sim_root, args.gpu_state_dir, args.gpu_share_limit))
    if args.die_at_hand_over:
        hand_over = host.leases.set_holder

        def hand_over_and_die(sandbox_id: str, holder: Holder) -> None:
            hand_over(sandbox_id, holder)
            os.kill(os.getpid(), signal.SIGKILL)

        host.leases.set_holder = hand_over_and_die  # type: ignore[method-assign]
    driver = get_driver_class(args.driver)(host, args.session, args.image)
    if args.reap:
        _reply({"removed": driver.reap(args.session)})
        return 0
    spec = parse_spec(args.spec)
    _reply({"ready": True})
    if not sys.stdin.readline():
        return 0
    try:
        sandbox = driver.create(spec)
    except DriverError as exc:
        _reply({"ok": False, "error": type(exc).__name__, "message": str(exc)})
        return 0
    with sandbox:
        try:
            visible = visible_gpu_uuids(sandbox)
        except (AssertionError, DriverError) as exc:  # reported, and judged by the caller
            visible = [f"(nvidia-smi failed: {exc})"]
        gpus = [gpu.uuid for gpu in sandbox.gpus]
        reply = {"ok": True, "sandbox": sandbox.id, "gpus": gpus, "visible": visible}
        if sorted(visible) != sorted(gpus):
            # What the caller's failure message needs: the nodes and nvidia-smi's own words.
            with contextlib.suppress(DriverError):
                reply["seen"] = describe_gpus(sandbox)
        _reply(reply)
        sys.stdin.read()
    return 0


def _reply(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
