// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"context"
	"encoding/binary"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf/ringbuf"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"golang.org/x/sys/unix"
)

// refusals reads the limiter's refusal events into a channel until the
// test ends.
func refusals(t *testing.T, l *Limiter) <-chan Refusal {
	t.Helper()
	ch := make(chan Refusal, 1024)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- l.ReadRefusals(ctx, func(r Refusal) { ch <- r }) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ReadRefusals: %v", err)
		}
	})
	return ch
}

func nextRefusal(t *testing.T, ch <-chan Refusal) Refusal {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(5 * time.Second):
		t.Fatal("no refusal event in 5s")
	}
	return Refusal{}
}

func TestEventLayout(t *testing.T) {
	if n := unsafe.Sizeof(limiterFsEvent{}); n != eventSize {
		t.Fatalf("struct fs_event is %d bytes in Go, %d expected", n, eventSize)
	}
}

// TestRefusalEvents: a refused connect and a refused SYN each write one
// event with the project, direction, both ends, the rule's inputs at the
// decision and the reason, read from the ring buffer.
func TestRefusalEvents(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 2, 1)
	if err := l.SetEvents(100, false); err != nil {
		t.Fatal(err)
	}
	ch := refusals(t, l)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	dst := netip.MustParseAddrPort(ln.Addr().String())
	alpha := startHelper(t, mkProject(t, root, "alpha"))
	if r := alpha.dial("tcp4", dst.String(), 3); r.ok != 2 || r.refused != 1 {
		t.Fatalf("dials: %+v", r)
	}
	e := nextRefusal(t, ch)
	if e.Project != "alpha" || e.Direction != "connect" || e.Remote != dst || e.Local.Port() != 0 ||
		e.Held != 2 || e.InUse != 2 || e.Share != 2 || e.Pool != 2 || e.Reason != ReasonOverShare || e.Would ||
		time.Since(e.Time) > 10*time.Second || time.Since(e.Time) < 0 {
		t.Errorf("connect refusal: %+v", e)
	}

	// connect6 writes the IPv6 ends.
	ln6 := sink(t, "tcp6", "[::1]:0")
	dst6 := netip.MustParseAddrPort(ln6.Addr().String())
	if r := alpha.dial("tcp6", dst6.String(), 1); r.refused != 1 {
		t.Fatalf("dial over IPv6: %+v", r)
	}
	if e := nextRefusal(t, ch); e.Direction != "connect" || e.Remote != dst6 || e.Project != "alpha" {
		t.Errorf("IPv6 connect refusal: %+v", e)
	}

	// A SYN to a project's listener while alpha fills the pool: srv holds
	// nothing (under its share), the pool is full.
	srv := startHelper(t, mkProject(t, root, "srv"))
	addr := netip.MustParseAddrPort(listenAddr(t, srv.do("listen 127.0.0.1:0")))
	c, err := dialOutside(addr.String())
	if !errors.Is(err, syscall.ECONNREFUSED) {
		if c != nil {
			c.Close()
		}
		t.Fatalf("SYN to a full pool: %v, want ECONNREFUSED", err)
	}
	e = nextRefusal(t, ch)
	if e.Project != "srv" || e.Direction != "syn" || e.Local != addr || e.Remote.Addr() != netip.MustParseAddr("127.0.0.1") ||
		e.Remote.Port() == 0 || e.Held != 0 || e.InUse != 2 || e.Pool != 2 || e.Reason != ReasonPoolFull || e.Would {
		t.Errorf("SYN refusal: %+v", e)
	}
	st, err := l.RefusalStats()
	if err != nil || st.Emitted < 3 || st.Dropped != 0 || st.Lost != 0 {
		t.Errorf("stats %+v %v", st, err)
	}
}

