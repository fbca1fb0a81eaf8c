// Command gosandbox is a GPU sandbox driver of the jsonl protocol
// (docs/external-protocol.md), in Go with its standard library only: bubblewrap jails
// (jail.go), each run as a host uid of its own (uids.go) under the engines' system call
// filter (seccomp.go), given GPUs through the host-wide lease registry (leases.go, version 4
// of docs/lease-protocol.md), the request judged as the request model says (request.go).
//
// It is one long-lived process: one request per line on stdin, one reply or event per
// line on stdout, each request handled in a goroutine of its own. Its jails die with it
// (bwrap --die-with-parent, and EOF on their init's stdin): a crash leaves no sandbox
// running, and their leases come back.
package main

import (
	"bufio"
	"crypto/rand"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"time"
)

const (
	driverName = "gosandbox" // the manifest's name: its driver_config block, its leases
	version    = "1.0"
	protocol   = 1
)

var capabilities = map[string]any{
	"maxGpusPerSandbox": "all", "exactIds": true, "idForms": []string{"index", "uuid", "cdi", "pci"},
	"exclusive": true, "shared": true, "mig": true, "vendors": []string{"nvidia", "amd", "intel"},
}

// ProtoError is an error answered as the protocol's (unavailable, timeout, cancelled, ...).
type ProtoError struct{ Type, Message string }

func (e *ProtoError) Error() string { return e.Message }

type Server struct {
	host      *Host
	out       sync.Mutex
	w         *bufio.Writer
	mu        sync.Mutex
	jails     map[string]*Jail
	cancels   map[int64]chan struct{} // requests in flight that a cancel may stop
	cancelled map[int64]bool
}

func (s *Server) send(message map[string]any) {
	line, err := json.Marshal(message)
	if err != nil {
		line, _ = json.Marshal(map[string]any{"id": message["id"], "op": message["op"],
			"error": map[string]any{"type": "infra", "message": "unencodable reply: " + err.Error()}})
	}
	s.out.Lock()
	defer s.out.Unlock()
	s.w.Write(append(line, '\n'))
	s.w.Flush()
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == filteredExec {
		runFiltered(os.Args[2:]) // a command's nsenter, under the filter (seccomp.go)
	}
	s := &Server{w: bufio.NewWriter(os.Stdout), jails: map[string]*Jail{},
		cancels: map[int64]chan struct{}{}, cancelled: map[int64]bool{}}
	in := bufio.NewReaderSize(os.Stdin, 1<<20)
	for {
		line, err := in.ReadBytes('\n')
		if len(strings.TrimSpace(string(line))) > 0 {
			value, derr := decodeLine(line)
			request, ok := value.(*Obj)
			if derr != nil || !ok {
				fmt.Fprintf(os.Stderr, "gosandbox: not a request: %q (%v)\n", line, derr)
				os.Exit(2)
			}
			if op, _ := request.M["op"].(string); op == "hello" {
				s.handle(request) // alone, first: the host it names is every other's
			} else {
				go s.handle(request)
			}
		}
		if err == io.EOF {
			os.Exit(0) // the adapter is gone: so are our jails (--die-with-parent)
		} else if err != nil {
			fmt.Fprintf(os.Stderr, "gosandbox: reading requests: %v\n", err)
			os.Exit(2)
		}
	}
}

func (s *Server) handle(request *Obj) {
	id, _ := request.M["id"].(json.Number)
	op, _ := request.M["op"].(string)
	number, _ := id.Int64()
	var result map[string]any
	var err error
	switch op {
	case "hello":
		result, err = s.hello(request)
	case "create":
		result, err = s.create(number, request)
	case "exec":
		result, err = s.exec(number, request)
	case "cancel":
		result, err = s.cancel(request)
	case "close":
		result, err = s.close(request)
	case "list":
		result, err = s.list(request)
	case "reap":
		result, err = s.reap(request)
	case "shutdown":
		result, err = s.shutdown()
	default:
		err = &ReqError{Type: "unsupported", Field: "op", Value: op, Message: fmt.Sprintf("no operation %q", op)}
	}
	if err == nil {
		s.send(map[string]any{"id": id, "op": op, "result": result})
		if op == "shutdown" {
			os.Exit(0)
		}
		return
	}
	s.send(map[string]any{"id": id, "op": op, "error": errorOf(err)})
}

