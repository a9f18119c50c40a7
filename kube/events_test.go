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
	defer cancel()
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
	// Nothing says when containerd has subscribed the stream (the events
	// before are not sent): pods are run until one is seen whole, its
	// sandbox's events and its container's.
	pods := map[string]*crtest.Pod{}     // by the sandbox's id
	seen := map[string]map[string]bool{} // by the sandbox's id
	whole := func(id string) bool {
		return seen[id]["sandbox CONTAINER_STARTED_EVENT"] && seen[id]["container CONTAINER_STARTED_EVENT"]
	}
	var p *crtest.Pod
	for deadline := time.Now().Add(30 * time.Second); p == nil; {
		q := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: fmt.Sprint("a", len(pods)), HostNetwork: true})
		pods[q.ID], seen[q.ID] = q, map[string]bool{}
		for next := time.After(3 * time.Second); p == nil; {
			var ev *rt.ContainerEventResponse
			select {
			case ev = <-evs:
			case err := <-streamed:
				t.Fatalf("%s: the stream ended: %v", v, err)
			case <-next:
			}
			if ev == nil {
				break // another pod
			}
			for id, pp := range pods {
				switch ev.ContainerId {
				case pp.ID:
					seen[id]["sandbox "+ev.ContainerEventType.String()] = true
					if ev.PodSandboxStatus.GetMetadata().GetNamespace() != "team-a" {
						t.Errorf("the sandbox's event carries %+v", ev.PodSandboxStatus.GetMetadata())
					}
				case pp.ContainerID:
					seen[id]["container "+ev.ContainerEventType.String()] = true
				}
				if whole(id) {
					p = pp
				}
			}
		}
		if p == nil && time.Now().After(deadline) {
			t.Fatalf("%s: the events of no new pod within 30s (%d pods run): %v", v, len(pods), seen)
		}
	}
	t.Logf("%s: the events of a new pod were seen whole (pods run: %d)", v, len(pods))
	cancel()
	if err := <-streamed; err != nil {
		t.Errorf("the stream, cancelled: %v", err)
	}

	s, logs := sourceOn(t, r, time.Hour)
	// The source says it follows the events (on a goroutine of its own,
	// not by the first poll) before it asks for them.
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(logs.String(), "following the container runtime's events"); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%s: the source does not say it follows the events:\n%s", v, logs)
		}
	}
	mount := testutil.Cgroup2Mount(t)
	// Pods are run until one is a member: the stream may not be open yet
	// for the first (polls once an hour: found by the events alone).
	deadline := time.Now().Add(30 * time.Second)
	for i := 0; ; i++ {
		q := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: fmt.Sprint("b", i), HostNetwork: true})
		took, ok := memberWithin(t, s, filepath.Join(mount, q.CgroupParent), 3*time.Second)
		if ok {
			t.Logf("%s: a new pod was a member %s after RunPod returned (by the events; polls once an hour; pods run: %d)", v, took.Round(time.Millisecond), i+1)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no new pod was a member within 30s (%d pods run), polling once an hour:\n%s", v, i+1, logs)
		}
	}

	// containerd restarts: the stream breaks, is said once, and is
	// followed again.
	r.Down(t)
	r.Up(t)
	// A pod run before the source subscribed again is found with the
	// next one's events.
	deadline = time.Now().Add(30 * time.Second)
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
