// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"bufio"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// moveSelf moves this process into the cgroup dir and back at the end.
func moveSelf(b *testing.B, dir string) {
	b.Helper()
	f, err := os.Open("/proc/self/cgroup")
	if err != nil {
		b.Fatal(err)
	}
	var orig string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			orig = p
		}
	}
	f.Close()
	mnt, err := Cgroup2Mount()
	if err != nil {
		b.Fatal(err)
	}
	pid := []byte(strconv.Itoa(os.Getpid()))
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), pid, 0); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if err := os.WriteFile(filepath.Join(mnt, orig, "cgroup.procs"), pid, 0); err != nil {
			b.Errorf("moving back to %s: %v", orig, err)
		}
	})
}

// benchPool is the connection pool of the benchmark: a large node's. The
// size matters because the permit map is sized from it.
const benchPool = 10000

// cycle is one loopback connect + accept + close of both ends, with raw
// syscalls so that the Go runtime adds as little as possible around them.
func cycle(b *testing.B, lfd int, sa unix.Sockaddr) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	if err := unix.Connect(fd, sa); err != nil {
		b.Fatal(err)
	}
	afd, _, err := unix.Accept4(lfd, unix.SOCK_CLOEXEC)
	if err != nil {
		b.Fatal(err)
	}
	unix.Close(fd)
	unix.Close(afd)
}

// BenchmarkConnectAcceptClose measures a loopback connect+accept+close cycle
// (both ends in one project, so it runs the outbound and the inbound path)
// with the programs attached and with nothing attached, interleaved in
// rounds within one run, and reports the ratio of the medians. It then runs
// with BPF run-time stats on and reports ns per program run.
//
// "outbound": the listener is outside the projects, only the client side
// takes a permit. "both": client and listener are in the project, the cycle
// takes two permits (one per side). "both-wildcard": the same with the
// listener on 0.0.0.0, as most servers listen.
func BenchmarkConnectAcceptClose(b *testing.B) {
	testutil.RequireRoot(b)
	b.Run("outbound", func(b *testing.B) { benchCycle(b, false, false) })
	b.Run("both", func(b *testing.B) { benchCycle(b, true, false) })
	b.Run("both-wildcard", func(b *testing.B) { benchCycle(b, true, true) })
}

func benchListener(b *testing.B, wildcard bool) (int, unix.Sockaddr) {
	lfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { unix.Close(lfd) })
	addr := [4]byte{127, 0, 0, 1}
	if wildcard {
		addr = [4]byte{}
	}
	if err := unix.Bind(lfd, &unix.SockaddrInet4{Addr: addr}); err != nil {
		b.Fatal(err)
	}
	if err := unix.Listen(lfd, 128); err != nil {
		b.Fatal(err)
	}
	sa, err := unix.Getsockname(lfd)
	if err != nil {
		b.Fatal(err)
	}
	if in4, ok := sa.(*unix.SockaddrInet4); ok && wildcard {
		in4.Addr = [4]byte{127, 0, 0, 1}
	}
	return lfd, sa
}

