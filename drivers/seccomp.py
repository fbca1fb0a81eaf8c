"""The system call filter of the sandboxes that run as processes of the host's kernel.

It is docker's default seccomp profile (moby/profiles ``seccomp/default.json``) as docker
applies it to a container with every capability dropped: the calls it allows and nothing
else, each refused call failing with EPERM, ``clone3`` with ENOSYS (so that the C library
falls back to ``clone``), ``clone`` only without namespace flags, ``socket`` only of the
families docker allows, ``personality`` only of its harmless values. Refused, among others:
the kernel keyrings (``add_key``, ``keyctl``, ``request_key``: not namespaced), ``bpf``,
``perf_event_open``, ``userfaultfd``, ``io_uring``, every ``mount`` call, ``unshare``,
module loading, ``kexec``, setting the clock, ``ptrace`` beyond what docker allows.

One addition: ``setns`` and ``chroot``. The filter is loaded into the process that enters a
running sandbox (``nsenter``) before it enters, so that every command is filtered from its
first instruction; ``nsenter`` joins the sandbox's namespaces and root with them, as root,
before it drops to the sandbox's user. Without ``CAP_SYS_ADMIN`` and ``CAP_SYS_CHROOT``,
which no process of a sandbox has (its bounding set is empty), both fail as docker's filter
would make them.

A sandbox's first process gets the filter from bwrap (``--seccomp FD``, ``bpf_fd``); each
command gets it from ``load_in_child``, run between fork and exec. A driver in another
language can load ``bpf()`` as it is: ``python -m drivers.seccomp FILE`` writes it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator

import pyseccomp as seccomp

ALLOWED = (
    "accept", "accept4", "access", "adjtimex", "alarm", "bind", "brk", "cachestat", "capget",
    "capset", "chdir", "chmod", "chown", "chown32", "clock_adjtime", "clock_adjtime64",
    "clock_getres", "clock_getres_time64", "clock_gettime", "clock_gettime64",
    "clock_nanosleep", "clock_nanosleep_time64", "close", "close_range", "connect",
    "copy_file_range", "creat", "dup", "dup2", "dup3", "epoll_create", "epoll_create1",
    "epoll_ctl", "epoll_ctl_old", "epoll_pwait", "epoll_pwait2", "epoll_wait",
    "epoll_wait_old", "eventfd", "eventfd2", "execve", "execveat", "exit", "exit_group",
    "faccessat", "faccessat2", "fadvise64", "fadvise64_64", "fallocate", "fanotify_mark",
    "fchdir", "fchmod", "fchmodat", "fchmodat2", "fchown", "fchown32", "fchownat", "fcntl",
    "fcntl64", "fdatasync", "fgetxattr", "flistxattr", "flock", "fork", "fremovexattr",
    "fsetxattr", "fstat", "fstat64", "fstatat64", "fstatfs", "fstatfs64", "fsync",
    "ftruncate", "ftruncate64", "futex", "futex_requeue", "futex_time64", "futex_wait",
    "futex_waitv", "futex_wake", "futimesat", "getcpu", "getcwd", "getdents", "getdents64",
    "getegid", "getegid32", "geteuid", "geteuid32", "getgid", "getgid32", "getgroups",
    "getgroups32", "getitimer", "getpeername", "getpgid", "getpgrp", "getpid", "getppid",
    "getpriority", "getrandom", "getresgid", "getresgid32", "getresuid", "getresuid32",
    "getrlimit", "get_robust_list", "getrusage", "getsid", "getsockname", "getsockopt",
    "get_thread_area", "gettid", "gettimeofday", "getuid", "getuid32", "getxattr",
    "getxattrat", "inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch",
    "io_cancel", "ioctl", "io_destroy", "io_getevents", "io_pgetevents",
    "io_pgetevents_time64", "ioprio_get", "ioprio_set", "io_setup", "io_submit", "ipc",
    "kill", "landlock_add_rule", "landlock_create_ruleset", "landlock_restrict_self",
    "lchown", "lchown32", "lgetxattr", "link", "linkat", "listen", "listmount", "listxattr",
    "listxattrat", "llistxattr", "_llseek", "lremovexattr", "lseek", "lsetxattr", "lstat",
    "lstat64", "madvise", "map_shadow_stack", "membarrier", "memfd_create", "memfd_secret",
    "mincore", "mkdir", "mkdirat", "mknod", "mknodat", "mlock", "mlock2", "mlockall", "mmap",
    "mmap2", "mprotect", "mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive",
    "mq_timedreceive_time64", "mq_timedsend", "mq_timedsend_time64", "mq_unlink", "mremap",
    "mseal", "msgctl", "msgget", "msgrcv", "msgsnd", "msync", "munlock", "munlockall",
    "munmap", "name_to_handle_at", "nanosleep", "newfstatat", "_newselect", "open", "openat",
    "openat2", "pause", "pidfd_open", "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc",
    "pkey_free", "pkey_mprotect", "poll", "ppoll", "ppoll_time64", "prctl", "pread64",
    "preadv", "preadv2", "prlimit64", "process_mrelease", "pselect6", "pselect6_time64",
    "pwrite64", "pwritev", "pwritev2", "read", "readahead", "readlink", "readlinkat", "readv",
    "recv", "recvfrom", "recvmmsg", "recvmmsg_time64", "recvmsg", "remap_file_pages",
    "removexattr", "removexattrat", "rename", "renameat", "renameat2", "restart_syscall",
    "rmdir", "rseq", "rt_sigaction", "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo",
    "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait", "rt_sigtimedwait_time64",
    "rt_tgsigqueueinfo", "sched_getaffinity", "sched_getattr", "sched_getparam",
    "sched_get_priority_max", "sched_get_priority_min", "sched_getscheduler",
    "sched_rr_get_interval", "sched_rr_get_interval_time64", "sched_setaffinity",
    "sched_setattr", "sched_setparam", "sched_setscheduler", "sched_yield", "seccomp",
    "select", "semctl", "semget", "semop", "semtimedop", "semtimedop_time64", "send",
    "sendfile", "sendfile64", "sendmmsg", "sendmsg", "sendto", "setfsgid", "setfsgid32",
    "setfsuid", "setfsuid32", "setgid", "setgid32", "setgroups", "setgroups32", "setitimer",
    "setpgid", "setpriority", "setregid", "setregid32", "setresgid", "setresgid32",
    "setresuid", "setresuid32", "setreuid", "setreuid32", "setrlimit", "set_robust_list",
    "setsid", "setsockopt", "set_thread_area", "set_tid_address", "setuid", "setuid32",
    "setxattr", "setxattrat", "shmat", "shmctl", "shmdt", "shmget", "shutdown",
    "sigaltstack", "signalfd", "signalfd4", "sigprocmask", "sigreturn", "socketcall",
    "socketpair", "splice", "stat", "stat64", "statfs", "statfs64", "statmount", "statx",
    "symlink", "symlinkat", "sync", "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill",
    "time", "timer_create", "timer_delete", "timer_getoverrun", "timer_gettime",
    "timer_gettime64", "timer_settime", "timer_settime64", "timerfd_create",
    "timerfd_gettime", "timerfd_gettime64", "timerfd_settime", "timerfd_settime64", "times",
    "tkill", "truncate", "truncate64", "ugetrlimit", "umask", "uname", "unlink", "unlinkat",
    "uretprobe", "utime", "utimensat", "utimensat_time64", "utimes", "vfork", "vmsplice",
    "wait4", "waitid", "waitpid", "write", "writev",
    # docker allows these on kernels from 4.8 on, where ptrace no longer escapes the filter
    "ptrace", "process_vm_readv", "process_vm_writev",
    # x86 (docker: amd64, x32, x86)
    "arch_prctl", "modify_ldt",
    # arm and arm64
    "arm_fadvise64_64", "arm_sync_file_range", "sync_file_range2", "breakpoint",
    "cacheflush", "set_tls",
    # the exec path's nsenter (see above): nothing without capabilities no sandbox has
    "setns", "chroot",
)  # fmt: skip
"""The calls allowed unconditionally: docker's, for its kernels from 4.8 on and no capability."""
SOCKET_FAMILIES = (
    *range(0, 12), 13, 14, 15, 16, 17, 18, 21, 22, 24, 26, 27, 28, 29, 30, 31, 32, 33, 35, 36,
    39, 41, 42, 43, 44, 45,
)  # fmt: skip
"""The address families ``socket`` may open (docker's: not AF_VSOCK, 40, among others)."""
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
"""PER_LINUX, PER_LINUX32, UNAME26 and both, and the query of the current one (docker's)."""
NAMESPACE_FLAGS = 0x7E020000
"""CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: clone never makes one."""
_SUB_ARCHES = {"X86_64": ("X86", "X32"), "AARCH64": ("ARM",)}


