package main

// A host uid of its own for each jail, by the host-wide claim of gpuhost/uids.py (and
// docs/security.md, "Sandbox users"): processes of one host user share the kernel's per-user
// state whatever their namespaces (the user keyrings, the process limit, the per-user quotas),
// so no two jails may run as one. The uid is the name of a file in uidDir, a directory only
// root may write, and whoever holds an exclusive flock on that file owns the uid: this process
// holds it for the jail's life, and the kernel drops it when this process ends, however it
// ends. A uid is taken only when its lock is free and, when its claim file was there before,
// no process of the host runs as it (a killed creator's jail may still be exiting).

import (
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"math/big"
	"os"
	"strconv"
	"syscall"
)

const (
	uidDir    = "/run/gpu-sandbox-uids"
	firstUID  = 1999100000 // gpuhost.uids.SANDBOX_UIDS: no account's, below 2**31
	uidCount  = 65536
	noLinks   = syscall.O_NOFOLLOW | syscall.O_CLOEXEC | syscall.O_NONBLOCK
	claimMode = 0o600
)

// SandboxUser is a uid (and the gid of the same number) held for one jail until Release.
type SandboxUser struct {
	UID    int
	lockFD int
}

// Release gives the uid back: once no process of it is left, another jail may take it.
func (u *SandboxUser) Release() {
	if u != nil && u.lockFD >= 0 {
		syscall.Close(u.lockFD)
		u.lockFD = -1
	}
}

// claimUser: a uid of the range that no other sandbox holds and no process runs as.
func claimUser() (*SandboxUser, error) {
	dirFD, err := privateDirectory(uidDir)
	if err != nil {
		return nil, err
	}
	defer syscall.Close(dirFD)
	n, err := rand.Int(rand.Reader, big.NewInt(uidCount))
	if err != nil {
		return nil, err
	}
	start := int(n.Int64())
	for step := 0; step < uidCount; step++ {
		uid := firstUID + (start+step)%uidCount
		fd, err := lockUID(dirFD, uid)
		if err != nil {
			return nil, err
		}
		if fd >= 0 {
			return &SandboxUser{UID: uid, lockFD: fd}, nil
		}
	}
	return nil, fmt.Errorf("no sandbox uid is free: all %d of %d..%d are held (claims in %s) or run a process",
		uidCount, firstUID, firstUID+uidCount-1, uidDir)
}

// lockUID: the locked claim file of uid, or -1 when its lock is held or a process runs as it.
func lockUID(dirFD, uid int) (int, error) {
	name := strconv.Itoa(uid)
	fresh := true // nobody claimed it since boot (the directory is on a tmpfs): no process
	fd, err := syscall.Openat(dirFD, name, syscall.O_RDWR|syscall.O_CREAT|syscall.O_EXCL|noLinks, claimMode)
	if errors.Is(err, syscall.EEXIST) {
		fresh = false
		fd, err = syscall.Openat(dirFD, name, syscall.O_RDWR|noLinks, 0)
	}
	if err != nil {
		return -1, fmt.Errorf("the sandbox uid claim %s/%s: %v", uidDir, name, err)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG {
		syscall.Close(fd)
		return -1, fmt.Errorf("the sandbox uid claim %s/%s is not a file", uidDir, name)
	}
	if err := syscall.Flock(fd, syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		syscall.Close(fd)
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return -1, nil
		}
		return -1, fmt.Errorf("the sandbox uid claim %s/%s: %v", uidDir, name, err)
	}
	if !fresh && runsAProcess(uid) {
		syscall.Close(fd)
		return -1, nil
	}
	return fd, nil
}

// runsAProcess: whether a process of the host has uid as a uid or gid (real, effective, saved, fs).
func runsAProcess(uid int) bool {
	id := []byte(strconv.Itoa(uid))
	found := false
	eachProcess("status", func(pid int, status []byte) {
		for _, line := range bytes.Split(status, []byte{'\n'}) {
			if bytes.HasPrefix(line, []byte("Uid:")) || bytes.HasPrefix(line, []byte("Gid:")) {
				for _, field := range bytes.Fields(line)[1:] {
					found = found || bytes.Equal(field, id)
				}
			}
		}
	})
	return found
}

// privateDirectory: an open fd of dir, made when missing: root's (this user's) alone, not a link.
func privateDirectory(dir string) (int, error) {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return -1, fmt.Errorf("the sandbox uid claims %s cannot be made: %v", dir, err)
	}
	fd, err := syscall.Open(dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("the sandbox uid claims %s cannot be opened as a directory: %v", dir, err)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil || int(st.Uid) != os.Geteuid() || st.Mode&0o022 != 0 {
		syscall.Close(fd)
		return -1, fmt.Errorf("the sandbox uid claims %s belong to uid %d with mode %o: only uid %d may write there; remove it",
			dir, st.Uid, st.Mode&0o7777, os.Geteuid())
	}
	return fd, nil
}
