// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
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

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/destination"
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
	mnt := testutil.Cgroup2Mount(b)
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
	fd, afd := connectPair(b, lfd, sa)
	unix.Close(fd)
	unix.Close(afd)
}

// connectPair connects a new socket to sa and accepts it from the listener
// lfd: the client's and the server's ends.
func connectPair(b testing.TB, lfd int, sa unix.Sockaddr) (fd, afd int) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	if err := unix.Connect(fd, sa); err != nil {
		b.Fatal(err)
	}
	afd, _, err = unix.Accept4(lfd, unix.SOCK_CLOEXEC)
	if err != nil {
		b.Fatal(err)
	}
	return fd, afd
}

// BenchmarkConnectAcceptClose measures a loopback connect+accept+close cycle
// with the programs attached and with nothing attached, interleaved in
// rounds within one run, and reports the overhead as the median of the
// per-round ratios, with their quartiles as the spread. A third side in
// every round attaches, at the same hooks, programs that return at once
// (floor-%): what the hooks cost on this kernel before a program does
// anything, a cost no program can go under; above-floor-% is the median
// over rounds of what ours add to it. A fourth side is what an operator
// would write instead: an nftables rule per cgroup, "socket cgroupv2 level
// N <path> ct count over K reject with tcp reset" at output and input
// (nft-%), with fairshare's overhead reported as a ratio to it
// (fairshare/nft); it is left out, with a message, where nft is not
// installed. It then runs with BPF run-time stats on and reports ns per
// program run, ours and the empty programs'.
//
// "outbound": the listener is outside the projects, only the client side
// takes a permit. "both": client and listener are in the project, the cycle
// takes two permits (one per side). "both-wildcard": the same with the
// listener on 0.0.0.0, as most servers listen. The "-rated" variants give
// the project a rate of new connections (SetRate) it never reaches (1e9/s):
// every connect and SYN takes a token, the cost a limited project pays;
// "-other-rated" gives the rate to another project, the cost to a project
// without one on a node where some have one.
func BenchmarkConnectAcceptClose(b *testing.B) {
	testutil.RequireRoot(b)
	b.Run("outbound", func(b *testing.B) { benchCycle(b, false, false, rateNone) })
	b.Run("both", func(b *testing.B) { benchCycle(b, true, false, rateNone) })
	b.Run("both-wildcard", func(b *testing.B) { benchCycle(b, true, true, rateNone) })
	b.Run("outbound-rated", func(b *testing.B) { benchCycle(b, false, false, rateOwn) })
	b.Run("both-rated", func(b *testing.B) { benchCycle(b, true, false, rateOwn) })
	b.Run("both-other-rated", func(b *testing.B) { benchCycle(b, true, false, rateOther) })
	b.Run("outbound-lowerbound", func(b *testing.B) { benchCycle(b, false, false, rateLowerBound) })
	b.Run("both-lowerbound", func(b *testing.B) { benchCycle(b, true, false, rateLowerBound) })
	b.Run("outbound-dests", benchDests)
	b.Run("outbound-dests-lowerbound", benchDestsLowerBound)
}

