package main

// Which devices a request gets, given the leases that stand (gpuhost/grants.py): the lowest
// open devices in PCI order; a shared request fills the GPUs already shared first; a MIG
// instance and its GPU are one device.

import "fmt"

func related(d *Device, leases []Lease) []Lease {
	var out []Lease
	for _, l := range leases {
		if l.GPUUUID == d.UUID || l.ParentUUID == d.UUID || (d.ParentUUID != "" && l.GPUUUID == d.ParentUUID) {
			out = append(out, l)
		}
	}
	return out
}

func blocked(d *Device, mode string, leases []Lease, limit int) string {
	rel := related(d, leases)
	if len(rel) == 0 {
		return ""
	}
	allShared := true
	for _, l := range rel {
		allShared = allShared && l.Mode == shared && l.GPUUUID == d.UUID
	}
	if mode == shared && allShared {
		least := limit
		for _, l := range rel {
			if l.ShareLimit > 0 && l.ShareLimit < least {
				least = l.ShareLimit
			}
		}
		if len(rel) < least {
			return ""
		}
		return fmt.Sprintf("shared by %d sandboxes, its limit: %s", len(rel), rel[0].Describe())
	}
	how, through := "held exclusively", ""
	if rel[0].Mode == shared {
		how = "shared"
	}
	if rel[0].GPUUUID != d.UUID {
		through = " through " + rel[0].GPUUUID
	}
	return fmt.Sprintf("%s%s by %s", how, through, rel[0].Describe())
}

func grant(leases []Lease, inventory []*Device, count int, exact []*Device, mode string, limit int) ([]*Device, error) {
	if len(exact) > 0 {
		for _, d := range exact {
			if reason := blocked(d, mode, leases, limit); reason != "" {
				return nil, &Refusal{Busy: true, Device: d.Describe(), Holder: reason,
					Message: fmt.Sprintf("GPU %s is already assigned to another sandbox (%s)", d.Describe(), reason)}
			}
		}
		return exact, nil
	}
	var open, sharedFirst []*Device
	for _, d := range inventory {
		if blocked(d, mode, leases, limit) == "" {
			if mode == shared && len(related(d, leases)) > 0 {
				sharedFirst = append(sharedFirst, d)
			} else {
				open = append(open, d)
			}
		}
	}
	open = append(sharedFirst, open...)
	if len(open) < count {
		held, sharedOnly := 0, 0
		for _, d := range inventory {
			rel := related(d, leases)
			if len(rel) == 0 {
				continue
			}
			held++
			all := true
			for _, l := range rel {
				all = all && l.Mode == shared
			}
			if all {
				sharedOnly++
			}
		}
		why := fmt.Sprintf("%s; %d held exclusively, %d shared", mode, held-sharedOnly, sharedOnly)
		if mode == shared {
			why += fmt.Sprintf(" (at most %d sandboxes each)", limit)
		}
		return nil, &Refusal{Requested: count, Available: len(open), Total: len(inventory),
			Message: fmt.Sprintf("GPU sandbox requested %d GPUs, but only %d selectable of %d devices "+
				"are available (%s)", count, len(open), len(inventory), why)}
	}
	return open[:count], nil
}
