// SPDX-License-Identifier: Apache-2.0

package front

import (
	"container/list"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// upKey names the requests an upstream connection may serve: those of one
// project, ordinary or exempt. A connection carries the requests of one
// key only, from its dial to its close, so that whatever an upstream sends
// on it unasked (an answer after the next request went out, which no
// HTTP/1.1 client can tell from that request's own answer) reaches at most
// the same project, never another (see "What the upstream may not do" in
// doc.go).
type upKey struct {
	project string
	exempt  bool
}

// keyOf is the key of the requests x may share a connection with.
func keyOf(x *exchange) upKey { return upKey{project: x.project, exempt: x.exempt} }

// idleLink is a connection's place in an idlePool, kept in the connection
// so that pooling it allocates nothing.
type idleLink[T any] struct {
	v            T
	key          upKey
	set          *idleSet[T]  // nil while not pooled
	prev, next   *idleLink[T] // in the pool, least recently used first
	sprev, snext *idleLink[T] // in its set, least recently used first
}

// idleSet is one key's idle connections.
type idleSet[T any] struct {
	head, tail *idleLink[T]
	n          int
}

// idleBudget is the bounds that several idlePools share: how many idle
// connections they hold together, in all and of each key. The direct
// path's pool and every fast-path loop's pool share the front's one, so
// that UpstreamIdlePerProject and idleUpstream bound what the front keeps
// idle, not what each pool keeps. Its zero value is an empty budget.
type idleBudget struct {
	mu  sync.Mutex // guards the fields below
	per map[upKey]int
	n   int
}

// drop counts one idle connection of k less. b.mu is held.
func (b *idleBudget) drop(k upKey) {
	if b.per[k]--; b.per[k] <= 0 {
		delete(b.per, k)
	}
	b.n--
}

// add counts one idle connection of k more. b.mu is held.
func (b *idleBudget) add(k upKey) {
	if b.per == nil {
		b.per = map[upKey]int{}
	}
	b.per[k]++
	b.n++
}

// idlePool keeps idle upstream connections by key: a request takes only a
// connection of its own key (the most recently used one). The pool is
// bounded per key and in all, counted in its budget (b) with the other
// pools that share it; a put past either bound evicts the least recently
// used connection of the key, or of the whole pool, or when this pool
// holds none to evict (the others hold them) the connection put. It is
// not safe for concurrent use (the direct path holds its lock around it,
// a loop owns its own); its budget is. Its zero value is an empty pool
// with a budget of its own.
type idlePool[T any] struct {
	b          *idleBudget
	sets       map[upKey]*idleSet[T]
	head, tail *idleLink[T]
	n          int
}

// budget returns the pool's budget, made when it has none.
func (p *idlePool[T]) budget() *idleBudget {
	if p.b == nil {
		p.b = &idleBudget{}
	}
	return p.b
}

// len is how many connections the pool holds.
func (p *idlePool[T]) len() int { return p.n }

// take removes and returns the most recently used connection of key k.
func (p *idlePool[T]) take(k upKey) (T, bool) {
	s := p.sets[k]
	if s == nil || s.tail == nil {
		var zero T
		return zero, false
	}
	l := s.tail
	p.remove(l)
	return l.v, true
}

// put pools l (its v set) under k as the most recently used, within
// perKey connections of k and total in all (each at least 1) in the
// pool's budget. It returns the connection evicted to make room, if any,
// for the caller to close: l's own when the bound is reached and this
// pool holds nothing to evict for it (l is then not pooled).
func (p *idlePool[T]) put(k upKey, l *idleLink[T], perKey, total int) (evicted T, ok bool) {
	if l.set != nil {
		panic("front: idle connection pooled twice")
	}
	s := p.set(k, total)
	b := p.budget()
	b.mu.Lock()
	var old *idleLink[T]
	switch {
	case b.per[k] >= max(1, perKey):
		old = s.head
	case b.n >= max(1, total):
		old = p.head
	default:
		b.add(k)
		b.mu.Unlock()
		p.link(k, s, l, false)
		return evicted, false
	}
	if old == nil {
		// Full, and this pool holds nothing to give way (the others
		// hold the key's, or all): l goes.
		b.mu.Unlock()
		return l.v, true
	}
	b.drop(old.key)
	b.add(k)
	b.mu.Unlock()
	p.unlink(old)
	p.link(k, s, l, false)
	return old.v, true
}

// putOldest pools l under k as the least recently used, if there is room
// within perKey and total in the budget; it reports whether it did (a
// sweep puts back what it kept, while newer connections may have come
// meanwhile).
func (p *idlePool[T]) putOldest(k upKey, l *idleLink[T], perKey, total int) bool {
	if l.set != nil {
		panic("front: idle connection pooled twice")
	}
	s := p.set(k, total)
	b := p.budget()
	b.mu.Lock()
	if b.per[k] >= max(1, perKey) || b.n >= max(1, total) {
		b.mu.Unlock()
		return false
	}
	b.add(k)
	b.mu.Unlock()
	p.link(k, s, l, true)
	return true
}

// link puts l in the pool and in s, as the most recently used or, with
// oldest, as the least.
func (p *idlePool[T]) link(k upKey, s *idleSet[T], l *idleLink[T], oldest bool) {
	l.key, l.set = k, s
	if oldest {
		l.prev, l.next = nil, p.head
		if p.head != nil {
			p.head.prev = l
		} else {
			p.tail = l
		}
		p.head = l
		l.sprev, l.snext = nil, s.head
		if s.head != nil {
			s.head.sprev = l
		} else {
			s.tail = l
		}
		s.head = l
	} else {
		l.prev, l.next = p.tail, nil
		if p.tail != nil {
			p.tail.next = l
		} else {
			p.head = l
		}
		p.tail = l
		l.sprev, l.snext = s.tail, nil
		if s.tail != nil {
			s.tail.snext = l
		} else {
			s.head = l
		}
		s.tail = l
	}
	s.n++
	p.n++
}

// set returns k's set, made when k has none. Empty sets are kept (a key
// whose only connection is taken and put back allocates nothing), and
// dropped all at once when there are many more sets than the pool can
// hold connections, so that the map stays within a small multiple of
// total whatever number of keys come and go.
func (p *idlePool[T]) set(k upKey, total int) *idleSet[T] {
	if s := p.sets[k]; s != nil {
		return s
	}
	if p.sets == nil {
		p.sets = map[upKey]*idleSet[T]{}
	} else if len(p.sets) >= 2*max(1, total)+16 {
		for key, s := range p.sets {
			if s.n == 0 {
				delete(p.sets, key)
			}
		}
	}
	s := &idleSet[T]{}
	p.sets[k] = s
	return s
}

// remove takes l out of the pool, if it is there, and reports whether it
// was.
func (p *idlePool[T]) remove(l *idleLink[T]) bool {
	if l.set == nil {
		return false
	}
	k := l.key
	p.unlink(l)
	b := p.budget()
	b.mu.Lock()
	b.drop(k)
	b.mu.Unlock()
	return true
}

// unlink takes l, which is pooled, out of the pool's lists (not out of
// its budget).
func (p *idlePool[T]) unlink(l *idleLink[T]) {
	s := l.set
	if l.prev != nil {
		l.prev.next = l.next
	} else {
		p.head = l.next
	}
	if l.next != nil {
		l.next.prev = l.prev
	} else {
		p.tail = l.prev
	}
	if l.sprev != nil {
		l.sprev.snext = l.snext
	} else {
		s.head = l.snext
	}
	if l.snext != nil {
		l.snext.sprev = l.sprev
	} else {
		s.tail = l.sprev
	}
	l.set, l.prev, l.next, l.sprev, l.snext = nil, nil, nil, nil, nil
	s.n--
	p.n--
}

// takeAll empties the pool and returns its connections' links, least
// recently used first, appended to into.
func (p *idlePool[T]) takeAll(into []*idleLink[T]) []*idleLink[T] {
	if p.head == nil {
		return into
	}
	b := p.budget()
	b.mu.Lock()
	for p.head != nil {
		l := p.head
		b.drop(l.key)
		p.unlink(l)
		into = append(into, l)
	}
	b.mu.Unlock()
	return into
}

// keys is how many keys have a set (tests read it).
func (p *idlePool[T]) keys() int { return len(p.sets) }

// keyedTransport is the fallback's round tripper to an h2c upstream: an
// http.Transport of each key (upKey), so that no connection carries the
// requests of two projects there either. (HTTP/2 frames each answer with
// its request's stream, so an answer cannot cross streams as it can cross
// requests on an HTTP/1.1 connection; the transports keep the rule one
// rule on every path.) An HTTP/1 upstream's fallback needs none: its
// transport uses a connection for one request.
//
// Each transport keeps one idle connection (HTTP/2 carries a key's
// concurrent requests on it). Past max transports, the least recently
// used one with no request in flight is dropped, its idle connection
// closed: a transport is never dropped while a request is in flight on
// it, since the connection that request goes idle on would then be in a
// transport nobody reaches, outside CloseIdleConnections and the
// descriptor budget until the upstream idle timeout. So at most max
// transports, and one more per request in flight, exist at once; when a
// request ends the transports past max that are idle are dropped.
type keyedTransport struct {
	mk  func() *http.Transport
	max int

	mu  sync.Mutex // guards the fields below
	ts  map[upKey]*keyedTr
	lru list.List // of *keyedTr, the most recently used first
}

type keyedTr struct {
	t    *http.Transport
	key  upKey
	busy int // requests in flight on it, their answers' bodies not closed
	el   *list.Element
}

// RoundTrip sends r on the transport of r's key (its exchange's). The
// transport counts the request in flight until its answer's body is
// closed.
func (k *keyedTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	var key upKey
	if x := exchangeOf(r); x != nil {
		key = keyOf(x)
	}
	e := k.acquire(key)
	res, err := e.t.RoundTrip(r)
	if err != nil || res.Body == nil || res.StatusCode == http.StatusSwitchingProtocols {
		// A switched protocol's body is the connection itself
		// (ReverseProxy needs its io.ReadWriteCloser): it is no longer
		// the transport's.
		k.release(e)
		return res, err
	}
	res.Body = &keyedBody{ReadCloser: res.Body, k: k, e: e}
	return res, nil
}

// keyedBody is an answer's body that ends its request's time in flight
// on its transport when it is closed.
type keyedBody struct {
	io.ReadCloser
	k    *keyedTransport
	e    *keyedTr
	done atomic.Bool
}

func (b *keyedBody) Close() error {
	err := b.ReadCloser.Close()
	if !b.done.Swap(true) {
		b.k.release(b.e)
	}
	return err
}

// acquire returns key's transport, made when it has none, with one more
// request in flight on it.
func (k *keyedTransport) acquire(key upKey) *keyedTr {
	k.mu.Lock()
	defer k.mu.Unlock()
	if e := k.ts[key]; e != nil {
		e.busy++
		k.lru.MoveToFront(e.el)
		return e
	}
	if k.ts == nil {
		k.ts = map[upKey]*keyedTr{}
	}
	t := k.mk()
	t.MaxIdleConns, t.MaxIdleConnsPerHost = 1, 1
	e := &keyedTr{t: t, key: key, busy: 1}
	e.el = k.lru.PushFront(e)
	k.ts[key] = e
	k.trim()
	return e
}

// release ends a request in flight on e.
func (k *keyedTransport) release(e *keyedTr) {
	k.mu.Lock()
	defer k.mu.Unlock()
	e.busy--
	k.trim()
}

// trim drops the least recently used idle transports while there are
// more than max. k.mu is held.
func (k *keyedTransport) trim() {
	for el := k.lru.Back(); el != nil && len(k.ts) > max(1, k.max); {
		e := el.Value.(*keyedTr)
		el = el.Prev()
		if e.busy > 0 {
			continue
		}
		k.lru.Remove(e.el)
		delete(k.ts, e.key)
		e.t.CloseIdleConnections()
		// The last stream's end is recorded just after its body's
		// close (on the transport's goroutine that wrote the request):
		// until then the connection does not count as idle.
		time.AfterFunc(time.Second, e.t.CloseIdleConnections)
	}
}

// CloseIdleConnections closes the idle connections of every key.
func (k *keyedTransport) CloseIdleConnections() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for _, e := range k.ts {
		e.t.CloseIdleConnections()
	}
}

// transports is how many keys have a transport (tests read it).
func (k *keyedTransport) transports() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.ts)
}
