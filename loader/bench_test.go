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
	"github.com/cilium/ebpf/asm"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// moveSelf moves this process into the cgroup dir and back at the end.
func moveSelf(b testing.TB, dir string) {
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
func cycle(b testing.TB, lfd int, sa unix.Sockaddr) {
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
// with the programs attached and with nothing attached, interleaved in
// rounds within one run, and reports the overhead as the median of the
// per-round ratios, with their quartiles as the spread. A third side in
// every round attaches, at the same hooks, programs that return at once
// (floor-%): what the hooks cost on this kernel before a program does
// anything, a cost no program can go under. It then runs with BPF run-time
// stats on and reports ns per program run.
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

func benchListener(b testing.TB, wildcard bool) (int, unix.Sockaddr) {
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

// pinCPU keeps the calling goroutine on its thread and the thread on one
// CPU until the returned function runs. Both arms then run on the same core
// with the same caches (loopback delivers on the sending CPU, so the whole
// cycle stays there), and the scheduler cannot move one arm and not the
// other to a core another process is using.
func pinCPU(b testing.TB) func() {
	runtime.LockOSThread()
	var old, one unix.CPUSet
	if err := unix.SchedGetaffinity(0, &old); err != nil {
		b.Fatal(err)
	}
	cpu := 0
	for i := range runtime.NumCPU() {
		if old.IsSet(i) {
			cpu = i
		}
	}
	one.Set(cpu)
	if err := unix.SchedSetaffinity(0, &one); err != nil {
		b.Fatal(err)
	}
	return func() {
		if err := unix.SchedSetaffinity(0, &old); err != nil {
			b.Errorf("restoring the CPU affinity: %v", err)
		}
		runtime.UnlockOSThread()
	}
}

func benchCycle(b *testing.B, both, wildcard bool) {
	root := newRoot(b)
	pin := newPinDir(b)
	proj := mkProject(b, root, "bench")
	defer pinCPU(b)()
	var lfd int
	var sa unix.Sockaddr
	if !both {
		lfd, sa = benchListener(b, wildcard) // created outside the project
	}
	moveSelf(b, proj)
	if both {
		lfd, sa = benchListener(b, wildcard)
	}

	l, err := Open(Options{ProjectsRoot: root, PinDir: pin, PoolSize: benchPool})
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		l.Close()
		if err := Cleanup(pin); err != nil {
			b.Error(err)
		}
	}()
	// The sides differ only in the links: the programs and maps stay
	// loaded, so a round costs an attach and a detach (milliseconds), not a
	// load, and rounds can be short.
	floor := emptyPrograms(b)
	defer floor.Close()
	detach := func() { detachLinks(b, l) }
	attach := func(objs *limiterObjects) { attachLinks(b, l, objs) }
	detach()

	// Run-time stats add ~20 ns to every program run: the ratio is only
	// meaningful with them off (they are turned on below, after it).
	if on, err := os.ReadFile("/proc/sys/kernel/bpf_stats_enabled"); err == nil && strings.TrimSpace(string(on)) != "0" {
		b.Logf("kernel.bpf_stats_enabled is on: the overhead includes the stats' own cost")
	}
	// No collection during the rounds: the cycle allocates little, but a GC
	// landing in one side of a pair would be counted as overhead.
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	runtime.GC()

	// Many short rounds, alternating which side goes first. The machine is
	// shared: pairing adjacent measurements cancels its drift, and the
	// median over rounds leaves out the rounds another process disturbed
	// (a mean would take them in). Within a round each cycle is timed and
	// the side's time is its median cycle: the programs' cost is paid by
	// every cycle and moves the median, while a cycle preempted by another
	// process is an outlier. overhead-mean-% is the same from each round's
	// mean cycle instead, which also counts a cost only some cycles pay: the
	// two agree unless the programs have such a cost, or the machine is
	// busy. The quartiles over rounds are the spread. Each side starts with
	// a pause and a few untimed cycles: an attach or a detach leaves the
	// kernel deferred work (RCU callbacks, freed links) that would otherwise
	// run during, and be charged to, the next side's first cycles, and the
	// first connections after an attach find the programs and maps cold.
	const rounds, warm, settle = 100, 10, 5 * time.Millisecond
	per := max(b.N/(2*rounds), 50)
	times := make([]float64, per)
	const bare, floored, attached = 0, 1, 2
	run := func(side int) (med, mean float64) {
		b.StopTimer()
		switch side {
		case floored:
			attach(floor)
		case attached:
			attach(&l.objs)
		}
		time.Sleep(settle)
		for range warm {
			cycle(b, lfd, sa)
		}
		b.StartTimer()
		start := time.Now()
		for i := range per {
			cycle(b, lfd, sa)
			now := time.Now()
			times[i], start = float64(now.Sub(start).Nanoseconds()), now
		}
		b.StopTimer()
		if side != bare {
			detach()
		}
		b.StartTimer()
		var sum float64
		for _, t := range times {
			sum += t
		}
		return median(times), sum / float64(per)
	}
	var cycles [3][]float64
	var ratio, ratioMean, floorRatio []float64
	for i := range rounds {
		var med, mean [3]float64
		for k := range 3 { // each side goes first, second and third in turn
			side := (i + k) % 3
			med[side], mean[side] = run(side)
		}
		for side := range cycles {
			cycles[side] = append(cycles[side], med[side])
		}
		ratio = append(ratio, med[attached]/med[bare])
		ratioMean = append(ratioMean, mean[attached]/mean[bare])
		floorRatio = append(floorRatio, med[floored]/med[bare])
	}
	b.StopTimer()
	b.ReportMetric(median(cycles[bare]), "bare-ns/cycle")
	b.ReportMetric(median(cycles[attached]), "attached-ns/cycle")
	b.ReportMetric(100*(median(ratio)-1), "overhead-%")
	b.ReportMetric(100*(quantile(ratio, 0.25)-1), "overhead-q1-%")
	b.ReportMetric(100*(quantile(ratio, 0.75)-1), "overhead-q3-%")
	b.ReportMetric(100*(median(ratioMean)-1), "overhead-mean-%")
	b.ReportMetric(100*(median(floorRatio)-1), "floor-%")

	// Run time per program, with stats on (they add ~20 ns per run): the
	// median over rounds of each program's mean, for the same reason.
	attach(&l.objs)
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
	const statRounds, statPer = 8, 500
	perRun := map[string][]float64{}
	runs := map[string]uint64{}
	for range statRounds {
		before := read()
		for range statPer {
			cycle(b, lfd, sa)
		}
		after := read()
		for name := range progs {
			n := after[name].runs - before[name].runs
			if n == 0 {
				continue
			}
			runs[name] += n
			perRun[name] = append(perRun[name], float64(after[name].ns-before[name].ns)/float64(n))
		}
	}
	var total float64
	for name, xs := range perRun {
		ns, rc := median(xs), float64(runs[name])/(statRounds*statPer)
		b.ReportMetric(ns, name+"-ns/run")
		b.ReportMetric(rc, name+"-runs/cycle")
		total += ns * rc
	}
	b.ReportMetric(total, "bpf-ns/cycle")
}

// emptyPrograms loads, for each program the limiter attaches, one of the
// same type and attach point that returns at once and lets everything
// through: the floor side of BenchmarkConnectAcceptClose.
func emptyPrograms(b testing.TB) *limiterObjects {
	spec, err := loadLimiter()
	if err != nil {
		b.Fatal(err)
	}
	pass := map[ebpf.ProgramType]int32{
		ebpf.CGroupSockAddr: 1, // allow the connect
		ebpf.CGroupSock:     1, // allow the release
		ebpf.SkLookup:       1, // SK_PASS: the usual socket lookup
		ebpf.Tracing:        0,
	}
	load := func(name string) *ebpf.Program {
		ps := spec.Programs[name].Copy()
		ret, ok := pass[ps.Type]
		if !ok {
			b.Fatalf("%s: no pass value for program type %s", name, ps.Type)
		}
		ps.Instructions = asm.Instructions{asm.Mov.Imm(asm.R0, ret), asm.Return()}
		p, err := ebpf.NewProgram(ps)
		if err != nil {
			b.Fatalf("loading an empty %s: %v", name, err)
		}
		return p
	}
	return &limiterObjects{limiterPrograms: limiterPrograms{
		FsConnect4:    load("fs_connect4"),
		FsConnect6:    load("fs_connect6"),
		FsSendReset:   load("fs_send_reset"),
		FsDrop:        load("fs_drop"),
		FsSetState:    load("fs_set_state"),
		FsSkLookup:    load("fs_sk_lookup"),
		FsSockRelease: load("fs_sock_release"),
	}}
}

func median(xs []float64) float64 { return quantile(xs, 0.5) }

// quantile is the q-quantile of xs, the nearest rank.
func quantile(xs []float64, q float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[int(q*float64(len(s)-1)+0.5)]
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
