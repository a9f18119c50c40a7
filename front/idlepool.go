// SPDX-License-Identifier: Apache-2.0

package front

import (
	"math"
	"net/http"
	"sync"
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

// idlePool keeps idle upstream connections by key: a request takes only a
// connection of its own key (the most recently used one). The pool is
// bounded per key and in all; a put past either bound evicts the least
// recently used connection of the key, or of the whole pool. It is not
// safe for concurrent use (the direct path holds its lock around it, a
// loop owns its own). Its zero value is an empty pool.
type idlePool[T any] struct {
	sets       map[upKey]*idleSet[T]
	head, tail *idleLink[T]
	n          int
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
// perKey connections of k and total in all (each at least 1). It returns
// the connection evicted to make room, if any, for the caller to close.
func (p *idlePool[T]) put(k upKey, l *idleLink[T], perKey, total int) (evicted T, ok bool) {
	s := p.set(k, total)
	var old *idleLink[T]
	switch {
	case s.n >= max(1, perKey):
		old = s.head
	case p.n >= max(1, total):
		old = p.head
	}
	if old != nil {
		p.remove(old)
		evicted, ok = old.v, true
	}
	l.key, l.set = k, s
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
	s.n++
	p.n++
	return evicted, ok
}

// putOldest pools l under k as the least recently used, if there is room
// within perKey and total; it reports whether it did (a sweep puts back
// what it kept, while newer connections may have come meanwhile).
func (p *idlePool[T]) putOldest(k upKey, l *idleLink[T], perKey, total int) bool {
	s := p.set(k, total)
	if s.n >= max(1, perKey) || p.n >= max(1, total) {
		return false
	}
	l.key, l.set = k, s
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
	s.n++
	p.n++
	return true
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
	s := l.set
	if s == nil {
		return false
	}
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
	return true
}

// takeAll empties the pool and returns its connections' links, least
// recently used first, appended to into.
func (p *idlePool[T]) takeAll(into []*idleLink[T]) []*idleLink[T] {
	for p.head != nil {
		l := p.head
		p.remove(l)
		into = append(into, l)
	}
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
// transport uses a connection for one request. At most max keys have a
// transport, each keeping one idle connection (HTTP/2 carries a key's
// concurrent requests on it); a new key past max closes the idle
// connections of the least recently used key's transport and drops it
// (what is in flight on it ends there).
type keyedTransport struct {
	mk  func() *http.Transport
	max int

	mu   sync.Mutex // guards the fields below
	tick uint64
	ts   map[upKey]*keyedTr
}

type keyedTr struct {
	t    *http.Transport
	used uint64 // keyedTransport.tick at its last request
}

// RoundTrip sends r on the transport of r's key (its exchange's).
func (k *keyedTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	var key upKey
	if x := exchangeOf(r); x != nil {
		key = keyOf(x)
	}
	return k.get(key).RoundTrip(r)
}

// get returns key's transport, made when it has none.
func (k *keyedTransport) get(key upKey) *http.Transport {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.tick++
	if e := k.ts[key]; e != nil {
		e.used = k.tick
		return e.t
	}
	if k.ts == nil {
		k.ts = map[upKey]*keyedTr{}
	}
	if len(k.ts) >= max(1, k.max) {
		var oldest upKey
		var at uint64 = math.MaxUint64
		for key, e := range k.ts {
			if e.used < at {
				oldest, at = key, e.used
			}
		}
		k.ts[oldest].t.CloseIdleConnections()
		delete(k.ts, oldest)
	}
	t := k.mk()
	t.MaxIdleConns, t.MaxIdleConnsPerHost = 1, 1
	k.ts[key] = &keyedTr{t: t, used: k.tick}
	return t
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
