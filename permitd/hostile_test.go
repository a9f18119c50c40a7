// SPDX-License-Identifier: Apache-2.0

package permitd_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	goruntime "runtime"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/pools"
)

// Every name a client sends goes through the one project rule: huge names,
// the metrics' "(other)", terminal escapes and newlines are refused, for
// acquire and spawn alike, and nothing is counted for them.
func TestProjectNamesAreChecked(t *testing.T) {
	f := start(t, 4, 4)
	s := raw(t, f)
	for i, name := range []string{strings.Repeat("a", 60<<10-200), "(other)", "evil\x1b[2J", "a\nconnections  kernel", "cgroup.procs", "-x"} {
		js, _ := json.Marshal(name)
		for _, op := range []string{
			fmt.Sprintf(`{"id":%d,"op":"acquire","pool":"flights","project":%s}`, i+1, js),
			fmt.Sprintf(`{"id":%d,"op":"spawn","object":"o","project":%s}`, i+1, js),
		} {
			got := s.roundTrip(op)
			if !strings.Contains(got, `"code":"BAD_REQUEST"`) || !strings.Contains(got, "invalid project name") {
				t.Errorf("%.80q: %.200s", op, got)
			}
			if len(got) > 400 {
				t.Errorf("the answer repeats a huge name: %d bytes", len(got))
			}
		}
	}
	if got := s.roundTrip(`{"id":99,"op":"spawn","project":"p","object":"` + strings.Repeat("o", permitd.MaxObjectLen+1) + `"}`); !strings.Contains(got, `"code":"BAD_REQUEST"`) {
		t.Errorf("a huge object name: %.200s", got)
	}
	if n := len(f.flights.Snapshot().Projects) + len(f.residents.Snapshot().Projects); n != 0 {
		t.Errorf("refused names left %d projects in the pools", n)
	}
}

// A wait_ms whose milliseconds overflow a time.Duration waits (capped),
// instead of turning negative and refusing at once.
func TestHugeWaitWaits(t *testing.T) {
	f := start(t, 1, 1)
	a, b := raw(t, f), raw(t, f)
	if got := a.roundTrip(`{"id":1,"op":"acquire","pool":"flights","project":"alpha"}`); !strings.Contains(got, `"ok":true`) {
		t.Fatal(got)
	}
	io.WriteString(b.conn, `{"id":7,"op":"acquire","pool":"flights","project":"beta","wait_ms":9000000000000000}`+"\n")
	b.conn.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if line, err := b.r.ReadString('\n'); err == nil {
		t.Fatalf("a wait of 9e15 ms was answered at once: %s", line)
	}
	// alpha's session ends: its permit goes to the waiting beta.
	a.conn.Close()
	b.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := b.r.ReadString('\n')
	if err != nil || !strings.Contains(line, `"id":7,"ok":true`) {
		t.Fatalf("after a release: %q %v", line, err)
	}
}

// Waiting operations are bounded per session and per server, with a code of
// their own, and the bound holds memory down: 30,000 waits on one session
// (which cost 165 MB before) leave the default per-session number waiting.
func TestWaitersAreBounded(t *testing.T) {
	f := start(t, 1, 1)
	hold := raw(t, f)
	if got := hold.roundTrip(`{"id":1,"op":"acquire","pool":"flights","project":"alpha"}`); !strings.Contains(got, `"ok":true`) {
		t.Fatal(got)
	}
	base := goruntime.NumGoroutine()
	c, err := net.Dial("unix", f.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const n = 30000
	go func() {
		w := bufio.NewWriter(c)
		for i := range n {
			fmt.Fprintf(w, `{"id":%d,"op":"acquire","pool":"flights","project":"beta","wait_ms":60000}`+"\n", i+1)
		}
		w.Flush()
	}()
	r := bufio.NewReader(c)
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	refused := 0
	for refused < n-permitd.DefaultMaxWaitingPerSession {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("after %d TOO_MANY_WAITING answers: %v", refused, err)
		}
		if !strings.Contains(line, `"code":"TOO_MANY_WAITING"`) || !strings.Contains(line, "this session already has") {
			t.Fatalf("unexpected answer: %s", line)
		}
		refused++
	}
	if g := goruntime.NumGoroutine() - base; g > permitd.DefaultMaxWaitingPerSession+100 {
		t.Errorf("%d goroutines more while %d may wait", g, permitd.DefaultMaxWaitingPerSession)
	}
	c.Close()
}

