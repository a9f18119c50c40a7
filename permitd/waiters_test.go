// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"net"
	"strings"
	"testing"

	"github.com/fairshare-dev/fairshare/pools"
)

// The waiting places are bounded per user as well as per session and per
// server: one member of the permit group, over as many sessions as it
// likes, cannot take the places the others need. Before, 8 sessions of one
// user with 512 waits each took all 4,096 and every other user's waits (and
// spawns) were refused.
func TestWaitersBoundedPerUser(t *testing.T) {
	p, err := pools.New(pools.Config{Name: "flights", Size: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{MaxWaiting: 48, MaxWaitingPerUID: 16, MaxWaitingPerSession: 8}, map[string]*pools.Pool{"flights": p}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	newPeer := func(peer string) *session {
		a, b := net.Pipe()
		t.Cleanup(func() { a.Close(); b.Close() })
		ss := newSession(s, a, Cred{})
		ss.peer = peer
		return ss
	}
	take := func(ss *session, n int) (got int, why string) {
		for range n {
			if why = s.startWait(ss, waitAcquire); why != "" {
				return got, why
			}
			got++
		}
		return got, ""
	}
	var hostile []*session
	for range 8 {
		ss := newPeer("uid:65534")
		hostile = append(hostile, ss)
		if n, why := take(ss, 8); n != 8 && !strings.Contains(why, "your user") {
			t.Fatalf("%d places, then %q", n, why)
		}
	}
	if s.waiting != 16 || s.waitingBy["uid:65534"] != 16 {
		t.Fatalf("one user holds %d of %d places, want 16", s.waitingBy["uid:65534"], s.waiting)
	}
	// Another user gets its own sixteen, and a third the rest of the server.
	if n, why := take(newPeer("uid:1000"), 8); n != 8 {
		t.Fatalf("another user: %d places (%s)", n, why)
	}
	if n, why := take(newPeer("uid:1001"), 9); n != 8 || !strings.Contains(why, "this session") {
		t.Fatalf("a third user's session: %d places (%s)", n, why)
	}
	// Places given back are the user's again.
	s.endWait(hostile[0], waitAcquire)
	again := newPeer("uid:65534")
	hostile = append(hostile, again)
	if why := s.startWait(again, waitAcquire); why != "" {
		t.Fatalf("after one ended: %s", why)
	}
	if why := s.startWait(again, waitAcquire); !strings.Contains(why, "your user") {
		t.Fatalf("the user's 17th: %q", why)
	}
	for _, ss := range hostile {
		for ss.waiting.Load() > 0 {
			s.endWait(ss, waitAcquire)
		}
	}
	if _, ok := s.waitingBy["uid:65534"]; ok || s.waiting != 16 {
		t.Fatalf("after the user's waits ended: %v, %d waiting", s.waitingBy, s.waiting)
	}
}