// benchDests is what destination pools (dest.go) cost connect4: its run
// time from BPF stats, for 1 and 64 pools configured, a connect matching a
// pool's host ("match"), matching none and stopped by the filter ("miss";
// "miss-other16" beside a pool of every port in another /16 of its first
// octet, "miss-exact" beside a /8 of every port, which the quick word's
// lanes cannot hold; "miss-port-lookup" beside a pool of another host at
// the port connected to, another database at the same port, stopped by
// the host's fingerprint), and matching none past the filter, a probe of
// the table at a length it holds ("miss-lookup": beside such a pool in its
// /16), each
// against the same programs with no pool in
// force ("none": no kinds in dest_kinds, the path of a node without pools); and, as
// "dests-1-prefix", the same with the one pool a /24 around the host. The
// cases take turns in blocks of 250 cycles, 40 turns, with the links
// attached throughout: the load of this shared machine moves between
// seconds, so each case's difference from "none" is taken within a turn and
// the median over turns is reported (dests-N-case-above-ns/run); for
// "match" the release paths' cost too (sock_release and set_state, per
// cycle: dests-N-match-release-above-ns/cycle). "none-again" is "none"
// measured again in the turn's last block: its difference from the first
// is the bias of a block's place in the turn, the noise floor of the
// others. Of the 64 pools half name a port and half take every port (IPv6
// prefixes: the filter stops IPv4 at them), and the matching one is last.
func benchDests(b *testing.B) {
	l, _, lfd, sa, lfdB, saB := destBench(b, 66)
	port := sa.(*unix.SockaddrInet4).Port
	pool := func(name, dest string) DestPool {
		ds, err := destination.ParseAll([]string{dest})
		if err != nil {
			b.Fatal(err)
		}
		return DestPool{Name: name, Size: benchPool, Destinations: ds}
	}
	mine := pool("db", "127.0.0.1/32:"+strconv.Itoa(port))
	// Extra pools of every port beside each set, not matching B: in
	// another /16 of its first octet (10.9.0.0/16 beside a pod's
	// 10.244.x: the filter stops it), a /8 (more /16s than the quick
	// word's lanes: the exact filter stops it), and in its /16, past the
	// filter (a probe of the table at its length).
	extras := []struct {
		miss  string
		pools []DestPool
	}{{"", nil}, {"miss-other16", []DestPool{pool("near16", "127.9.0.0/16")}},
		{"miss-exact", []DestPool{pool("wide", "10.0.0.0/8")}},
		{"miss-lookup", []DestPool{pool("near", "127.0.0.2/31")}},
		{"miss-port-lookup", []DestPool{pool("nearport", "127.0.0.2/32:"+strconv.Itoa(saB.(*unix.SockaddrInet4).Port))}}}
	var many []DestPool
	for i := range 63 {
		d := fmt.Sprintf("10.%d.%d.0/24:5432", i/8, i%8)
		if i%2 == 1 {
			d = fmt.Sprintf("[2001:db8:%x::]/48", i)
		}
		many = append(many, pool(fmt.Sprintf("p%d", i), d))
	}
	sets := []struct {
		name  string
		pools []DestPool
	}{{"dests-1", []DestPool{mine}}, {"dests-64", append(many, mine)},
		{"dests-1-prefix", []DestPool{pool("db", "127.0.0.0/24:"+strconv.Itoa(port))}}}
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Skipf("bpf stats unavailable: %v", err)
	}
	defer stats.Close()
	progs := [3]*ebpf.Program{l.objs.FsConnect4, l.objs.FsSockRelease, l.objs.FsSetState}
	var release []float64 // the last block's release cost, beside its return value
	block := func(fd int, to unix.Sockaddr) float64 {
		c, r := connectCost(b, progs, fd, to)
		release = append(release, r)
		return c
	}
	// lastRelease is the release cost of the block that ran last.
	lastRelease := func() float64 { return release[len(release)-1] }
	turns := max(b.N/50000, 10)
	b.ResetTimer()
	for _, set := range sets {
		var kinds uint32
		above := map[string][]float64{}
		relAbove := map[string][]float64{}
		var none []float64
		for _, extra := range extras {
			ps := append(slices.Clone(set.pools), extra.pools...)
			if err := l.SetDestPools(ps); err != nil {
				b.Fatal(err)
			}
			var cfg limiterFsSettings
			if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
				b.Fatal(err)
			}
			kinds = cfg.DestKinds & destKindsMask
			for range 100 {
				cycle(b, lfd, sa)
			}
			for range turns {
				if err := l.setDestKinds(0); err != nil {
					b.Fatal(err)
				}
				base := block(lfd, sa)
				relBase := lastRelease()
				if err := l.setDestKinds(kinds); err != nil {
					b.Fatal(err)
				}
				if extra.miss != "" {
					above[extra.miss] = append(above[extra.miss], block(lfdB, saB)-base)
					continue
				}
				none = append(none, base)
				above["match"] = append(above["match"], block(lfd, sa)-base)
				relAbove["match"] = append(relAbove["match"], lastRelease()-relBase)
				above["miss"] = append(above["miss"], block(lfdB, saB)-base)
				if err := l.setDestKinds(0); err != nil {
					b.Fatal(err)
				}
				above["none-again"] = append(above["none-again"], block(lfdB, saB)-base)
				relAbove["none-again"] = append(relAbove["none-again"], lastRelease()-relBase)
			}
		}
		b.ReportMetric(median(none), set.name+"-none-connect4-ns/run")
		for _, c := range []string{"match", "miss", "miss-other16", "miss-exact", "miss-lookup", "miss-port-lookup", "none-again"} {
			b.ReportMetric(median(above[c]), set.name+"-"+c+"-above-ns/run")
		}
		for _, c := range []string{"match", "none-again"} {
			b.ReportMetric(median(relAbove[c]), set.name+"-"+c+"-release-above-ns/cycle")
		}
		if d := destSnap(b, l, "db"); d.Projects == nil || d.Projects[0].Admitted == 0 {
			b.Fatalf("the pool was not in force: %+v", d)
		}
	}
	b.StopTimer()
}

