// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
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
	system int             // pods of system namespaces in the last good poll
	warned map[string]bool // pod ids whose bad label was logged
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
	if s.err != nil || !slices.Equal(f.Members, s.found.Members) || !slices.Equal(f.Skipped, s.found.Skipped) || !slices.Equal(netns, s.netns) {
		s.notify()
	}
	s.err, s.found, s.netns, s.system = nil, f, netns, system
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
