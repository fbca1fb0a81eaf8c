package main

// Finding the processes of this driver's jails, and of a command, from any process: by the
// stamp on bwrap's command line (a jail) or the marker in a command's environment. A name and
// a command line are whatever their owner chose: any local user may start a "bwrap" that
// carries a session's stamp (session ids are no secret), so a jail's process is also ours.

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// killMarked SIGKILLs every process whose environment holds needle, until none is left.
// It looks again a millisecond later, then less often: a process killed a moment ago is
// usually gone by then (a zombie's environ reads empty), and a kill at a timeout is timed.
func killMarked(needle string) {
	deadline := time.Now().Add(5 * time.Second)
	for wait := time.Millisecond; time.Now().Before(deadline); wait *= 2 {
		found := marked(needle)
		if len(found) == 0 {
			return
		}
		for _, pid := range found {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		if wait > 20*time.Millisecond {
			wait = 20 * time.Millisecond
		}
		time.Sleep(wait)
	}
}

func marked(needle string) []int {
	var found []int
	eachProcess("environ", func(pid int, data []byte) {
		for _, entry := range bytes.Split(data, []byte{0}) {
			if string(entry) == needle {
				found = append(found, pid)
				return
			}
		}
	})
	return found
}

func eachProcess(entry string, fn func(pid int, data []byte)) {
	names, _ := filepath.Glob("/proc/[0-9]*")
	for _, dir := range names {
		pid, err := strconv.Atoi(filepath.Base(dir))
		if err != nil {
			continue
		}
		if data, err := os.ReadFile(dir + "/" + entry); err == nil {
			fn(pid, data)
		}
	}
}

// owner: the uid of a process whose real, effective, saved and filesystem uids are that
// one; -1 when they differ, or when it is gone.
func owner(pid int) int {
	status, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return -1
	}
	for _, line := range strings.Split(string(status), "\n") {
		if ids := strings.Fields(line); len(ids) == 5 && ids[0] == "Uid:" {
			if ids[1] != ids[2] || ids[1] != ids[3] || ids[1] != ids[4] {
				return -1
			}
			uid, err := strconv.Atoi(ids[1])
			if err != nil {
				return -1
			}
			return uid
		}
	}
	return -1
}

// jails: each process of the session's jails (bwrap, and its fork the jail's pid 1): its id.
// This user's processes alone.
func jails(session string) map[int]string {
	found := map[int]string{}
	eachProcess("cmdline", func(pid int, data []byte) {
		args := strings.Split(string(data), "\x00")
		if len(args) < 2 || !strings.HasSuffix(args[0], "bwrap") || owner(pid) != os.Geteuid() {
			return
		}
		for i, arg := range args[:len(args)-1] {
			if arg == stamp {
				owner, sid, _ := strings.Cut(args[i+1], "/")
				if owner == session {
					found[pid] = sid
				}
				return
			}
		}
	})
	return found
}

// reapJails kills every jail of the session, whoever made it, and waits for them to go.
func reapJails(session string) ([]string, error) {
	found := jails(session)
	for pid := range found {
		if _, still := jails(session)[pid]; still {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	deadline := time.Now().Add(jailWait)
	for len(jails(session)) > 0 {
		if time.Now().After(deadline) {
			return nil, errors.New("the jails of session " + session + " did not exit")
		}
		time.Sleep(10 * time.Millisecond)
	}
	var ids []string
	for _, sid := range found {
		ids = append(ids, sid)
	}
	return ids, nil
}
