// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	rt "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// SourceOptions configure NewSource.
type SourceOptions struct {
	// CRI is the runtime's client; the source closes it.
	CRI *CRI
	// Rules decide each pod's project.
	Rules Rules
	// Mount is the cgroup2 mount point: a pod's member cgroup is its
	// cgroup's directory below it.
	Mount string
	// PodCgroups are the cgroups every pod's cgroup must be strictly below
	// (CheckPodCgroup); nil means DefaultPodCgroups.
	PodCgroups []string
	// CheckPid checks a pod's sandbox's pid against the pod's cgroup (its
	// directory below Mount): nil when the process is in it or below,
	// checked through a pidfd. The uid CheckPodCgroup checks the cgroup's
	// name against is the runtime's word too; a process of the runtime's
	// pod, held while its cgroup is read, is the kernel's. nil means
	// netnsscan.CheckPid with the cgroup2 mount at Mount.
	CheckPid func(pid int, dir string) error
	// Every is the poll period (the daemon's tick), which also bounds one
	// poll; 0 means 1s. The pods are listed again each period (one call,
	// plus one status call per sandbox not seen before), and at once on
	// the runtime's container events where they are followed (follow).
	Every time.Duration
	// Log receives the runtime's first answer and each pod label that is
	// not a project name.
	Log *slog.Logger
	// Self is the daemon's own cgroup (a directory below Mount), "" if
	// unknown. The namespace of the pod it is in (the chart's
	// fairshare-system, or wherever the daemon runs) is treated as a
	// system namespace: the daemon's own pod is never a tenant, whatever
	// the configuration says.
	Self string
	// Cache, if set, is a file where each changed good poll is kept, so a
	// daemon that restarts while the runtime is away starts from the pods
	// it last saw (Last) instead of from none.
	Cache string
	// NoEvents polls only, even on a runtime whose container events could
	// be followed (tests measure the polling with it).
	NoEvents bool
}

// PodNetns is the network namespace of a pod that is in a project and has
// a namespace of its own.
type PodNetns struct {
	// Path opens it: /proc/<pid>/ns/net of the sandbox's process (the
	// daemon runs with the host's pids), else the runtime's bind mount.
	Path    string `json:"path"`
	Project string `json:"project"`
	// Pid is the sandbox's process (0 if the runtime gave none: Path is
	// then the runtime's), and Cgroup the pod's member cgroup it must be
	// in for its namespace to be the pod's (netnsscan.OpenPid): a pid may
	// have been reused by another process since the runtime gave it.
	Pid    int    `json:"pid,omitempty"`
	Cgroup string `json:"cgroup,omitempty"`
	// Pod is namespace/name, for logs.
	Pod string `json:"pod"`
}

// Source is the kubernetes source of members: each ready pod's cgroup is a
// member of the project its Rules give; pods of system namespaces are in no
// project, so like host processes they are neither counted nor refused
// anywhere. It is a membership.Polled (Name, Scan, Changed): the runtime is
// asked in a goroutine of its own, so one that hangs never stalls the
// caller's loop. While the runtime does not answer, Scan returns why (one
// text per cause, so a caller that reports each new error reports it once)
// and the caller keeps the members of the last good poll.
type Source struct {
	*membership.Polled
	o SourceOptions

	mu         sync.Mutex // guards the fields below
	found      membership.Found
	netns      []PodNetns
	system     int               // pods of system namespaces in the last good poll
	none       []string          // member cgroups of the last good poll's pods in no project by the rules
	selfNS     string            // the namespace of the daemon's own pod in the last good poll, "" if none
	warned     map[string]bool   // pod ids whose bad label was logged
	refused    map[string]string // pod ids whose cgroup was refused, and why (logged once)
	pending    map[string]bool   // pod ids whose status could not be read (logged once)
	checked    map[string]int    // pod ids whose sandbox's pid was found in the pod's cgroup: that pid
	polled     bool              // a poll succeeded
	keepFailed bool              // a write of the cache failed (logged once)
	last       *membership.Found // what Cache held at start
	lastNetns  []PodNetns        // and its network namespaces

	stop       context.CancelFunc // ends follow
	followDone chan struct{}
}

