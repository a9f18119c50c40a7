// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// With listenEnv set, the test binary is a project's server: it listens on
// 127.0.0.1:0, prints "listening ADDR", accepts and holds connections until
// its stdin closes.
const listenEnv = "FAIRSHARE_E2E_LISTEN"

func listenHelper() {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		fmt.Println("error", err)
		os.Exit(1)
	}
	fmt.Println("listening", ln.Addr())
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer c.Close()
		}
	}()
	bufio.NewReader(os.Stdin).ReadString('\n')
	os.Exit(0)
}

// listenIn starts a server in project (created under the node's root) and
// returns its address.
func (n *node) listenIn(project string) netip.AddrPort {
	n.t.Helper()
	return listenInCgroup(n.t, n.mkProject(project)) // a member before it listens
}

// listenInCgroup starts a server in cgroup cg and returns its address.
func listenInCgroup(t *testing.T, cg string) netip.AddrPort {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "-test.run=^$")
	cmd.Env = append(cleanEnv(), listenEnv+"=1")
	stdin, out := testutil.Pipes(t, cmd)
	testutil.StartInCgroup(t, cmd, cg)
	t.Cleanup(func() { stdin.Close(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	addr, ok := strings.CutPrefix(strings.TrimSpace(line), "listening ")
	if err != nil || !ok {
		t.Fatalf("listen helper said %q (%v)", line, err)
	}
	return netip.MustParseAddrPort(addr)
}

// TestKernelRefusalEvents: a connect and a SYN refused by the BPF programs
// come out of 'fairshare events --json' with the project, direction, both
// ends, the rule's inputs and the reason; a flood of refused connects gives
// at most events.per_sec events a second for the project and one dropped
// event per second with the rest.
func TestKernelRefusalEvents(t *testing.T) {
	const perSec = 5
	n := newNode(t, fmt.Sprintf("pools: {connections: {size: 2, floor: 1}}\nevents: {per_sec: %d}\n", perSec))
	n.start()
	sink, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testutil.Sink(t, sink)
	dst := netip.MustParseAddrPort(sink.Addr().String())
	alpha := n.connectFrom("alpha", dst.String(), 3)
	defer alpha.close()
	if alpha.connected != 2 || alpha.refused != 1 {
		t.Fatalf("alpha: %d connected, %d refused; want 2 and 1", alpha.connected, alpha.refused)
	}
	srv := n.listenIn("srv")
	c, err := net.DialTimeout("tcp4", srv.String(), 3*time.Second)
	if !errors.Is(err, syscall.ECONNREFUSED) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("a SYN to srv on a full pool: %v, want ECONNREFUSED", err)
	}
	var conn, syn events.Event
	eventually(t, func() error {
		for _, e := range n.events("--pool", "connections") {
			if e.Source == events.SourceKernel && e.Kind == events.KindRefused {
				switch e.Direction {
				case "connect":
					conn = e
				case "syn":
					syn = e
				}
			}
		}
		if conn.Project == "" || syn.Project == "" {
			return fmt.Errorf("kernel refusals not all seen: connect %+v, syn %+v", conn, syn)
		}
		return nil
	})
	if conn.Project != "alpha" || conn.Remote != dst.String() || conn.Local != "" || conn.Reason != events.ReasonShare ||
		conn.Held != 2 || conn.InUse != 2 || conn.Share != 2 || conn.PoolSize != 2 || conn.Pool != "connections" {
		t.Errorf("connect refusal: %+v", conn)
	}
	if syn.Project != "srv" || syn.Local != srv.String() || !strings.HasPrefix(syn.Remote, "127.0.0.1:") || syn.Reason != events.ReasonPoolFull ||
		syn.Held != 0 || syn.InUse != 2 || syn.Share != 1 || syn.PoolSize != 2 {
		t.Errorf("SYN refusal: %+v", syn)
	}

	// The flood.
	const flood = 300
	start := time.Now()
	fl := n.connectFrom("alpha", dst.String(), flood)
	fl.close()
	secs := int(time.Since(start)/time.Second) + 1
	if fl.refused != flood {
		t.Fatalf("flood: %d refused of %d", fl.refused, flood)
	}
	var got, dropped uint64
	eventually(t, func() error {
		got, dropped = 0, 0
		for _, e := range n.events("--project", "alpha") {
			if e.Source != events.SourceKernel {
				continue
			}
			switch e.Kind {
			case events.KindRefused:
				got++
			case events.KindDropped:
				dropped += e.Count
			}
		}
		if got+dropped != flood+1 {
			return fmt.Errorf("alpha: %d events and %d dropped, want %d in all", got, dropped, flood+1)
		}
		return nil
	})
	if bound := uint64((secs + 1) * (perSec + runtime.NumCPU())); got > bound || dropped == 0 {
		t.Errorf("%d refusals in %d s: %d events (bound %d), %d dropped", flood+1, secs, got, bound, dropped)
	}
	if m := n.metrics(); !strings.Contains(m, fmt.Sprintf(`fairshare_events_dropped_total{where="kernel"} %d`, dropped)) {
		t.Errorf("/metrics does not count the %d dropped in the kernel", dropped)
	}
	t.Logf("%d refusals in %d s: %d events, %d dropped", flood+1, secs, got, dropped)
}

// TestKernelDryRun: the connections pool in dry-run (enforce: false)
// admits connects past POOL, counting each would-be refusal in status,
// /metrics and events; a project's own dry-run ('policy set
// --enforce=false') does so in an enforcing pool, live.
func TestKernelDryRun(t *testing.T) {
	sink, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	testutil.Sink(t, sink)
	for _, tc := range []struct{ name, yaml string }{
		{"pool", "pools: {connections: {size: 2, floor: 1, enforce: false}}\n"},
		{"project", "pools: {connections: {size: 2, floor: 1}}\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := newNode(t, tc.yaml)
			n.start()
			if tc.name == "project" {
				// The project's cgroup first: the kernel learns of a
				// dry-run at once for a cgroup that exists, at the next
				// tick for one made later.
				if err := os.MkdirAll(filepath.Join(n.root, "alpha"), 0o755); err != nil {
					t.Fatal(err)
				}
				if _, errOut, code := n.cli("policy", "set", "--enforce=false", "alpha"); code != 0 {
					t.Fatalf("policy set: %s", errOut)
				}
			}
			alpha := n.connectFrom("alpha", sink.Addr().String(), 4)
			defer alpha.close()
			if alpha.connected != 4 {
				t.Fatalf("dry-run: %d of 4 connected (pool 2)", alpha.connected)
			}
			eventually(t, func() error {
				p := pool(n.status(), "connections")
				pr := project(p, "alpha")
				if p.InUse != 4 || pr.WouldRefuse != 2 || p.WouldRefuse != 2 || p.Refused != 0 || p.DryRun != (tc.name == "pool") || pr.DryRun != (tc.name == "project") {
					return fmt.Errorf("connections in dry-run: %+v", p)
				}
				return nil
			})
			would := ofKind(n.events("--project", "alpha"), events.SourceKernel, events.KindWouldRefuse)
			if len(would) != 2 || would[0].Held != 2 || would[1].Held != 3 || would[0].Direction != "connect" {
				t.Errorf("would_refuse events: %+v", would)
			}
			if m := n.metrics(); !strings.Contains(m, `fairshare_project_would_refuse_total{pool="connections",project="alpha"} 2`) {
				t.Errorf("/metrics lacks alpha's 2 would-be refusals")
			}
			if tc.name == "project" {
				// Another project is refused for real, and alpha again
				// once its dry-run ends.
				if beta := n.connectFrom("beta", sink.Addr().String(), 1); beta.refused != 1 {
					t.Errorf("beta in an enforcing pool: %+v", beta)
				} else {
					beta.close()
				}
				if _, errOut, code := n.cli("policy", "set", "--enforce=true", "alpha"); code != 0 {
					t.Fatalf("policy set: %s", errOut)
				}
				if a := n.connectFrom("alpha", sink.Addr().String(), 1); a.refused != 1 {
					t.Errorf("alpha enforced again: %+v", a)
				} else {
					a.close()
				}
			}
		})
	}
}