// destBench is the setting of the destination pools' benchmarks: this
// goroutine's thread on one CPU and in project "bench" (cgroup proj), two
// listeners outside the projects, A (lfd at sa) and B, and a limiter with
// room for maxPools destination pools; all undone when the benchmark ends.
func destBench(b *testing.B, maxPools uint32) (l *Limiter, proj string, lfd int, sa unix.Sockaddr, lfdB int, saB unix.Sockaddr) {
	root := newRoot(b)
	pin := newPinDir(b)
	proj = mkProject(b, root, "bench")
	b.Cleanup(pinCPU(b))
	lfd, sa = benchListener(b, false)
	lfdB, saB = benchListener(b, false)
	moveSelf(b, proj)
	l, err := openRoot(b, root, Options{PinDir: pin, PoolSize: benchPool, MaxDestPools: maxPools})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		l.Close()
		if err := Cleanup(pin); err != nil {
			b.Error(err)
		}
	})
	return l, proj, lfd, sa, lfdB, saB
}

// connectCost is a block of 250 cycles to the listener fd at to: by the
// BPF run-time stats (which must be on) of progs, connect4's cost per run
// (one run a cycle), and the release paths', sock_release's and
// set_state's together, per cycle (the client's permit is given back at
// one of them, whichever comes first, and the other finds nothing).
func connectCost(b *testing.B, progs [3]*ebpf.Program, fd int, to unix.Sockaddr) (connect, release float64) {
	var before [3]*ebpf.ProgramStats
	for i, p := range progs {
		st, err := p.Stats()
		if err != nil {
			b.Fatal(err)
		}
		before[i] = st
	}
	const cycles = 250
	for range cycles {
		cycle(b, fd, to)
	}
	var per [3]float64
	for i, p := range progs {
		st, err := p.Stats()
		if err != nil {
			b.Fatal(err)
		}
		per[i] = float64(st.Runtime - before[i].Runtime)
		if i == 0 {
			per[i] /= float64(st.RunCount - before[i].RunCount)
		}
	}
	return per[0], (per[1] + per[2]) / cycles
}