// cached is the content of SourceOptions.Cache.
type cached struct {
	Found membership.Found `json:"found"`
	Netns []PodNetns       `json:"netns,omitempty"`
	// None is NoProject's list: the system namespaces' pods (kube-proxy,
	// CNI and CSI agents) stay out of the unclassified project across a
	// restart while the runtime does not answer.
	None []string `json:"none,omitempty"`
}

// checkPidBelow is SourceOptions.CheckPid's default: netnsscan.CheckPid
// with the cgroup2 mount at point.
func checkPidBelow(point string) func(pid int, dir string) error {
	mount := cgroup.Mount{Point: point, Root: "/"}
	return func(pid int, dir string) error { return netnsscan.CheckPid(pid, mount, dir) }
}

// NewSource starts polling the runtime, at once and then every o.Every,
// until Close.
func NewSource(o SourceOptions) *Source {
	if o.Every <= 0 {
		o.Every = time.Second
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.CheckPid == nil {
		o.CheckPid = checkPidBelow(o.Mount)
	}
	s := &Source{o: o, warned: map[string]bool{}, refused: map[string]string{}, checked: map[string]int{}, pending: map[string]bool{}}
	if o.Cache != "" {
		if raw, err := os.ReadFile(o.Cache); err == nil {
			var c cached
			if err := json.Unmarshal(raw, &c); err == nil {
				s.last, s.lastNetns = &c.Found, c.Netns
				// NoProject's until the first good poll: without it the
				// system pods' sockets counted as unclassified, and could
				// be refused, once the daemon stopped waiting for the
				// runtime (daemon.unreadHold).
				s.none = c.None
			} else {
				o.Log.Warn("the pods kept from the last run are unreadable; starting from the runtime's", "file", o.Cache, "err", err)
			}
		}
	}
	// Stored before the first fetch, which signals through it.
	s.Polled = membership.PreparePolled(membership.SourceKubernetes, o.Every, s.fetch)
	s.Start()
	ctx, stop := context.WithCancel(context.Background())
	s.stop, s.followDone = stop, make(chan struct{})
	go s.follow(ctx)
	return s
}

// eventsRetry is the wait before the runtime's events are asked for again,
// after the runtime did not answer or the stream broke.
const eventsRetry = time.Second

// follow reads the pods again at each of the runtime's container events,
// where the runtime gives every reader every event (EventsShared): a new
// pod's sandbox is read as it starts, before its first container, instead
// of at the next poll (up to a period later). The polls go on beside it, so
// an event lost or a stream broken costs at most a period. A runtime
// without events (containerd 1.6), or whose events kubelet may need for
// itself, is polled only; that is said once.
func (s *Source) follow(ctx context.Context) {
	defer close(s.followDone)
	if s.o.NoEvents {
		return
	}
	wait := func() bool {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(eventsRetry):
			return true
		}
	}
	var broken string // the last stream's error, logged once
	following := false
	for {
		name, version, err := s.o.CRI.Version(ctx)
		if err != nil { // not up yet, or gone: the polls say so
			if !wait() {
				return
			}
			continue
		}
		if why := EventsShared(name, version); why != "" {
			s.o.Log.Info("the container runtime's events are not followed: new pods are found by the polls, once a period",
				"reason", why, "period", s.o.Every)
			return
		}
		if !following {
			following = true
			s.o.Log.Info("following the container runtime's events: a new pod is read as its sandbox starts",
				"runtime", name+" "+version)
		}
		err = s.o.CRI.Events(ctx, func(*rt.ContainerEventResponse) {
			if broken != "" {
				broken = ""
				s.o.Log.Info("the container runtime's event stream is back", "runtime", name+" "+version)
			}
			s.Poke()
		})
		switch {
		case ctx.Err() != nil:
			return
		case errors.Is(err, ErrNoEvents):
			s.o.Log.Info("the container runtime has no container events: new pods are found by the polls, once a period",
				"runtime", name+" "+version, "period", s.o.Every, "detail", err)
			return
		}
		if err.Error() != broken {
			broken = err.Error()
			s.o.Log.Warn("the container runtime's event stream broke: new pods are found by the polls until it is back", "err", err)
		}
		s.Poke()
		if !wait() {
			return
		}
	}
}

