"""The sandboxes' system call filter (drivers/seccomp.py): docker's default, no capability."""

from __future__ import annotations

import subprocess
import sys

import pytest

from drivers import seccomp

_TRY = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
calls = {"add_key": (248, b"user", b"k", b"v", 1, -4), "keyctl": (250, 0, -4, 0),
         "request_key": (249, b"user", b"k", None, 0), "clone3": (435, 0, 0),
         "bpf": (321, 0, 0, 0), "perf_event_open": (298, 0, 0, -1, -1, 0),
         "userfaultfd": (323, 0), "io_uring_setup": (425, 1, 0), "unshare": (272, 0x10000000),
         "mount": (165, b"none", b"/tmp", b"tmpfs", 0, None), "personality": (135, 0x40000)}
for name, args in calls.items():
    got = libc.syscall(*args)
    print(name, got if got >= 0 else -ctypes.get_errno())
try:
    socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK
    print("vsock", 0)
except OSError as exc:
    print("vsock", -exc.errno)
print("fork", os.waitpid(os.fork() or os._exit(0), 0)[1] if True else 0)
print("seccomp", open("/proc/self/status").read().split("Seccomp:")[1].split()[0])
"""


@pytest.mark.skipif(
    subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip() != "x86_64",
    reason="the system call numbers tried are x86_64's",
)
def test_a_filtered_process_is_refused_what_dockers_default_refuses() -> None:
    seccomp.prepare()
    done = subprocess.run(
        [sys.executable, "-I", "-c", _TRY],
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=seccomp.load_in_child,
    )
    said = dict(line.split() for line in done.stdout.splitlines())
    eperm, enosys = "-1", "-38"
    refused = {name: value for name, value in said.items() if value == eperm}
    assert set(refused) == {
        "add_key", "keyctl", "request_key", "bpf", "perf_event_open", "userfaultfd",
        "io_uring_setup", "unshare", "mount", "personality", "vsock",
    }, said  # fmt: skip
    assert said["clone3"] == enosys, "clone3 must say ENOSYS, for the C library to use clone"
    assert said["fork"] == "0"
    assert said["seccomp"] == "2"


def test_the_program_is_written_for_other_languages(tmp_path: pytest.TempPathFactory) -> None:
    out = f"{tmp_path}/filter.bpf"
    subprocess.run([sys.executable, "-m", "drivers.seccomp", out], check=True)
    with open(out, "rb") as written:
        program = written.read()
    assert program == seccomp.bpf()
    assert len(program) % 8 == 0
    assert len(program) // 8 < 4096  # a BPF program's limit
