// SPDX-License-Identifier: Apache-2.0

package front

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The idle pool hands a key only its own connections, most recently used
// first; a put past the key's bound evicts the key's least recently used,
// one past the total the pool's least recently used; and the pool agrees
// with a plain model of it over random operations.
func TestIdlePool(t *testing.T) {
	type conn struct {
		id   int
		link idleLink[*conn]
	}
	mk := func(id int) *conn { c := &conn{id: id}; c.link.v = c; return c }
	a, b := upKey{project: "a"}, upKey{project: "b"}
	var p idlePool[*conn]
	for i := range 3 {
		if _, ev := p.put(a, &mk(i).link, 2, 3); ev != (i == 2) {
			t.Fatalf("put %d of a: evicted %v", i, ev)
		}
	}
	// a holds 1, 2 (0 was evicted at its bound).
	if old, ev := p.put(b, &mk(10).link, 2, 3); ev {
		t.Fatalf("b's first put evicted %d", old.id)
	}
	// The total is 3: b's second evicts the pool's oldest, a's 1.
	if old, ev := p.put(b, &mk(11).link, 2, 3); !ev || old.id != 1 {
		t.Fatalf("total bound: evicted %v %v, want a's 1", old, ev)
	}
	if c, ok := p.take(upKey{project: "a", exempt: true}); ok {
		t.Fatalf("a's exempt requests took a's ordinary connection %d", c.id)
	}
	if c, ok := p.take(a); !ok || c.id != 2 {
		t.Fatalf("a took %v %v, want 2", c, ok)
	}
	if c, ok := p.take(a); ok {
		t.Fatalf("a took %d, none left", c.id)
	}
	if c, ok := p.take(b); !ok || c.id != 11 {
		t.Fatalf("b took %v, want its most recent 11", c)
	}

	// Against a model: per key a list, oldest first, and the order of puts.
	rng := rand.New(rand.NewPCG(1, 2))
	p = idlePool[*conn]{}
	model := map[upKey][]int{}
	var order []int // ids, least recently used first
	keyOf := map[int]upKey{}
	conns := map[int]*conn{}
	drop := func(id int) {
		k := keyOf[id]
		for i, v := range model[k] {
			if v == id {
				model[k] = append(model[k][:i], model[k][i+1:]...)
				break
			}
		}
		for i, v := range order {
			if v == id {
				order = append(order[:i], order[i+1:]...)
				break
			}
		}
	}
	const perKey, total = 3, 8
	for step := range 20000 {
		k := upKey{project: fmt.Sprint(rng.IntN(6)), exempt: rng.IntN(4) == 0}
		switch rng.IntN(3) {
		case 0, 1:
			c := mk(step)
			conns[step], keyOf[step] = c, k
			want := -1
			switch {
			case len(model[k]) >= perKey:
				want = model[k][0]
			case len(order) >= total:
				want = order[0]
			}
			old, ev := p.put(k, &c.link, perKey, total)
			if ev != (want >= 0) || (ev && old.id != want) {
				t.Fatalf("step %d: put evicted %v %v, want %d", step, old, ev, want)
			}
			if ev {
				drop(want)
			}
			model[k] = append(model[k], step)
			order = append(order, step)
		case 2:
			c, ok := p.take(k)
			if l := model[k]; len(l) == 0 {
				if ok {
					t.Fatalf("step %d: took %d from an empty key", step, c.id)
				}
			} else if !ok || c.id != l[len(l)-1] {
				t.Fatalf("step %d: took %v %v, want %d", step, c, ok, l[len(l)-1])
			} else {
				drop(c.id)
			}
		}
		if rng.IntN(10) == 0 && len(order) > 0 {
			// A connection closed while idle (it spoke, or timed out).
			id := order[rng.IntN(len(order))]
			if !p.remove(&conns[id].link) {
				t.Fatalf("step %d: %d not in the pool", step, id)
			}
			drop(id)
		}
		if p.len() != len(order) {
			t.Fatalf("step %d: pool holds %d, model %d", step, p.len(), len(order))
		}
	}
	if n := p.keys(); n > 2*total+16 {
		t.Errorf("%d keys kept for a pool of %d", n, total)
	}
}