// benchDestsLowerBound is what a destination pool costs connect4 in
// fairshare's programs and in the least a limiter can do at the hook to
// count one (testdata/lowerbound.c with lb_dest_on: an exact host's pool by
// one array load indexed by the port, a fetch-add on the pool's count against its size and
// one on the project's in it), in the same run: turns alternate the two,
// each with destination pools off ("none") and on, a connect to the pool's
// host ("match") and to another port ("miss"), in blocks of 250 cycles.
// Reported: each side's median over turns of its difference from its own
// "none" (ours-match-above-ns/run, lowerbound-match-above-ns/run, ...),
// and the release paths' (per cycle) for a match. "none-again" is "none"
// measured again after the others: its difference from the first is the
// bias of a block's place in the turn, the noise floor of the others.
func benchDestsLowerBound(b *testing.B) {
	l, proj, lfd, sa, lfdB, saB := destBench(b, 2)
	port := sa.(*unix.SockaddrInet4).Port
	ds, err := destination.ParseAll([]string{"127.0.0.1/32:" + strconv.Itoa(port)})
	if err != nil {
		b.Fatal(err)
	}
	if err := l.SetDestPools([]DestPool{{Name: "db", Size: benchPool, Destinations: ds}}); err != nil {
		b.Fatal(err)
	}
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		b.Fatal(err)
	}
	kinds := cfg.DestKinds & destKindsMask
	floor := emptyPrograms(b)
	defer floor.Close()
	lb, coll := lowerBound(b, l, floor, proj, false, lfd, sa)
	defer lb.Close()
	// The lower bound's pool: index 1, of benchPool, for 127.0.0.1 at
	// port (both in network order, as connect4 reads them).
	type project struct{ InUse, Limit int64 }
	if err := coll.Maps["lb_dpools"].Put(uint32(1), project{0, benchPool}); err != nil {
		b.Fatal(err)
	}
	type dest struct {
		Addr [4]byte
		Pool uint32
	}
	nport := uint32(port>>8 | port&0xff<<8)
	if err := coll.Maps["lb_dests"].Put(nport, dest{[4]byte{127, 0, 0, 1}, 1}); err != nil {
		b.Fatal(err)
	}
	lbOn := func(on uint32) {
		if err := coll.Maps["lb_dest_on"].Put(uint32(0), on); err != nil {
			b.Fatal(err)
		}
	}
	lbHeld := func() (pool, proj int64) {
		var p project
		if err := coll.Maps["lb_dpools"].Lookup(uint32(1), &p); err != nil {
			b.Fatal(err)
		}
		if err := coll.Maps["lb_dpool_proj"].Lookup(uint32(64+1), &proj); err != nil {
			b.Fatal(err)
		}
		return p.InUse, proj
	}
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Skipf("bpf stats unavailable: %v", err)
	}
	defer stats.Close()
	sides := []struct {
		name  string
		objs  *limiterObjects
		on    func(bool)
		check func() // after a block of each: nothing held
	}{
		{"ours", &l.objs, func(on bool) {
			k := uint32(0)
			if on {
				k = kinds
			}
			if err := l.setDestKinds(k); err != nil {
				b.Fatal(err)
			}
		}, func() {
			if d := destSnap(b, l, "db"); d.InUse != 0 {
				b.Fatalf("fairshare's pool holds %d permits after a block", d.InUse)
			}
		}},
		{"lowerbound", lb, func(on bool) {
			if on {
				lbOn(1)
			} else {
				lbOn(0)
			}
		}, func() {
			if pool, proj := lbHeld(); pool != 0 || proj != 0 {
				b.Fatalf("the lower bound's pool holds %d permits (the project %d) after a block", pool, proj)
			}
		}},
	}
	// Each side takes a destination permit for a connection to the pool's
	// host and gives it back at its close, or its "match" is no match.
	held := func(side int) (pool, proj int64) {
		if side == 0 {
			d := destSnap(b, l, "db")
			for _, p := range d.Projects {
				if p.Project == "bench" {
					proj = int64(p.InUse)
				}
			}
			return int64(d.InUse), proj
		}
		return lbHeld()
	}
	detachLinks(b, l)
	for i, side := range sides {
		attachLinks(b, l, side.objs)
		side.on(true)
		fd, afd := connectPair(b, lfd, sa)
		pool, proj := held(i)
		unix.Close(fd)
		unix.Close(afd)
		side.on(false)
		side.check()
		detachLinks(b, l)
		if pool != 1 || proj != 1 {
			b.Fatalf("%s: a connection to the pool's host held %d permits in it (%d for the project), want 1", side.name, pool, proj)
		}
	}
	above := map[string][]float64{}
	turns := max(b.N/50000, 10)
	b.ResetTimer()
	for t := range turns {
		for i := range sides {
			side := sides[(i+t)%len(sides)]
			attachLinks(b, l, side.objs)
			progs := [3]*ebpf.Program{side.objs.FsConnect4, side.objs.FsSockRelease, side.objs.FsSetState}
			side.on(false)
			for range 20 {
				cycle(b, lfd, sa)
			}
			base, relBase := connectCost(b, progs, lfd, sa)
			side.on(true)
			c, r := connectCost(b, progs, lfd, sa)
			above[side.name+"-match"] = append(above[side.name+"-match"], c-base)
			above[side.name+"-match-release"] = append(above[side.name+"-match-release"], r-relBase)
			c, _ = connectCost(b, progs, lfdB, saB)
			above[side.name+"-miss"] = append(above[side.name+"-miss"], c-base)
			side.on(false)
			c, _ = connectCost(b, progs, lfd, sa)
			above[side.name+"-none-again"] = append(above[side.name+"-none-again"], c-base)
			side.check()
			detachLinks(b, l)
		}
	}
	b.StopTimer()
	for _, side := range sides {
		for _, c := range []string{"match", "miss", "none-again"} {
			b.ReportMetric(median(above[side.name+"-"+c]), side.name+"-"+c+"-above-ns/run")
		}
		b.ReportMetric(median(above[side.name+"-match-release"]), side.name+"-match-release-above-ns/cycle")
	}
	// The lower bound counted: a block took and gave back its pool's permits.
	if pool, proj := lbHeld(); pool != 0 || proj != 0 {
		b.Fatalf("the lower bound's pool holds %d permits (the project %d)", pool, proj)
	}
	attachLinks(b, l, &l.objs) // as Close expects
}

// Which project of benchCycle has a rate of new connections.
const (
	rateNone  = iota // none
	rateOwn          // the benchmark's project
	rateOther        // another project
	// Not a rate: the attached side is the least a limiter can do at our
	// hooks and still count correctly (testdata/lowerbound.c), in place of
	// fairshare's programs: the lower bound of above-floor-%.
	rateLowerBound
)

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

// nftPeer is the nftables side of the benchmark: a table whose rules limit
// the connections of one cgroup, added for a side and deleted after it (its
// conntrack hooks go with it, so the other sides do not pay for them).
type nftPeer struct {
	nft, table string
	level      uint32
	path       string // the cgroup as nft names it
}

