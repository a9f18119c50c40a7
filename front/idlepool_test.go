// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
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
	for step := range 40000 {
		k := upKey{project: fmt.Sprint(rng.IntN(6)), exempt: rng.IntN(4) == 0}
		switch r := rng.IntN(200); {
		case r == 0:
			// A sweep: everything out, least recently used first.
			all := p.takeAll(nil)
			if len(all) != len(order) {
				t.Fatalf("step %d: takeAll gave %d, model %d", step, len(all), len(order))
			}
			for i, l := range all {
				if l.v.id != order[i] || l.key != keyOf[order[i]] {
					t.Fatalf("step %d: takeAll's %d is %d, want %d", step, i, l.v.id, order[i])
				}
			}
			model, order = map[upKey][]int{}, nil
		case r < 40:
			// A sweep puts back what it kept, as the least recently used.
			c := mk(step)
			conns[step], keyOf[step] = c, k
			want := len(model[k]) < perKey && len(order) < total
			if got := p.putOldest(k, &c.link, perKey, total); got != want {
				t.Fatalf("step %d: putOldest %v, want %v", step, got, want)
			}
			if want {
				model[k] = append([]int{step}, model[k]...)
				order = append([]int{step}, order...)
			}
		case r < 140:
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
		default:
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
		if b := p.budget(); p.len() != len(order) || b.n != len(order) || b.per[k] != len(model[k]) {
			t.Fatalf("step %d: pool holds %d (budget %d, %d of %v), model %d (%d)", step, p.len(), b.n, b.per[k], k, len(order), len(model[k]))
		}
	}
	if n := p.keys(); n > 2*total+16 {
		t.Errorf("%d keys kept for a pool of %d", n, total)
	}
}

// Pools that share a budget keep within its bounds together: a put past a
// bound evicts from the pool put to, or, when that pool holds nothing to
// give way, the connection put itself. A link pooled twice is a bug that
// would corrupt the lists: put panics.
func TestIdlePoolSharedBudget(t *testing.T) {
	type conn struct {
		id   int
		link idleLink[*conn]
	}
	mk := func(id int) *idleLink[*conn] { c := &conn{id: id}; c.link.v = c; return &c.link }
	a, b, c := upKey{project: "a"}, upKey{project: "b"}, upKey{project: "c"}
	budget := &idleBudget{}
	p1, p2 := idlePool[*conn]{b: budget}, idlePool[*conn]{b: budget}
	const perKey, total = 2, 3
	for i := range 2 {
		if old, ev := p1.put(a, mk(i), perKey, total); ev {
			t.Fatalf("p1's a %d evicted %d", i, old.id)
		}
	}
	if old, ev := p2.put(a, mk(2), perKey, total); !ev || old.id != 2 {
		t.Fatalf("a's third in p2 (p1 holds a's 2): evicted %v %v, want itself", old, ev)
	}
	if _, ev := p2.put(b, mk(3), perKey, total); ev {
		t.Fatal("b's first evicted")
	}
	if old, ev := p1.put(c, mk(4), perKey, total); !ev || old.id != 0 {
		t.Fatalf("c in p1 past the total: evicted %v %v, want p1's oldest 0", old, ev)
	}
	if old, ev := p2.put(c, mk(5), perKey, total); !ev || old.id != 3 {
		t.Fatalf("c in p2 past the total: evicted %v %v, want p2's oldest 3", old, ev)
	}
	if !p1.remove(&p1.head.v.link) || p1.putOldest(a, mk(6), perKey, total) != true {
		t.Fatal("putOldest with room refused")
	}
	if p2.putOldest(b, mk(7), perKey, total) {
		t.Fatal("putOldest past the total accepted")
	}
	if budget.n != 3 || budget.per[a] != 1 || budget.per[c] != 2 || p1.len()+p2.len() != 3 {
		t.Fatalf("budget %d (%v), pools %d and %d: want 3", budget.n, budget.per, p1.len(), p2.len())
	}
	defer func() {
		if recover() == nil {
			t.Error("a link put twice did not panic")
		}
	}()
	p1.put(a, p1.tail, perKey, total)
}

