package main

// A client of the host-wide lease protocol, version 4 (docs/lease-protocol.md): flock on
// the registry's directory, this user's leases.<uid>.json rewritten in place, every user's
// file read strictly, process holders judged from /proc, any other kind alive.

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"time"
)

const (
	formatVersion = 4
	maxFileBytes  = 16 << 20
	lockTimeout   = 30 * time.Second
	exclusive     = "exclusive"
	shared        = "shared"
)

var (
	fileName   = regexp.MustCompile(`^leases\.(0|[1-9][0-9]{0,9})\.json$`)
	processRef = regexp.MustCompile(`^[^:]+:[0-9]+:[0-9]+$`)
)

type Holder struct {
	Kind string `json:"kind"`
	Ref  string `json:"ref"`
}

type Lease struct {
	GPUUUID    string      `json:"gpu_uuid"`
	Driver     string      `json:"driver"`
	SandboxID  string      `json:"sandbox_id"`
	SessionID  string      `json:"session_id"`
	Holder     Holder      `json:"holder"`
	Mode       string      `json:"mode"`
	AcquiredAt json.Number `json:"acquired_at"`
	ParentUUID string      `json:"parent_uuid,omitempty"`
	ShareLimit int         `json:"share_limit,omitempty"`
}

func (l *Lease) Describe() string {
	s := ""
	if l.Mode == shared {
		s = " (shared)"
	}
	return fmt.Sprintf("sandbox %s of the %s driver%s, held by %s %s", l.SandboxID, l.Driver, s,
		l.Holder.Kind, l.Holder.Ref)
}

// Owner is who asks: stamped on every lease a grant makes.
type Owner struct {
	Driver, SandboxID, SessionID string
	Holder                       Holder
}

// Refusal is a grant refused: busy (an exact device held) or exhausted.
type Refusal struct {
	Busy                        bool
	Device, Holder              string
	Requested, Available, Total int
	Message                     string
}

func (r *Refusal) Error() string { return r.Message }

// Registry is the lease registry of one host, in Dir.
type Registry struct {
	Dir string
	uid int
	mu  sync.Mutex // flock excludes other processes; this, our own goroutines
}

func NewRegistry(dir string) *Registry { return &Registry{Dir: dir, uid: os.Geteuid()} }

func (r *Registry) mine() string { return fmt.Sprintf("leases.%d.json", r.uid) }

// locked runs fn with the directory locked, this user's leases and (withOthers) every other
// user's; fn returns this user's leases to write back (nil: unchanged). A release or a
// hand-over reads no other user's file: one made unreadable stops grants, never a release.
func (r *Registry) locked(withOthers bool, fn func(mine, others []Lease) ([]Lease, error)) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	dirfd, err := r.openDir()
	if err != nil {
		return err
	}
	defer syscall.Close(dirfd)
	if err := r.flock(dirfd); err != nil {
		return err
	}
	defer syscall.Flock(dirfd, syscall.LOCK_UN)
	fd, err := r.openMine(dirfd)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	mine, err := r.readFd(fd, r.Dir+"/"+r.mine())
	if err != nil {
		return err
	}
	var others []Lease
	if withOthers {
		if others, err = r.readOthers(dirfd); err != nil {
			return err
		}
	}
	changed, err := fn(mine, others)
	if err != nil || changed == nil {
		return err
	}
	return r.store(fd, changed)
}

func (r *Registry) openDir() (int, error) {
	if _, err := os.Lstat(r.Dir); os.IsNotExist(err) {
		if err := os.MkdirAll(r.Dir, 0o755); err == nil {
			os.Chmod(r.Dir, 0o1777|os.ModeSticky) // every user's sandboxes share the GPUs
			syscall.Chmod(r.Dir, 0o1777)
		}
	}
	fd, err := syscall.Open(r.Dir, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("the lease registry %s cannot be opened: %v", r.Dir, err)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		syscall.Close(fd)
		return -1, err
	}
	problem := ""
	if st.Uid != 0 && int(st.Uid) != r.uid {
		problem = fmt.Sprintf("belongs to uid %d", st.Uid)
	} else if st.Mode&0o022 != 0 && st.Mode&syscall.S_ISVTX == 0 {
		problem = fmt.Sprintf("is writable by others (mode %o) but not sticky", st.Mode&0o7777)
	}
	if problem != "" {
		syscall.Close(fd)
		return -1, fmt.Errorf("the lease registry %s %s: refusing to use it", r.Dir, problem)
	}
	return fd, nil
}