// TestRefusalEventsBounded: a flood of refused connects writes at most
// per_sec events a second for the project; every other refusal is counted
// as dropped, node-wide and for the project.
func TestRefusalEventsBounded(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 1, 1)
	const perSec, flood = 5, 200
	if err := l.SetEvents(perSec, false); err != nil {
		t.Fatal(err)
	}
	ch := refusals(t, l)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "flood"))
	start := time.Now()
	if r := h.dial("tcp4", ln.Addr().String(), 1+flood); r.ok != 1 || r.refused != flood {
		t.Fatalf("dials: %+v", r)
	}
	secs := int(time.Since(start)/time.Second) + 1 // the seconds the flood touched
	st, err := l.RefusalStats()
	if err != nil {
		t.Fatal(err)
	}
	// Each refusal is written or dropped, at most per_sec a second (the
	// flood may touch one second more than it lasted whole ones).
	bound := uint64((secs + 1) * perSec)
	if st.Emitted+st.Dropped != flood || st.Emitted > bound || st.Emitted < perSec || st.Lost != 0 {
		t.Fatalf("%d refusals in %d s: emitted %d, dropped %d, lost %d (bound %d)", flood, secs, st.Emitted, st.Dropped, st.Lost, bound)
	}
	var id uint64
	for k := range st.Projects {
		id = k
	}
	if len(st.Projects) != 1 || st.Projects[id].Dropped != st.Dropped {
		t.Fatalf("per project: %+v", st.Projects)
	}
	for i := range st.Emitted {
		if e := nextRefusal(t, ch); e.Project != "flood" {
			t.Fatalf("event %d: %+v", i, e)
		}
	}
	select {
	case e := <-ch:
		t.Fatalf("more events than emitted: %+v", e)
	case <-time.After(100 * time.Millisecond):
	}
	t.Logf("%d refusals in %d s: %d events, %d dropped", flood, secs, st.Emitted, st.Dropped)
}

// TestRefusalEventsBoundRaced: CPUs racing at a window's start cannot pass
// the events' bound. The window is made 2 ms (instead of a second) so that
// a one-second flood crosses 500 window starts, each raced by a flooder
// pinned to each CPU in one project; every window's events, by the
// programs' own timestamps, are at most the bound, and most flooded
// windows reach it (the bound is not held by dropping everything).
func TestRefusalEventsBoundRaced(t *testing.T) {
	testutil.RequireRoot(t)
	cpus := runtime.NumCPU()
	if cpus < 2 {
		t.Skip("one CPU: nothing races")
	}
	cpus = min(cpus, 4)
	const perWindow, window, floodMs = 3, 2 * time.Millisecond, 1000
	root, pin := newRoot(t), newPinDir(t)
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 1, Floor: 1, ReservationTTL: 2 * time.Second, eventWindow: window})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	if err := l.SetEvents(perWindow, false); err != nil {
		t.Fatal(err)
	}
	rd, err := ringbuf.NewReader(l.objs.FsEvents)
	if err != nil {
		t.Fatal(err)
	}
	var stamps []uint64 // the events' time_ns
	read := make(chan struct{})
	go func() {
		defer close(read)
		for {
			rec, err := rd.Read()
			if err != nil {
				return
			}
			stamps = append(stamps, binary.NativeEndian.Uint64(rec.RawSample[8:16]))
		}
	}()
	ln := sink(t, "tcp4", "127.0.0.1:0")
	dir := mkProject(t, root, "racer")
	// The project holds the pool: each flooder's connects are refused.
	if r := startHelper(t, dir).dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
		t.Fatalf("the first connect: %+v", r)
	}
	var hs []*helper
	for cpu := range cpus {
		cmd := exec.Command("taskset", "-c", strconv.Itoa(cpu), os.Args[0], "-test.run=^TestHelperProcess$")
		cmd.Env = append(os.Environ(), "FAIRSHARE_LOADER_HELPER=1")
		hs = append(hs, launchHelper(t, cmd, dir))
	}
	var wg sync.WaitGroup
	replies := make([]string, len(hs))
	for i, h := range hs {
		wg.Go(func() { replies[i] = h.do("flood %s %d", ln.Addr().String(), floodMs) })
	}
	wg.Wait()
	time.Sleep(100 * time.Millisecond) // the reader drains the ring
	rd.Close()
	<-read
	st, err := l.RefusalStats()
	if err != nil {
		t.Fatal(err)
	}
	perWin := map[uint64]int{}
	for _, ns := range stamps {
		perWin[ns/uint64(window)]++
	}
	over, full := 0, 0
	for w, n := range perWin {
		if n > perWindow {
			over++
			if over <= 5 {
				t.Errorf("window %d: %d events, bound %d", w, n, perWindow)
			}
		}
		if n == perWindow {
			full++
		}
	}
	t.Logf("%d CPUs flooding (%v): %d events read, stats %d emitted, %d dropped, %d lost; %d windows with events, %d at the bound, %d over it",
		len(hs), replies, len(stamps), st.Emitted, st.Dropped, st.Lost, len(perWin), full, over)
	if over > 0 {
		t.Fatalf("%d of %d windows passed the bound", over, len(perWin))
	}
	if uint64(len(stamps))+st.Lost != st.Emitted {
		t.Errorf("%d events read + %d lost, %d emitted", len(stamps), st.Lost, st.Emitted)
	}
	if full < len(perWin)/2 {
		t.Errorf("only %d of %d windows reached the bound", full, len(perWin))
	}
}