// errorOf: the protocol's error object.
func errorOf(err error) map[string]any {
	var req *ReqError
	var refusal *Refusal
	var proto *ProtoError
	switch {
	case errors.As(err, &req):
		e := map[string]any{"type": req.Type, "message": req.Message, "field": req.Field, "value": req.Value}
		if req.Type == "invalid" {
			e["reason"] = req.Reason
		}
		return e
	case errors.As(err, &refusal) && refusal.Busy:
		return map[string]any{"type": "busy", "message": refusal.Message, "device": refusal.Device,
			"holder": refusal.Holder}
	case errors.As(err, &refusal):
		return map[string]any{"type": "exhausted", "message": refusal.Message,
			"requested": refusal.Requested, "available": refusal.Available, "total": refusal.Total}
	case errors.As(err, &proto):
		return map[string]any{"type": proto.Type, "message": proto.Message}
	}
	return map[string]any{"type": "infra", "message": err.Error()}
}

func str(o *Obj, key string) string {
	v, _ := o.M[key].(string)
	return v
}

func (s *Server) hello(request *Obj) (map[string]any, error) {
	host, _ := asObj(request.M["host"])
	var missing []string
	for _, tool := range []string{"bwrap", "nsenter", "setpriv"} {
		if hostTool(tool) == "" {
			missing = append(missing, tool)
		}
	}
	if len(missing) > 0 || os.Geteuid() != 0 {
		return nil, fmt.Errorf("needed root and %s (found uid %d, missing %s)",
			"bwrap, nsenter and setpriv", os.Geteuid(), orNone(missing))
	}
	var err error
	if root := str(host, "sim_root"); root != "" {
		s.host, err = loadSimulated(root)
	} else {
		s.host, err = loadReal()
	}
	if err != nil {
		return nil, err
	}
	s.host.Leases = NewRegistry(str(host, "leases_dir"))
	limit, _ := host.M["share_limit"].(json.Number).Int64()
	s.host.ShareLimit = int(limit)
	out, err := exec.Command(hostTool("bwrap"), "--version").Output()
	if err != nil {
		return nil, fmt.Errorf("bwrap --version: %v", err)
	}
	return map[string]any{"protocol": protocol, "capabilities": capabilities,
		"driver": map[string]any{"name": driverName,
			"version": fmt.Sprintf("%s (%s)", version, strings.TrimSpace(string(out)))}}, nil
}

func newID() string {
	b := make([]byte, 6)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func (s *Server) track(id int64) chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := make(chan struct{})
	s.cancels[id] = c
	if s.cancelled[id] {
		close(c)
	}
	return c
}

func (s *Server) untrack(id int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.cancels, id)
	was := s.cancelled[id]
	delete(s.cancelled, id)
	return was
}

func (s *Server) create(id int64, request *Obj) (map[string]any, error) {
	s.track(id)
	session := str(request, "session_id")
	req, err := s.parseRequest(request.M["request"])
	if err != nil {
		s.untrack(id)
		return nil, err
	}
	sid := newID()
	var devices []*Device
	if plan := req.Plan; plan != nil {
		holder, err := processHolder(os.Getpid()) // ours until the jail runs, then its pid 1's
		if err == nil {
			owner := Owner{driverName, sid, session, holder}
			pool := s.host.Pool(plan.Vendor, plan.Profile)
			devices, err = s.host.Leases.Acquire(pool, owner, plan.Count, plan.Exact, plan.Sharing, s.host.ShareLimit)
		}
		if err != nil {
			s.untrack(id)
			return nil, err
		}
	}
	jail, err := s.startJail(sid, session, devices, req.Env)
	if err == nil && len(devices) > 0 {
		if err = s.host.Leases.SetHolder(sid, jail.holder); err != nil {
			jail.Close()
		}
	}
	if err != nil {
		s.host.Leases.Release(sid, "", "")
		s.untrack(id)
		return nil, err
	}
	s.mu.Lock()
	s.jails[sid] = jail
	s.mu.Unlock()
	if s.untrack(id) {
		s.closeJail(sid)
		return nil, &ProtoError{"cancelled", "cancelled by the adapter"}
	}
	gpus := []string{}
	for _, d := range devices {
		gpus = append(gpus, d.UUID)
	}
	return map[string]any{"sandbox_id": sid, "gpus": gpus}, nil
}

func (s *Server) jail(sid string) *Jail {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.jails[sid]
}

