package main

// The request model (docs/request-model.md): the request in the seeds' shape, judged in the
// documented order before anything is taken: the driver's own block, the count, the
// sharing, this driver's capabilities, the IDs against the request, then the IDs resolved
// to this host's devices. Each refusal names the field and shows the value as Python's
// repr writes it, as the suite's own drivers do.

import (
	"encoding/json"
	"fmt"
	"math/big"
	"strings"
	"unicode"
)

const (
	envelope   = "template.driver_config"
	countField = "resource_requirements.gpu.count"
	shareField = "resource_requirements.gpu.sharing"
)

var vendors = []string{"nvidia", "amd", "intel"}

// ReqError is a refused request: the protocol's invalid (Reason) or unsupported error.
type ReqError struct {
	Type, Reason, Field, Message string
	Value                        any
}

func (e *ReqError) Error() string { return e.Message }

func invalid(reason, field string, value any, format string, args ...any) *ReqError {
	return &ReqError{"invalid", reason, field, fmt.Sprintf(format, args...), value}
}

func unsupported(field string, value any, format string, args ...any) *ReqError {
	return &ReqError{"unsupported", "", field, fmt.Sprintf(format, args...), value}
}

// Plan is a request once judged: nil means no GPU.
type Plan struct {
	Count   int
	Exact   []*Device
	Sharing string
	Profile string
	Vendor  string
}

// Request is what create carries, parsed.
type Request struct {
	Env  [][2]string
	Plan *Plan
}

func asObj(v any) (*Obj, bool) {
	o, ok := v.(*Obj)
	return o, ok
}

func kindOf(v any) string {
	switch t := v.(type) {
	case *Obj:
		return "an object"
	case []any:
		return "a list"
	case string:
		return "a string"
	case bool:
		return "a boolean"
	case json.Number:
		if isInteger(t) {
			return "an integer"
		}
		return "a number"
	case nil:
		return "null"
	}
	return fmt.Sprintf("%T", v)
}

func unknownKeys(where string, o *Obj, known ...string) error {
	if key, found := o.unknownKey(known); found {
		return invalid("request", where+"."+key, o.M[key], "%s has an unknown key %s = %s (known: %s)",
			where, shown(key), shown(o.M[key]), strings.Join(known, ", "))
	}
	return nil
}

