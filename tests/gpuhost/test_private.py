"""gpuhost.private: a directory of this user's own, files made new in it and read back."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuhost.private import NotPrivate, create, private_directory, read_own
from tests.other_user import OTHER_USER, PYTHON, readable_copy, setpriv


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory all may write, sticky, as /tmp is."""
    base = Path(tempfile.mkdtemp(prefix="gpu-sandbox-private-"))
    base.chmod(0o1777)
    yield base
    shutil.rmtree(base)


def test_a_missing_directory_is_made_0700_and_one_of_ours_made_so(shared: Path) -> None:
    os.close(private_directory(shared / "new"))
    assert stat.S_IMODE((shared / "new").stat().st_mode) == 0o700
    (shared / "ours").mkdir(mode=0o777)
    (shared / "ours").chmod(0o777)
    os.close(private_directory(shared / "ours"))
    assert stat.S_IMODE((shared / "ours").stat().st_mode) == 0o700


def test_another_users_directory_or_a_link_is_refused_by_name(shared: Path) -> None:
    theirs = shared / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_USER, OTHER_USER)
    with pytest.raises(NotPrivate, match=f"{theirs}: is uid {OTHER_USER}'s directory"):
        private_directory(theirs)
    link = shared / "link"
    link.symlink_to(shared)
    with pytest.raises(NotPrivate, match=f"{link}: is a link"):
        private_directory(link)


def test_a_parent_others_may_write_without_its_sticky_bit_is_refused(shared: Path) -> None:
    loose = shared / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(NotPrivate, match="others may write it, and it is not sticky"):
        private_directory(loose / "lanes")


def test_another_user_refuses_roots_directory_too(shared: Path) -> None:
    """As uid 65534: root's directory under the name it would use is not its own."""
    (shared / "vm-65534").mkdir()
    tree = readable_copy(shared / "code")
    script = (
        "from pathlib import Path; from gpuhost.private import NotPrivate, private_directory\n"
        f"try: private_directory(Path({str(shared / 'vm-65534')!r}))\n"
        "except NotPrivate as exc: print(exc)\n"
        f"private_directory(Path({str(shared / 'mine')!r})); print('made')\n"
    )
    done = subprocess.run(
        [*setpriv(), PYTHON, "-c", script], env={"PYTHONPATH": str(tree)},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.stdout.splitlines() == [
        f"{shared / 'vm-65534'}: is uid 0's directory, not this user's (uid {OTHER_USER})",
        "made",
    ], done.stderr
    assert (shared / "mine").stat().st_uid == OTHER_USER


def test_a_file_is_made_new_and_read_back_only_when_it_is_a_regular_file_of_ours(
    shared: Path,
) -> None:
    directory = private_directory(shared / "d")
    victim = shared / "victim"
    victim.write_text("root's own\n")
    (shared / "d" / "x.log").symlink_to(victim)
    fd = create(directory, "x.log")
    os.write(fd, b"ours\n")
    os.close(fd)
    assert victim.read_text() == "root's own\n"
    assert read_own(directory, "x.log", 100) == b"ours\n"
    (shared / "d" / "link").symlink_to(victim)
    os.mkfifo(shared / "d" / "fifo")
    (shared / "d" / "theirs").write_text("forged")
    os.chown(shared / "d" / "theirs", OTHER_USER, OTHER_USER)
    for name, said in [
        ("link", "cannot be read: Too many levels of symbolic links"),
        ("fifo", "is not a regular file"),
        ("theirs", f"is uid {OTHER_USER}'s file, not this user's"),
        ("x.log", "is over 2 bytes"),
    ]:
        with pytest.raises(NotPrivate, match=said):
            read_own(directory, name, 2 if name == "x.log" else 100)
    os.close(directory)