// newNftPeer prepares the rules for the cgroup dir, or returns nil with the
// reason when nft is not installed. nft resolves a cgroupv2 path below
// /sys/fs/cgroup (on a hybrid host it starts with unified/); the level is
// the cgroup's in the v2 hierarchy.
func newNftPeer(b testing.TB, dir string) (*nftPeer, string) {
	nft, err := exec.LookPath("nft")
	if err != nil {
		return nil, "nft is not installed (Debian: apt-get install nftables)"
	}
	mi, err := cgroup.FindMount()
	if err != nil {
		b.Fatal(err)
	}
	level, err := mi.Level(dir)
	if err != nil {
		b.Fatal(err)
	}
	rel, err := filepath.Rel("/sys/fs/cgroup", dir)
	if err != nil || strings.HasPrefix(rel, "..") {
		return nil, fmt.Sprintf("%s is not below /sys/fs/cgroup, where nft looks for cgroups", dir)
	}
	testutil.NftSweep(nft)
	return &nftPeer{nft: nft, table: fmt.Sprintf("fairshare_bench_%d", os.Getpid()), level: level, path: rel}, ""
}

// rules is the table with the limit k at the given hooks (output, input).
func (p *nftPeer) rules(k int, hooks ...string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "table inet %s {\n", p.table)
	for _, h := range hooks {
		fmt.Fprintf(&b, "\tchain %s { type filter hook %s priority 0; policy accept; "+
			"socket cgroupv2 level %d %q ct count over %d reject with tcp reset; }\n", h, h, p.level, p.path, k)
	}
	b.WriteString("}\n")
	return b.String()
}

func (p *nftPeer) add(b testing.TB, rules string) {
	if err := testutil.NftRun(p.nft, rules); err != nil {
		b.Fatalf("loading the nftables rules: %v\n%s", err, rules)
	}
}

func (p *nftPeer) del(b testing.TB) {
	if err := testutil.NftRun(p.nft, "delete table inet "+p.table+"\n"); err != nil {
		b.Fatalf("deleting the nftables table: %v", err)
	}
}

// effective checks that the rule at hook matches the benchmark's
// connections: with "over 0" for the limit, at that hook alone, a connect
// on fd is reset. The input rule is checked with a client created outside
// the cgroup: one inside would have the reset dropped at input in turn (so,
// with both rules in place, a refused client times out instead).
func (p *nftPeer) effective(b testing.TB, sa unix.Sockaddr, hook string, fd int) {
	p.add(b, p.rules(0, hook))
	defer p.del(b)
	err := unix.Connect(fd, sa)
	if err == unix.EINPROGRESS {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		if n, perr := unix.Poll(pfd, 2000); perr == nil && n == 1 {
			var e int
			if e, err = unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR); err == nil {
				err = unix.Errno(e)
			}
		} else {
			err = unix.ETIMEDOUT
		}
	}
	if err != unix.ECONNREFUSED {
		b.Fatalf("with \"ct count over 0\" at %s a connect gave %v, want ECONNREFUSED: the rule does not match", hook, err)
	}
}

// clientSocket is a non-blocking TCP socket, closed when the test ends.
func clientSocket(b testing.TB) int {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { unix.Close(fd) })
	return fd
}

