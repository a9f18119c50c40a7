// SPDX-License-Identifier: Apache-2.0

package admin

import (
	"time"

	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
)

// Membership is which cgroups are in which project, from every source, and
// the network namespaces their processes are in.
type Membership struct {
	// Sources are the sources of membership, in their order of priority.
	Sources []MemberSource `json:"sources"`
	// Members are the registered cgroups in force, sorted by cgroup.
	Members []Member `json:"members"`
	// Refused are the members not in force, with why, sorted by cgroup.
	Refused []Refused `json:"refused"`
	// Missing are members in force whose cgroup did not exist when the
	// namespace scan last read it: a registration that outlived its pod or
	// service, or one made for a cgroup not made yet.
	Missing []Member `json:"missing,omitempty"`
	// Changed is when the members in force last changed.
	Changed time.Time `json:"changed,omitzero"`
	// Kernel says the kernel's programs place sockets by these members
	// (their membership map): false without BPF.
	Kernel bool `json:"kernel"`
	// Netns lists the network namespaces of the members' processes; nil
	// when they are not looked for.
	Netns *Netns `json:"netns,omitempty"`
}

// MemberSource is one source of membership.
type MemberSource struct {
	Name string `json:"name"`
	// Members and Refused count this source's members in force and not.
	Members int `json:"members"`
	Refused int `json:"refused"`
	// Error is why the last read failed; the source's last members stay
	// in force meanwhile.
	Error   string    `json:"error,omitempty"`
	Scanned time.Time `json:"scanned,omitzero"`
}

// Member is a registered cgroup in force: project, cgroup, source.
type Member = membership.Entry

// Refused is a member not in force, or a cgroup a source could not make a
// member (Project empty), with why.
type Refused struct {
	membership.Refusal
	// By is who refused it: "sources" (it conflicts with another member,
	// or its name or path is invalid) or "kernel" (the kernel side could
	// not take it: its cgroup is gone, say, or the map is full).
	By string `json:"by"`
}

// Netns is what the network namespace scan found.
type Netns struct {
	Namespaces []Namespace     `json:"namespaces"`
	Scan       netnsscan.Stats `json:"scan"`
}

// Namespace is one network namespace a member's process is in.
type Namespace struct {
	netnsscan.Namespace
	// Attached says inbound admission runs in it; Cookie is its netns
	// cookie then. Error is why attaching failed.
	Attached bool   `json:"attached"`
	Cookie   uint64 `json:"cookie,omitempty"`
	Error    string `json:"error,omitempty"`
}

// Registration is the answer to a registration or its removal: the
// project's registered cgroups now, and what changed.
type Registration struct {
	Project string `json:"project"`
	// Cgroups are every cgroup registered for the project now, sorted.
	Cgroups []string `json:"cgroups"`
	// Added or Removed are the cgroups this call changed (those already
	// registered are neither).
	Added   []string `json:"added,omitempty"`
	Removed []string `json:"removed,omitempty"`
	// Pending says the change is stored but was not in force yet when the
	// call returned; the daemon applies it within a tick.
	Pending bool `json:"pending,omitempty"`
	// Refused lists the project's registrations not in force, with why.
	Refused []Refused `json:"refused,omitempty"`
}

// RegisterRequest is the body of POST /v1/projects/{project}.
type RegisterRequest struct {
	Cgroups []string `json:"cgroups"`
}

// MaxRegister bounds the cgroups of one registration request.
const MaxRegister = 1024