func TestWaitersBoundedPerServer(t *testing.T) {
	f := startWith(t, t.TempDir()+"/p.sock", pools.Config{Name: "flights", Size: 1}, pools.Config{Name: "residents", Size: 1},
		func(s *permitd.Server) { permitd.SetWaitLimits(s, 12, 8) })
	hold := raw(t, f)
	if got := hold.roundTrip(`{"id":1,"op":"acquire","pool":"flights","project":"alpha"}`); !strings.Contains(got, `"ok":true`) {
		t.Fatal(got)
	}
	wait := func(s *rawSession, id int) {
		io.WriteString(s.conn, fmt.Sprintf(`{"id":%d,"op":"acquire","pool":"flights","project":"beta","wait_ms":60000}`+"\n", id))
	}
	a, b := raw(t, f), raw(t, f)
	for i := range 8 {
		wait(a, i+1)
	}
	if got := a.roundTrip(`{"id":9,"op":"acquire","pool":"flights","project":"beta","wait_ms":60000}`); !strings.Contains(got, `"id":9`) ||
		!strings.Contains(got, "TOO_MANY_WAITING") || !strings.Contains(got, "session") {
		t.Fatalf("9th wait of a session: %s", got)
	}
	for i := range 4 {
		wait(b, i+1)
	}
	if got := b.roundTrip(`{"id":5,"op":"acquire","pool":"flights","project":"beta","wait_ms":60000}`); !strings.Contains(got, "TOO_MANY_WAITING") || !strings.Contains(got, "server") {
		t.Fatalf("13th wait of the server: %s", got)
	}
	// A spawn the pool admits at once does not wait, so it needs no place:
	// before, every spawn took one, and whoever filled them blocked every
	// spawn on the node.
	if got := b.roundTrip(`{"id":6,"op":"spawn","project":"beta","object":"o"}`); !strings.Contains(got, `"ok":true`) {
		t.Fatalf("a spawn with room, all waiting places taken: %s", got)
	}
	// A spawn that would wait (the pool of one is full and nobody is over
	// share) is refused for want of a place, and leaves nothing behind.
	if got := raw(t, f).roundTrip(`{"id":7,"op":"spawn","project":"gamma","object":"g"}`); !strings.Contains(got, "TOO_MANY_WAITING") {
		t.Fatalf("a spawn that must wait, all places taken: %s", got)
	}
	if s := f.srv.Snapshot().Residents; s.Spawning != 0 || s.Pool.InUse != 1 {
		t.Fatalf("after the refused spawn: spawning %d, in use %d", s.Spawning, s.Pool.InUse)
	}
	// When waits end, places come back.
	a.conn.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		got := b.roundTrip(`{"id":8,"op":"acquire","pool":"flights","project":"beta","wait_ms":1}`)
		if !strings.Contains(got, "TOO_MANY_WAITING") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no place after a session's waits ended: %s", got)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A spawn keeps its one-second deadline even when the victim's owner does
// not read: the eviction notice no longer blocks the spawn behind the
// owner's stalled writes (7.5 s before, up to the 10 s write timeout).
func TestSpawnDeadlineWithOwnerNotReading(t *testing.T) {
	f := start(t, 4, 2)
	owner := raw(t, f)
	for i, obj := range []string{"o1", "o2"} {
		if got := owner.roundTrip(fmt.Sprintf(`{"id":%d,"op":"spawn","project":"big","object":%q}`, i+1, obj)); !strings.Contains(got, `"ok":true`) {
			t.Fatal(got)
		}
	}
	// The owner sends and never reads: its answers fill the socket, and the
	// server's writes to it block.
	go func() {
		w := bufio.NewWriter(owner.conn)
		for i := range 60000 {
			if _, err := fmt.Fprintf(w, `{"id":%d,"op":"ping"}`+"\n", i+100); err != nil {
				return
			}
		}
		w.Flush()
	}()
	time.Sleep(300 * time.Millisecond)
	sp := raw(t, f)
	start := time.Now()
	got := sp.roundTrip(`{"id":1,"op":"spawn","project":"small","object":"s1"}`)
	took := time.Since(start)
	if !strings.Contains(got, `"code":"TOO_MANY_RESIDENTS"`) || took > 2500*time.Millisecond {
		t.Fatalf("spawn answered after %v: %s", took, got)
	}
	// The unconfirmed victim still counts as resident.
	if s := f.residents.Snapshot(); s.InUse != 2 {
		t.Errorf("residents in use %d, want 2", s.InUse)
	}
	owner.conn.Close()
}
