"""What a sandbox can see: exactly the GPUs its driver says it gave, by UUID and by node."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from conformance.bad_requests import EVERY_OTHER, OTHER_BLOCKS, block_name
from conformance.dimensions import declared
from conformance.fixtures import SandboxFactory
from conformance.observe import (
    COMMAND_PATHS,
    NodeSeen,
    Run,
    create_side_by_side,
    cuda_visible_uuids,
    device_nodes,
    foreign_gpu_nodes,
    nvidia_gpu_nodes,
    opens_a_node_it_makes,
    refused_nodes,
    uuids,
    visible_gpu_uuids,
    ways_to_run,
)
from drivers.base import Driver, Sandbox
from gpuhost.spec import DEVICE_IDS_KEY, SHARED, SandboxSpec, parse_spec

CUDA_CONTROL_NODES = frozenset({"/dev/nvidiactl", "/dev/nvidia-uvm"})
"""What CUDA opens besides a GPU's own node: without them it cannot initialise."""
GPU_NODE_PLACES = ("/dev", "/run/nvidia/driver/dev", "/var/lib/nvidia")
"""Where a GPU's node may be in a sandbox: /dev, the GPU operator's driver root, anywhere."""
ISOLATION_REQUESTS = ("exact: the last GPU", "a count of 2", "a default")
_EVERY_NODE = (
    "find / \\( -path /proc -o -path /sys \\) -prune -o -type c -print0 2>/dev/null; "
    "printf '\\0%s\\0' mountinfo; cat /proc/self/mountinfo"
)
_STAT_EACH = 'for p; do stat -c "%F|%t|%T" -- "$p" 2>/dev/null || echo -; done'


def _nodes_anywhere(run: Run) -> list[NodeSeen]:
    """Every character device in a sandbox's files (but /proc and /sys), by ``stat``'s numbers.

    Wherever it is (the GPU operator keeps the driver's nodes under /run/nvidia/driver/dev)
    and under any name. ``find -type c`` trusts the directory entry; a node bound over a
    placeholder file (as bubblewrap does) is a mount point: each mount point is stat'ed too.
    """
    __tracebackhide__ = True
    listed = run(["sh", "-c", _EVERY_NODE]).check().stdout
    found, _, table = listed.partition("\0mountinfo\0")
    points = (line.split(" ")[4] for line in table.splitlines() if line.count(" ") >= 4)
    octal = re.compile(r"\\([0-7]{3})")
    paths = sorted(
        {path for path in found.split("\0") if path.startswith("/")}
        | {octal.sub(lambda code: chr(int(code[1], 8)), point) for point in points}
    )
    nodes = []
    for at in range(0, len(paths), 200):
        chunk = paths[at : at + 200]
        kinds = run(["sh", "-c", _STAT_EACH, "sh", *chunk]).check().stdout.splitlines()
        for path, kind in zip(chunk, kinds, strict=True):
            what, _, numbers = kind.partition("|")
            if what == "character special file":
                major, minor = numbers.split("|")
                nodes.append(NodeSeen(path, int(major, 16), int(minor, 16)))
    # /dev/null is in every sandbox: not seeing it means the search itself failed.
    assert NodeSeen("/dev/null", 1, 3) in nodes, f"cannot list the sandbox's nodes: {listed!r}"
    return nodes