// Last returns the members of the last good poll of an earlier run (from
// SourceOptions.Cache), for a caller that has no scan yet because the
// runtime does not answer.
func (s *Source) Last() (membership.Found, bool) {
	if s.last == nil {
		return membership.Found{}, false
	}
	return *s.last, true
}

// Netns returns the network namespaces of the last good poll's pods that
// are in a project and not on the host's network, by path.
func (s *Source) Netns() []PodNetns {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.netns)
}

// NoProject returns the cgroups of the last good poll's pods that the rules
// put in no project (system namespaces, the daemon's own namespace, pods
// without the label while namespaces are not projects), sorted; before the
// first, those of the last run's (SourceOptions.Cache). They are
// classified: below the pod roots, which count for the reserved
// unclassified project until a pod is classified, their sockets count for
// none (loader.NoProject).
func (s *Source) NoProject() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.none)
}

// SelfNamespace is the namespace of the daemon's own pod in the last good
// poll, "" if the daemon is in no pod the runtime lists.
func (s *Source) SelfNamespace() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.selfNS
}

// System is how many pods of system namespaces the last good poll saw.
func (s *Source) System() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.system
}

// Close stops the polls and closes the runtime's client.
func (s *Source) Close() error {
	s.stop()
	<-s.followDone
	s.Polled.Close()
	return s.o.CRI.Close()
}

// fetch is one poll: the pods, through the rules.
func (s *Source) fetch(ctx context.Context) (membership.Found, error) {
	pods, err := s.o.CRI.Pods(ctx)
	if err != nil {
		return membership.Found{}, s.runtimeError(err)
	}
	s.mu.Lock()
	f, netns, system, none, selfNS := s.members(pods)
	if selfNS != s.selfNS && selfNS != "" {
		s.o.Log.Info("the daemon runs in a pod: its namespace is never limited, like a system namespace", "namespace", selfNS)
	}
	other := !slices.Equal(netns, s.netns) || !slices.Equal(none, s.none)
	same := !other && slices.Equal(f.Members, s.found.Members) && slices.Equal(f.Skipped, s.found.Skipped)
	s.none, s.selfNS = none, selfNS
	first := !s.polled
	s.found, s.netns, s.system, s.polled = f, netns, system, true
	if other {
		// A new pod of a system namespace, or a pod's new network
		// namespace: applied now, not at the next tick (the members'
		// own changes are signalled once this fetch is kept). Under
		// s.mu, which NoProject and Netns wait for.
		s.Signal()
	}
	keep := s.o.Cache != "" && (first || !same)
	var kept cached
	if keep {
		kept = cached{Found: s.found, Netns: s.netns, None: s.none}
	}
	s.mu.Unlock()
	// The runtime's version and the cache file are asked for and written
	// past s.mu: NoProject and Netns, which the control loop calls, wait
	// for it, and a runtime that answers the pod list but hangs on its
	// version (or a slow disk) would stall the loop for the fetch's bound.
	// fetch runs one at a time (Polled), so keepFailed needs no lock.
	if first {
		version, _ := s.o.CRI.Ping(ctx)
		s.o.Log.Info("the container runtime answers", "runtime", version, "endpoint", s.o.CRI.Endpoint(),
			"pods_in_projects", len(f.Members), "pods_of_system_namespaces", system)
	}
	if keep {
		err := s.keep(kept)
		if err != nil && !s.keepFailed {
			s.o.Log.Warn("the pods could not be kept for a restart while the runtime is away", "file", s.o.Cache, "err", err)
		}
		s.keepFailed = err != nil
	}
	return f, nil
}

// keep writes c, a good poll, to the cache file (a new file renamed over
// the old, so a crash leaves one or the other).
func (s *Source) keep(c cached) error {
	raw, err := json.Marshal(c)
	if err != nil {
		return err
	}
	tmp := s.o.Cache + ".new"
	if err := os.WriteFile(tmp, raw, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, s.o.Cache)
}