def _rules() -> Iterator[tuple[int, str, tuple[seccomp.Arg, ...]]]:
    """(action, call, argument conditions) of every rule, docker's order."""
    for name in ALLOWED:
        yield seccomp.ALLOW, name, ()
    for family in SOCKET_FAMILIES:
        yield seccomp.ALLOW, "socket", (seccomp.Arg(0, seccomp.EQ, family),)
    for persona in PERSONALITIES:
        yield seccomp.ALLOW, "personality", (seccomp.Arg(0, seccomp.EQ, persona),)
    yield seccomp.ALLOW, "clone", (seccomp.Arg(0, seccomp.MASKED_EQ, NAMESPACE_FLAGS, 0),)
    yield seccomp.ERRNO(errno.ENOSYS), "clone3", ()


@functools.cache
def bpf() -> bytes:
    """The filter as a BPF program for this machine's architecture (and its 32-bit ones).

    Calls that this libseccomp does not know are left out, and so refused.
    """
    syscalls = seccomp.SyscallFilter(defaction=seccomp.ERRNO(errno.EPERM))
    native = seccomp.system_arch()
    for name, value in vars(seccomp.Arch).items():
        if value == native:
            for sub in _SUB_ARCHES.get(name, ()):
                syscalls.add_arch(getattr(seccomp.Arch, sub))
    for action, name, args in _rules():
        if seccomp.resolve_syscall(native, name) < 0:
            continue
        syscalls.add_rule(action, name, *args)
    with tempfile.TemporaryFile() as out:
        syscalls.export_bpf(out)
        out.seek(0)
        return out.read()


