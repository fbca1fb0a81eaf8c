"""A host user of its own per sandbox: the claims in a root-only directory (gpuhost/uids.py)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuhost import uids
from gpuhost.errors import SandboxStartError
from gpuhost.uids import SANDBOX_UIDS, SandboxUser
from gpuhost.wait import wait_for
from tests.other_user import OTHER_USER

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (uid claims are root's)")


@pytest.fixture
def claims(tmp_path: Path) -> Path:
    return tmp_path / "uids"


@pytest.fixture
def held(claims: Path) -> Iterator[list[SandboxUser]]:
    users: list[SandboxUser] = []
    yield users
    for user in users:
        user.release()


def test_claims_are_distinct_uids_of_the_range_and_no_accounts(
    claims: Path, held: list[SandboxUser]
) -> None:
    held += [uids.claim(claims) for _ in range(50)]
    taken = [user.uid for user in held]
    assert len(set(taken)) == len(taken)
    assert all(uid in SANDBOX_UIDS for uid in taken)
    assert all(user.gid == user.uid for user in held)
    assert claims.stat().st_mode & 0o777 == 0o700


def test_a_held_uid_is_not_claimed_again_and_a_released_one_may_be(
    claims: Path, held: list[SandboxUser], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("secrets.randbelow", lambda n: 0)
    first = uids.claim(claims)
    held.append(first)
    second = uids.claim(claims)
    held.append(second)
    assert (first.uid, second.uid) == (SANDBOX_UIDS[0], SANDBOX_UIDS[1])
    first.release()
    again = uids.claim(claims)
    held.append(again)
    assert again.uid == first.uid


def test_a_uid_a_process_still_runs_as_is_not_claimed(
    claims: Path, held: list[SandboxUser], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox whose creator was killed may still be exiting: its uid stays taken."""
    monkeypatch.setattr("secrets.randbelow", lambda n: 0)
    first = uids.claim(claims)
    uid = first.uid
    lingering = subprocess.Popen(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "60"]
    )
    try:
        wait_for(
            lambda: uids.runs_a_process(uid),
            bool,
            timeout_s=5,
            what=f"setpriv to take uid {uid}",
        )
        first.release()  # the lock is free, the process is not gone
        user = uids.claim(claims)
        held.append(user)
        assert user.uid != uid
        assert uids.runs_a_process(uid)
    finally:
        lingering.kill()
        lingering.wait()
    assert not uids.runs_a_process(uid)


def test_a_claims_directory_another_user_made_or_can_write_is_refused(claims: Path) -> None:
    claims.mkdir(mode=0o700)
    os.chown(claims, OTHER_USER, OTHER_USER)
    with pytest.raises(SandboxStartError, match=rf"{claims} belong to uid {OTHER_USER}"):
        uids.claim(claims)
    os.chown(claims, 0, 0)
    claims.chmod(0o777)
    with pytest.raises(SandboxStartError, match="mode 777"):
        uids.claim(claims)


def test_a_claims_directory_that_is_a_link_is_refused(claims: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    claims.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SandboxStartError, match="cannot be opened as a directory"):
        uids.claim(claims)


def test_a_claim_that_is_not_a_file_is_refused_by_name(
    claims: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("secrets.randbelow", lambda n: 0)
    claims.mkdir(mode=0o700)
    os.mkfifo(claims / str(SANDBOX_UIDS[0]))
    with pytest.raises(SandboxStartError, match=f"{SANDBOX_UIDS[0]} is not a file"):
        uids.claim(claims)
    (claims / str(SANDBOX_UIDS[0])).unlink()
    (claims / str(SANDBOX_UIDS[0])).symlink_to("/etc/passwd")
    with pytest.raises(SandboxStartError, match=f"{SANDBOX_UIDS[0]} cannot be opened"):
        uids.claim(claims)
