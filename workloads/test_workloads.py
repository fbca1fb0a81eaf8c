"""The workload lane: each workload of the manifest runs inside a sandbox of each driver."""

from __future__ import annotations

import pytest

from conformance.fixtures import SandboxFactory
from conformance.settings import Settings
from drivers.base import Driver
from gpuhost.spec import SandboxSpec
from workloads.harness import NOT_RUN, run_in_sandbox
from workloads.manifest import Workload


def test_workload_ends_as_the_manifest_expects(
    driver: Driver,
    sandboxes: SandboxFactory,
    settings: Settings,
    workload: Workload,
    workload_python: str,
    workload_cpu: bool,
) -> None:
    """A manifest workload MUST run in the sandbox and end as the manifest expects."""
    if workload_cpu and workload.payload is None and workload.gpus:
        pytest.skip(f"{workload.name} is a command: it has no CPU mode")
    if workload.gpus > driver.capabilities.max_gpus_per_sandbox:
        pytest.skip(
            f"{workload.name} needs {workload.gpus} GPUs in one sandbox; the {driver.name} "
            f"driver gives at most {driver.capabilities.max_gpus_per_sandbox}"
        )
    simulated = driver.host.simulated is not None
    if simulated and not workload_cpu and workload.gpus:
        pytest.skip(
            f"no CUDA device: the GPUs are simulated ({driver.host.describe()}); the workload "
            "lane needs a real GPU (--workload-cpu runs the payloads' CPU mode instead)"
        )
    image = workload.image or settings.image
    spec = (
        SandboxSpec.with_gpus(workload.gpus, image=image)
        if workload.gpus
        else SandboxSpec(image=image)
    )
    sandbox = sandboxes(spec)
    if simulated and workload.payload is not None:
        # The simulated hosts' base image is busybox: a payload needs a Python it lacks. On a
        # real GPU host an image without one is the image's failure, and is reported so.
        found = sandbox.exec([workload_python, "-c", "pass"])
        if found.returncode in NOT_RUN:
            pytest.skip(f"no {workload_python} in the sandbox ({image or 'the default image'})")
    for run in range(1, workload.runs + 1):
        outcome = run_in_sandbox(sandbox, workload, workload_python, workload_cpu)
        assert outcome.verdict == workload.expect, (
            f"run {run} of {workload.runs} in sandbox {sandbox.id}: {outcome.explain()}"
        )