func (r *Registry) flock(fd int) error {
	deadline := time.Now().Add(lockTimeout)
	wait := time.Millisecond
	for {
		err := syscall.Flock(fd, syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return nil
		}
		if err != syscall.EWOULDBLOCK && err != syscall.EINTR {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the lease registry %s was locked for over %v", r.Dir, lockTimeout)
		}
		time.Sleep(wait)
		if wait < 50*time.Millisecond {
			wait *= 2
		}
	}
}

// Every lease file is opened with these: never through a link, never waiting on a FIFO,
// never taking a terminal for its own.
const openFlags = syscall.O_NOFOLLOW | syscall.O_NONBLOCK | syscall.O_NOCTTY | syscall.O_CLOEXEC

// at names an entry of the directory dirfd by a path that is that directory, whatever
// is done to the path above it: for lstat and rmdir, which have no *at form in syscall.
func at(dirfd int, name string) string { return fmt.Sprintf("/proc/self/fd/%d/%s", dirfd, name) }

// lstatAt: the entry name of dirfd itself, never what a link names.
func lstatAt(dirfd int, name string) (*syscall.Stat_t, error) {
	var st syscall.Stat_t
	if err := syscall.Lstat(at(dirfd, name), &st); err != nil {
		return nil, err
	}
	return &st, nil
}

// describe: what an entry is, and whose, for a message: "a FIFO of uid 65534".
func describe(st *syscall.Stat_t) string {
	kind := map[uint32]string{syscall.S_IFLNK: "a symbolic link", syscall.S_IFIFO: "a FIFO",
		syscall.S_IFDIR: "a directory", syscall.S_IFSOCK: "a socket", syscall.S_IFCHR: "a device",
		syscall.S_IFBLK: "a device"}[st.Mode&syscall.S_IFMT]
	if kind == "" {
		kind = "a plain file"
	}
	return fmt.Sprintf("%s of uid %d", kind, st.Uid)
}

// openMine opens this user's file, made if need be. What stands under its name and is not
// a plain file of this user's (a file another user made, a FIFO, a directory, a symbolic
// link) was planted: it is removed, never opened, followed or read, and a file of ours
// made in its place (O_CREAT|O_EXCL). Refused, naming it, where it cannot be removed.
func (r *Registry) openMine(dirfd int) (int, error) {
	name := r.mine()
	path := r.Dir + "/" + name
	for try := 0; try < 3; try++ {
		st, err := lstatAt(dirfd, name)
		if err == syscall.ENOENT {
			fd, err := syscall.Openat(dirfd, name, syscall.O_RDWR|syscall.O_CREAT|syscall.O_EXCL|openFlags, 0o644)
			if err == syscall.EEXIST {
				continue // made again meanwhile: look again
			}
			if err != nil {
				return -1, fmt.Errorf("the lease file %s cannot be made: %v", path, err)
			}
			syscall.Fchmod(fd, 0o644) // whatever the umask: every user's client reads it
			return fd, nil
		}
		if err != nil {
			return -1, fmt.Errorf("the lease file %s cannot be examined: %v", path, err)
		}
		if st.Mode&syscall.S_IFMT == syscall.S_IFREG && int(st.Uid) == r.uid {
			return openChecked(dirfd, path, name, st)
		}
		if st.Mode&syscall.S_IFMT == syscall.S_IFDIR {
			err = syscall.Rmdir(at(dirfd, name)) // only when empty
		} else {
			err = syscall.Unlinkat(dirfd, name)
		}
		if err != nil && err != syscall.ENOENT {
			return -1, fmt.Errorf("%s is %s, not a lease file of its user %d, and cannot be "+
				"removed (%v): ask root to remove it", path, describe(st), r.uid, err)
		}
	}
	return -1, fmt.Errorf("%s was made again each time it was removed: refusing to use it", path)
}

