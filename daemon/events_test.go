// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"log/slog"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/events"
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
