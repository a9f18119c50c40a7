// SPDX-License-Identifier: Apache-2.0

package events

import (
	"bufio"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestHubFilterAndFanOut(t *testing.T) {
	h := NewHub(nil)
	all := h.Subscribe(Filter{}, 16)
	alpha := h.Subscribe(Filter{Project: "alpha"}, 16)
	conns := h.Subscribe(Filter{Pool: "connections", Project: "beta"}, 16)
	h.Publish(Event{Source: SourceKernel, Kind: KindRefused, Pool: "connections", Project: "alpha"})
	h.Publish(Event{Source: SourceFront, Kind: KindRefused, Pool: "requests", Project: "beta"})
	h.Publish(Event{Source: SourceKernel, Kind: KindRefused, Pool: "connections", Project: "beta"})
	want := map[*Sub][]string{all: {"alpha", "beta", "beta"}, alpha: {"alpha"}, conns: {"beta"}}
	for s, projects := range want {
		for _, p := range projects {
			select {
			case e := <-s.C:
				if e.Project != p || e.Time.IsZero() {
					t.Fatalf("got %+v, want project %s with a time", e, p)
				}
			default:
				t.Fatalf("missing event of %s", p)
			}
		}
		select {
		case e := <-s.C:
			t.Fatalf("unexpected %+v", e)
		default:
		}
	}
	alpha.Close()
	alpha.Close() // twice is fine
	if _, ok := <-alpha.C; ok {
		t.Fatal("closed stream still open")
	}
	h.Publish(Event{Project: "alpha"}) // no send on a closed stream
	if st := h.Stats(); st.Subscribers != 2 || st.Published != 4 {
		t.Fatalf("stats %+v", st)
	}
}

// TestHubSlowSubscriber: publishing never blocks; a stream that falls behind
// is told how many events it lost once it has room, and other streams lose
// nothing.
func TestHubSlowSubscriber(t *testing.T) {
	h := NewHub(nil)
	slow := h.Subscribe(Filter{}, 2)
	fast := h.Subscribe(Filter{}, 100)
	done := make(chan struct{})
	go func() {
		for i := 0; i < 50; i++ {
			h.Publish(Event{Kind: KindRefused, Project: "alpha", Count: uint64(i)})
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Publish blocked on a full stream")
	}
	if len(fast.C) != 50 {
		t.Fatalf("fast stream has %d events, want 50", len(fast.C))
	}
	<-slow.C
	<-slow.C
	h.Publish(Event{Kind: KindRefused, Project: "alpha", Count: 99})
	e := <-slow.C
	if e.Kind != KindDropped || e.Count != 48 {
		t.Fatalf("first event after falling behind: %+v, want dropped 48", e)
	}
	if e := <-slow.C; e.Count != 99 {
		t.Fatalf("then %+v, want the new event", e)
	}
	if st := h.Stats(); st.Lost != 48 {
		t.Fatalf("stats %+v", st)
	}
}

func TestLogRotates(t *testing.T) {
	path := filepath.Join(t.TempDir(), "events.log")
	l, err := OpenLog(path, LogOptions{MaxBytes: 400, Keep: 2})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 40; i++ {
		if err := l.Write(Event{Kind: KindRefused, Project: "alpha", Detail: strings.Repeat("x", 20), Count: uint64(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	var counts []uint64
	for _, name := range []string{path + ".2", path + ".1", path} {
		f, err := os.Open(name)
		if err != nil {
			t.Fatal(err)
		}
		st, _ := f.Stat()
		if st.Size() > 400 {
			t.Errorf("%s is %d bytes, over the 400 asked", name, st.Size())
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			var e Event
			if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			counts = append(counts, e.Count)
		}
		f.Close()
	}
	if _, err := os.Stat(path + ".3"); !os.IsNotExist(err) {
		t.Errorf("more files kept than asked: %v", err)
	}
	// The files hold the newest events, in order, without a gap.
	for i := 1; i < len(counts); i++ {
		if counts[i] != counts[i-1]+1 {
			t.Fatalf("events out of order or missing: %v", counts)
		}
	}
	if len(counts) == 0 || counts[len(counts)-1] != 39 {
		t.Fatalf("newest event missing: %v", counts)
	}
	if _, err := OpenLog(t.TempDir(), LogOptions{}); err == nil {
		t.Fatal("a directory taken as the log file")
	}
}

// TestTakeLost: a stream that lost events and then drained is told how
// many even when no event follows, and only once.
func TestTakeLost(t *testing.T) {
	h := NewHub(nil)
	s := h.Subscribe(Filter{}, 1)
	for range 4 {
		h.Publish(Event{Kind: KindRefused})
	}
	<-s.C
	if n := s.TakeLost(); n != 3 {
		t.Fatalf("lost %d, want 3", n)
	}
	if n := s.TakeLost(); n != 0 {
		t.Fatalf("told twice: %d", n)
	}
	h.Publish(Event{Kind: KindRefused})
	if e := <-s.C; e.Kind != KindRefused {
		t.Fatalf("after TakeLost the next event is %+v, want no second notice", e)
	}
}

// TestTextEscapes: a field a client chose (a permit object's name is up to
// 1 KiB of anything) cannot forge a second line or drive the terminal in
// 'fairshare events': control characters and non-ASCII are quoted.
func TestTextEscapes(t *testing.T) {
	e := Event{Time: time.Unix(0, 0), Source: "permits", Kind: KindEvicted, Pool: "residents", Project: "team-a",
		Victim: "x\n00:00:00.000 kernel refused connections team-b reason=share\x1b[2J", Owner: "team-a", Spawner: "team-b",
		Detail: "a plain detail"}
	got := e.Text()
	if strings.ContainsAny(got, "\n\x1b") {
		t.Fatalf("Text() = %q: a control character passed", got)
	}
	if !strings.Contains(got, `victim="x\n00:00`) || !strings.Contains(got, "(a plain detail)") {
		t.Errorf("Text() = %q", got)
	}
}
