// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"fmt"
	"io"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
)

// TestEventSinkBounds: a flood of one project's events is cut at per_sec
// in each second, the rest counted and announced in one dropped event per
// source and project at the next flush; other projects are not held up; the
// recent ring keeps the newest.
func TestEventSinkBounds(t *testing.T) {
	cfg := config.Default().Events
	cfg.PerSec, cfg.Recent = 5, 8
	s, err := newEventSink(cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	sub := s.hub.Subscribe(events.Filter{}, 100)
	at := time.Unix(1000, 0)
	for i := range 20 {
		s.publish(events.Event{Time: at, Source: events.SourceFront, Kind: events.KindRefused, Project: "flood", Count: uint64(i)})
	}
	s.publish(events.Event{Time: at, Source: events.SourceFront, Kind: events.KindRefused, Project: "calm"})
	s.countKernelDropped("flood", 7)
	s.flush()
	// A new second: the bound starts again.
	s.publish(events.Event{Time: at.Add(time.Second), Source: events.SourceFront, Kind: events.KindRefused, Project: "flood"})
	var got []events.Event
	for len(sub.C) > 0 {
		got = append(got, <-sub.C)
	}
	if len(got) != 5+1+2+1 {
		t.Fatalf("%d events: %+v", len(got), got)
	}
	dropped := map[string]uint64{}
	for _, e := range got {
		if e.Kind == events.KindDropped {
			dropped[e.Source+"/"+e.Project] = e.Count
		}
	}
	if dropped["front/flood"] != 15 || dropped["kernel/flood"] != 7 || len(dropped) != 2 {
		t.Fatalf("dropped notices %v", dropped)
	}
	st := s.status()
	if st.Published != 9 || st.Dropped != 15 || st.KernelDropped != 7 {
		t.Fatalf("status %+v", st)
	}
	recent := s.recent(events.Filter{})
	if len(recent) != 8 || recent[7].Seq != 9 || recent[0].Seq != 2 {
		t.Fatalf("recent: %+v", recent)
	}
	if r := s.recent(events.Filter{Project: "calm"}); len(r) != 1 {
		t.Fatalf("recent of calm: %+v", r)
	}
}

// TestDroppedNoticesFollowTheirFilter: a dropped notice names the pool and
// project whose events it stands for, and passes the filters those events
// would have passed: --pool requests shows alpha's lost requests events,
// --project beta does not show the loss of events of no project, and the
// kernel's notices (counted per project, no pool) pass any pool of their
// project. Before, the notices named no pool: one of a project was in no
// --pool view, and one of no project was in every --project view.
func TestDroppedNoticesFollowTheirFilter(t *testing.T) {
	cfg := config.Default().Events
	cfg.PerSec = 5
	s, err := newEventSink(cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	at := time.Unix(1000, 0)
	for range 20 {
		s.publish(events.Event{Time: at, Source: events.SourceFront, Kind: events.KindRefused, Pool: "requests", Project: "alpha"})
		s.publish(events.Event{Time: at, Source: events.SourceFront, Kind: events.KindRefused, Pool: "requests"})
	}
	s.countKernelDropped("alpha", 7)
	s.flush()
	notices := func(f events.Filter) map[string]uint64 {
		out := map[string]uint64{}
		for _, e := range s.recent(f) {
			if e.Kind == events.KindDropped {
				out[e.Source+"/"+e.Pool+"/"+e.Project] = e.Count
			}
		}
		return out
	}
	for _, tc := range []struct {
		f    events.Filter
		want string
	}{
		{events.Filter{Pool: "requests"}, "map[front/requests/:15 front/requests/alpha:15 kernel//alpha:7]"},
		{events.Filter{Pool: "connections"}, "map[kernel//alpha:7]"},
		{events.Filter{Project: "alpha"}, "map[front/requests/alpha:15 kernel//alpha:7]"},
		{events.Filter{Project: "alpha", Pool: "requests"}, "map[front/requests/alpha:15 kernel//alpha:7]"},
		{events.Filter{Project: "beta"}, "map[]"},
	} {
		if got := fmt.Sprint(notices(tc.f)); got != tc.want {
			t.Errorf("filter %+v: dropped notices %s, want %s", tc.f, got, tc.want)
		}
	}
	// A stream's own notice passes every filter.
	if !(events.Filter{Project: "beta", Pool: "x"}).Match(events.Event{Source: events.SourceEvents, Kind: events.KindDropped, Count: 3}) {
		t.Error("a stream's own dropped notice was filtered out")
	}
}

// TestReconcileEvents: each repair of a reconcile pass is an event:
// adoptions, those past the rule and moves past it (one per pool and
// project, the pool named: gamma's socket past both pools is in each),
// sockets not adopted (one per project), orphans, stale listeners, the
// exempt count and each project's in_use correction, with its size; and
// the pass is counted as status and the metrics show it (recordPass: the
// daemon's passes and Open's).
func TestReconcileEvents(t *testing.T) {
	s, err := newEventSink(config.Default().Events, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	k := &kernelSide{events: s}
	end := time.Unix(1700000000, 0)
	k.recordPass(loader.ReconcileReport{Adopted: 3, Orphans: 1, Repaired: map[string]int{"beta": -2, "alpha": 1, "calm": 0},
		AdoptedPast:   map[string]int{"alpha": 1, "beta": 1, "gamma": 1},
		AdoptedPastIn: map[string]map[string]int{loader.ConnectionsPool: {"gamma": 1, "alpha": 1}, "db": {"gamma": 1, "beta": 1}},
		MovedPast:     map[string]int{"team-a": 2}, MovedPastIn: map[string]map[string]int{"db": {"team-a": 2}},
		Unadopted: map[string]int{"zeta": 955, "eta": 2},
		Kernel:    map[string]int{"alpha": 4, "zeta": 2000}, Held: map[string]int{"alpha": 4, "zeta": 1045}}, end)
	if r := k.record(); r == nil || r.Passes != 1 || !r.Time.Equal(end) || r.Unadopted != 957 || r.Adopted != 3 ||
		r.AdoptedPastTotal != 3 || r.MovedPastTotal != 2 || r.Sockets != 2004 || r.Held != 1049 || r.Repairs != 7 {
		t.Fatalf("the pass's record %+v", r)
	}
	got := s.recent(events.Filter{})
	type row struct {
		kind, pool, project string
		count               uint64
	}
	var rows []row
	for _, e := range got {
		if e.Source != events.SourceReconcile {
			t.Fatalf("event %+v", e)
		}
		rows = append(rows, row{e.Kind, e.Pool, e.Project, e.Count})
	}
	conn := config.PoolConnections
	want := []row{{events.KindAdopted, conn, "", 3},
		{events.KindAdoptedPast, conn, "alpha", 1}, {events.KindAdoptedPast, conn, "gamma", 1},
		{events.KindAdoptedPast, "db", "beta", 1}, {events.KindAdoptedPast, "db", "gamma", 1},
		{events.KindMovedPast, "db", "team-a", 2},
		{events.KindUnadopted, conn, "eta", 2}, {events.KindUnadopted, conn, "zeta", 955},
		{events.KindRepaired, conn, "", 1}, {events.KindRepaired, conn, "alpha", 1}, {events.KindRepaired, conn, "beta", 2}}
	if len(rows) != len(want) {
		t.Fatalf("events %+v, want %+v", rows, want)
	}
	for i := range want {
		if rows[i] != want[i] {
			t.Fatalf("events %+v, want %+v", rows, want)
		}
	}
	if loader.ConnectionsPool != config.PoolConnections {
		t.Errorf("the loader names the node's pool %q, the configuration %q", loader.ConnectionsPool, config.PoolConnections)
	}
	if d := got[1].Detail; !strings.HasPrefix(d, "adopted past the rule") {
		t.Errorf("adopted_past_rule's detail %q", d)
	}
	if d := got[5].Detail; !strings.HasPrefix(d, "permits taken while its pod was unclassified") {
		t.Errorf("moved_past_rule's detail %q", d)
	}
	if d := got[6].Detail; !strings.HasPrefix(d, "sockets that hold no permit not adopted") {
		t.Errorf("unadopted's detail %q", d)
	}
	if e := got[len(got)-1]; e.Detail != "in_use corrected by -2" {
		t.Errorf("detail %q", e.Detail)
	}

	// A migration's count of the live connections is no repair.
	k.recordPass(loader.ReconcileReport{Adopted: 5, Orphans: 1, Migrated: true}, end)
	if r := k.record(); r.Passes != 2 || r.Repairs != 1 || r.RepairsTotal != 8 || r.Adopted != 5 {
		t.Fatalf("after a migration's pass: %+v; want 1 repair (the orphan), 8 in all", r)
	}
	all := s.recent(events.Filter{})
	if e := all[len(got)]; e.Kind != events.KindAdopted || e.Count != 5 || !strings.HasPrefix(e.Detail, "live connections counted into the maps of a migration") {
		t.Errorf("a migration's adoption: %+v", e)
	}
}

// TestEventSinkInOrder: events published from many goroutines reach a
// subscriber in Seq order, which the admin stream relies on to drop what a
// follower has seen (a hostile review lost 195 of 160,000 events when the
// hub was fed after the sink's lock was let go).
func TestEventSinkInOrder(t *testing.T) {
	cfg := config.Default().Events
	cfg.PerSec = config.MaxEventsPerSec // no project reaches its bound
	s, err := newEventSink(cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	const writers, each = 8, 5000
	sub := s.hub.Subscribe(events.Filter{}, writers*each)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			for range each {
				s.publish(events.Event{Source: events.SourceFront, Kind: events.KindRefused, Project: fmt.Sprintf("p%d", w)})
			}
		})
	}
	wg.Wait()
	var last uint64
	out := 0
	for len(sub.C) > 0 {
		e := <-sub.C
		if e.Seq <= last {
			out++
		}
		last = max(last, e.Seq)
	}
	if out != 0 {
		t.Fatalf("%d of %d events out of order", out, writers*each)
	}
}

// TestPublishDoesNotBlockOnAHungFile: with events.log on a file system
// that does not take writes (frozen, an NFS server gone), publishing and
// the tick's flush return at once; the log drops what its queue cannot
// hold and counts it, and the ring and the streams keep every event.
func TestPublishDoesNotBlockOnAHungFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "events.log")
	cfg := config.Default().Events
	cfg.Log = path
	s, err := newEventSink(cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	// The log's descriptor is made to lead to a FIFO nobody reads: its
	// writes block once the pipe is full, as on a hung file system.
	r := testutil.HangFile(t, path, filepath.Join(dir, "fifo"))
	const n = 20000
	sub := s.hub.Subscribe(events.Filter{}, n)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range n {
			s.publish(events.Event{Source: events.SourceKernel, Kind: events.KindRefused, Project: "alpha",
				Count: uint64(i), Detail: strings.Repeat("x", 100)})
		}
		s.flush()
	}()
	t.Cleanup(func() {
		// Read the FIFO so that the writer ends, then close.
		read := make(chan struct{})
		go func() {
			io.Copy(io.Discard, r)
			close(read)
		}()
		<-done
		if err := s.close(); err != nil {
			t.Errorf("close: %v", err)
		}
		<-read
		r.Close()
	})
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("publish waited for a file that does not take writes")
	}
	st := s.status()
	ls := s.file.Stats()
	if st.Published != n || len(sub.C) != n {
		t.Fatalf("published %d, %d on the stream; want %d", st.Published, len(sub.C), n)
	}
	if ls.Dropped == 0 || st.LogDropped != ls.Dropped || st.LogFailed != ls.Failed || st.LogErrors != ls.Dropped+ls.Failed {
		t.Fatalf("the log's drops not counted: status %+v, log %+v", st, ls)
	}
	if r := s.recent(events.Filter{}); len(r) != cfg.Recent || r[len(r)-1].Count != n-1 {
		t.Fatalf("the ring: %d events, the last %+v", len(r), r[len(r)-1])
	}
}

// TestStopWithEventsLogStuck: a daemon whose events.log cannot take its
// last events at stop (a hung file system here; a full disk alike) closes
// cleanly, saying what was lost: the file is for diagnosis, and an exit
// status of failure at every stop on a full disk would mark the unit
// failed.
func TestStopWithEventsLogStuck(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "events.log")
	d, _, logs := newTestDaemon(t, func(c *config.Config) { c.Events.Log = path })
	r := testutil.HangFile(t, path, filepath.Join(dir, "fifo"))
	t.Cleanup(func() { r.Close() })
	for i := range 5000 {
		d.events.publish(events.Event{Source: events.SourceKernel, Kind: events.KindRefused, Project: "alpha",
			Count: uint64(i), Detail: strings.Repeat("x", 100)})
	}
	if err := d.Close(); err != nil {
		t.Fatalf("close with events.log stuck: %v, want a clean stop", err)
	}
	if logged(logs, "events.log: the last events were not all written at stop") != 1 {
		t.Error("the lost events were not logged at stop")
	}
}