NO_GPU_REQUESTS = (
    "nothing at all",
    "a vendor in its own block",
    "a MIG profile in its own block",
    "other drivers' blocks naming GPUs",
)
"""Requests that ask for no GPU: a choice among GPUs, or exact IDs for other drivers, is none."""
DIMENSIONS = {
    "GPU-NONE-01": declared(
        request=NO_GPU_REQUESTS,
        neighbour=("another sandbox holds a GPU",),
        seen_by=("the driver's report", "device nodes of every kind", "nvidia-smi"),
    ),
    "GPU-DEFAULT-01": declared(
        which=("the first", "the second, while the first is held"),
        seen_by=("the driver's report", "nvidia-smi, by UUID", "CUDA_VISIBLE_DEVICES inside"),
    ),
    "GPU-COUNT-01": declared(
        count=("1", "2", "all the driver takes in one sandbox"),
        beside=("nothing held", "a GPU another sandbox holds"),
        sharing=("exclusive", "shared"),
        seen_by=("the driver's report", "nvidia-smi, by UUID", "CUDA_VISIBLE_DEVICES inside"),
    ),
    "GPU-ISOLATION-01": declared(
        request=ISOLATION_REQUESTS,
        node_kind=(
            "NVIDIA GPU",
            "nvidiactl and nvidia-uvm (there, and open)",
            "DRM card and render",
            "nvidia-caps",
            "kfd",
            "the host's own GPU majors",
        ),
        where=(*GPU_NODE_PLACES, "made inside by a command"),
        path=COMMAND_PATHS,
        host=("one GPU", "two GPUs or more, side by side"),
    ),
}


def _no_gpu_request(driver: Driver, what: str) -> SandboxSpec | None:
    """The request ``what`` (one of ``NO_GPU_REQUESTS``) for ``driver``; None if it takes none."""
    if what == NO_GPU_REQUESTS[0]:
        return SandboxSpec()
    if what == NO_GPU_REQUESTS[1]:
        block: dict[str, Any] = {"vendor": "nvidia"}
    elif what == NO_GPU_REQUESTS[2]:
        if not driver.capabilities.mig_profiles:
            return None  # refused (UnsupportedGpuRequest): a block it cannot serve
        profiles = sorted({mig.profile for mig in driver.host.mig_devices})
        block = {"mig_profile": (profiles or ["1g.10gb"])[0]}
    else:
        ids = [i for gpu in driver.inventory()[:2] for i in driver.device_ids(gpu)[:1]]
        whose = [name for name in OTHER_BLOCKS if name not in (driver.name, EVERY_OTHER)]
        others = {block_name(name, driver.name): {DEVICE_IDS_KEY: ids} for name in whose}
        return parse_spec({"template": {"driver_config": others}})
    return parse_spec({"template": {"driver_config": {driver.name: block}}})


@pytest.mark.requirement("GPU-NONE-01")
def test_no_gpu_request_sees_no_gpu(driver: Driver, sandboxes: SandboxFactory) -> None:
    """A sandbox created without a GPU request MUST contain no GPU node and see no GPU."""
    sandboxes(SandboxSpec.with_gpus())  # another sandbox holds a GPU meanwhile
    for what in NO_GPU_REQUESTS:
        spec = _no_gpu_request(driver, what)
        if spec is None:
            continue
        sandbox = sandboxes(spec)
        assert sandbox.gpus == (), f"{what} asks for no GPU; the driver gave {uuids(sandbox)}"
        assert foreign_gpu_nodes(sandbox, driver, device_nodes(sandbox)) == [], what
        assert visible_gpu_uuids(sandbox) == [], what
        sandbox.close()


@pytest.mark.requirement("GPU-DEFAULT-01")
def test_default_request_sees_exactly_one_gpu(
    sandboxes: SandboxFactory, host_gpus: tuple[str, ...]
) -> None:
    """A default GPU request MUST give exactly one GPU, the one the driver reports."""
    _assert_one_default(sandboxes, host_gpus)


@pytest.mark.requirement("GPU-DEFAULT-01")
@pytest.mark.gpus(2)
def test_a_second_default_while_the_first_is_held_sees_exactly_one_gpu(
    sandboxes: SandboxFactory, host_gpus: tuple[str, ...]
) -> None:
    """The second default request, while the first is held, MUST give exactly one GPU too."""
    # Not only the lowest GPU. (The concurrency tests check what each of the sandboxes that
    # fill the host sees.)
    sandboxes(SandboxSpec.with_gpus())
    _assert_one_default(sandboxes, host_gpus)