// openChecked opens the file of ours st describes (no other user can replace it: the
// directory is sticky); refused when it is not that file any more, or has a second name.
func openChecked(dirfd int, path, name string, st *syscall.Stat_t) (int, error) {
	fd, err := syscall.Openat(dirfd, name, syscall.O_RDWR|openFlags, 0)
	if err != nil {
		return -1, fmt.Errorf("the lease file %s cannot be opened: %v", path, err)
	}
	var opened syscall.Stat_t
	syscall.Fstat(fd, &opened)
	problem := error(nil)
	if opened.Dev != st.Dev || opened.Ino != st.Ino {
		problem = fmt.Errorf("%s was replaced while it was opened: refusing to use it", path)
	} else if opened.Nlink != 1 {
		problem = fmt.Errorf("the lease file %s has %d names (another was linked to it): refusing "+
			"to write it; remove it", path, opened.Nlink)
	} else if opened.Mode&0o022 != 0 {
		syscall.Fchmod(fd, 0o644) // ours: only we may write it
		syscall.Fstat(fd, &opened)
	}
	if problem == nil {
		problem = checkFile(path, &opened, int(st.Uid))
	}
	if problem != nil {
		syscall.Close(fd)
		return -1, problem
	}
	return fd, nil
}

func checkFile(path string, st *syscall.Stat_t, owner int) error {
	problem := ""
	switch {
	case st.Mode&syscall.S_IFMT != syscall.S_IFREG:
		problem = fmt.Sprintf("is not a plain file (%s)", describe(st))
	case owner >= 0 && int(st.Uid) != owner:
		problem = fmt.Sprintf("belongs to uid %d, not %d", st.Uid, owner)
	case owner >= 0 && st.Mode&0o022 != 0:
		problem = fmt.Sprintf("is writable by others (mode %o)", st.Mode&0o7777)
	case st.Size > maxFileBytes:
		problem = fmt.Sprintf("holds %d bytes, over %d", st.Size, maxFileBytes)
	}
	if problem != "" {
		return fmt.Errorf("the lease file %s %s: refusing to read it", path, problem)
	}
	return nil
}

func (r *Registry) readFd(fd int, path string) ([]Lease, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		return nil, err
	}
	data := make([]byte, st.Size)
	n, err := syscall.Pread(fd, data, 0)
	if err != nil {
		return nil, err
	}
	return readLeases(path, data[:n], st.Mtim.Sec)
}

// readOthers: every other user's live-or-not leases, by the uid each file's name gives; a
// file of versions 1 to 3 (leases.json) refuses every grant while it holds a lease. Each
// file is read through one descriptor: opened without following a link or waiting on a
// FIFO, judged by fstat on it, then read from it. Whatever another user made under a
// user's name is no lease file: skipped, whatever it is.
func (r *Registry) readOthers(dirfd int) ([]Lease, error) {
	dir, err := os.Open(at(dirfd, "."))
	if err != nil {
		return nil, err
	}
	names, err := dir.Readdirnames(-1)
	dir.Close()
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	var found []Lease
	for _, name := range names {
		owner := -1
		if m := fileName.FindStringSubmatch(name); m != nil {
			owner, _ = strconv.Atoi(m[1])
			if owner == r.uid {
				continue
			}
		} else if name != "leases.json" {
			continue
		}
		path := r.Dir + "/" + name
		fd, err := syscall.Openat(dirfd, name, syscall.O_RDONLY|openFlags, 0)
		if err == syscall.ENOENT {
			continue
		}
		if err != nil {
			// A link is never followed: whose is it?
			if st, lerr := lstatAt(dirfd, name); lerr == nil && owner >= 0 && int(st.Uid) != owner {
				continue
			}
			return nil, fmt.Errorf("the lease file %s cannot be opened: %v", path, err)
		}
		var st syscall.Stat_t
		syscall.Fstat(fd, &st)
		if owner >= 0 && int(st.Uid) != owner {
			syscall.Close(fd) // forged under another user's name: none of it was granted
			continue
		}
		if err := checkFile(path, &st, owner); err != nil {
			syscall.Close(fd)
			return nil, err
		}
		leases, err := r.readFd(fd, path)
		syscall.Close(fd)
		if err != nil {
			return nil, err
		}
		if owner < 0 && len(leases) > 0 {
			return nil, fmt.Errorf("%s holds leases of a client of protocol version 3 or older, "+
				"which cannot share a host with this one: stop it, then delete the file", path)
		}
		found = append(found, leases...)
	}
	return found, nil
}