// The sweep puts what it keeps back under each connection's own key: after
// sweepIdle, a key's takes give exactly the connections put under it.
func TestSweepKeepsKeys(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var held []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	defer func() {
		mu.Lock()
		for _, c := range held {
			c.Close()
		}
		mu.Unlock()
	}()
	d := &directUpstream{addr: l.Addr().String(), dial: (&net.Dialer{}).DialContext, maxIdle: 64, maxIdlePer: 8,
		idleFor: time.Minute, unasked: func(string) {}}
	defer d.closeIdle()
	keys := []upKey{{project: "a"}, {project: "b"}, {project: "a", exempt: true}, {project: "c"}}
	mine := map[*upConn]upKey{}
	now := time.Now()
	for i := range 3 * len(keys) {
		k := keys[i%len(keys)]
		uc, _, err := d.dialNew(context.Background(), k)
		if err != nil {
			t.Fatal(err)
		}
		mine[uc] = k
		d.put(uc, now)
	}
	d.sweepIdle()
	for _, k := range keys {
		n := 0
		for {
			d.mu.Lock()
			uc, ok := d.idle.take(k)
			d.mu.Unlock()
			if !ok {
				break
			}
			n++
			if mine[uc] != k {
				t.Errorf("%v took a connection of %v", k, mine[uc])
			}
			d.put(uc, now) // back, then out of the way
			d.mu.Lock()
			d.idle.remove(&uc.link)
			d.mu.Unlock()
			uc.c.Close()
		}
		if n != 3 {
			t.Errorf("%v took %d connections after the sweep, want its 3", k, n)
		}
	}
}

// Behind an h2c upstream (the fallback, through http.Transport) each
// project's requests have connections of their own too: two projects take
// two connections, a project's next request reuses its own, and a third
// project past the bound of keys drops the least recently used key's.
func TestUpstreamH2CConnectionPerProject(t *testing.T) {
	// Each answer names the upstream connection it came on (the client's
	// address as the upstream sees it): the test judges which connection
	// served whom, not how many dials the transport made (under load it
	// may dial twice for one request and keep one).
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.WriteString(w, req.Proto+" "+req.RemoteAddr)
	}))
	up.Config.Protocols = new(http.Protocols)
	up.Config.Protocols.SetHTTP1(true)
	up.Config.Protocols.SetUnencryptedHTTP2(true)
	up.Start()
	defer up.Close()
	f, err := New(Config{Upstream: up.URL, UpstreamH2C: true, TrustedPeers: []string{"192.0.2.1"}}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	defer f.CloseIdle()
	f.keyed.max = 2
	get := func(project string) string {
		t.Helper()
		rec := httptest.NewRecorder()
		req := httptest.NewRequest("GET", "/", nil)
		req.Header.Set(DefaultProjectHeader, project)
		f.ServeHTTP(rec, req)
		proto, conn, _ := strings.Cut(rec.Body.String(), " ")
		if proto != "HTTP/2.0" {
			t.Fatalf("%s: upstream saw %q, want HTTP/2.0", project, rec.Body.String())
		}
		return conn
	}
	a1, b1, a2, b2 := get("alpha"), get("beta"), get("alpha"), get("beta")
	if a1 == b1 {
		t.Errorf("alpha and beta shared the upstream connection %s", a1)
	}
	if a2 != a1 || b2 != b1 {
		t.Errorf("a project's next request took another connection: alpha %s then %s, beta %s then %s", a1, a2, b1, b2)
	}
	g := get("gamma")
	if g == a1 || g == b1 {
		t.Errorf("gamma was served on another project's connection %s (alpha %s, beta %s)", g, a1, b1)
	}
	if k := f.keyed.transports(); k != 2 {
		t.Errorf("gamma: %d transports kept, want 2", k)
	}
	if b3 := get("beta"); b3 != b1 { // kept: alpha was the least recently used
		t.Errorf("beta after gamma took another connection: %s, had %s", b3, b1)
	}
	if a3 := get("alpha"); a3 == a1 {
		t.Errorf("alpha's transport was not dropped: its connection %s served it again", a3)
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
