package main

// Who holds a lease, and whether it still lives (gpuhost/liveness.py): a process holder is
// <boot id>:<pid>:<start time>, judged from /proc; any other kind cannot be judged here.

import (
	"errors"
	"fmt"
	"math/big"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

var (
	bootOnce sync.Once
	bootIDv  string
	bootTm   float64
)

func bootInfo() {
	bootOnce.Do(func() {
		b, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
		bootIDv = strings.TrimSpace(string(b))
		stat, _ := os.ReadFile("/proc/stat")
		for _, line := range strings.Split(string(stat), "\n") {
			if strings.HasPrefix(line, "btime ") {
				bootTm, _ = strconv.ParseFloat(strings.TrimSpace(line[6:]), 64)
			}
		}
	})
}

func bootID() string          { bootInfo(); return bootIDv }
func bootTime() float64       { bootInfo(); return bootTm }
func bigInt(n int64) *big.Int { return big.NewInt(n) }

// statFields: /proc/<pid>/stat after the command's last ')': state is [0], start time [19].
func statFields(pid int) ([]string, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	s := string(raw)
	i := strings.LastIndex(s, ")")
	if i < 0 || i+2 > len(s) {
		return nil, errors.New("unreadable stat")
	}
	f := strings.Fields(s[i+2:])
	if len(f) < 20 {
		return nil, errors.New("short stat")
	}
	return f, nil
}

func processHolder(pid int) (Holder, error) {
	f, err := statFields(pid)
	if err != nil {
		return Holder{}, err
	}
	return Holder{"process", fmt.Sprintf("%s:%d:%s", bootID(), pid, f[19])}, nil
}

// processRunning: the process pid that started at start still runs (a zombie does not);
// one hidden from us counts as running.
func processRunning(pid int, start string) bool {
	f, err := statFields(pid)
	if err != nil {
		if !os.IsNotExist(err) && !errors.Is(err, syscall.ESRCH) {
			return true
		}
		err := syscall.Kill(pid, 0)
		return err == syscall.EPERM
	}
	return f[19] == start && f[0] != "Z" && f[0] != "X"
}

// holderAlive: a process holder by /proc; any other kind cannot be judged here: alive.
func holderAlive(h Holder) bool {
	if h.Kind != "process" {
		return true
	}
	parts := strings.Split(h.Ref, ":")
	if len(parts) != 3 {
		return true
	}
	pid, err := strconv.Atoi(parts[1])
	if err != nil {
		return true
	}
	return parts[0] == bootID() && processRunning(pid, parts[2])
}