def _assert_one_default(sandboxes: SandboxFactory, host_gpus: tuple[str, ...]) -> None:
    __tracebackhide__ = True
    sandbox = sandboxes(SandboxSpec.with_gpus())
    assert len(sandbox.gpus) == 1, f"the driver reports {uuids(sandbox)}"
    assert uuids(sandbox)[0] in host_gpus
    seen = visible_gpu_uuids(sandbox)
    assert seen == uuids(sandbox)
    cuda = cuda_visible_uuids(sandbox, seen)
    assert cuda == seen, f"nvidia-smi lists {seen}; CUDA_VISIBLE_DEVICES inside leaves {cuda}"


def _counts(driver: Driver) -> list[int]:
    total = min(len(driver.inventory()), driver.capabilities.max_gpus_per_sandbox)
    return sorted({min(2, total), total})


@pytest.mark.requirement("GPU-COUNT-01")
def test_a_count_of_one_sees_exactly_one_gpu(
    sandboxes: SandboxFactory, host_gpus: tuple[str, ...]
) -> None:
    """A request for 1 GPU MUST give exactly one of the host's GPUs, visible by UUID."""
    # The form of GPU-COUNT-01 a host of one GPU can check; N of 2 and more follows.
    sandbox = sandboxes(SandboxSpec.with_gpus(1))
    reported = uuids(sandbox)
    assert len(reported) == 1, f"asked for 1 GPU, the driver reports {reported}"
    assert set(reported) <= set(host_gpus)
    assert visible_gpu_uuids(sandbox) == reported


@pytest.mark.requirement("GPU-COUNT-01")
@pytest.mark.gpus(2)
def test_count_request_sees_exactly_n_distinct_gpus(
    driver: Driver, sandboxes: SandboxFactory, host_gpus: tuple[str, ...]
) -> None:
    """A request for N GPUs MUST give exactly N distinct GPUs, visible by UUID."""
    for count in _counts(driver):
        sandbox = sandboxes(SandboxSpec.with_gpus(count))
        reported = uuids(sandbox)
        assert len(reported) == count, f"asked for {count} GPUs, the driver reports {reported}"
        assert len(set(reported)) == count, f"the driver reports one GPU twice: {reported}"
        assert set(reported) <= set(host_gpus)
        seen = visible_gpu_uuids(sandbox)
        assert sorted(seen) == sorted(reported), f"asked for {count}, nvidia-smi shows {seen}"
        sandbox.close()
    if len(host_gpus) >= 3 and driver.capabilities.exclusive:
        # While another sandbox holds a GPU: N others, none of them the held one.
        held = uuids(sandboxes(SandboxSpec.with_gpus()))
        pair = sandboxes(SandboxSpec.with_gpus(2))
        assert len(set(uuids(pair))) == 2
        assert not set(uuids(pair)) & set(held), f"{held} is held; a count of 2 got {uuids(pair)}"
        seen = visible_gpu_uuids(pair)
        assert sorted(seen) == sorted(uuids(pair))
        cuda = cuda_visible_uuids(pair, seen)
        assert cuda == seen, f"nvidia-smi lists {seen}; CUDA_VISIBLE_DEVICES inside leaves {cuda}"
        if driver.capabilities.shared:
            # Shared, a count is as many distinct GPUs: never one GPU co-held twice.
            pair.close()
            shared = sandboxes(SandboxSpec.with_gpus(2, sharing=SHARED))
            got = uuids(shared)
            assert len(set(got)) == 2, f"a shared count of 2 got {got}"
            assert not set(got) & set(held), f"{held} is held exclusively; shared got {got}"
            assert sorted(visible_gpu_uuids(shared)) == sorted(got)


@pytest.mark.requirement("GPU-ISOLATION-01")
def test_what_cuda_opens_is_there_on_one_gpu(driver: Driver, sandboxes: SandboxFactory) -> None:
    """A sandbox's GPU nodes, nvidiactl and nvidia-uvm MUST be there and open, on one GPU too."""
    # The form of GPU-ISOLATION-01 a host of one GPU can check (CI runners have one): without
    # nvidia-uvm, nvidia-smi works and CUDA cannot start.
    sandbox = sandboxes(SandboxSpec.with_gpus())
    for way, run in ways_to_run(sandbox).items():
        seen = _nodes_anywhere(run)
        foreign = foreign_gpu_nodes(sandbox, driver, seen)
        assert foreign == [], (
            f"through {way}, sandbox {sandbox.id} holds GPU device nodes not its own: {foreign}"
        )
        _assert_cuda_can_open(sandbox, seen)


