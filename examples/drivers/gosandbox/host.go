package main

// The host's GPUs: a simulated host's, read from what it publishes under its root
// (share/inventory.tsv, share/mig.tsv, share/dri.tsv, share/control-nodes.tsv, cdi/kind;
// docs/simulated-host.md), or a real host's whole NVIDIA GPUs, from nvidia-smi.

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"
)

const (
	sandboxShare = "/run/gpu-sim" // where a simulated host's share/ appears inside
	capsMajor    = 122
	kfdMajor     = 123
)

// Node is a device node: Path inside the sandbox, Source on the host.
type Node struct {
	Path, Source string
	Major, Minor uint32
}

// Device is one thing a sandbox can be given: a GPU, a MIG instance, an AMD or Intel GPU.
type Device struct {
	Index      int // the host's index in PCI order (a MIG instance's is its GPU's)
	UUID       string
	Name       string
	PCI        string // 0000:18:00.0
	Vendor     string
	Minor      int
	Nodes      []Node
	CDIKind    string
	ParentUUID string // a MIG instance's GPU
	MigIndex   int
	Profile    string
	MigEnabled bool // a GPU in MIG mode: counts take its instances, not it
}

func (d *Device) IsMIG() bool { return d.ParentUUID != "" }

func (d *Device) Describe() string {
	switch {
	case d.IsMIG():
		return fmt.Sprintf("MIG %s device %d of GPU %d (%s)", d.Profile, d.MigIndex, d.Index, d.UUID)
	case d.Vendor != "nvidia":
		return fmt.Sprintf("%s GPU %d (%s, %s)", d.Vendor, d.Index, d.UUID, d.PCI)
	}
	return fmt.Sprintf("GPU %d (%s, %s)", d.Index, d.UUID, d.PCI)
}

// IDs are the exact IDs that name the device (idForms index, uuid, cdi, pci).
func (d *Device) IDs() []string {
	if d.Vendor != "nvidia" {
		return []string{d.PCI, d.UUID}
	}
	if d.IsMIG() {
		index := fmt.Sprintf("%d:%d", d.Index, d.MigIndex)
		return []string{d.UUID, d.CDIKind + "=" + index, d.CDIKind + "=" + d.UUID}
	}
	index := strconv.Itoa(d.Index)
	return []string{index, d.UUID, d.CDIKind + "=" + index, d.CDIKind + "=" + d.UUID, d.PCI}
}

// Host is what hello says: its devices, control nodes, tools and lease registry.
type Host struct {
	SimRoot    string
	GPUs       []*Device // NVIDIA's, whole (in MIG mode too)
	MIGs       []*Device
	DRI        []*Device
	Control    []Node
	ShareLimit int
	Leases     *Registry
}

func (h *Host) Devices() []*Device {
	all := append(append(append([]*Device{}, h.GPUs...), h.MIGs...), h.DRI...)
	return all
}

// DefaultDevices: what default and count requests choose among, with no vendor or profile.
func (h *Host) DefaultDevices() []*Device {
	var whole []*Device
	for _, g := range h.GPUs {
		if !g.MigEnabled {
			whole = append(whole, g)
		}
	}
	if len(whole) > 0 || len(h.DRI) == 0 {
		return whole
	}
	for _, vendor := range []string{"amd", "intel"} {
		if pool := h.Pool(vendor, ""); len(pool) > 0 {
			return pool
		}
	}
	return nil
}

// Pool: what a count of this vendor or MIG profile chooses among.
func (h *Host) Pool(vendor, profile string) []*Device {
	var out []*Device
	switch {
	case profile != "":
		for _, m := range h.MIGs {
			if m.Profile == profile {
				out = append(out, m)
			}
		}
	case vendor == "":
		return h.DefaultDevices()
	case vendor == "nvidia":
		for _, g := range h.GPUs {
			if !g.MigEnabled {
				out = append(out, g)
			}
		}
	default:
		for _, g := range h.DRI {
			if g.Vendor == vendor {
				out = append(out, g)
			}
		}
	}
	return out
}

// ToolMounts: (host, sandbox) read-only binds of a simulated host's GPU tools.
func (h *Host) ToolMounts() [][2]string {
	if h.SimRoot == "" {
		return nil
	}
	return [][2]string{{filepath.Join(h.SimRoot, "share"), sandboxShare}}
}