func benchCycle(b *testing.B, both, wildcard bool, rated int) {
	root := newRoot(b)
	pin := newPinDir(b)
	proj := mkProject(b, root, "bench")
	defer pinCPU(b)()
	var lfd int
	var sa unix.Sockaddr
	if !both {
		lfd, sa = benchListener(b, wildcard) // created outside the project
	}
	outside := clientSocket(b) // to check the nftables input rule
	moveSelf(b, proj)
	if both {
		lfd, sa = benchListener(b, wildcard)
	}

	l, err := openRoot(b, root, Options{PinDir: pin, PoolSize: benchPool})
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		l.Close()
		if err := Cleanup(pin); err != nil {
			b.Error(err)
		}
	}()
	switch rated {
	case rateOwn:
		err = l.SetRate("bench", 1e9)
	case rateOther:
		mkProject(b, root, "other")
		err = l.SetRate("other", 1e9)
	}
	if err != nil {
		b.Fatal(err)
	}
	// The sides differ only in the links: the programs and maps stay
	// loaded, so a round costs an attach and a detach (milliseconds), not a
	// load, and rounds can be short.
	floor := emptyPrograms(b)
	defer floor.Close()
	ours := &l.objs
	if rated == rateLowerBound {
		ours, _ = lowerBound(b, l, floor, proj, both, lfd, sa)
		defer ours.Close()
	}
	detach := func() { detachLinks(b, l) }
	attach := func(objs *limiterObjects) { attachLinks(b, l, objs) }
	detach()
	nft, why := newNftPeer(b, proj)
	var nftRules string
	if nft == nil {
		b.Logf("no nftables side: %s", why)
	} else {
		nft.effective(b, sa, "output", clientSocket(b))
		if both {
			nft.effective(b, sa, "input", outside)
		}
		nftRules = nft.rules(benchPool, "output", "input")
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

	// Many short rounds, rotating which side goes first. The machine is
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
	const bare, floored, attached, nftables = 0, 1, 2, 3
	sides := 3
	if nft != nil {
		sides = 4
	}
	per := max(b.N/(sides*rounds), 50)
	times := make([]float64, per)
	run := func(side int) (med, mean float64) {
		b.StopTimer()
		switch side {
		case floored:
			attach(floor)
		case attached:
			attach(ours)
		case nftables:
			nft.add(b, nftRules)
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
		switch side {
		case floored, attached:
			detach()
		case nftables:
			nft.del(b)
		}
		b.StartTimer()
		var sum float64
		for _, t := range times {
			sum += t
		}
		return median(times), sum / float64(per)
	}
	var cycles [4][]float64
	var ratio, ratioMean, floorRatio, above, nftRatio, vsNft []float64
	for i := range rounds {
		var med, mean [4]float64
		for k := range sides { // each side goes first, second, ... in turn
			side := (i + k) % sides
			med[side], mean[side] = run(side)
		}
		for side := range sides {
			cycles[side] = append(cycles[side], med[side])
		}
		ratio = append(ratio, med[attached]/med[bare])
		ratioMean = append(ratioMean, mean[attached]/mean[bare])
		floorRatio = append(floorRatio, med[floored]/med[bare])
		above = append(above, (med[attached]-med[floored])/med[bare])
		if nft != nil {
			nftRatio = append(nftRatio, med[nftables]/med[bare])
			vsNft = append(vsNft, (med[attached]-med[bare])/(med[nftables]-med[bare]))
		}
	}
	b.StopTimer()
	b.ReportMetric(median(cycles[bare]), "bare-ns/cycle")
	b.ReportMetric(median(cycles[attached]), "attached-ns/cycle")
	b.ReportMetric(100*(median(ratio)-1), "overhead-%")
	b.ReportMetric(100*(quantile(ratio, 0.25)-1), "overhead-q1-%")
	b.ReportMetric(100*(quantile(ratio, 0.75)-1), "overhead-q3-%")
	b.ReportMetric(100*(median(ratioMean)-1), "overhead-mean-%")
	b.ReportMetric(100*(median(floorRatio)-1), "floor-%")
	b.ReportMetric(100*median(above), "above-floor-%")
	if nft != nil {
		b.ReportMetric(100*(median(nftRatio)-1), "nft-%")
		b.ReportMetric(median(vsNft), "fairshare/nft")
	}

	// Run time per program, with stats on (they add ~20 ns to every run):
	// the median over rounds of each program's mean, ours and the empty
	// ones' at the same hooks.
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Logf("bpf stats unavailable: %v", err)
		return
	}
	defer stats.Close()
	mine := progStats(b, ours, lfd, sa, attach, detach)
	empty := progStats(b, floor, lfd, sa, attach, detach)
	var total, totalAbove float64
	for name, o := range mine {
		b.ReportMetric(o.ns, name+"-ns/run")
		b.ReportMetric(o.ns-empty[name].ns, name+"-above-ns/run")
		b.ReportMetric(o.perCycle, name+"-runs/cycle")
		total += o.ns * o.perCycle
		totalAbove += (o.ns - empty[name].ns) * o.perCycle
	}
	b.ReportMetric(total, "bpf-ns/cycle")
	b.ReportMetric(totalAbove, "bpf-above-ns/cycle")
}

// progStat is a program's run time per run and its runs per cycle.
type progStat struct{ ns, perCycle float64 }

// progStats attaches objs, runs cycles with run-time stats on and returns
// the median over rounds of each program's mean run time.
func progStats(b *testing.B, objs *limiterObjects, lfd int, sa unix.Sockaddr, attach func(*limiterObjects), detach func()) map[string]progStat {
	attach(objs)
	defer detach()
	progs := map[string]*ebpf.Program{
		"connect4": objs.FsConnect4, "sock_release": objs.FsSockRelease,
		"set_state": objs.FsSetState, "sk_lookup": objs.FsSkLookup, "sockops": objs.FsSockops,
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
	for range 100 {
		cycle(b, lfd, sa)
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
	out := map[string]progStat{}
	for name, xs := range perRun {
		out[name] = progStat{median(xs), float64(runs[name]) / (statRounds * statPer)}
	}
	return out
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
		ebpf.SockOps:        1, // the kernel's defaults
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
		FsSockops:     load("fs_sockops"),
		FsSetState:    load("fs_set_state"),
		FsSkLookup:    load("fs_sk_lookup"),
		FsSockRelease: load("fs_sock_release"),
	}}
}

