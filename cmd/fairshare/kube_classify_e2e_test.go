// SPDX-License-Identifier: Apache-2.0

package main

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/crtest"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// classifyRoundsEnv sets how many pods TestPodClassified times (default 3;
// the figures in docs/kubernetes.md are medians of 10).
const classifyRoundsEnv = "FAIRSHARE_CLASSIFY_ROUNDS"

// TestPodClassified times, on the daemon binary with BPF on a real
// containerd, the time from RunPodSandbox to the pod's cgroup being a
// member of its project in the kernel (in the pinned fs_members map, where
// the programs look it up): by the polls on Debian's containerd 1.6, by the
// container events on a containerd 2.x when $FAIRSHARE_CONTAINERD2 names
// one. It logs the median; it asserts only that each pod becomes a member.
func TestPodClassified(t *testing.T) {
	rounds := 3
	if v, err := strconv.Atoi(os.Getenv(classifyRoundsEnv)); err == nil && v > 0 {
		rounds = v
	}
	t.Run("containerd", func(t *testing.T) { classifyRounds(t, crtest.Start(t), rounds) })
	t.Run("containerd2", func(t *testing.T) { classifyRounds(t, crtest.StartContainerd2(t), rounds) })
}

func classifyRounds(t *testing.T, r *crtest.Runtime, rounds int) {
	v := r.Version(t)
	n := kubeNode(t, r, "")
	n.start()
	// run --check says which way new pods are found.
	want := "new pods are found by the polls, each tick"
	if strings.HasPrefix(v, "containerd 2") {
		want = "new pods are read at its container events"
	}
	if out, errOut, code := runCLI(t, "run", "--check", "--config", n.cfg); code != 0 || !strings.Contains(out, want) {
		t.Errorf("run --check on %s: exit %d, want %q\n%s%s", v, code, want, out, errOut)
	}
	members, err := ebpf.LoadPinnedMap(filepath.Join(n.pin, "fs_members"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer members.Close()
	mnt := testutil.Cgroup2Mount(t)
	var fromCall, fromReady []time.Duration
	for i := range rounds {
		uid := crtest.NewUID()
		dir := filepath.Join(mnt, "kubepods/burstable/pod"+uid)
		found := make(chan time.Time, 1)
		stop := make(chan struct{})
		go func() {
			val := make([]byte, members.ValueSize())
			for {
				select {
				case <-stop:
					return
				default:
				}
				if id, err := cgroup.ID(dir); err == nil {
					if err := members.Lookup(&id, &val); err == nil {
						found <- time.Now()
						return
					}
				}
				time.Sleep(500 * time.Microsecond)
			}
		}()
		p := r.RunPod(t, crtest.PodSpec{Namespace: "team-" + strconv.Itoa(i), Name: "p", UID: uid, HostNetwork: true})
		select {
		case at := <-found:
			fromCall = append(fromCall, at.Sub(p.Called))
			fromReady = append(fromReady, at.Sub(p.Ready))
		case <-time.After(10 * time.Second):
			close(stop)
			t.Fatalf("%s: pod %d was no member in the kernel 10s after RunPodSandbox returned", v, i)
		}
		close(stop)
		r.RemovePod(t, p)
	}
	t.Logf("%s, tick 1s: RunPodSandbox called to member in the kernel: median %s of %d (%v); from its return: median %s",
		v, median(fromCall), rounds, fromCall, median(fromReady))
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return (s[(len(s)-1)/2] + s[len(s)/2]) / 2
}