func (h *Host) ToolPath() []string {
	if h.SimRoot == "" {
		return nil
	}
	return []string{sandboxShare + "/bin"}
}

var busID = regexp.MustCompile(`^(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$`)

// normalizePCI: the sysfs form 0000:18:00.0 of a PCI address; "" if it is none.
func normalizePCI(s string) string {
	m := busID.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return ""
	}
	domain := int64(0)
	if m[1] != "" {
		domain, _ = strconv.ParseInt(m[1], 16, 64)
	}
	return fmt.Sprintf("%04x:%s:%s.%s", domain, strings.ToLower(m[2]), strings.ToLower(m[3]), m[4])
}

func rows(path string) ([][]string, error) {
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out [][]string
	scan := bufio.NewScanner(f)
	for scan.Scan() {
		line := scan.Text()
		if line != "" && !strings.HasPrefix(line, "#") {
			out = append(out, strings.Split(line, "\t"))
		}
	}
	return out, scan.Err()
}

func atoi(s string) int {
	n, err := strconv.Atoi(strings.TrimSpace(s))
	if err != nil {
		panic(fmt.Sprintf("not a number in the host's inventory: %q", s))
	}
	return n
}

func simNode(root, name string, major, minor int) Node {
	return Node{"/dev/" + name, filepath.Join(root, "dev", name), uint32(major), uint32(minor)}
}

// loadSimulated reads the simulated host under root as gpuhost.simulated.load does.
func loadSimulated(root string) (h *Host, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%v", r)
		}
	}()
	if _, err := os.Stat(filepath.Join(root, "simulated-gpu-host")); err != nil {
		return nil, fmt.Errorf("%s is not a simulated GPU host: %v", root, err)
	}
	kindText, err := os.ReadFile(filepath.Join(root, "cdi", "kind"))
	if err != nil {
		return nil, err
	}
	kind := strings.TrimSpace(string(kindText))
	share := filepath.Join(root, "share")
	migRows, err := rows(filepath.Join(share, "mig.tsv"))
	if err != nil {
		return nil, err
	}
	inMig := map[int]bool{}
	for _, r := range migRows {
		inMig[atoi(r[0])] = true
	}
	inventory, err := rows(filepath.Join(share, "inventory.tsv"))
	if err != nil {
		return nil, err
	}
	h = &Host{SimRoot: root}
	for _, r := range inventory {
		minor := atoi(r[0])
		pci := normalizePCI(r[3])
		if pci == "" {
			return nil, fmt.Errorf("not a PCI address in %s/inventory.tsv: %q", share, r[3])
		}
		h.GPUs = append(h.GPUs, &Device{
			UUID: r[1], Name: r[2], PCI: pci, Vendor: "nvidia", Minor: minor, CDIKind: kind,
			Nodes:      []Node{simNode(root, fmt.Sprintf("nvidia%d", minor), 120, minor)},
			MigEnabled: inMig[minor],
		})
	}
	sort.SliceStable(h.GPUs, func(i, j int) bool { return h.GPUs[i].PCI < h.GPUs[j].PCI })
	byMinor := map[int]*Device{}
	for i, g := range h.GPUs {
		g.Index = i
		byMinor[g.Minor] = g
	}
	for _, r := range migRows {
		parent := byMinor[atoi(r[0])]
		if parent == nil {
			return nil, fmt.Errorf("a MIG instance of no GPU in %s/mig.tsv: %v", share, r)
		}
		mig := *parent
		mig.UUID, mig.Profile, mig.ParentUUID = r[5], r[4], parent.UUID
		mig.Name = parent.Name + " MIG " + r[4]
		mig.MigIndex, mig.MigEnabled = atoi(r[1]), false
		mig.Nodes = append(append([]Node{}, parent.Nodes...),
			simNode(root, "nvidia-caps/nvidia-cap"+r[6], capsMajor, atoi(r[6])),
			simNode(root, "nvidia-caps/nvidia-cap"+r[7], capsMajor, atoi(r[7])))
		h.MIGs = append(h.MIGs, &mig)
	}
	sort.SliceStable(h.MIGs, func(i, j int) bool {
		a, b := h.MIGs[i], h.MIGs[j]
		return a.Index < b.Index || (a.Index == b.Index && a.MigIndex < b.MigIndex)
	})
	dri, err := rows(filepath.Join(share, "dri.tsv"))
	if err != nil {
		return nil, err
	}
	sort.Slice(dri, func(i, j int) bool { return strings.Join(dri[i], "\t") < strings.Join(dri[j], "\t") })
	numbered := map[string]int{}
	for _, r := range dri {
		bus, vendor := r[0], r[1]
		card, render := atoi(r[3]), atoi(r[4])
		nodes := []Node{
			simNode(root, fmt.Sprintf("dri/card%d", card), 124, card),
			simNode(root, fmt.Sprintf("dri/renderD%d", render), 124, render),
		}
		if vendor == "amd" {
			nodes = append(nodes, simNode(root, "kfd", kfdMajor, 0))
		}
		h.DRI = append(h.DRI, &Device{
			Index: numbered[vendor], UUID: "PCI-" + bus, Name: r[2], PCI: bus, Vendor: vendor,
			Nodes: nodes, Minor: -1,
		})
		numbered[vendor]++
	}
	control, err := rows(filepath.Join(share, "control-nodes.tsv"))
	if err != nil {
		return nil, err
	}
	for _, r := range control {
		h.Control = append(h.Control, simNode(root, r[0], atoi(r[1]), atoi(r[2])))
	}
	return h, checkTrusted(h)
}