@pytest.mark.requirement("GPU-ISOLATION-01")
@pytest.mark.gpus(2)
def test_only_assigned_device_nodes_exist(driver: Driver, sandboxes: SandboxFactory) -> None:
    """Only the assigned GPUs' device nodes MUST exist inside the sandbox, of every kind."""
    count = min(2, driver.capabilities.max_gpus_per_sandbox)
    requests = [SandboxSpec.with_gpus(count), SandboxSpec.with_gpus()]
    if driver.capabilities.exact_ids:
        last = driver.device_ids(driver.inventory()[-1])[0]
        requests.insert(0, SandboxSpec.with_gpus(driver=driver.name, device_ids=[last]))
    if len(driver.inventory()) < count + len(requests) - 1:
        for spec in requests:  # too few GPUs to hold them all at once
            with sandboxes(spec) as sandbox:
                _assert_only_its_own_nodes(driver, sandbox)
        return
    # Side by side, the exact request first: each beside the others, whose GPUs it must not see.
    held = [sandboxes(requests[0]), *create_side_by_side(sandboxes, requests[1:])]
    with ThreadPoolExecutor(len(held)) as pool:
        list(pool.map(lambda sandbox: _assert_only_its_own_nodes(driver, sandbox), held))


def _assert_cuda_can_open(sandbox: Sandbox, seen: list[NodeSeen]) -> None:
    """What CUDA opens is there to open: the GPUs' nodes, nvidiactl and nvidia-uvm."""
    __tracebackhide__ = True
    present = {node.path for node in seen}
    missing = sorted(CUDA_CONTROL_NODES - present)
    assert not missing, f"sandbox {sandbox.id} has NVIDIA GPUs but not {missing}"
    own = [node.path for node in nvidia_gpu_nodes(seen)]
    assert own, f"sandbox {sandbox.id} holds no NVIDIA GPU node: {seen}"
    refused = refused_nodes(sandbox, [*CUDA_CONTROL_NODES, *own])
    assert not refused, f"sandbox {sandbox.id} may not open its GPU nodes: {refused}"


def _assert_only_its_own_nodes(driver: Driver, sandbox: Sandbox) -> None:
    __tracebackhide__ = True
    assert all(gpu.minor is not None for gpu in sandbox.gpus), (
        f"the driver reports GPUs without a device minor: {sandbox.gpus}"
    )
    expected = sorted(gpu.minor for gpu in sandbox.gpus if gpu.minor is not None)
    # Anywhere in its files, through every path to a command.
    for way, run in ways_to_run(sandbox).items():
        seen = _nodes_anywhere(run)
        nodes = nvidia_gpu_nodes(seen)
        assert sorted(node.minor for node in nodes) == expected, (
            f"assigned GPU minors {expected}, but through {way} the sandbox holds {nodes}"
        )
        foreign = foreign_gpu_nodes(sandbox, driver, seen)
        assert foreign == [], (
            f"through {way}, sandbox {sandbox.id} holds GPU device nodes not its own: {foreign}"
        )
    _assert_cuda_can_open(sandbox, seen)
    # Nor can a command inside make a node of another GPU and reach it (a privileged sandbox).
    own = {node.minor for node in nodes}
    other = next((gpu for gpu in driver.inventory() if gpu.minor not in {*own, None}), None)
    if other is not None and other.minor is not None:
        reached = opens_a_node_it_makes(sandbox, other.nodes[0].major, other.minor)
        assert reached is None, (
            f"sandbox {sandbox.id} made the node of {other.uuid} "
            f"({other.nodes[0].major}:{other.minor}) and "
            f"opened it: {reached}"
        )
    assert sorted(visible_gpu_uuids(sandbox)) == sorted(uuids(sandbox))
