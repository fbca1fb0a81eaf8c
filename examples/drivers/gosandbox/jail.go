package main

// Bubblewrap jails, one per sandbox, as examples/drivers/jail.py makes them: the host's
// programs read-only, a /dev of the sandbox's GPUs' nodes (and the control nodes), its own
// /proc, /tmp, /run and /dev/shm, the simulated host's tools, no network, one pid namespace;
// what runs in it runs as a host uid of the jail's own (uids.go) without capabilities, under
// the engines' default system call filter (seccomp.go). Commands enter the jail's namespaces
// with nsenter. A jail is found from the host by the stamp on bwrap's command line
// (processes.go).

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	hostPath  = "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	stamp     = "GOSANDBOX_SANDBOX" // bwrap --setenv GOSANDBOX_SANDBOX <session>/<id>: how reap finds it
	jailWait  = 10 * time.Second
	chunkSize = 64 * 1024
	markerEnv = "GPU_SANDBOX_EXEC"
)

var shownDirs = []string{"usr", "bin", "sbin", "lib", "lib32", "lib64", "etc", "opt"}

type Jail struct {
	ID, Session string
	Devices     []*Device
	cmd         *exec.Cmd
	stdin       io.WriteCloser
	done        chan struct{} // closed once bwrap has exited
	init        int           // the host pid of the jail's pid 1: commands enter its namespaces
	initStart   string
	holder      Holder
	user        *SandboxUser // the jail's uid, held until its pid 1 is gone
	drop        []string
	env         [][2]string
}

// spawner forks every bwrap from one thread that never exits: bwrap's --die-with-parent
// (PR_SET_PDEATHSIG) fires when the forking thread exits, not the process.
var spawner = make(chan func())

func init() {
	go func() {
		runtime.LockOSThread()
		for fn := range spawner {
			fn()
		}
	}()
}

func onSpawner(fn func()) {
	done := make(chan struct{})
	spawner <- func() { fn(); close(done) }
	<-done
}

func hostTool(name string) string {
	for _, dir := range filepath.SplitList(hostPath) {
		path := filepath.Join(dir, name)
		if st, err := os.Stat(path); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return path
		}
	}
	return ""
}