// lowerBound builds and loads testdata/lowerbound.c (clang, the flags of
// gen.go; the benchmark is skipped without it), registers the cgroup dir as
// its one project with room for benchPool permits, and, with both, the
// listener's port as the project's. Programs it has no counterpart for are
// floor's (empty).
func lowerBound(b *testing.B, l *Limiter, floor *limiterObjects, dir string, both bool, lfd int, sa unix.Sockaddr) (*limiterObjects, *ebpf.Collection) {
	clang, err := exec.LookPath("clang")
	if err != nil {
		b.Skip("clang is not installed: no lower-bound programs")
	}
	obj := filepath.Join(b.TempDir(), "lowerbound.o")
	if out, err := exec.Command(clang, "-target", "bpf", "-O2", "-g", "-mcpu=v3", "-Wall", "-Werror",
		"-I", "../bpf/headers", "-c", "testdata/lowerbound.c", "-o", obj).CombinedOutput(); err != nil {
		b.Fatalf("building testdata/lowerbound.c: %v\n%s", err, out)
	}
	spec, err := ebpf.LoadCollectionSpec(obj)
	if err != nil {
		b.Fatal(err)
	}
	coll, err := ebpf.NewCollection(spec)
	if err != nil {
		b.Fatalf("loading the lower-bound programs: %v", err)
	}
	b.Cleanup(coll.Close)
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		b.Fatal(err)
	}
	type project struct{ InUse, Limit int64 }
	if err := coll.Maps["lb_members"].Put(st.Ino, uint32(1)); err != nil {
		b.Fatal(err)
	}
	if err := coll.Maps["lb_projects"].Put(uint32(1), project{0, benchPool}); err != nil {
		b.Fatal(err)
	}
	if both {
		if err := coll.Maps["lb_ports"].Put(uint32(sa.(*unix.SockaddrInet4).Port), uint32(1)); err != nil {
			b.Fatal(err)
		}
	}
	// The programs are the collection's: cloned so that Close on the
	// result leaves the collection (and floor) to their owners.
	clone := func(p *ebpf.Program) *ebpf.Program {
		c, err := p.Clone()
		if err != nil {
			b.Fatal(err)
		}
		return c
	}
	// The programs must count, or the bound is no bound: check it now,
	// with one connection held open (both: its two ends).
	objs := &limiterObjects{limiterPrograms: limiterPrograms{
		FsConnect4:    clone(coll.Programs["lb_connect4"]),
		FsConnect6:    clone(floor.FsConnect6),
		FsSockops:     clone(coll.Programs["lb_sockops"]),
		FsSetState:    clone(coll.Programs["lb_set_state"]),
		FsSkLookup:    clone(coll.Programs["lb_sk_lookup"]),
		FsSockRelease: clone(coll.Programs["lb_sock_release"]),
	}}
	held := func() int64 {
		var p project
		if err := coll.Maps["lb_projects"].Lookup(uint32(1), &p); err != nil {
			b.Fatal(err)
		}
		return p.InUse
	}
	attachLinks(b, l, objs)
	fd, afd := connectPair(b, lfd, sa)
	want := int64(1)
	if both {
		want = 2
	}
	got := held()
	unix.Close(fd)
	unix.Close(afd)
	after := held()
	detachLinks(b, l)
	if got != want || after != 0 {
		b.Fatalf("the lower-bound programs held %d permits for an open connection (want %d), %d after its close (want 0)", got, want, after)
	}
	return objs, coll
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