// checkTrusted refuses a host whose nodes are not the character devices they say (a link,
// a disk under a GPU's name), nor owned by root or us: they are handed to sandboxes.
func checkTrusted(h *Host) error {
	for _, d := range h.Devices() {
		for _, n := range append(append([]Node{}, d.Nodes...), h.Control...) {
			var st syscall.Stat_t
			if err := syscall.Lstat(n.Source, &st); err != nil {
				if os.IsNotExist(err) {
					continue
				}
				return err
			}
			major, minor := uint32((st.Rdev>>8)&0xfff), uint32((st.Rdev&0xff)|((st.Rdev>>12)&0xfff00))
			if st.Mode&syscall.S_IFMT != syscall.S_IFCHR || major != n.Major || minor != n.Minor ||
				(st.Uid != 0 && int(st.Uid) != os.Geteuid()) {
				return fmt.Errorf("refusing the simulated host %s: %s is not the character device "+
					"%d:%d of root's it must be", h.SimRoot, n.Source, n.Major, n.Minor)
			}
		}
	}
	return nil
}

// loadReal: a real host's whole NVIDIA GPUs, by nvidia-smi, each by its /dev/nvidia<minor>.
func loadReal() (*Host, error) {
	h := &Host{}
	for _, name := range []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"} {
		var st syscall.Stat_t
		path := "/dev/" + name
		if syscall.Stat(path, &st) == nil && st.Mode&syscall.S_IFMT == syscall.S_IFCHR {
			major, minor := uint32((st.Rdev>>8)&0xfff), uint32((st.Rdev&0xff)|((st.Rdev>>12)&0xfff00))
			h.Control = append(h.Control, Node{path, path, major, minor})
		}
	}
	smi, err := exec.LookPath("nvidia-smi")
	if err != nil {
		return h, nil // no GPU here
	}
	out, err := exec.Command(smi, "--query-gpu=uuid,name,pci.bus_id", "--format=csv,noheader").Output()
	if err != nil {
		return nil, fmt.Errorf("nvidia-smi --query-gpu: %v", err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		fields := strings.Split(line, ", ")
		if len(fields) != 3 {
			continue
		}
		pci := normalizePCI(fields[2])
		info, err := os.ReadFile("/proc/driver/nvidia/gpus/" + pci + "/information")
		if err != nil {
			return nil, err
		}
		m := regexp.MustCompile(`(?m)^Device Minor:\s*(\d+)`).FindSubmatch(info)
		if m == nil {
			return nil, fmt.Errorf("no device minor for GPU %s", pci)
		}
		minor := atoi(string(m[1]))
		path := fmt.Sprintf("/dev/nvidia%d", minor)
		h.GPUs = append(h.GPUs, &Device{
			UUID: fields[0], Name: fields[1], PCI: pci, Vendor: "nvidia", Minor: minor,
			CDIKind: "nvidia.com/gpu", Nodes: []Node{{path, path, 195, uint32(minor)}},
		})
	}
	sort.SliceStable(h.GPUs, func(i, j int) bool { return h.GPUs[i].PCI < h.GPUs[j].PCI })
	for i, g := range h.GPUs {
		g.Index = i
	}
	return h, nil
}