// TestKernelDryRun: a pool in dry-run admits connects and SYNs past POOL,
// counting each would-be refusal and writing its event; back under
// enforcement it refuses again; a project alone in dry-run is admitted
// while another is refused.
func TestKernelDryRun(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 2, 1)
	if err := l.SetEvents(100, true); err != nil {
		t.Fatal(err)
	}
	ch := refusals(t, l)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	alpha := startHelper(t, mkProject(t, root, "alpha"))
	if r := alpha.dial("tcp4", ln.Addr().String(), 4); r.ok != 4 {
		t.Fatalf("dry-run pool of 2: %+v, want 4 admitted", r)
	}
	s := snap(t, l)
	if s.InUse != 4 || project(s, "alpha").InUse != 4 || project(s, "alpha").Refused != 0 || s.Events.RefusedOut != 0 {
		t.Fatalf("dry-run counts: %+v", s)
	}
	for i, want := range []int64{2, 3} {
		e := nextRefusal(t, ch)
		if !e.Would || e.Held != want || e.InUse != want || e.Reason != ReasonOverShare || e.Direction != "connect" {
			t.Errorf("would-refuse event %d: %+v", i, e)
		}
	}
	// A SYN to a listener of another project, past POOL, is admitted too.
	srv := startHelper(t, mkProject(t, root, "srv"))
	addr := listenAddr(t, srv.do("listen 127.0.0.1:0"))
	c, err := dialOutside(addr)
	if err != nil {
		t.Fatalf("SYN in dry-run: %v", err)
	}
	defer c.Close()
	if e := nextRefusal(t, ch); !e.Would || e.Direction != "syn" || e.Project != "srv" || e.Reason != ReasonPoolFull {
		t.Errorf("SYN would-refuse event: %+v", e)
	}
	st, err := l.RefusalStats()
	if err != nil || st.WouldOut != 2 || st.WouldIn != 1 {
		t.Fatalf("stats %+v %v", st, err)
	}

	// Enforced again: refused.
	if err := l.SetEvents(100, false); err != nil {
		t.Fatal(err)
	}
	if r := alpha.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("enforced: %+v", r)
	}
	if e := nextRefusal(t, ch); e.Would {
		t.Errorf("a real refusal marked would: %+v", e)
	}
	// alpha alone in dry-run.
	if err := l.SetDryRunProjects(map[string]bool{"alpha": true, "not-yet": true}); err != nil {
		t.Fatal(err)
	}
	beta := startHelper(t, mkProject(t, root, "beta"))
	if r := beta.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("beta, enforced: %+v", r)
	}
	if r := alpha.dial("tcp4", ln.Addr().String(), 1); r.ok != 1 {
		t.Fatalf("alpha in dry-run: %+v", r)
	}
	if err := l.SetDryRunProjects(nil); err != nil {
		t.Fatal(err)
	}
	if r := alpha.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("alpha out of dry-run: %+v", r)
	}
}