// parseRequest: the request's shape, then the driver's judgement of its block and GPUs.
func (s *Server) parseRequest(raw any) (*Request, error) {
	spec, ok := asObj(raw)
	if !ok {
		return nil, invalid("request", "spec", raw, "spec must be an object, got %s: %s", kindOf(raw), shown(raw))
	}
	if err := unknownKeys("spec", spec, "resource_requirements", "template"); err != nil {
		return nil, err
	}
	template := &Obj{M: map[string]any{}}
	if t, present := spec.Get("template"); present {
		if template, ok = asObj(t); !ok {
			return nil, invalid("request", "template", t, "template must be an object, got %s: %s", kindOf(t), shown(t))
		}
	}
	if err := unknownKeys("template", template, "driver_config", "env", "image"); err != nil {
		return nil, err
	}
	if image, present := template.Get("image"); present && image != nil {
		name, ok := image.(string)
		if !ok || name == "" || !printable(name) || strings.IndexFunc(name, unicode.IsSpace) >= 0 {
			return nil, invalid("request", "template.image", image, "template.image must be an image's "+
				"name: a non-empty string without white space or control characters, got %s", shown(image))
		}
	}
	req := &Request{}
	if env, present := template.Get("env"); present {
		o, ok := asObj(env)
		if !ok {
			return nil, invalid("request", "template.env", env, "template.env must map variable names to "+
				"strings, got %s: %s", kindOf(env), shown(env))
		}
		for _, key := range o.Keys {
			value, ok := o.M[key].(string)
			if key == "" || strings.Contains(key, "=") {
				return nil, invalid("request", "template.env", key, "template.env has a variable name %s: "+
					"names are non-empty and hold no '='", shown(key))
			}
			if !ok || strings.ContainsRune(value, 0) {
				return nil, invalid("request", "template.env."+key, o.M[key], "%s must be a string without NUL "+
					"characters, got %s", named("template.env."+key), shown(o.M[key]))
			}
			req.Env = append(req.Env, [2]string{key, value})
		}
	}
	block := &Obj{M: map[string]any{}}
	if config, present := template.Get("driver_config"); present {
		envelopeObj, ok := asObj(config)
		if !ok {
			return nil, invalid("config", envelope, config, "%s must be an object, got %s: %s", envelope, kindOf(config), shown(config))
		}
		if mine, present := envelopeObj.Get(driverName); present { // the others' blocks are not ours
			if block, ok = asObj(mine); !ok {
				field := envelope + "." + driverName
				return nil, invalid("config", field, mine, "%s must be an object, got %s: %s", field, kindOf(mine), shown(mine))
			}
		}
	}
	var gpu *Obj
	if rr, present := spec.Get("resource_requirements"); present && rr != nil {
		o, ok := asObj(rr)
		if !ok {
			return nil, invalid("request", "resource_requirements", rr, "resource_requirements must be an "+
				"object, got %s: %s", kindOf(rr), shown(rr))
		}
		if err := unknownKeys("resource_requirements", o, "gpu"); err != nil {
			return nil, err
		}
		if g, present := o.Get("gpu"); present && g != nil {
			where := "resource_requirements.gpu"
			if gpu, ok = asObj(g); !ok {
				return nil, invalid("request", where, g, "%s must be an object, got %s: %s", where, kindOf(g), shown(g))
			}
			for _, key := range []string{"device_ids", "device_id", "gpu_device_ids"} {
				if v, present := gpu.Get(key); present {
					return nil, invalid("request", where+"."+key, v, "%s.%s (%s) was replaced by "+
						"template.driver_config.<driver>.gpu_device_ids: exact devices are driver-native, "+
						"in the block of the driver they are for", where, key, shown(v))
				}
			}
			if err := unknownKeys(where, gpu, "count", "sharing"); err != nil {
				return nil, err
			}
		}
	}
	plan, err := s.judge(block, gpu)
	req.Plan = plan
	return req, err
}

func blockField(key string) string {
	if key == "" {
		return envelope + "." + driverName
	}
	return envelope + "." + driverName + "." + key
}

