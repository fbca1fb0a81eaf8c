"""The lease protocol as published: its schema, and a second client in sh that interoperates."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from gpuhost.devices import GpuDevice
from gpuhost.errors import GpuBusy
from gpuhost.leases import Holder, LeaseOwner, LeaseRegistry, boot_id

ROOT = Path(__file__).parents[2]
CLIENT = ROOT / "gpuhost" / "gpu-lease"
SCHEMA = json.loads((ROOT / "docs" / "lease-file.schema.json").read_text())
INVENTORY = tuple(
    GpuDevice(i, f"GPU-{i:08d}-aaaa-bbbb-cccc-000000000000", "GPU", f"0000:{0x18 + i:02x}:00.0")
    for i in range(4)
)
BUSY = 3


def client(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLIENT), "--dir", str(directory), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def registry(tmp_path: Path) -> LeaseRegistry:
    return LeaseRegistry(tmp_path / "leases")


@pytest.fixture
def sh_holds(registry: LeaseRegistry) -> Iterator[subprocess.Popen[str]]:
    """The sh client holding GPUs 1 and 3 for a sleeping command."""
    held = subprocess.Popen(
        [str(CLIENT), "--dir", str(registry.directory), "hold", "--driver", "sh-client",
         "--session", "s", "--sandbox", "sh-1", INVENTORY[1].uuid, INVENTORY[3].uuid,
         "--", "sleep", "60"],
        text=True,
    )  # fmt: skip
    try:
        _wait_for_leases(registry, 2)
        yield held
    finally:
        held.kill()
        held.wait()


def _wait_for_leases(registry: LeaseRegistry, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(registry.leases()) < count:
        assert time.monotonic() < deadline, "the sh client never took its leases"
        time.sleep(0.02)


def _document(registry: LeaseRegistry) -> dict[str, object]:
    text = (registry.path).read_text()
    document, _ = json.JSONDecoder().raw_decode(text)
    assert isinstance(document, dict)
    return document


def test_the_python_clients_file_follows_the_schema(registry: LeaseRegistry) -> None:
    owner = LeaseOwner("test", "a", "s", Holder.process(os.getpid()))
    registry.acquire(INVENTORY, owner, count=2)
    document = _document(registry)
    jsonschema.validate(document, SCHEMA)
    assert (document["version"], document["boot_id"]) == (4, boot_id())


def test_the_sh_clients_file_follows_the_schema(
    registry: LeaseRegistry, sh_holds: subprocess.Popen[str]
) -> None:
    jsonschema.validate(_document(registry), SCHEMA)


@pytest.mark.parametrize(
    "broken",
    [
        {"version": 2, "leases": []},  # no boot id
        {"version": 5, "boot_id": "b", "leases": []},
        {"version": 2, "boot_id": "b", "leases": [{"gpu_uuid": "GPU-1"}]},
        {"version": 2, "boot_id": "b", "leases": [{
            "gpu_uuid": "GPU-1", "driver": "d", "sandbox_id": "s", "session_id": "",
            "holder": {"kind": "process", "ref": "1234"}, "mode": "exclusive",
            "acquired_at": 1.0,
        }]},
    ],
    ids=["no-boot-id", "unknown-version", "lease-missing-fields", "bad-process-ref"],
)  # fmt: skip
def test_the_schema_refuses_what_the_protocol_forbids(broken: dict[str, object]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)


def test_python_never_grants_what_the_sh_client_holds(
    registry: LeaseRegistry, sh_holds: subprocess.Popen[str]
) -> None:
    mine = LeaseOwner("test", "py-1", "s", Holder.process(os.getpid()))
    assert registry.acquire(INVENTORY, mine, count=2) == (INVENTORY[0], INVENTORY[2])
    with pytest.raises(GpuBusy, match="sh-1 of the sh-client driver"):
        registry.acquire(INVENTORY, mine, exact=[INVENTORY[3]])


def test_the_sh_client_never_takes_what_python_holds(registry: LeaseRegistry) -> None:
    registry.acquire(INVENTORY, LeaseOwner("test", "py-1", "s", Holder.process(os.getpid())),
                     exact=[INVENTORY[2]])  # fmt: skip
    refused = client(registry.directory, "hold", "--sandbox", "sh-2", INVENTORY[0].uuid,
                     INVENTORY[2].uuid, "--", "true")  # fmt: skip
    assert refused.returncode == BUSY
    assert f"GPU {INVENTORY[2].uuid} is already assigned to another sandbox" in refused.stderr
    assert "py-1 of the test driver" in refused.stderr
    assert [lease.sandbox_id for lease in registry.leases()] == ["py-1"], "it took GPU 0"


def test_a_dead_sh_holders_gpus_are_reclaimed_by_python(
    registry: LeaseRegistry, sh_holds: subprocess.Popen[str]
) -> None:
    sh_holds.kill()
    sh_holds.wait()
    mine = LeaseOwner("test", "py-1", "s", Holder.process(os.getpid()))
    assert registry.acquire(INVENTORY, mine, count=4) == INVENTORY


def test_a_dead_python_holders_gpus_are_reclaimed_by_the_sh_client(
    registry: LeaseRegistry,
) -> None:
    gone = subprocess.Popen(["true"])
    holder = Holder.process(gone.pid)
    registry.acquire(INVENTORY, LeaseOwner("test", "py-1", "s", holder), count=4)
    gone.wait()
    taken = client(registry.directory, "hold", "--sandbox", "sh-3", INVENTORY[0].uuid, "--",
                   "true")  # fmt: skip
    assert taken.returncode == 0, taken.stderr


def test_the_sh_client_lists_and_releases(
    registry: LeaseRegistry, sh_holds: subprocess.Popen[str]
) -> None:
    listed = client(registry.directory, "list").stdout.splitlines()
    assert [line.split("\t")[:3] for line in listed] == [
        [INVENTORY[1].uuid, "sh-client", "sh-1"],
        [INVENTORY[3].uuid, "sh-client", "sh-1"],
    ]
    assert client(registry.directory, "release", "sh-1").returncode == 0
    assert registry.leases() == []
    jsonschema.validate(_document(registry), SCHEMA)


def test_the_sh_client_writes_in_place_then_truncates(
    registry: LeaseRegistry, sh_holds: subprocess.Popen[str]
) -> None:
    """Never truncate first: the same inode, shorter after a release, and still valid."""
    path = registry.path
    inode, size = path.stat().st_ino, path.stat().st_size
    assert client(registry.directory, "release", "sh-1").returncode == 0
    assert path.stat().st_ino == inode
    assert path.stat().st_size < size
    assert json.loads(path.read_text())["leases"] == []


def test_the_sh_client_respects_a_mig_instance_held_by_python(registry: LeaseRegistry) -> None:
    """A lease on a MIG instance names its GPU (parent_uuid): the whole GPU is busy."""
    instance = dataclasses.replace(
        INVENTORY[1], uuid="MIG-00000001-aaaa-bbbb-cccc-000000000000",
        parent_uuid=INVENTORY[1].uuid, mig_index=0, profile="1g.10gb",
    )  # fmt: skip
    registry.acquire([instance], LeaseOwner("test", "py-mig", "s", Holder.process(os.getpid())),
                     exact=[instance])  # fmt: skip
    jsonschema.validate(_document(registry), SCHEMA)
    refused = client(registry.directory, "hold", "--sandbox", "sh-4", INVENTORY[1].uuid, "--",
                     "true")  # fmt: skip
    assert refused.returncode == BUSY, refused.stderr
    assert "py-mig of the test driver" in refused.stderr


def test_a_mig_instance_held_by_the_sh_client_keeps_its_gpu_from_python(
    registry: LeaseRegistry,
) -> None:
    """``--parent`` names the instance's GPU: Python then refuses the GPU whole, not a sibling."""
    gpu = INVENTORY[2]
    first, sibling = (
        dataclasses.replace(gpu, uuid=f"MIG-0000000{i}-aaaa-bbbb-cccc-000000000000",
                            parent_uuid=gpu.uuid, mig_index=i, profile="1g.10gb")
        for i in range(2)
    )  # fmt: skip
    held = subprocess.Popen(
        [str(CLIENT), "--dir", str(registry.directory), "hold", "--sandbox", "sh-mig",
         "--parent", gpu.uuid, first.uuid, "--", "sleep", "60"],
        text=True,
    )  # fmt: skip
    try:
        _wait_for_leases(registry, 1)
        jsonschema.validate(_document(registry), SCHEMA)
        assert registry.leases()[0].parent_uuid == gpu.uuid
        owner = LeaseOwner("test", "py", "s", Holder.process(os.getpid()))
        with pytest.raises(GpuBusy, match="sh-mig"):
            registry.acquire([gpu], owner, exact=[gpu])
        with pytest.raises(GpuBusy, match="sh-mig"):
            registry.acquire([first], owner, exact=[first])
        assert registry.acquire([sibling], owner, exact=[sibling]) == (sibling,)
        again = client(registry.directory, "hold", "--sandbox", "sh-2", "--parent", gpu.uuid,
                       sibling.uuid, "--", "true")  # fmt: skip
        assert again.returncode == BUSY, again.stderr
        whole = client(registry.directory, "hold", "--sandbox", "sh-3", gpu.uuid, "--", "true")
        assert whole.returncode == BUSY, whole.stderr
    finally:
        held.kill()
        held.wait()
