package main

// A lease file read strictly (docs/lease-file.schema.json): what is outside the schema is
// no lease list; a file of another boot, or one cut short before this boot, holds nothing.

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"unicode/utf8"
)

// readLeases: the leases of this boot in a file, read by the schema and nothing looser.
func readLeases(path string, data []byte, mtime int64) ([]Lease, error) {
	if len(data) == 0 {
		return nil, nil
	}
	leases, boot, newer, err := parseFile(data)
	if err != nil {
		if float64(mtime) < bootTime() && !newer {
			return nil, nil // cut short before this boot: nothing of it lives
		}
		return nil, fmt.Errorf("the GPU lease file %s cannot be read (%v); no GPU can be granted "+
			"safely until it is fixed: stop every sandbox of its user on this host, then delete it", path, err)
	}
	if boot != "" && boot != bootID() {
		return nil, nil // every lease of an earlier boot is dead
	}
	return leases, nil
}

func parseFile(data []byte) (leases []Lease, boot string, newer bool, err error) {
	if !utf8.Valid(data) {
		return nil, "", false, errors.New("not UTF-8")
	}
	value, err := decodeFirst(data)
	if err != nil {
		return nil, "", false, err
	}
	doc, ok := value.(*Obj)
	if !ok {
		return nil, "", false, errors.New("not an object")
	}
	if err := onlyKeys("", doc, "version", "boot_id", "leases"); err != nil {
		return nil, "", false, err
	}
	version, ok := integral(doc.M["version"])
	if ok && version.Cmp(bigInt(formatVersion)) > 0 {
		return nil, "", true, fmt.Errorf("version: version %s, written by a newer client; this one "+
			"reads versions 1 to %d: upgrade it", version, formatVersion)
	}
	if !ok || version.Cmp(bigInt(1)) < 0 {
		return nil, "", false, fmt.Errorf("version: %s is not one of (1, 2, 3, 4)", shown(doc.M["version"]))
	}
	if b, present := doc.M["boot_id"]; present || version.Int64() >= 2 {
		s, ok := b.(string)
		if !ok || s == "" {
			return nil, "", false, fmt.Errorf("boot_id: %s is not a non-empty string", shown(b))
		}
		boot = s
	}
	list, ok := doc.M["leases"].([]any)
	if !ok {
		return nil, "", false, errors.New("leases: not an array")
	}
	for i, item := range list {
		lease, err := parseLease(item)
		if err != nil {
			return nil, "", false, fmt.Errorf("leases[%d]%s", i, err)
		}
		leases = append(leases, lease)
	}
	return leases, boot, false, nil
}

func parseLease(item any) (Lease, error) {
	var l Lease
	o, ok := item.(*Obj)
	if !ok {
		return l, errors.New(": not an object")
	}
	if err := onlyKeys("", o, "gpu_uuid", "driver", "sandbox_id", "session_id", "holder", "mode",
		"acquired_at", "parent_uuid", "share_limit"); err != nil {
		return l, err
	}
	str := func(key string, empty bool) (string, error) {
		s, ok := o.M[key].(string)
		if !ok || (!empty && s == "") {
			return "", fmt.Errorf(".%s: %s is not a string (non-empty)", key, shown(o.M[key]))
		}
		return s, nil
	}
	for _, key := range []string{"gpu_uuid", "driver", "sandbox_id", "session_id", "holder", "mode", "acquired_at"} {
		if _, ok := o.M[key]; !ok {
			return l, fmt.Errorf(": no '%s'", key)
		}
	}
	var err error
	if l.GPUUUID, err = str("gpu_uuid", false); err != nil {
		return l, err
	}
	if l.Driver, err = str("driver", false); err != nil {
		return l, err
	}
	if l.SandboxID, err = str("sandbox_id", false); err != nil {
		return l, err
	}
	if l.SessionID, err = str("session_id", true); err != nil {
		return l, err
	}
	if _, ok := o.M["parent_uuid"]; ok {
		if l.ParentUUID, err = str("parent_uuid", false); err != nil {
			return l, err
		}
	}
	h, ok := o.M["holder"].(*Obj)
	if !ok {
		return l, errors.New(".holder: not an object")
	}
	if err := onlyKeys(".holder", h, "kind", "ref"); err != nil {
		return l, err
	}
	kind, _ := h.M["kind"].(string)
	ref, _ := h.M["ref"].(string)
	if kind == "" || ref == "" || (kind == "process" && !processRef.MatchString(ref)) {
		return l, fmt.Errorf(".holder: %s is not a holder", shown(h))
	}
	l.Holder = Holder{kind, ref}
	if l.Mode, _ = o.M["mode"].(string); l.Mode != exclusive && l.Mode != shared {
		return l, fmt.Errorf(".mode: %s is not one of ('exclusive', 'shared')", shown(o.M["mode"]))
	}
	at, ok := o.M["acquired_at"].(json.Number)
	if f, err := strconv.ParseFloat(string(at), 64); !ok || err != nil || math.IsInf(f, 0) {
		return l, fmt.Errorf(".acquired_at: %s is not a number", shown(o.M["acquired_at"]))
	}
	l.AcquiredAt = at
	if v, present := o.M["share_limit"]; present {
		n, ok := integral(v)
		if !ok || n.Cmp(bigInt(1)) < 0 || !n.IsInt64() || n.Int64() > math.MaxInt32 {
			return l, fmt.Errorf(".share_limit: %s is not an integer of 1 or more", shown(v))
		}
		l.ShareLimit = int(n.Int64())
	}
	return l, nil
}

func onlyKeys(where string, o *Obj, allowed ...string) error {
	if key, found := o.unknownKey(allowed); found {
		return fmt.Errorf("%s: unknown key %s", where, shown(key))
	}
	return nil
}