func (s *Server) startJail(id, session string, devices []*Device, env [][2]string) (j *Jail, err error) {
	var nodes []Node
	for _, d := range devices {
		if d.Vendor == "nvidia" {
			nodes = append(nodes, s.host.Control...)
			break
		}
	}
	for _, d := range devices {
		nodes = append(nodes, d.Nodes...)
	}
	sort.Slice(nodes, func(i, j int) bool {
		a, b := nodes[i], nodes[j]
		if a.Path != b.Path {
			return a.Path < b.Path
		}
		return a.Source < b.Source
	})
	var unique []Node
	for i, n := range nodes {
		if i == 0 || n != nodes[i-1] {
			unique = append(unique, n)
		}
	}
	groupSet := map[string]bool{}
	for _, n := range unique {
		var st syscall.Stat_t
		if err := syscall.Stat(n.Source, &st); err != nil {
			return nil, fmt.Errorf("device node %s: %v", n.Source, err)
		}
		if st.Gid != 0 {
			groupSet[strconv.Itoa(int(st.Gid))] = true
		}
	}
	var groups []string
	for g := range groupSet {
		groups = append(groups, g)
	}
	sort.Strings(groups)
	groupArg := "--clear-groups"
	if len(groups) > 0 {
		groupArg = "--groups=" + strings.Join(groups, ",")
	}
	// A uid of the jail's own: the kernel keeps keyrings and process limits per uid.
	user, err := claimUser()
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			user.Release()
		}
	}()
	drop := []string{"setpriv", fmt.Sprintf("--reuid=%d", user.UID), fmt.Sprintf("--regid=%d", user.UID),
		"--no-new-privs", groupArg, "--inh-caps=-all", "--bounding-set=-all", "--"}
	argv := []string{"--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net",
		"--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
		"--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", // for setpriv, which drops all
		"--setenv", stamp, session + "/" + id, "--chdir", "/tmp"}
	for _, name := range shownDirs { // /bin -> usr/bin binds /usr/bin there: the same files
		argv = append(argv, "--ro-bind-try", "/"+name, "/"+name)
	}
	argv = append(argv, "--dev", "/dev", "--proc", "/proc")
	for _, place := range []string{"/tmp", "/var/tmp", "/run", "/dev/shm"} {
		argv = append(argv, "--perms", "1777", "--tmpfs", place)
	}
	for _, m := range s.host.ToolMounts() {
		argv = append(argv, "--ro-bind", m[0], m[1])
	}
	parents := map[string]bool{}
	for _, n := range unique {
		if dir := filepath.Dir(n.Path); dir != "/dev" {
			parents[dir] = true
		}
	}
	var dirs []string
	for d := range parents {
		dirs = append(dirs, d)
	}
	sort.Strings(dirs)
	for _, d := range dirs { // else bwrap makes them root's alone
		argv = append(argv, "--perms", "0755", "--dir", d)
	}
	for _, n := range unique {
		argv = append(argv, "--dev-bind", n.Source, n.Path)
	}
	// bwrap loads the system call filter, read from fd 3, last, just before the init runs.
	// The init says "up" once the jail is built, then waits for EOF on its stdin: close
	// gives it; so does this process's death.
	argv = append(append(argv, "--seccomp", "3"), drop...)
	argv = append(argv, "sh", "-c", "echo up; exec cat")
	filter, err := filterFile()
	if err != nil {
		return nil, err
	}
	defer filter.Close()
	cmd := exec.Command(hostTool("bwrap"), argv...)
	cmd.Env = []string{"PATH=" + hostPath}
	cmd.ExtraFiles = []*os.File{filter}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	onSpawner(func() { err = cmd.Start() })
	if err != nil {
		return nil, fmt.Errorf("cannot run bwrap: %v", err)
	}
	filter.Close()
	j = &Jail{ID: id, Session: session, Devices: devices, cmd: cmd, stdin: stdin,
		done: make(chan struct{}), user: user, drop: drop}
	up := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		up <- line
	}()
	var line string
	select {
	case line = <-up:
	case <-time.After(jailWait):
	}
	if line != "up\n" {
		cmd.Process.Kill()
		cmd.Wait()
		return nil, fmt.Errorf("jail did not start: %s", strings.TrimSpace(stderr.String()))
	}
	go func() { cmd.Wait(); close(j.done) }()
	// The jail's pid 1, a fork of bwrap, holds the leases: the kernel ends it last.
	for pid, sid := range jails(session) {
		if sid == id && pid != cmd.Process.Pid {
			j.init = pid
		}
	}
	if j.init != 0 {
		j.holder, err = processHolder(j.init)
	}
	if j.init == 0 || err != nil {
		cmd.Process.Kill()
		<-j.done
		return nil, fmt.Errorf("jail died as it started (pid 1 not found: %v)", err)
	}
	j.initStart = strings.Split(j.holder.Ref, ":")[2]
	path := append(append([]string{}, s.host.ToolPath()...), hostPath)
	j.env = mergeEnv([][2]string{{"PATH", strings.Join(path, ":")}, {"HOME", "/tmp"}, {"LANG", "C.UTF-8"}}, env)
	return j, nil
}

// mergeEnv: base with more over it, in order.
func mergeEnv(base, more [][2]string) [][2]string {
	out := append([][2]string{}, base...)
	for _, kv := range more {
		replaced := false
		for i := range out {
			if out[i][0] == kv[0] {
				out[i][1], replaced = kv[1], true
			}
		}
		if !replaced {
			out = append(out, kv)
		}
	}
	return out
}

func (j *Jail) exited() bool {
	select {
	case <-j.done:
		return true
	default:
		return false
	}
}

// Running: bwrap not yet reaped and its pid 1 alive with its namespaces; an exiting pid 1
// drops them (nsenter then fails to enter) before it is a zombie.
func (j *Jail) Running() bool {
	if j.exited() || !processRunning(j.init, j.initStart) {
		return false
	}
	_, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/pid", j.init))
	return err == nil
}

