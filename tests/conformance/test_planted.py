"""The suite must bite: the catalogue fails every planted broken driver where it breaks."""

from __future__ import annotations

import inspect
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from conformance import requirements
from conformance.test_hostwide import HOSTS as HOSTWIDE_HOSTS
from gpuhost import simulated
from gpuhost.procfs import marked_processes
from tests.breakers import ALL, containers, hostwide, pods, vms
from tests.breakers.base import BrokenDriver
from tests.breakers.exhaustion import WaitsForAFreeGpu
from tests.breakers.lifecycle import ReapDoesNothing
from tests.breakers.visibility import OmitsCtlNode, OmitsUvmNode
from tests.catalogue import (
    assert_fails_its_requirement,
    golden_ids,
    planted_name,
    run_catalogue,
    what_failed,
)


def test_every_requirement_has_a_planted_breaker() -> None:
    required = golden_ids()
    broken = {cls.BREAKS for cls in ALL} | {cls.BREAKS for cls in containers.ALL}
    assert required - broken == set(), "requirements no planted driver breaks"


def test_every_planted_breaker_names_its_requirement_first() -> None:
    """Its docstring starts with its ``BREAKS``, for whoever reads the class."""
    planted: list[type] = [*ALL, *containers.ALL, *pods.ALL, *vms.ALL]
    unnamed = [
        cls.__qualname__
        for cls in planted
        if not (inspect.getdoc(cls) or "").startswith(f"{cls.BREAKS}: ")  # type: ignore[attr-defined]
    ]
    assert unnamed == [], "planted breakers whose docstring does not start with BREAKS"


@pytest.mark.parametrize("broken", ALL, ids=[cls.__name__ for cls in ALL])
def test_catalogue_fails_the_broken_driver(
    pytester: pytest.Pytester, tmp_path: Path, broken: type[BrokenDriver]
) -> None:
    name = planted_name(broken)
    wanted = broken.BREAKS_ONE_OF or {broken.BREAKS}
    result, run = run_catalogue(
        pytester, tmp_path, name, 8, f"--requirement={','.join(sorted(wanted))}"
    )
    outcomes = {req: cells.get(name) for req, cells in result["matrix"].items()}
    # A race fails at random: what is certain is that one of the requirements it may break
    # fails. Any other defect fails exactly its own.
    failed = {req for req in wanted if outcomes.get(req) == "failed"}
    assert failed, (
        f"{broken.__name__} ({broken.__doc__}) breaks {sorted(wanted)}, "
        f"but the catalogue says {[outcomes.get(req) for req in sorted(wanted)]}: {outcomes}"
    )
    # Failed in the test's own assertions, not by crashing in set-up or tear-down.
    caught = [
        test
        for test in result["tests"]
        if test["requirement"] in failed and test["outcome"] == "failed"
    ]
    assert caught, f"{sorted(failed)} only errored for {broken.__name__}: {result['tests']}"
    # The release gate: the verdict fails the driver, and the run fails.
    if broken.BREAKS_ONE_OF:
        run.stdout.fnmatch_lines([f"{name}: FAIL — *"])
    else:
        run.stdout.fnmatch_lines([f"{name}: FAIL — *{broken.BREAKS}*"])
    assert run.ret == pytest.ExitCode.TESTS_FAILED