def bpf_fd() -> int:
    """A file descriptor to read ``bpf()`` from, from its start (bwrap's ``--seccomp FD``)."""
    fd = os.memfd_create("gpu-sandbox-seccomp", os.MFD_CLOEXEC)
    os.write(fd, bpf())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_char_p))


_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_BPF_INSTRUCTION_SIZE = 8


@functools.cache
def _loader() -> tuple[Callable[..., int], _SockFprog]:
    program = bpf()
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl, _SockFprog(len(program) // _BPF_INSTRUCTION_SIZE, program)


def prepare() -> None:
    """Build the filter now, so that ``load_in_child`` does nothing but load it."""
    _loader()


def load_in_child() -> None:
    """Load the filter into this process (a fork about to exec a sandbox's command).

    A ``preexec_fn``: it only makes system calls, on what ``prepare`` built before the fork.
    Without ``CAP_SYS_ADMIN`` the kernel demands no-new-privileges first, which the sandbox's
    commands have anyway.
    """
    prctl, program = _loader()
    if os.geteuid() != 0 and prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


def main(argv: list[str]) -> int:
    """``python -m drivers.seccomp FILE``: write the filter's BPF program to FILE."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m drivers.seccomp FILE\n")
        return 2
    with open(argv[0], "wb") as out:
        out.write(bpf())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