// Close ends the jail: EOF to its init, then (past jailWait) SIGKILL; it returns once pid 1
// is gone, bwrap may exit before it.
func (j *Jail) Close() error {
	j.stdin.Close()
	select {
	case <-j.done:
	case <-time.After(jailWait):
		j.cmd.Process.Kill()
		<-j.done
	}
	deadline := time.Now().Add(jailWait)
	for processRunning(j.init, j.initStart) {
		if time.Now().After(deadline) {
			return fmt.Errorf("pid 1 of jail %s (host pid %d) did not exit", j.ID, j.init)
		}
		time.Sleep(5 * time.Millisecond)
	}
	j.user.Release() // no process of the jail is left: another jail may have its uid
	return nil
}

// Kill is a crash: SIGKILL to bwrap; --die-with-parent does the rest; nothing released.
func (j *Jail) Kill() { j.cmd.Process.Signal(syscall.SIGKILL) }

// Outcome is how an exec ended.
type Outcome struct {
	Code, Signal int
	TimedOut     bool
	Cancelled    bool
}

// Exec runs argv in the jail, as its user and under the system call filter from nsenter's
// first instruction, with the jail's environment and env over it; output goes to emit as it
// comes. At timeout or cancel, its process group and every process carrying its marker are
// killed.
func (j *Jail) Exec(argv []string, env [][2]string, timeout time.Duration, cancel <-chan struct{},
	started func(int), emit func(stream string, data []byte)) (Outcome, error) {
	full := []string{hostTool("nsenter"), "--target=" + strconv.Itoa(j.init), "--all", "--root", "--wd"}
	full = append(append(full, j.drop...), "env", "-i")
	for _, kv := range mergeEnv(j.env, env) {
		full = append(full, kv[0]+"="+kv[1])
	}
	full = append(full, argv...)
	cmd := exec.Command(selfPath, append([]string{filteredExec}, full...)...) // seccomp.go
	cmd.Env = []string{"PATH=" + hostPath}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	outR, outW, err := os.Pipe()
	if err != nil {
		return Outcome{}, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		outR.Close()
		outW.Close()
		return Outcome{}, err
	}
	cmd.Stdout, cmd.Stderr = outW, errW
	err = cmd.Start()
	outW.Close()
	errW.Close()
	if err != nil {
		outR.Close()
		errR.Close()
		return Outcome{}, fmt.Errorf("cannot run %s in jail %s: %v", shown(argv), j.ID, err)
	}
	started(cmd.Process.Pid)
	var readers sync.WaitGroup
	for _, p := range []struct {
		r    *os.File
		name string
	}{{outR, "stdout"}, {errR, "stderr"}} {
		readers.Add(1)
		go func(r *os.File, name string) {
			defer readers.Done()
			buf := make([]byte, chunkSize)
			for {
				n, err := r.Read(buf)
				if n > 0 {
					emit(name, append([]byte{}, buf[:n]...))
				}
				if err != nil {
					return
				}
			}
		}(p.r, p.name)
	}
	finished := make(chan error, 1)
	go func() {
		readers.Wait()
		finished <- cmd.Wait()
	}()
	var outcome Outcome
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-finished:
		outR.Close()
		errR.Close()
		status := cmd.ProcessState.Sys().(syscall.WaitStatus)
		if status.Signaled() {
			outcome.Signal = int(status.Signal())
		} else {
			outcome.Code = status.ExitStatus()
		}
		return outcome, nil
	case <-timer.C:
		outcome.TimedOut = true
	case <-cancel:
		outcome.Cancelled = true
	}
	syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	killMarked(markerEnv + "=" + envValue(env, markerEnv))
	select {
	case <-finished:
	case <-time.After(2 * time.Second): // something that escaped holds a pipe: let go of it
		outR.Close()
		errR.Close()
		<-finished
	}
	outR.Close()
	errR.Close()
	return outcome, nil
}

func envValue(env [][2]string, key string) string {
	for _, kv := range env {
		if kv[0] == key {
			return kv[1]
		}
	}
	return "-"
}