func (r *Registry) store(fd int, leases []Lease) error {
	if leases == nil {
		leases = []Lease{}
	}
	data, err := json.Marshal(map[string]any{"version": formatVersion, "boot_id": bootID(), "leases": leases})
	if err != nil {
		return err
	}
	for written := 0; written < len(data); {
		n, err := syscall.Pwrite(fd, data[written:], int64(written))
		if err != nil {
			return err
		}
		written += n
	}
	return syscall.Ftruncate(fd, int64(len(data)))
}

// Acquire grants exact devices, or count of inventory, atomically. The leases as they stand
// are tried first; only a refusal drops the leases of dead process holders and tries again
// (holders of other kinds cannot be judged here: they live).
func (r *Registry) Acquire(inventory []*Device, owner Owner, count int, exact []*Device, mode string, limit int) ([]*Device, error) {
	var granted []*Device
	var refused error
	try := func(mine, others []Lease, reclaim bool) ([]Lease, error) {
		live := mine
		if reclaim {
			live, others = liveOnly(mine), liveOnly(others)
		}
		g, err := grant(append(append([]Lease{}, live...), others...), inventory, count, exact, mode, limit)
		if err != nil {
			refused = err
			if len(live) != len(mine) {
				return live, nil // the dead dropped from our file all the same
			}
			return nil, nil
		}
		granted = g
		return append(live, newLeases(g, owner, mode, limit)...), nil
	}
	if err := r.locked(true, func(m, o []Lease) ([]Lease, error) { return try(m, o, false) }); err != nil {
		return nil, err
	}
	if granted != nil {
		return granted, nil
	}
	if err := r.locked(true, func(m, o []Lease) ([]Lease, error) { return try(m, o, true) }); err != nil {
		return nil, err
	}
	if granted != nil {
		return granted, nil
	}
	return nil, refused
}

func liveOnly(leases []Lease) []Lease {
	var out []Lease
	judged := map[Holder]bool{}
	for _, l := range leases {
		alive, ok := judged[l.Holder]
		if !ok {
			alive = holderAlive(l.Holder)
			judged[l.Holder] = alive
		}
		if alive {
			out = append(out, l)
		}
	}
	return out
}

func newLeases(granted []*Device, owner Owner, mode string, limit int) []Lease {
	now := strconv.FormatFloat(float64(time.Now().UnixNano())/1e9, 'f', -1, 64)
	var out []Lease
	for _, d := range granted {
		l := Lease{GPUUUID: d.UUID, Driver: owner.Driver, SandboxID: owner.SandboxID,
			SessionID: owner.SessionID, Holder: owner.Holder, Mode: mode,
			AcquiredAt: json.Number(now), ParentUUID: d.ParentUUID}
		if mode == shared {
			l.ShareLimit = limit
		}
		out = append(out, l)
	}
	return out
}

// SetHolder hands a sandbox's leases to what now embodies it.
func (r *Registry) SetHolder(sandboxID string, h Holder) error {
	return r.locked(false, func(mine, _ []Lease) ([]Lease, error) {
		out := append([]Lease{}, mine...)
		for i := range out {
			if out[i].SandboxID == sandboxID {
				out[i].Holder = h
			}
		}
		return out, nil
	})
}

// Release drops this user's leases of a sandbox, or of a session and driver (sandbox "").
func (r *Registry) Release(sandboxID, sessionID, driver string) ([]Lease, error) {
	var gone []Lease
	err := r.locked(false, func(mine, _ []Lease) ([]Lease, error) {
		kept := []Lease{}
		for _, l := range mine {
			if (sandboxID != "" && l.SandboxID == sandboxID) ||
				(sandboxID == "" && l.SessionID == sessionID && l.Driver == driver) {
				gone = append(gone, l)
			} else {
				kept = append(kept, l)
			}
		}
		if len(gone) == 0 {
			return nil, nil
		}
		return kept, nil
	})
	return gone, err
}
