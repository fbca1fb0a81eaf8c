"""Run a manifest workload inside a sandbox (or on the bare host) and judge what it printed.

A payload goes in as ``<python> -c <its source> <args>`` through ``Sandbox.exec``, so it
needs no shared filesystem: the same works for a bubblewrap sandbox and for a container.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from drivers.base import ExecResult, Sandbox
from workloads.manifest import Workload

PASS, FAIL, ERROR = "pass", "fail", "error"
REPORT_FIELDS: Mapping[str, type] = {
    "workload": str,
    "ok": bool,
    "mode": str,
    "metrics": dict,
    "detail": str,
}
NOT_RUN = (126, 127)
"""The shell's and container engines' exit codes for a command that could not be run."""
STDERR_LINES = 30
"""How much of a payload's stderr a failure message shows: the end, where tracebacks are."""


@dataclass(frozen=True)
class Outcome:
    """How a workload ended: ``pass``, ``fail`` (its own verdict) or ``error`` (no verdict)."""

    workload: Workload
    verdict: str
    result: ExecResult
    report: Mapping[str, Any] | None = None
    problem: str = ""

    @property
    def metrics(self) -> Mapping[str, Any]:
        return self.report["metrics"] if self.report else {}

    def explain(self) -> str:
        """A failure message: what ran, what was expected, the verdict, and the stderr."""
        lines = [
            f"workload {self.workload.describe()}: expected {self.workload.expect}, "
            f"got {self.verdict}" + (f": {self.problem}" if self.problem else ""),
            f"exit status: {self.result.returncode}",
        ]
        if self.report:
            lines += [
                f"detail: {self.report['detail']}",
                f"metrics: {json.dumps(self.report['metrics'])}",
            ]
        stderr = self.result.stderr.strip().splitlines()[-STDERR_LINES:]
        lines += ["stderr:", *(f"  {line}" for line in stderr or ["(empty)"])]
        return "\n".join(lines)


def judge(workload: Workload, result: ExecResult, cpu: bool = False) -> Outcome:
    """The outcome of one run, from its exit status and (for payloads) its JSON line."""
    if workload.payload is None:
        return Outcome(workload, PASS if result.returncode == 0 else FAIL, result)
    report, problem = parse_report(result.stdout)
    if report is None:
        if result.returncode in NOT_RUN:
            problem += (
                f"\nexit {result.returncode}: {result.argv[0]} was not found or could not run "
                "in the sandbox; does the image have it?"
            )
        return Outcome(workload, ERROR, result, problem=problem)
    allowed = {"cpu", "none"} if cpu else {"cuda", "none"}
    if report["mode"] not in allowed:
        problem = f"the payload ran in mode {report['mode']!r}, expected one of {sorted(allowed)}"
        return Outcome(workload, ERROR, result, report, problem)
    if not report["ok"]:
        return Outcome(workload, FAIL, result, report)
    if result.returncode != 0:
        problem = f"the payload reported ok but exited {result.returncode}"
        return Outcome(workload, ERROR, result, report, problem)
    return Outcome(workload, PASS, result, report)


def parse_report(stdout: str) -> tuple[dict[str, Any] | None, str]:
    """The payload's one JSON line, or ``None`` and why it is not there."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if len(lines) != 1:
        shown = "\n".join(lines[-5:]) or "(nothing)"
        return (
            None,
            f"the payload must print one JSON line on stdout, printed {len(lines)}:\n{shown}",
        )
    try:
        report = json.loads(lines[0])
    except json.JSONDecodeError as exc:
        return None, f"the payload's stdout is not JSON ({exc}): {lines[0][:300]}"
    if not isinstance(report, dict):
        return None, f"the payload's JSON line is not an object: {lines[0][:300]}"
    for field, kind in REPORT_FIELDS.items():
        if not isinstance(report.get(field), kind):
            return None, f"the payload's JSON line lacks {field!r} ({kind.__name__}): {report}"
    return report, ""


def run_in_sandbox(sandbox: Sandbox, workload: Workload, python: str, cpu: bool = False) -> Outcome:
    """Run ``workload`` inside ``sandbox``, given its GPUs' UUIDs, and judge it."""
    argv = workload.argv(python, [gpu.uuid for gpu in sandbox.gpus], cpu)
    return judge(workload, sandbox.exec(argv, timeout=workload.timeout_s), cpu)


def run_on_host(
    workload: Workload,
    python: str,
    gpu_uuids: Sequence[str] = (),
    cpu: bool = False,
    env: Mapping[str, str] | None = None,
) -> Outcome:
    """Run ``workload`` on the bare host, as it would run in a sandbox, and judge it."""
    argv = workload.argv(python, gpu_uuids, cpu)
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=workload.timeout_s, env=env, check=False
    )
    return judge(workload, ExecResult(tuple(argv), done.returncode, done.stdout, done.stderr), cpu)
