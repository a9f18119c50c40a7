// SPDX-License-Identifier: Apache-2.0

package netnsscan_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/netnsscan"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"golang.org/x/sys/unix"
)

// BenchmarkSweep measures the scanner on a big node: 50,000 registered pod
// cgroups (kubepods/burstable/pod<i>, one container cgroup each: 100,000
// directories), 200 of them with a process in a network namespace of its
// own. One op is a whole sweep at the default budget; it reports the steps
// a sweep takes and the mean and largest time of one step (the work the
// control loop does per tick).
func BenchmarkSweep(b *testing.B) {
	testutil.RequireRoot(b)
	const pods, withNetns = 50_000, 200
	top := testutil.TempCgroup(b, testutil.Cgroup2Mount(b), "fairshare-netns-bench-")
	qos := filepath.Join(top, "kubepods", "burstable")
	if err := os.MkdirAll(qos, 0o755); err != nil {
		b.Fatal(err)
	}
	es := make([]membership.Entry, pods)
	start := time.Now()
	for i := range pods {
		pod := filepath.Join(qos, fmt.Sprintf("pod%08x-1f2e-4d3c-8b7a-%012x", i, i))
		if err := unix.Mkdir(pod, 0o755); err != nil {
			b.Fatal(err)
		}
		if err := unix.Mkdir(pod+"/ctr", 0o755); err != nil {
			b.Fatal(err)
		}
		es[i] = membership.Entry{Member: membership.Member{Project: fmt.Sprintf("tenant-%05d", i/5), Cgroup: pod}, Source: "registered"}
	}
	b.Logf("made %d cgroups in %s", 2*pods, time.Since(start).Round(time.Millisecond))
	for i := range withNetns {
		cmd := exec.Command("sleep", "600")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
		testutil.StartInCgroup(b, cmd, es[i*(pods/withNetns)].Cgroup+"/ctr")
	}
	s, err := netnsscan.New(netnsscan.Options{})
	if err != nil {
		b.Fatal(err)
	}
	s.SetMembers(es) // es is sorted: the paths differ only in the counter
	first, found := time.Now(), 0
	for {
		ch := s.Step()
		found += len(ch.New)
		if ch.Swept {
			break
		}
	}
	b.Logf("the first sweep found %d namespaces in %s", found, time.Since(first).Round(time.Millisecond))
	if found != withNetns {
		b.Fatalf("found %d namespaces, want %d", found, withNetns)
	}
	var steps int
	var worst, total time.Duration
	for b.Loop() {
		for {
			t0 := time.Now()
			ch := s.Step()
			d := time.Since(t0)
			steps++
			total += d
			worst = max(worst, d)
			if len(ch.Gone) != 0 {
				b.Fatalf("%d namespaces gone", len(ch.Gone))
			}
			if ch.Swept {
				break
			}
		}
	}
	b.ReportMetric(float64(steps)/float64(b.N), "steps/sweep")
	b.ReportMetric(float64(total.Microseconds())/float64(steps)/1000, "ms/step")
	b.ReportMetric(float64(worst.Microseconds())/1000, "max-ms/step")
	if st := s.Stats(); st.Errors != 0 {
		b.Fatalf("errors: %+v", st)
	}
}