// BenchmarkConnectDepth is the cost of finding a socket's project by the
// walk (bpf/lib/project.h): the project registered 1, 2 and 3 levels below
// the base level, the connecting process in a leaf below it, and the
// programs' run time per run with BPF stats on (medians over rounds; the
// stats add ~20 ns to every run). connect4 and sock_release walk once per
// cycle, set_state for the closing socket (the listener is outside the
// projects). The extra cost per level is the difference between depths.
func BenchmarkConnectDepth(b *testing.B) {
	testutil.RequireRoot(b)
	for depth := 1; depth <= 3; depth++ {
		b.Run("depth="+strconv.Itoa(depth), func(b *testing.B) {
			root := newRoot(b)
			pin := newPinDir(b)
			rel := ""
			for i := range depth {
				rel = filepath.Join(rel, "l"+strconv.Itoa(i+1))
			}
			member := mkdirs(b, root, rel)[0]
			leaf := mkdirs(b, member, "ctr")[0]
			defer pinCPU(b)()
			lfd, sa := benchListener(b, false) // outside the projects
			moveSelf(b, leaf)
			o := rootOptions(b, root, Options{PinDir: pin, PoolSize: benchPool})
			o.MaxDepth = DefaultMaxDepth
			l, err := Open(o)
			if err != nil {
				b.Fatal(err)
			}
			defer func() {
				l.Close()
				if err := Cleanup(pin); err != nil {
					b.Error(err)
				}
			}()
			if rep, err := l.SetMembers([]Member{{Project: "bench", Cgroup: member}}); err != nil || len(rep.Refused) > 0 {
				b.Fatalf("%+v %v", rep, err)
			}
			stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
			if err != nil {
				b.Skipf("bpf stats unavailable: %v", err)
			}
			defer stats.Close()
			detachLinks(b, l)
			b.ResetTimer()
			var st map[string]progStat
			for range max(b.N/4000, 1) {
				st = progStats(b, &l.objs, lfd, sa, func(o *limiterObjects) { attachLinks(b, l, o) }, func() { detachLinks(b, l) })
			}
			b.StopTimer()
			for _, name := range []string{"connect4", "sock_release", "set_state"} {
				b.ReportMetric(st[name].ns, name+"-ns/run")
			}
			if s := snap(b, l); s.Admitted == 0 || len(s.Projects) != 1 || s.Projects[0].Project != "bench" {
				b.Fatalf("the connections did not count for the project: %+v", s)
			}
		})
	}
}

// BenchmarkConnectUnclassified is BenchmarkConnectDepth's depth=3 for a
// socket in no member below a weak one: the reserved Unclassified project
// registered at the first level (a pod root), the connecting process three
// levels below it (QoS, pod, container), so the walk goes on past the weak
// hit to the socket's own level and falls back to it.
func BenchmarkConnectUnclassified(b *testing.B) {
	testutil.RequireRoot(b)
	root := newRoot(b)
	pin := newPinDir(b)
	dirs := mkdirs(b, root, "l1", "l1/l2/l3/ctr")
	weak, leaf := dirs[0], dirs[1]
	defer pinCPU(b)()
	lfd, sa := benchListener(b, false) // outside the projects
	moveSelf(b, leaf)
	// The benchmark's process is in the host's network namespace, where
	// only LimitHostNetwork puts a pod under a weak member.
	o := rootOptions(b, root, Options{PinDir: pin, PoolSize: benchPool, LimitHostNetwork: true})
	o.MaxDepth = DefaultMaxDepth
	l, err := Open(o)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		l.Close()
		if err := Cleanup(pin); err != nil {
			b.Error(err)
		}
	}()
	if rep, err := l.SetMembers([]Member{{Project: Unclassified, Cgroup: weak}}); err != nil || len(rep.Refused) > 0 {
		b.Fatalf("%+v %v", rep, err)
	}
	stats, err := ebpf.EnableStats(uint32(unix.BPF_STATS_RUN_TIME))
	if err != nil {
		b.Skipf("bpf stats unavailable: %v", err)
	}
	defer stats.Close()
	detachLinks(b, l)
	b.ResetTimer()
	var st map[string]progStat
	for range max(b.N/4000, 1) {
		st = progStats(b, &l.objs, lfd, sa, func(o *limiterObjects) { attachLinks(b, l, o) }, func() { detachLinks(b, l) })
	}
	b.StopTimer()
	for _, name := range []string{"connect4", "sock_release", "set_state"} {
		b.ReportMetric(st[name].ns, name+"-ns/run")
	}
	if s := snap(b, l); s.Admitted == 0 || len(s.Projects) != 1 || s.Projects[0].Project != Unclassified {
		b.Fatalf("the connections did not count for the unclassified project: %+v", s)
	}
}

// BenchmarkSettle is what a change of members costs the daemon beside a
// reconcile pass: Settle's walk of the host's namespace against a full
// Reconcile, with 2000 project connections open (4000 sockets, both ends on
// loopback) besides the machine's own. The walk reads the whole TCP table
// once per namespace given; a pass reads it at least once per namespace
// too, and the permit tables and sock_diag's listing besides.
func BenchmarkSettle(b *testing.B) {
	testutil.RequireRoot(b)
	root, pin := newRoot(b), newPinDir(b)
	l := openLimiter(b, root, pin, 4096, 0)
	out := sink(b, "tcp4", "127.0.0.1:0").Addr().String()
	h := startHelper(b, mkProject(b, root, "busy"))
	h.dialOK("tcp4", out, 2000, "busy")
	b.Run("settle", func(b *testing.B) {
		for b.Loop() {
			if _, err := l.Settle(b.Context(), true, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("reconcile", func(b *testing.B) {
		for b.Loop() {
			if _, err := l.Reconcile(b.Context()); err != nil {
				b.Fatal(err)
			}
		}
	})
}