// BenchmarkRefusalEvent measures what a refusal event costs the refused
// connect(): a connect of a project over its share, refused in the
// connect4 program, in three sides interleaved in rounds within one run:
// events off (events.per_sec 0), every refusal written to the ring buffer
// (a reader on another CPU draining it), and every refusal over the bound
// (per_sec 1: counted as dropped, nothing written, as in a flood).
// event-ns and dropped-ns are the medians over rounds of the difference of
// each side's median connect from the off side's; refused-ns is a refused
// connect with events off (socket, connect, close).
func BenchmarkRefusalEvent(b *testing.B) {
	testutil.RequireRoot(b)
	root, pin := newRoot(b), newPinDir(b)
	proj := mkProject(b, root, "bench")
	defer pinCPU(b)()
	_, sa := benchListener(b, false) // outside the project
	moveSelf(b, proj)
	l, err := openRoot(b, root, Options{PinDir: pin, PoolSize: 1, Floor: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		l.Close()
		if err := Cleanup(pin); err != nil {
			b.Error(err)
		}
	}()
	hold, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer unix.Close(hold)
	if err := unix.Connect(hold, sa); err != nil {
		b.Fatal(err)
	}
	// The reader runs on another CPU than the refusals, as the daemon's
	// would on a busy node: its wake-ups are not the connect's cost.
	var benchCPU unix.CPUSet
	if err := unix.SchedGetaffinity(0, &benchCPU); err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var read atomic.Uint64
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		var other unix.CPUSet
		for i := range runtime.NumCPU() {
			if !benchCPU.IsSet(i) {
				other.Set(i)
			}
		}
		if other.Count() > 0 {
			_ = unix.SchedSetaffinity(0, &other)
		}
		done <- l.ReadRefusals(ctx, func(Refusal) { read.Add(1) })
	}()
	defer func() { cancel(); <-done }()
	refuse := func() {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			b.Fatal(err)
		}
		if err := unix.Connect(fd, sa); err != unix.ECONNREFUSED {
			b.Fatalf("connect over the share: %v, want ECONNREFUSED", err)
		}
		unix.Close(fd)
	}
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	const rounds = 50
	per := max(b.N/(3*rounds), 50)
	times := make([]float64, per)
	side := func(perSec uint32) float64 {
		if err := l.SetEvents(perSec, false); err != nil {
			b.Fatal(err)
		}
		for range 5 {
			refuse()
		}
		for i := range times {
			t0 := time.Now()
			refuse()
			times[i] = float64(time.Since(t0).Nanoseconds())
		}
		sort.Float64s(times)
		return times[len(times)/2]
	}
	const off, on, over = 0, 1 << 30, 1
	var evs, drops, offs []float64
	b.ResetTimer()
	for r := range rounds {
		order := [][3]uint32{{off, on, over}, {on, over, off}, {over, off, on}}[r%3]
		med := map[uint32]float64{}
		for _, ps := range order {
			med[ps] = side(ps)
		}
		evs = append(evs, med[on]-med[off])
		drops = append(drops, med[over]-med[off])
		offs = append(offs, med[off])
	}
	b.StopTimer()
	st, err := l.RefusalStats()
	if err != nil {
		b.Fatal(err)
	}
	if st.Emitted == 0 || st.Dropped == 0 {
		b.Fatalf("events: %+v", st)
	}
	q := func(xs []float64, f float64) float64 { sort.Float64s(xs); return xs[int(f*float64(len(xs)-1))] }
	b.ReportMetric(q(evs, 0.5), "event-ns")
	b.ReportMetric(q(evs, 0.25), "event-ns-q1")
	b.ReportMetric(q(evs, 0.75), "event-ns-q3")
	b.ReportMetric(q(drops, 0.5), "dropped-ns")
	b.ReportMetric(q(offs, 0.5), "refused-ns")
	b.ReportMetric(0, "ns/op")
}

// A project's event window word far ahead of the clock (corrupt, or written
// under another window length on the same pins) is no late CPU's: the
// window starts again and the project's refusals are reported, not muted
// until the clock catches up with the word.
func TestRefusalEventsWindowAhead(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 1, 1)
	if err := l.SetEvents(100, false); err != nil {
		t.Fatal(err)
	}
	ch := refusals(t, l)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "ahead"))
	if r := h.dial("tcp4", ln.Addr().String(), 2); r.ok != 1 || r.refused != 1 {
		t.Fatalf("dials: %+v", r)
	}
	if e := nextRefusal(t, ch); e.Project != "ahead" {
		t.Fatalf("first refusal: %+v", e)
	}
	id, err := l.projectID("ahead")
	if err != nil {
		t.Fatal(err)
	}
	// Ahead of the clock's window (CLOCK_MONOTONIC, 1 s windows), not of
	// the word: a second that began since the last event makes a word 2
	// ahead of itself 1 ahead of the clock, a late CPU's, whose event is
	// dropped. 3 stays more than one ahead across one more second.
	for _, ahead := range []uint64{3, 1000, 1 << 30} {
		var v limiterFsEvproj
		if err := l.objs.FsEvProjects.Lookup(id, &v); err != nil {
			t.Fatal(err)
		}
		var ts unix.Timespec
		if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
			t.Fatal(err)
		}
		v.Window = ((uint64(ts.Sec) + ahead) & 0xffffffff) << 32
		if err := l.objs.FsEvProjects.Put(id, &v); err != nil {
			t.Fatal(err)
		}
		if r := h.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
			t.Fatalf("dial: %+v", r)
		}
		select {
		case e := <-ch:
			if e.Project != "ahead" {
				t.Fatalf("refusal: %+v", e)
			}
		case <-time.After(2 * time.Second):
			st, _ := l.RefusalStats()
			t.Fatalf("window word %d windows ahead: no event for the refusal (project's dropped %d)", ahead, st.Projects[id].Dropped)
		}
	}
	h.do("close")
	waitInUse(t, l, 0, nil)
}
