// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	rt "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/fairshare-dev/fairshare/internal/crtest"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

func TestEventsShared(t *testing.T) {
	for _, c := range []struct {
		name, version string
		follow        bool
	}{
		{"containerd", "v2.4.2", true},
		{"containerd", "2.0.0", true},
		{"containerd", "v10.1", true},
		{"containerd", "1.6.20~ds1", false},
		{"containerd", "v1.7.27", false},
		{"containerd", "", false},
		{"containerd", "dev", false},
		{"cri-o", "1.31.0", false},
	} {
		if why := EventsShared(c.name, c.version); (why == "") != c.follow {
			t.Errorf("EventsShared(%q, %q) = %q; want follow %v", c.name, c.version, why, c.follow)
		}
	}
}

// memberWithin waits for a member in cgroup cg, scanning, and returns how
// long it took.
func memberWithin(t *testing.T, s *Source, cg string, within time.Duration) (time.Duration, bool) {
	t.Helper()
	start := time.Now()
	for time.Since(start) < within {
		if f, err := s.Scan(context.Background()); err == nil &&
			slices.ContainsFunc(f.Members, func(m membership.Member) bool { return m.Cgroup == cg }) {
			return time.Since(start), true
		}
		time.Sleep(2 * time.Millisecond)
	}
	return within, false
}

// sourceOn is a Source over the runtime r polling every period, its log
// kept.
func sourceOn(t *testing.T, r *crtest.Runtime, every time.Duration) (*Source, *testutil.Buffer) {
	t.Helper()
	cri, err := DialCRI(r.Socket)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testutil.Buffer{}
	s := NewSource(SourceOptions{CRI: cri, Rules: labelledRules(), Mount: testutil.Cgroup2Mount(t),
		Every: every, Log: slog.New(slog.NewTextHandler(logs, nil))})
	t.Cleanup(func() { s.Close() })
	if _, err := scanUntil(t, s, "the first poll", read); err != nil {
		t.Fatal(err)
	}
	return s, logs
}

// TestEventsFallbackContainerd16: Debian's containerd 1.6 has no container
// events: the stream says ErrNoEvents (Unimplemented), the source is not
// made to follow it (EventsShared: containerd before 2 shares its events
// with kubelet) and says so once, and a new pod is found by the polls.
func TestEventsFallbackContainerd16(t *testing.T) {
	r := crtest.Start(t)
	v := r.Version(t)
	if !strings.HasPrefix(v, "containerd 1.6") {
		t.Skipf("the containerd on PATH is %s, not 1.6", v)
	}
	cri, err := DialCRI(r.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cri.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err = cri.Events(ctx, func(*rt.ContainerEventResponse) { t.Error("an event from containerd 1.6") })
	if !errors.Is(err, ErrNoEvents) {
		t.Fatalf("container events of containerd 1.6: %v, want ErrNoEvents", err)
	}

	const every = 500 * time.Millisecond
	s, logs := sourceOn(t, r, every)
	p := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})
	took, ok := memberWithin(t, s, filepath.Join(testutil.Cgroup2Mount(t), p.CgroupParent), 10*time.Second)
	if !ok {
		t.Fatal("a new pod was not found by the polls within 10s")
	}
	t.Logf("%s: a new pod was a member %s after RunPod returned (polls every %s)", v, took.Round(time.Millisecond), every)
	if n := strings.Count(logs.String(), "the container runtime's events are not followed"); n != 1 {
		t.Errorf("the fallback was said %d times, want once:\n%s", n, logs)
	}
}

// TestEventsContainerd2 runs a containerd 2.x ($FAIRSHARE_CONTAINERD2): its
// stream gives the sandbox's events (created, started, the sandbox's id as
// the container's) and the container's, and a source polling once an hour
// finds a new pod within seconds, by the events alone; after containerd
// restarts the stream is followed again.
func TestEventsContainerd2(t *testing.T) {
	r := crtest.StartContainerd2(t)
	v := r.Version(t)
	cri, err := DialCRI(r.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer cri.Close()
	ctx, cancel := context.WithCancel(context.Background())
	evs := make(chan *rt.ContainerEventResponse, 64)
	streamed := make(chan error, 1)
	go func() {
		streamed <- cri.Events(ctx, func(ev *rt.ContainerEventResponse) {
			select {
			case evs <- ev:
			default:
			}
		})
	}()
	time.Sleep(200 * time.Millisecond) // subscribed (an event before is not sent)
	p := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "a", HostNetwork: true})
	seen := map[string]bool{}
	for deadline := time.After(10 * time.Second); !seen["sandbox CONTAINER_STARTED_EVENT"] || !seen["container CONTAINER_STARTED_EVENT"]; {
		select {
		case ev := <-evs:
			switch ev.ContainerId {
			case p.ID:
				seen["sandbox "+ev.ContainerEventType.String()] = true
				if ev.PodSandboxStatus.GetMetadata().GetNamespace() != "team-a" {
					t.Errorf("the sandbox's event carries %+v", ev.PodSandboxStatus.GetMetadata())
				}
			case p.ContainerID:
				seen["container "+ev.ContainerEventType.String()] = true
			}
		case <-deadline:
			t.Fatalf("%s: events of a new pod within 10s: %v", v, seen)
		}
	}
	cancel()
	if err := <-streamed; err != nil {
		t.Errorf("the stream, cancelled: %v", err)
	}

	s, logs := sourceOn(t, r, time.Hour)
	if !strings.Contains(logs.String(), "following the container runtime's events") {
		t.Errorf("%s: the source does not say it follows the events:\n%s", v, logs)
	}
	mount := testutil.Cgroup2Mount(t)
	q := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "b", HostNetwork: true})
	took, ok := memberWithin(t, s, filepath.Join(mount, q.CgroupParent), 10*time.Second)
	if !ok {
		t.Fatalf("%s: a new pod was no member within 10s, polling once an hour:\n%s", v, logs)
	}
	t.Logf("%s: a new pod was a member %s after RunPod returned (by the events; polls once an hour)", v, took.Round(time.Millisecond))

	// containerd restarts: the stream breaks, is said once, and is
	// followed again.
	r.Down(t)
	r.Up(t)
	// A pod run before the source subscribed again is found with the
	// next one's events.
	deadline := time.Now().Add(30 * time.Second)
	for i := 0; ; i++ {
		c := r.RunPod(t, crtest.PodSpec{Namespace: "team-c", Name: fmt.Sprint("c", i), HostNetwork: true})
		if _, ok := memberWithin(t, s, filepath.Join(mount, c.CgroupParent), 3*time.Second); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no new pod found by the events after a restart of containerd:\n%s", v, logs)
		}
	}
	if n := strings.Count(logs.String(), "event stream broke"); n != 1 {
		t.Errorf("the broken stream was said %d times, want once:\n%s", n, logs)
	}
}