func (s *Server) exec(id int64, request *Obj) (map[string]any, error) {
	cancel := s.track(id)
	defer s.untrack(id)
	sid := str(request, "sandbox_id")
	jail := s.jail(sid)
	if jail == nil || !jail.Running() {
		return nil, &ProtoError{"unavailable", fmt.Sprintf("sandbox %s is not running", sid)}
	}
	var argv []string
	list, _ := request.M["argv"].([]any)
	for _, a := range list {
		text, _ := a.(string)
		argv = append(argv, text)
	}
	var env [][2]string
	if o, ok := asObj(request.M["env"]); ok {
		for _, k := range o.Keys {
			v, _ := o.M[k].(string)
			env = append(env, [2]string{k, v})
		}
	}
	seconds, _ := request.M["timeout"].(json.Number).Float64()
	number := request.M["id"]
	var replied sync.Mutex // no event after the reply
	over := false
	emit := func(stream string, data []byte) {
		replied.Lock()
		defer replied.Unlock()
		if !over {
			s.send(map[string]any{"id": number, "event": "output", "stream": stream,
				"data": base64.StdEncoding.EncodeToString(data)})
		}
	}
	started := func(pid int) { s.send(map[string]any{"id": number, "event": "started", "pid": pid}) }
	outcome, err := jail.Exec(argv, env, time.Duration(seconds*float64(time.Second)), cancel, started, emit)
	replied.Lock()
	over = true
	replied.Unlock()
	switch {
	case err != nil:
		return nil, err
	case outcome.TimedOut:
		return nil, &ProtoError{"timeout", fmt.Sprintf("ran past its timeout of %g s; killed", seconds)}
	case outcome.Cancelled:
		return nil, &ProtoError{"cancelled", "cancelled by the adapter"}
	case outcome.Signal != 0:
		return map[string]any{"signal": outcome.Signal}, nil
	case outcome.Code != 0 && !jail.Running():
		return nil, &ProtoError{"unavailable", fmt.Sprintf("sandbox %s ended while %s ran", sid, shown(argv))}
	}
	return map[string]any{"exit_code": outcome.Code}, nil
}

func (s *Server) cancel(request *Obj) (map[string]any, error) {
	target, _ := request.M["target"].(json.Number).Int64()
	s.mu.Lock()
	defer s.mu.Unlock()
	if c, inFlight := s.cancels[target]; inFlight && !s.cancelled[target] {
		s.cancelled[target] = true
		close(c)
	}
	return map[string]any{}, nil
}

// closeJail ends a jail and releases its leases.
func (s *Server) closeJail(sid string) error {
	s.mu.Lock()
	jail := s.jails[sid]
	delete(s.jails, sid)
	s.mu.Unlock()
	if jail != nil {
		if err := jail.Close(); err != nil {
			return err
		}
	}
	_, err := s.host.Leases.Release(sid, "", "")
	return err
}

func (s *Server) close(request *Obj) (map[string]any, error) {
	sid := str(request, "sandbox_id")
	if kill, _ := request.M["kill"].(bool); kill {
		if jail := s.jail(sid); jail != nil {
			jail.Kill() // as a crash would: its leases come back when its pid 1 is seen dead
		}
		return map[string]any{}, nil
	}
	if s.jail(sid) == nil {
		return map[string]any{}, nil // gone already: closing twice is harmless
	}
	return map[string]any{}, s.closeJail(sid)
}

func (s *Server) list(request *Obj) (map[string]any, error) {
	seen := map[string]bool{}
	ids := []string{}
	for _, sid := range jails(str(request, "session_id")) {
		if !seen[sid] {
			seen[sid] = true
			ids = append(ids, sid)
		}
	}
	sort.Strings(ids)
	return map[string]any{"sandbox_ids": ids}, nil
}

func (s *Server) reap(request *Obj) (map[string]any, error) {
	session := str(request, "session_id")
	found, err := reapJails(session)
	if err != nil {
		return nil, err
	}
	released, err := s.host.Leases.Release("", session, driverName)
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	var gone []*Jail
	for sid, jail := range s.jails {
		if jail.Session == session {
			gone = append(gone, jail)
			delete(s.jails, sid)
		}
	}
	s.mu.Unlock()
	for _, jail := range gone {
		jail.Kill()
		<-jail.done
		jail.user.Release() // reapJails saw its pid 1 gone
	}
	seen := map[string]bool{}
	removed := []string{}
	for _, sid := range found {
		seen[sid] = true
	}
	for _, lease := range released {
		seen[lease.SandboxID] = true
	}
	for sid := range seen {
		removed = append(removed, sid)
	}
	sort.Strings(removed)
	return map[string]any{"removed": removed}, nil
}

func (s *Server) shutdown() (map[string]any, error) {
	s.mu.Lock()
	var sids []string
	for sid := range s.jails {
		sids = append(sids, sid)
	}
	s.mu.Unlock()
	for _, sid := range sids {
		s.closeJail(sid)
	}
	return map[string]any{}, nil
}