func benchCycle(b *testing.B, both, wildcard bool) {
	root := newRoot(b)
	pin := newPinDir(b)
	proj := mkProject(b, root, "bench")
	var lfd int
	var sa unix.Sockaddr
	if !both {
		lfd, sa = benchListener(b, wildcard) // created outside the project
	}
	moveSelf(b, proj)
	if both {
		lfd, sa = benchListener(b, wildcard)
	}

	open := func() *Limiter {
		l, err := Open(Options{ProjectsRoot: root, PinDir: pin, PoolSize: benchPool})
		if err != nil {
			b.Fatal(err)
		}
		return l
	}
	shut := func(l *Limiter) {
		l.Close()
		if err := Cleanup(pin); err != nil {
			b.Fatal(err)
		}
	}

	// Run-time stats add ~20 ns to every program run: the ratio is only
	// meaningful with them off (they are turned on below, after it).
	if on, err := os.ReadFile("/proc/sys/kernel/bpf_stats_enabled"); err == nil && strings.TrimSpace(string(on)) != "0" {
		b.Logf("kernel.bpf_stats_enabled is on: the overhead includes the stats' own cost")
	}
	// No collection during the rounds: the cycle allocates little, but a GC
	// landing in one side of a pair would be counted as overhead.
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	runtime.GC()

	// Rounds alternate which side goes first, and the overhead is the median
	// of the per-round ratios: the machine is shared, and pairing adjacent
	// measurements cancels most of its drift.
	const rounds = 15
	per := max(b.N/(2*rounds), 50)
	run := func(on bool) float64 {
		b.StopTimer()
		var l *Limiter
		if on {
			l = open()
		}
		b.StartTimer()
		start := time.Now()
		for range per {
			cycle(b, lfd, sa)
		}
		ns := float64(time.Since(start).Nanoseconds()) / float64(per)
		b.StopTimer()
		if on {
			shut(l)
		}
		b.StartTimer()
		return ns
	}
	var bare, attached, ratio []float64
	for i := range rounds {
		var nb, na float64
		if i%2 == 0 {
			nb, na = run(false), run(true)
		} else {
			na, nb = run(true), run(false)
		}
		bare, attached, ratio = append(bare, nb), append(attached, na), append(ratio, na/nb)
	}
	b.StopTimer()
	b.ReportMetric(median(bare), "bare-ns/cycle")
	b.ReportMetric(median(attached), "attached-ns/cycle")
	b.ReportMetric(100*(median(ratio)-1), "overhead-%")

	// Run time per program, with stats on (they add ~20 ns per run).
	l := open()
	defer shut(l)
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Logf("bpf stats unavailable: %v", err)
		return
	}
	defer stats.Close()
	progs := map[string]*ebpf.Program{
		"connect4": l.objs.FsConnect4, "sock_release": l.objs.FsSockRelease,
		"set_state": l.objs.FsSetState, "sk_lookup": l.objs.FsSkLookup,
	}
	type st struct{ runs, ns uint64 }
	read := func() map[string]st {
		out := map[string]st{}
		for name, p := range progs {
			ps, err := p.Stats()
			if err != nil {
				b.Fatal(err)
			}
			out[name] = st{ps.RunCount, uint64(ps.Runtime)}
		}
		return out
	}
	before := read()
	const n = 2000
	for range n {
		cycle(b, lfd, sa)
	}
	after := read()
	var total float64
	for name := range progs {
		runs := after[name].runs - before[name].runs
		ns := after[name].ns - before[name].ns
		if runs == 0 {
			continue
		}
		b.ReportMetric(float64(ns)/float64(runs), name+"-ns/run")
		b.ReportMetric(float64(runs)/n, name+"-runs/cycle")
		total += float64(ns) / n
	}
	b.ReportMetric(total, "bpf-ns/cycle")
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

// BenchmarkReadSlots reads the held-permit slots as a reconcile pass does,
// for a pool of 4096 and of 65536 (2 x POOL slots, half of them held), in
// batches (readSlots) and, for comparison, one entry per lookup.
func BenchmarkReadSlots(b *testing.B) {
	testutil.RequireRoot(b)
	for _, pool := range []uint32{4096, 65536} {
		root, pin := newRoot(b), newPinDir(b)
		l := openLimiter(b, root, pin, pool, 0)
		for i := uint32(0); i < l.held; i += 2 {
			slot := limiterFsSlot{Cookie: uint64(i) | 1<<40, Sock: limiterFsSock{Project: 1, Kind: 1}}
			if err := l.objs.FsSlots.Put(i, slot); err != nil {
				b.Fatal(err)
			}
		}
		want := int(l.held / 2)
		b.Run("batch/pool="+strconv.Itoa(int(pool)), func(b *testing.B) {
			for b.Loop() {
				n := 0
				if err := l.readSlots(func(uint64, limiterFsSock) { n++ }); err != nil {
					b.Fatal(err)
				}
				if n != want {
					b.Fatalf("read %d held slots, want %d", n, want)
				}
			}
		})
		b.Run("iterate/pool="+strconv.Itoa(int(pool)), func(b *testing.B) {
			for b.Loop() {
				n := 0
				var idx uint32
				var slot limiterFsSlot
				it := l.objs.FsSlots.Iterate()
				for it.Next(&idx, &slot) {
					if slot.Cookie != 0 && slot.Cookie&slotBusy == 0 {
						n++
					}
				}
				if err := it.Err(); err != nil || n != want {
					b.Fatalf("read %d held slots, want %d: %v", n, want, err)
				}
			}
		})
		// The slots are not real permits: clear them before Cleanup.
		for i := uint32(0); i < l.held; i += 2 {
			_ = l.objs.FsSlots.Put(i, limiterFsSlot{})
		}
	}
}
