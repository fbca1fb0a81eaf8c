package main

// The system call filter every process of a jail runs under: the container engines' default
// for a container without capabilities, as drivers/seccomp.py builds it (adding add_key,
// keyctl, bpf, unshare, mount... to what a jail cannot do). `make gosandbox` writes its BPF
// program for this machine (python -m drivers.seccomp seccomp.bpf) and the build embeds it.
//
// bwrap loads it into the jail's first process (--seccomp FD). A command enters the jail
// through nsenter, which must run filtered from its first instruction; Go runs nothing between
// fork and exec, so the driver runs itself as a trampoline (its first argument filteredExec)
// that loads the filter into itself and then executes nsenter in its place.

import (
	_ "embed"
	"fmt"
	"os"
	"runtime"
	"syscall"
	"unsafe"
)

//go:embed seccomp.bpf
var filterProgram []byte

const (
	filteredExec = "--filtered-exec" // gosandbox --filtered-exec PATH ARG...: the trampoline
	selfPath     = "/proc/self/exe"

	prSetNoNewPrivs        = 38
	seccompSetModeFilter   = 1
	seccompFilterFlagTsync = 1
	bpfInstructionSize     = 8
)

// seccompCall: the number of the seccomp system call, which package syscall does not name.
var seccompCall = map[string]uintptr{"amd64": 317, "arm64": 277}

// filterFile gives the program to read from its start to its end (bwrap --seccomp FD).
func filterFile() (*os.File, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	go func() { // more than a pipe may hold unread: written as bwrap reads
		w.Write(filterProgram)
		w.Close()
	}()
	return r, nil
}

// runFiltered is the trampoline: it loads the filter into this process, every thread of it,
// then executes argv (argv[0] a path) in its place. It never returns.
func runFiltered(argv []string) {
	runtime.LockOSThread() // no-new-privileges is a thread's: set on the one that loads
	if len(argv) == 0 {
		fmt.Fprintln(os.Stderr, "gosandbox: "+filteredExec+" needs a program to run")
		os.Exit(126)
	}
	if err := loadFilter(); err != nil {
		fmt.Fprintf(os.Stderr, "gosandbox: cannot load the system call filter: %v\n", err)
		os.Exit(126)
	}
	err := syscall.Exec(argv[0], argv, os.Environ())
	fmt.Fprintf(os.Stderr, "gosandbox: cannot run %s: %v\n", argv[0], err)
	os.Exit(127)
}

// sockFprog is the kernel's struct sock_fprog.
type sockFprog struct {
	len    uint16
	filter *byte
}

func loadFilter() error {
	call, known := seccompCall[runtime.GOARCH]
	if !known {
		return fmt.Errorf("no seccomp system call known on %s", runtime.GOARCH)
	}
	count := len(filterProgram) / bpfInstructionSize
	if count == 0 || count > 0xffff || len(filterProgram)%bpfInstructionSize != 0 {
		return fmt.Errorf("seccomp.bpf holds %d bytes: not a BPF program", len(filterProgram))
	}
	// Without CAP_SYS_ADMIN the kernel demands no-new-privileges first.
	if os.Geteuid() != 0 {
		if _, _, errno := syscall.RawSyscall6(syscall.SYS_PRCTL, prSetNoNewPrivs, 1, 0, 0, 0, 0); errno != 0 {
			return fmt.Errorf("prctl(PR_SET_NO_NEW_PRIVS): %v", errno)
		}
	}
	program := sockFprog{len: uint16(count), filter: &filterProgram[0]}
	// TSYNC: every thread of the Go runtime's gets it, or none does (then the id of the one
	// that could not).
	failed, _, errno := syscall.RawSyscall(call, seccompSetModeFilter, seccompFilterFlagTsync,
		uintptr(unsafe.Pointer(&program)))
	if errno != 0 {
		return fmt.Errorf("seccomp(SECCOMP_SET_MODE_FILTER): %v", errno)
	}
	if failed != 0 {
		return fmt.Errorf("seccomp(SECCOMP_SET_MODE_FILTER): thread %d could not take the filter", failed)
	}
	return nil
}