// podOf reports whether cg (an absolute member cgroup) is the cgroup
// kubelet makes for p.
func (s *Source) podOf(p Pod, cg string) bool {
	rel, err := filepath.Rel(s.o.Mount, cg)
	return err == nil && CheckPodCgroup("/"+rel, p.UID, s.o.PodCgroups) == nil
}

// known is the member p had in the last good poll, or before the first
// one in the last run's (SourceOptions.Cache: a pod whose sandbox is new
// later was not in it, and that run's rules may have been others), found
// by its uid in the cgroup's name. Called with s.mu held.
func (s *Source) known(p Pod) (membership.Member, bool) {
	lists := [][]membership.Member{s.found.Members}
	if s.last != nil && !s.polled {
		lists = append(lists, s.last.Members)
	}
	for _, ms := range lists {
		for _, m := range ms {
			if s.podOf(p, m.Cgroup) {
				return m, true
			}
		}
	}
	return membership.Member{}, false
}

// knownNone is p's cgroup if the last good poll (or the last run's) had p
// in no project. Called with s.mu held.
func (s *Source) knownNone(p Pod) (string, bool) {
	for _, cg := range s.none {
		if s.podOf(p, cg) {
			return cg, true
		}
	}
	return "", false
}

// selfNamespace is the namespace of the pod whose cgroup holds the daemon's
// own (SourceOptions.Self), "" if none does.
func (s *Source) selfNamespace(pods []Pod) string {
	if s.o.Self == "" {
		return ""
	}
	for _, p := range pods {
		if p.Unusable != "" || p.Cgroup == "" || CheckPodCgroup(p.Cgroup, p.UID, s.o.PodCgroups) != nil {
			continue
		}
		cg := filepath.Join(s.o.Mount, p.Cgroup)
		if s.o.Self == cg || strings.HasPrefix(s.o.Self, cg+"/") {
			return p.Namespace
		}
	}
	return ""
}