// judge is gpuhost.validation.validate_gpu_request and drivers.base.Driver.plan, in order.
func (s *Server) judge(block, gpu *Obj) (*Plan, error) {
	idsKey, choiceKeys := "gpu_device_ids", []string{"mig_profile", "vendor"}
	for _, key := range block.Keys {
		if key == idsKey || key == choiceKeys[0] || key == choiceKeys[1] {
			continue
		}
		value := block.M[key]
		if key == "device_ids" || key == "device_id" {
			return nil, invalid("config", blockField(key), value, "%s (%s) was replaced by %s",
				blockField(key), shown(value), blockField(idsKey))
		}
		return nil, invalid("config", blockField(key), value, "%s has an unknown key %s = %s (the %s "+
			"driver takes: gpu_device_ids, mig_profile, vendor)", blockField(""), shown(key), shown(value), driverName)
	}
	idsField := blockField(idsKey)
	var ids []string
	rawIDs, hasIDs := block.Get(idsKey)
	if hasIDs {
		list, ok := rawIDs.([]any)
		if !ok {
			return nil, invalid("config", idsField, rawIDs, "%s must be a list of strings, got %s: %s",
				idsField, kindOf(rawIDs), shown(rawIDs))
		}
		if len(list) == 0 {
			return nil, invalid("config", idsField, list, "%s must not be empty, got []", idsField)
		}
		for _, entry := range list {
			id, ok := entry.(string)
			if !ok {
				return nil, invalid("config", idsField, entry, "%s entries must be strings, got %s", idsField, shown(entry))
			}
			if strings.TrimSpace(id) == "" {
				return nil, invalid("config", idsField, entry, "%s contains a blank device ID %s", idsField, shown(entry))
			}
			ids = append(ids, id)
		}
	}
	chosen := map[string]string{}
	var order []string
	for _, key := range choiceKeys {
		value, present := block.Get(key)
		if !present || value == nil {
			continue
		}
		text, ok := value.(string)
		if !ok || strings.TrimSpace(text) == "" {
			return nil, invalid("config", blockField(key), value, "%s must be a non-empty string, got %s",
				blockField(key), shown(value))
		}
		chosen[key] = text
		order = append(order, key)
	}
	profile, vendor := chosen["mig_profile"], chosen["vendor"]
	if vendor != "" && !contains(vendors, vendor) {
		return nil, invalid("config", blockField("vendor"), vendor, "%s must be one of %s, got %s",
			blockField("vendor"), strings.Join(vendors, ", "), shown(vendor))
	}
	if len(order) > 0 && hasIDs {
		key := order[0]
		return nil, invalid("config", blockField(key), chosen[key], "%s names exact devices and a %s (%s): "+
			"the devices decide, give one or the other", blockField(""), key, shown(chosen[key]))
	}
	if profile != "" && vendor != "" && vendor != "nvidia" {
		return nil, invalid("config", blockField("vendor"), vendor, "%s (%s) is NVIDIA's; %s is %s",
			blockField("mig_profile"), shown(profile), blockField("vendor"), shown(vendor))
	}
	count, sharing := 0, exclusive
	var countGiven any
	if gpu != nil {
		countGiven, _ = gpu.Get("count")
		n, err := checkedCount(countGiven)
		if err != nil {
			return nil, err
		}
		if v, present := gpu.Get("sharing"); present && v != nil {
			text, ok := v.(string)
			if !ok || (text != exclusive && text != shared) {
				return nil, invalid("sharing", shareField, v, "gpu sharing must be one of exclusive, shared, got %s", shown(v))
			}
			sharing = text
		}
		if n.Cmp(big.NewInt(int64(s.maxPerSandbox()))) > 0 {
			return nil, unsupported(countField, countGiven, "gpu count (%s) exceeds the %s driver's maximum "+
				"of %d GPUs per sandbox", shownInt(n), driverName, s.maxPerSandbox())
		}
		count = int(n.Int64())
	}
	if hasIDs && len(ids) > s.maxPerSandbox() {
		return nil, unsupported(idsField, rawIDs, "%s names %d GPUs (%s); the %s driver's maximum is %d per "+
			"sandbox", idsField, len(ids), shown(rawIDs), driverName, s.maxPerSandbox())
	}
	if !hasIDs {
		if gpu == nil {
			return nil, nil
		}
		plan := &Plan{Count: count, Sharing: sharing, Profile: profile, Vendor: vendor}
		return plan, s.checkChoice(plan)
	}
	if gpu == nil {
		return nil, invalid("ids-without-request", idsField, rawIDs, "%s requires a gpu request (got %s "+
			"without resource_requirements.gpu)", idsField, shown(rawIDs))
	}
	seen := map[string]bool{}
	for _, id := range ids {
		if seen[id] {
			return nil, invalid("duplicate", idsField, id, "%s contains duplicate device ID %s", idsField, shown(id))
		}
		seen[id] = true
	}
	if countGiven != nil && count != len(ids) {
		return nil, invalid("count-mismatch", idsField, rawIDs, "gpu count (%s) must match %s length (%d): %s",
			shown(countGiven), idsField, len(ids), shown(rawIDs))
	}
	exact, err := s.resolve(ids, idsField)
	if err != nil {
		return nil, err
	}
	return &Plan{Count: len(exact), Exact: exact, Sharing: sharing}, nil
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// checkedCount: absent is the default request of one; a count is a positive integer
// (not 2.0, not "2", not true).
func checkedCount(v any) (*big.Int, error) {
	if v == nil {
		return big.NewInt(1), nil
	}
	n, ok := v.(json.Number)
	if !ok || !isInteger(n) {
		return nil, invalid("count", countField, v, "gpu count must be an integer, got %s (%s)", shown(v), kindOf(v))
	}
	i, _ := new(big.Int).SetString(string(n), 10)
	if i.Sign() <= 0 {
		return nil, invalid("count", countField, v, "gpu count must be greater than 0, got %s", shown(v))
	}
	return i, nil
}

// maxPerSandbox: capabilities.maxGpusPerSandbox "all": every device the driver takes.
func (s *Server) maxPerSandbox() int {
	if n := len(s.host.Devices()); n > 0 {
		return n
	}
	return 1
}

func (s *Server) checkChoice(p *Plan) error {
	if p.Profile != "" && len(s.host.Pool("", p.Profile)) == 0 {
		var profiles []string
		for _, m := range s.host.MIGs {
			if !contains(profiles, m.Profile) {
				profiles = append(profiles, m.Profile)
			}
		}
		return unsupported(blockField("mig_profile"), p.Profile, "no MIG instance of this host has the profile "+
			"%s (%s); its profiles: %s", shown(p.Profile), blockField("mig_profile"), orNone(profiles))
	}
	if p.Vendor != "" && len(s.host.Pool(p.Vendor, "")) == 0 {
		var have []string
		for _, d := range s.host.Devices() {
			if !contains(have, d.Vendor) {
				have = append(have, d.Vendor)
			}
		}
		return unsupported(blockField("vendor"), p.Vendor, "this host has no %s GPU (%s); its GPUs are %s",
			shown(p.Vendor), blockField("vendor"), orNone(have))
	}
	return nil
}

func orNone(list []string) string {
	if len(list) == 0 {
		return "none"
	}
	return strings.Join(list, ", ")
}

// lookup: the device an exact ID names, one of its IDs as listed; a PCI address in either
// letter case (the kernel's 0000:c3:00.0, NVML's 0000:C3:00.0), no other form of it.
func (s *Server) lookup(id string) *Device {
	for _, d := range s.host.Devices() {
		for _, own := range d.IDs() {
			if own == id {
				return d
			}
		}
		if !d.IsMIG() && d.PCI != "" && id == strings.ToUpper(d.PCI) {
			return d
		}
	}
	return nil
}

// resolve maps exact IDs to devices: unknown IDs, and two IDs of one device (or of a GPU
// and its MIG instance), are refused.
func (s *Server) resolve(ids []string, field string) ([]*Device, error) {
	chosen := map[string]string{}
	var out []*Device
	for _, id := range ids {
		d := s.lookup(id)
		if d == nil {
			return nil, invalid("unknown-device", field, id, "%s names an unknown device %s (the %s driver "+
				"accepts a host index, a UUID (GPU-…, MIG-…), a CDI name, or a PCI address; this host has %d GPUs)",
				field, shown(id), driverName, len(s.host.DefaultDevices()))
		}
		if first, dup := chosen[d.UUID]; dup {
			return nil, invalid("duplicate", field, id, "%s contains duplicate device ID %s: %s names the same "+
				"GPU (%s)", field, shown(id), shown(first), d.UUID)
		}
		chosen[d.UUID] = id
		out = append(out, d)
	}
	for _, d := range out {
		if whole, dup := chosen[d.ParentUUID]; d.IsMIG() && dup {
			return nil, invalid("duplicate", field, chosen[d.UUID], "%s names %s whole and its MIG instance %s: "+
				"the instance is part of that GPU (%s)", field, shown(whole), shown(chosen[d.UUID]), d.ParentUUID)
		}
	}
	return out, nil
}

// shownInt: an integer for a message, by its number of digits when too long to show.
func shownInt(n *big.Int) string {
	text := n.String()
	if digits := len(strings.TrimPrefix(text, "-")); digits > 78 {
		return fmt.Sprintf("an integer of %d digits", digits)
	}
	return text
}
