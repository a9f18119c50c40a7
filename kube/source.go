// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/membership"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
	// Every is the poll period (the daemon's tick); 0 means 1s. containerd
	// 1.6 has no container events (GetContainerEvents came with 1.7), so the
	// pods are listed again each period; a list costs one call, plus one
	// status call per sandbox not seen before.
	Every time.Duration
	// Timeout bounds one poll; 0 means 5s.
	Timeout time.Duration
	// Log receives a line per pod label that is not a project name.
	Log *slog.Logger
	// Cache, if set, is a file where each changed good poll is kept, so a
	// daemon that restarts while the runtime is away starts from the pods
	// it last saw (Last) instead of from none.
	Cache string
}

// PodNetns is the network namespace of a pod that is in a project and has
// a namespace of its own.
type PodNetns struct {
	// Path opens it: /proc/<pid>/ns/net of the sandbox's process (the
	// daemon runs with the host's pids), else the runtime's bind mount.
	Path    string
	Project string
	// Pod is namespace/name, for logs.
	Pod string
}

// Source is the kubernetes source of members (membership.Source and
// membership.Notifier): each ready pod's cgroup is a member of the project
// its Rules give; pods of system namespaces are in no project, so like host
// processes they are neither counted nor refused anywhere. It polls the
// runtime in a goroutine of its own, so a runtime that hangs never stalls
// the caller's loop: Scan returns the last poll's result at once. While the
// runtime does not answer, Scan returns the error (one text per cause, so a
// caller that reports changes reports it once) and the caller keeps the
// members of the last good poll.
type Source struct {
	o       SourceOptions
	changed chan struct{}
	cancel  context.CancelFunc
	done    chan struct{}

	mu     sync.Mutex // guards the fields below
	found  membership.Found
	netns  []PodNetns
	err    error
	system int               // pods of system namespaces in the last good poll
	warned map[string]bool   // pod ids whose bad label was logged
	last   *membership.Found // what Cache held at start
	polled bool              // a poll succeeded
	// keepFailed says a write of the cache failed (logged once).
	keepFailed bool
}

// cached is the content of SourceOptions.Cache.
type cached struct {
	Found membership.Found `json:"found"`
	Netns []PodNetns       `json:"netns,omitempty"`
}

// NewSource polls the runtime once (so the first Scan has the pods, or the
// reason there are none), then every o.Every until Close.
func NewSource(o SourceOptions) *Source {
	if o.Every <= 0 {
		o.Every = time.Second
	}
	if o.Timeout <= 0 {
		o.Timeout = 5 * time.Second
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Source{o: o, changed: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{}), warned: map[string]bool{}}
	if o.Cache != "" {
		if raw, err := os.ReadFile(o.Cache); err == nil {
			var c cached
			if err := json.Unmarshal(raw, &c); err == nil {
				s.last = &c.Found
			} else {
				o.Log.Warn("the pods kept from the last run are unreadable; starting from the runtime's", "file", o.Cache, "err", err)
			}
		}
	}
	s.poll(ctx)
	go s.loop(ctx)
	return s
}

// Name implements membership.Source.
func (s *Source) Name() string { return membership.SourceKubernetes }

// Scan implements membership.Source: the last poll's members, or its error.
func (s *Source) Scan(context.Context) (membership.Found, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return membership.Found{}, s.err
	}
	return membership.Found{Members: slices.Clone(s.found.Members), Skipped: slices.Clone(s.found.Skipped)}, nil
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

// Changed implements membership.Notifier: a poll found other pods, or the
// runtime stopped or started answering.
func (s *Source) Changed() <-chan struct{} { return s.changed }

// Netns returns the network namespaces of the last good poll's pods that
// are in a project and not on the host's network, by path.
func (s *Source) Netns() []PodNetns {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.netns)
}

// System is how many pods of system namespaces the last good poll saw.
func (s *Source) System() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.system
}

// Close stops the polls and closes the runtime's client.
func (s *Source) Close() error {
	s.cancel()
	<-s.done
	return s.o.CRI.Close()
}

func (s *Source) loop(ctx context.Context) {
	defer close(s.done)
	t := time.NewTicker(s.o.Every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.poll(ctx)
		}
	}
}

// poll lists the pods once and notifies when the result changed.
func (s *Source) poll(ctx context.Context) {
	pctx, cancel := context.WithTimeout(ctx, s.o.Timeout)
	pods, err := s.o.CRI.Pods(pctx)
	cancel()
	if err != nil && ctx.Err() != nil {
		return // closing
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		err = s.runtimeError(err)
		if s.err == nil || s.err.Error() != err.Error() {
			s.err = err
			s.notify()
		}
		return
	}
	f, netns, system := s.members(pods)
	same := slices.Equal(f.Members, s.found.Members) && slices.Equal(f.Skipped, s.found.Skipped) && slices.Equal(netns, s.netns)
	if s.err != nil || !same {
		s.notify()
	}
	first := !s.polled
	s.err, s.found, s.netns, s.system, s.polled = nil, f, netns, system, true
	if s.o.Cache != "" && (first || !same) {
		kerr := s.keep()
		if kerr != nil && !s.keepFailed {
			s.o.Log.Warn("the pods could not be kept for a restart while the runtime is away", "file", s.o.Cache, "err", kerr)
		}
		s.keepFailed = kerr != nil
	}
}

// keep writes the last good poll to the cache file (a new file renamed
// over the old, so a crash leaves one or the other). Called with s.mu held.
func (s *Source) keep() error {
	raw, err := json.Marshal(cached{Found: s.found, Netns: s.netns})
	if err != nil {
		return err
	}
	tmp := s.o.Cache + ".new"
	if err := os.WriteFile(tmp, raw, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, s.o.Cache)
}

func (s *Source) notify() {
	select {
	case s.changed <- struct{}{}:
	default:
	}
}

// members applies the rules to the pods. Called with s.mu held.
func (s *Source) members(pods []Pod) (membership.Found, []PodNetns, int) {
	var f membership.Found
	var netns []PodNetns
	system := 0
	live := make(map[string]bool, len(pods))
	for _, p := range pods {
		live[p.ID] = true
		cg := filepath.Join(s.o.Mount, p.Cgroup)
		project, err := s.o.Rules.Project(p)
		switch {
		case project == "" && err != nil:
			f.Skipped = append(f.Skipped, membership.Skipped{Cgroup: cg, Reason: err.Error()})
			continue
		case project == "":
			if slices.Contains(s.o.Rules.System, p.Namespace) {
				system++
			}
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
				netns = append(netns, PodNetns{Path: path, Project: project, Pod: p.Namespace + "/" + p.Name})
			}
		}
	}
	for id := range s.warned {
		if !live[id] {
			delete(s.warned, id)
		}
	}
	slices.SortFunc(f.Members, func(a, b membership.Member) int {
		return cmp.Or(cmp.Compare(a.Cgroup, b.Cgroup), cmp.Compare(a.Project, b.Project))
	})
	slices.SortFunc(f.Skipped, func(a, b membership.Skipped) int { return cmp.Compare(a.Cgroup, b.Cgroup) })
	slices.SortFunc(netns, func(a, b PodNetns) int { return cmp.Compare(a.Path, b.Path) })
	return f, netns, system
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
		return fmt.Errorf("%w at %s did not answer within %s", ErrRuntime, ep, s.o.Timeout)
	case codes.Unimplemented:
		return fmt.Errorf("%w at %s does not serve the CRI v1 runtime service: %s", ErrRuntime, ep, st.Message())
	}
	return err
}