def test_catalogue_passes_the_reference_driver(
    pytester: pytest.Pytester, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole catalogue passes the oracle, and leaves no process of its own behind."""
    canary = f"GPU_SANDBOX_LEAK_CANARY={uuid.uuid4().hex}"
    monkeypatch.setenv(*canary.split("="))
    result, run = run_catalogue(pytester, tmp_path, "reference")
    left = marked_processes(canary.encode())
    assert left == [], f"the catalogue left processes behind: {_cmdlines(left)}"
    assert result["simulated"] is True
    required = golden_ids()
    verdicts = {req: cells["reference"] for req, cells in result["matrix"].items()}
    profile = requirements.load().profile("reference")
    expected = {
        req: "not applicable" if profile[req] == "not applicable" else "passed" for req in required
    }
    assert {req: verdicts.get(req) for req in required} == expected
    # The catalogue alone leaves the workload lane's requirements to the workload run.
    assert {verdicts[req] for req in set(verdicts) - required} <= {"not run", "not applicable"}
    run.stdout.fnmatch_lines(["reference: PASS (*mandatory passed*; 0 optional failed)"])
    assert run.ret == pytest.ExitCode.OK


def _cmdlines(pids: list[int]) -> list[str]:
    return [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in pids]


SMALL_HOST_STRICT = ("GPU-HOSTWIDE-01",)
"""Requirements whose every case runs on the smallest host it can, or is dropped by name
(``fixtures.dropped``): on one GPU they are passed or partial, never skipped, and a
partial one names what it dropped."""


def _assert_dropped_by_name(result: dict[str, Any], requirement: str) -> str:
    """``requirement``'s verdict for the reference: passed, or partial naming its cases."""
    __tracebackhide__ = True
    verdict = result["matrix"][requirement]["reference"]
    tests = [test for test in result["tests"] if test["requirement"] == requirement]
    assert tests, f"no test of {requirement} ran"
    assert all(test["outcome"] == "passed" for test in tests), (requirement, tests)
    if verdict == "partial":
        assert any(test.get("dropped") for test in tests), (requirement, tests)
    else:
        assert verdict == "passed", (requirement, verdict, tests)
    return str(verdict)


@pytest.mark.parametrize("gpus", [1, 2])
def test_reference_driver_fails_nothing_on_small_hosts(
    pytester: pytest.Pytester, tmp_path: Path, gpus: int
) -> None:
    """On 1 or 2 GPUs what needs more is skipped with the reason, or dropped; nothing fails."""
    result, run = run_catalogue(pytester, tmp_path, "reference", gpus, full=False)
    verdicts = {req: result["matrix"][req]["reference"] for req in golden_ids()}
    assert set(verdicts.values()) <= {"passed", "partial", "skipped", "not applicable"}, (
        f"{what_failed(result, 'reference')}\nverdicts: {verdicts}"
    )
    skips = [test["message"] for test in result["tests"] if test["outcome"] == "skipped"]
    reasons = ("needs", "does not apply", "not applicable")
    assert all(any(reason in message for reason in reasons) for message in skips), skips
    for requirement in SMALL_HOST_STRICT:
        _assert_dropped_by_name(result, requirement)
    # GPU-HOSTWIDE-01: on one GPU each holder holds it, and only the cases beside free GPUs
    # are left out, by name; on two it is whole.
    assert verdicts["GPU-HOSTWIDE-01"] == ("partial" if gpus == 1 else "passed"), verdicts
    dropped = {
        test["dropped"] for test in result["tests"] if test["requirement"] == "GPU-HOSTWIDE-01"
    }
    expected = f"{HOSTWIDE_HOSTS[1]} (needs 2 GPUs; the host has 1)"
    assert dropped == ({expected, ""} if gpus == 1 else {""}), dropped
    run.stdout.fnmatch_lines(["reference: PASS (*mandatory passed*; 0 optional failed)"])
    assert run.ret == pytest.ExitCode.OK


MIG_AND_DRI = (
    "MIG-EXACT-01", "MIG-PROFILE-01", "MIG-ISOLATION-01", "MIG-EXCLUSIVE-01",
    "DRI-ISOLATION-01", "DRI-PAIRING-01", "DRI-EXCLUSIVE-01",
)  # fmt: skip


def test_reference_driver_on_the_smallest_mig_and_dri_host_drops_cases_by_name(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """One GPU, in MIG mode with one instance, and one AMD GPU: nothing skipped, nothing hidden.

    What needs more (two instances, two GPUs in MIG mode, two GPUs of a vendor, a GPU of
    another kind beside) is dropped by name: the cell is partial, never passed.
    """
    host = simulated.setup(
        tmp_path / "sim", 1,
        mig=simulated.parse_mig_layout("0:1x7g.80gb"), dri=simulated.parse_dri_layout("amd:1"),
    )  # fmt: skip
    asked = f"--requirement={','.join(MIG_AND_DRI)}"
    result, run = run_catalogue(pytester, tmp_path, "reference", 1, asked, sim_root=host.root)
    verdicts = {req: _assert_dropped_by_name(result, req) for req in MIG_AND_DRI}
    assert verdicts == {**dict.fromkeys(MIG_AND_DRI, "partial"), "DRI-PAIRING-01": "passed"}
    assert run.ret == pytest.ExitCode.OK


def test_a_driver_from_another_package_declares_keys_of_its_own(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Its own keys pass validation and the catalogue reads them; gpuhost knows none of them."""
    result, run = run_catalogue(
        pytester, tmp_path, "tests.fake_drivers:TieredDriver", 4, "--requirement=GPU-VALIDATE-01",
        full=False,
    )  # fmt: skip
    # Its block takes "image", which the catalogue otherwise sends as another driver's key.
    assert result["matrix"]["GPU-VALIDATE-01"]["tests.fake_drivers:TieredDriver"] == "passed", (
        result["tests"]
    )
    assert run.ret == pytest.ExitCode.OK, run.stdout.str()


def test_a_broken_reap_fails_its_requirement_and_nothing_else(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """A test that leaves GPUs held fails itself, not its neighbours: no cascade.

    The whole catalogue, on the gate's host layout: sandboxes a broken reap leaves behind
    are closed by the fixture after each test, and what is left fails that test alone.
    """
    name = planted_name(ReapDoesNothing)
    result, _ = run_catalogue(pytester, tmp_path, name, 8)
    failed = {
        requirement
        for requirement, cells in result["matrix"].items()
        if cells.get(name) in ("failed", "error")
    }
    assert failed == {"SANDBOX-REAP-01"}, [
        (test["nodeid"], test["message"])
        for test in result["tests"]
        if test["outcome"] in ("failed", "error")
    ]


@pytest.mark.parametrize("broken", [OmitsUvmNode, OmitsCtlNode], ids=lambda cls: cls.__name__)
def test_on_one_gpu_a_driver_that_leaves_out_a_cuda_node_fails_isolation(
    pytester: pytest.Pytester, tmp_path: Path, broken: type[BrokenDriver]
) -> None:
    """Without the workload lane: most CI runners have one GPU."""
    assert_fails_its_requirement(pytester, tmp_path, broken, 1)


HOLDERS_BREAKERS = (*hostwide.BLIND, *hostwide.MISJUDGING, *hostwide.LOCK_TAKING)
"""A breaker per holder of GPU-HOSTWIDE-01 (ReclaimsNonProcessHolders and
ReclaimsOtherSessions among them): each passed the whole catalogue on one GPU before the
holders held that GPU in turn."""


@pytest.mark.parametrize("broken", HOLDERS_BREAKERS, ids=lambda cls: cls.__name__)
def test_on_one_gpu_a_driver_blind_to_a_holder_fails_hostwide(
    pytester: pytest.Pytester, tmp_path: Path, broken: type[BrokenDriver]
) -> None:
    """On one GPU each holder holds that GPU: the breaker of each fails GPU-HOSTWIDE-01.

    The registry lock's test waits out the reference's 30 s for the lock; it can only add a
    failure, so it runs for the breaker of the lock alone.
    """
    lock = broken in hostwide.LOCK_TAKING
    assert_fails_its_requirement(
        pytester, tmp_path, broken, 1, *([] if lock else ["-k", "not registry_lock"])
    )


def test_a_driver_that_never_refuses_fails_by_name_without_waiting_out_the_test_bound(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """Each create is bounded by the driver's own pace: no test waits out the 900 s bound."""
    name = planted_name(WaitsForAFreeGpu)
    asked = ["GPU-DEFAULT-02", "MIG-PROFILE-01", "DRI-EXCLUSIVE-01"]
    start = time.monotonic()
    result, run = run_catalogue(pytester, tmp_path, name, 8, f"--requirement={','.join(asked)}")
    took = time.monotonic() - start
    failed = {req for req, cells in result["matrix"].items() if cells[name] == "failed"}
    assert failed == set(asked), f"{what_failed(result, name)}\nmatrix: {result['matrix']}"
    hung = [test for test in result["tests"] if "did not return within" in test["message"]]
    assert {test["requirement"] for test in hung} == set(asked), result["tests"]
    assert took < 120, f"the catalogue took {took:.0f} s on a driver that never refuses"
    run.stdout.fnmatch_lines([f"{name}: FAIL — *"])