// members applies the rules to the pods: the members, the pods'
// namespaces, how many pods are of system namespaces, the cgroups of the
// pods in no project, and the daemon's own namespace. Called with s.mu held.
func (s *Source) members(pods []Pod) (membership.Found, []PodNetns, int, []string, string) {
	var f membership.Found
	var netns []PodNetns
	var none []string
	system := 0
	rules := s.o.Rules
	selfNS := s.selfNamespace(pods)
	if selfNS != "" && !slices.Contains(rules.System, selfNS) {
		rules.System = append(slices.Clip(rules.System), selfNS)
	}
	live := make(map[string]bool, len(pods))
	// Whatever the runtime says, a pod whose cgroup cannot be trusted is
	// in no project: listed with why, logged once.
	refuse := func(p Pod, why string) {
		f.Skipped = append(f.Skipped, membership.Skipped{Reason: fmt.Sprintf("pod %s/%s: %s", p.Namespace, p.Name, why)})
		if s.refused[p.ID] != why {
			s.refused[p.ID] = why
			s.o.Log.Warn("a pod's cgroup as the container runtime reports it is refused: the pod is in no project",
				"pod", p.Namespace+"/"+p.Name, "sandbox", p.ID, "reason", why)
		}
	}
	for _, p := range pods {
		live[p.ID] = true
		if p.Pending != "" {
			// Not refused: its status is asked again at the next list.
			// A pod known before (the last poll's, or the last run's
			// after a restart, when every sandbox is new to the client)
			// keeps what it had meanwhile; a new one is in no project yet.
			if m, ok := s.known(p); ok {
				f.Members = append(f.Members, m)
				last := s.lastNetns
				if s.polled {
					last = nil
				}
				for _, n := range slices.Concat(s.netns, last) {
					if n.Cgroup == m.Cgroup {
						netns = append(netns, n)
						break
					}
				}
			} else if cg, ok := s.knownNone(p); ok {
				none = append(none, cg)
			} else {
				f.Skipped = append(f.Skipped, membership.Skipped{Reason: fmt.Sprintf("pod %s/%s: no status from the runtime yet: %s", p.Namespace, p.Name, p.Pending)})
			}
			if !s.pending[p.ID] {
				s.pending[p.ID] = true
				s.o.Log.Warn("a pod's status could not be read from the container runtime; asked again at every poll",
					"pod", p.Namespace+"/"+p.Name, "sandbox", p.ID, "err", p.Pending)
			}
			continue
		}
		delete(s.pending, p.ID)
		why := p.Unusable
		if why == "" {
			if err := CheckPodCgroup(p.Cgroup, p.UID, s.o.PodCgroups); err != nil {
				why = err.Error()
			}
		}
		if why != "" {
			refuse(p, why)
			continue
		}
		cg := filepath.Join(s.o.Mount, p.Cgroup)
		if p.Pid > 0 && s.checked[p.ID] != p.Pid {
			// The runtime says where the pod is; its sandbox's process
			// shows it: in the pod's cgroup or below, or the pod is
			// refused (checked once per sandbox and pid).
			if err := s.o.CheckPid(p.Pid, cg); err != nil {
				refuse(p, fmt.Sprintf("its sandbox's process %d is not in the cgroup the runtime reports (%s): %v", p.Pid, p.Cgroup, err))
				continue
			}
			s.checked[p.ID] = p.Pid
		}
		delete(s.refused, p.ID)
		project, err := rules.Project(p)
		switch {
		case project == "" && err != nil:
			f.Skipped = append(f.Skipped, membership.Skipped{Cgroup: cg, Reason: err.Error()})
			continue
		case project == "":
			if slices.Contains(rules.System, p.Namespace) {
				system++
			}
			none = append(none, cg)
			continue
		case err != nil && !s.warned[p.ID]:
			s.warned[p.ID] = true
			s.o.Log.Warn("a pod's project label is not a project name: the pod counts for its namespace", "err", err)
		}
		f.Members = append(f.Members, membership.Member{Project: project, Cgroup: cg})
		if !p.HostNetwork {
			path := p.NetNS
			if p.Pid > 0 {
				path = "/proc/" + strconv.Itoa(p.Pid) + "/ns/net"
			}
			if path != "" {
				netns = append(netns, PodNetns{Path: path, Project: project, Pid: max(p.Pid, 0), Cgroup: cg, Pod: p.Namespace + "/" + p.Name})
			}
		}
	}
	for id := range s.warned {
		if !live[id] {
			delete(s.warned, id)
		}
	}
	for id := range s.refused {
		if !live[id] {
			delete(s.refused, id)
		}
	}
	for id := range s.checked {
		if !live[id] {
			delete(s.checked, id)
		}
	}
	for id := range s.pending {
		if !live[id] {
			delete(s.pending, id)
		}
	}
	slices.SortFunc(f.Members, func(a, b membership.Member) int {
		return cmp.Or(cmp.Compare(a.Cgroup, b.Cgroup), cmp.Compare(a.Project, b.Project))
	})
	slices.SortFunc(f.Skipped, func(a, b membership.Skipped) int {
		return cmp.Or(cmp.Compare(a.Cgroup, b.Cgroup), cmp.Compare(a.Reason, b.Reason))
	})
	slices.SortFunc(netns, func(a, b PodNetns) int { return cmp.Compare(a.Path, b.Path) })
	slices.Sort(none)
	return f, netns, system, none, selfNS
}

// runtimeError gives the runtime's error one text per cause: gRPC's
// transport errors carry details that vary from one attempt to the next,
// and the caller reports a source's error each time its text changes.
func (s *Source) runtimeError(err error) error {
	ep := s.o.CRI.Endpoint()
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	switch st.Code() {
	case codes.Unavailable:
		cause := st.Message()
		if i := strings.LastIndex(cause, ": "); i >= 0 {
			cause = cause[i+2:]
		}
		return fmt.Errorf("%w at %s is not answering: %s", ErrRuntime, ep, strings.Trim(cause, `"`))
	case codes.DeadlineExceeded:
		return fmt.Errorf("%w at %s did not answer in time", ErrRuntime, ep)
	case codes.Unimplemented:
		return fmt.Errorf("%w at %s does not serve the CRI v1 runtime service: %s", ErrRuntime, ep, st.Message())
	}
	return err
}