// Behind an h2c upstream (the fallback, through http.Transport) each
// project's requests have connections of their own too: two projects take
// two connections, a project's next request reuses its own, and a third
// project past the bound of keys drops the least recently used key's.
func TestUpstreamH2CConnectionPerProject(t *testing.T) {
	var conns atomic.Int64
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.WriteString(w, req.Proto)
	}))
	up.Config.Protocols = new(http.Protocols)
	up.Config.Protocols.SetHTTP1(true)
	up.Config.Protocols.SetUnencryptedHTTP2(true)
	up.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	up.Start()
	defer up.Close()
	f, err := New(Config{Upstream: up.URL, UpstreamH2C: true, TrustedPeers: []string{"192.0.2.1"}}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.CloseIdle()
	f.keyed.max = 2
	get := func(project string) {
		t.Helper()
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("GET", "/", nil)
		req.Header.Set(DefaultProjectHeader, project)
		f.ServeHTTP(rec, req)
		if rec.Body.String() != "HTTP/2.0" {
			t.Fatalf("%s: upstream saw %q, want HTTP/2.0", project, rec.Body.String())
		}
	}
	for _, p := range []string{"alpha", "beta", "alpha", "beta"} {
		get(p)
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("alpha and beta, twice each, took %d upstream connections, want 2", n)
	}
	get("gamma")
	if n, k := conns.Load(), f.keyed.transports(); n != 3 || k != 2 {
		t.Errorf("gamma: %d connections (want 3), %d transports kept (want 2)", n, k)
	}
	get("beta") // kept: alpha was the least recently used
	if n := conns.Load(); n != 3 {
		t.Errorf("beta after gamma took a new connection (%d in all)", n)
	}
}

// A project's h2c transport is not dropped while a request is in flight on
// it: ten projects with one slow request each, behind a front that keeps
// two transports, leave no upstream connection open once the answers are
// in and the idle ones are closed (when the transports were dropped in
// flight, eight connections went idle in transports nobody reached and
// stayed open for the upstream idle timeout).
func TestUpstreamH2CNoLeakInFlight(t *testing.T) {
	var open atomic.Int64
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		time.Sleep(300 * time.Millisecond)
		_, _ = io.WriteString(w, req.Proto)
	}))
	up.Config.Protocols = new(http.Protocols)
	up.Config.Protocols.SetHTTP1(true)
	up.Config.Protocols.SetUnencryptedHTTP2(true)
	up.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		switch s {
		case http.StateNew:
			open.Add(1)
		case http.StateClosed, http.StateHijacked:
			open.Add(-1)
		}
	}
	up.Start()
	defer up.Close()
	f, err := New(Config{Upstream: up.URL, UpstreamH2C: true, TrustedPeers: []string{"192.0.2.1"}}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.CloseIdle()
	f.keyed.max = 2
	var wg sync.WaitGroup
	for i := range 10 {
		wg.Go(func() {
			rec := httptest.NewRecorder()
			req := httptest.NewRequest("GET", "/", nil)
			req.Header.Set(DefaultProjectHeader, fmt.Sprint("p", i))
			f.ServeHTTP(rec, req)
			if rec.Body.String() != "HTTP/2.0" {
				t.Errorf("p%d: upstream saw %q, want HTTP/2.0", i, rec.Body.String())
			}
		})
	}
	wg.Wait()
	if k := f.keyed.transports(); k > 2 {
		t.Errorf("%d transports kept with nothing in flight, want at most 2", k)
	}
	f.CloseIdle()
	deadline := time.Now().Add(5 * time.Second)
	for open.Load() > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := open.Load(); n != 0 {
		t.Errorf("%d upstream connections still open after CloseIdle", n)
	}
}
