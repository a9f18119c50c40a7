// SPDX-License-Identifier: Apache-2.0

package client

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fairshare-dev/fairshare/internal/wire"
)

// DefaultSocket is the daemon's permit socket when Options.Socket is empty
// (the server's default: one definition, in internal/wire).
const DefaultSocket = wire.DefaultSocket

var (
	// ErrRefused matches an *Error whose pool refused by the fair-share rule.
	ErrRefused = errors.New("permit refused")
	// ErrTooManyResidents matches an *Error of a spawn that found no room
	// and nothing put to sleep within a second.
	ErrTooManyResidents = errors.New("too many residents")
	// ErrTooManyWaiting matches an *Error of an operation that would have
	// waited (AcquireWait, Spawn) while the session or the daemon already
	// had its bound of waiting operations (TOO_MANY_WAITING): retry once
	// some of the caller's waits have ended.
	ErrTooManyWaiting = errors.New("too many operations waiting")
	// ErrTooManyObjects matches an *Error of a spawn of a new object while
	// the user or the daemon keeps its bound of objects (TOO_MANY_OBJECTS):
	// remove objects that will not be called again.
	ErrTooManyObjects = errors.New("too many objects")
	// ErrBadRequest matches an *Error of a request the daemon could not
	// take as it was (BAD_REQUEST), for instance an invalid project name.
	ErrBadRequest = errors.New("bad request")
	// ErrClosed is returned by calls on a closed Client.
	ErrClosed = errors.New("permit client closed")
	// ErrDisconnected is returned by calls whose connection dropped before
	// they were answered.
	ErrDisconnected = errors.New("permit connection lost")
	// ErrLeasesLost matches the *LostLeasesError given to OnReconnect when
	// acquire leases held by callers ended with the connection.
	ErrLeasesLost = errors.New("leases ended with the connection")
	// ErrEvicting is returned by a Spawn of an object the daemon has asked
	// this runtime to put to sleep while OnEvict has not returned: the
	// object is being put away, and a spawn sent now could not say whether
	// before or after. Nothing is sent. Spawn it again once OnEvict has
	// returned (a runtime that holds its own lock on the object while it
	// calls Spawn must let go of it first: OnEvict may be waiting for it).
	ErrEvicting = errors.New("object is being evicted: spawn it again once OnEvict has returned")
)

// Options configures a Client.
type Options struct {
	Socket string // default DefaultSocket
	// OnEvict is called, each time in its own goroutine, when the daemon
	// asks this runtime to put one of its objects to sleep. Return nil once
	// the object is asleep; the client then confirms to the daemon, which
	// lets the waiting spawn proceed. A non-nil error leaves the object
	// resident (the spawn that needed the room will be refused). Without
	// OnEvict evictions are confirmed at once. While OnEvict runs, a Spawn
	// of the object fails with ErrEvicting; once it has returned nil, a
	// Spawn waits for the confirmation and then wakes the object.
	//
	// An eviction left unconfirmed counts against the runtime: after
	// permitd.MaxUnconfirmed (3) in a row of one project's objects,
	// whether OnEvict failed, hung or was never called, the daemon stops
	// waiting for it and ends those residences itself. OnEvict is then
	// called once more for each, with Reason ReasonDropped: the object
	// holds no permit any more and must be put to sleep; nothing is
	// confirmed and the error is ignored.
	OnEvict func(Eviction) error
	// Reconnect makes the client redial after losing its connection and
	// spawn its resident objects again.
	Reconnect bool
	// OnReconnect, if set, is called after a redial and re-registration,
	// with the error of the re-registration joined with a
	// *LostLeasesError (matching ErrLeasesLost) for the acquire leases
	// callers held when the connection dropped: the daemon ended them,
	// and the new one does not know them (releasing one is harmless and
	// releases nothing). nil when every resident went back and no lease
	// was held.
	OnReconnect func(error)
}

// LostLeasesError lists the acquire leases, held by callers and not
// released, that ended with a connection (Options.OnReconnect).
type LostLeasesError struct {
	Leases []Lease // by id
}

func (e *LostLeasesError) Error() string {
	return fmt.Sprintf("%d acquire leases ended with the connection", len(e.Leases))
}

// Is makes errors.Is(err, ErrLeasesLost) match.
func (e *LostLeasesError) Is(target error) bool { return target == ErrLeasesLost }

// Lease is a permit held by this client's session.
type Lease struct {
	ID      uint64
	Pool    string
	Project string
	Object  string // residents only
}

// ReasonDropped is the Reason of an Eviction the daemon has already carried
// out: the runtime left evictions unconfirmed (Options.OnEvict).
const ReasonDropped = "unconfirmed"

// Eviction asks the runtime to put Object (of Project) to sleep. Lease is
// the residence being ended (0 from a daemon that does not say): the
// confirmation releases it, so that a confirmation the object's waking
// overtook (a Spawn of it answered meanwhile, a residence of its own) ends
// nothing.
type Eviction struct {
	Project, Object, Reason string
	Lease                   uint64
}

// Refusal is the pool's account of a refusal.
type Refusal struct {
	Pool    string `json:"pool"`
	Project string `json:"project"`
	Reason  string `json:"reason"`
	Held    int    `json:"held"`
	Share   int    `json:"share"`
	InUse   int    `json:"in_use"`
	Size    int    `json:"size"`
}

// Error is a request the daemon answered with ok=false.
type Error struct {
	Code       string
	Message    string
	RetryAfter time.Duration // when to try again (REFUSED, TOO_MANY_RESIDENTS)
	Refusal    *Refusal
}

func (e *Error) Error() string { return "permitd: " + e.Code + ": " + e.Message }

// Is lets callers branch with errors.Is(err, ErrRefused) and the like.
func (e *Error) Is(target error) bool {
	switch target {
	case ErrRefused:
		return e.Code == "REFUSED"
	case ErrTooManyResidents:
		return e.Code == "TOO_MANY_RESIDENTS"
	case ErrTooManyWaiting:
		return e.Code == "TOO_MANY_WAITING"
	case ErrTooManyObjects:
		return e.Code == "TOO_MANY_OBJECTS"
	case ErrBadRequest:
		return e.Code == "BAD_REQUEST"
	}
	return false
}

// reply is one line from the server: an answer, or an event when Event is set.
type reply struct {
	ID           uint64    `json:"id"`
	OK           bool      `json:"ok"`
	Lease        uint64    `json:"lease"`
	Released     bool      `json:"released"`
	Code         string    `json:"code"`
	Error        string    `json:"error"`
	Note         string    `json:"note"`
	RetryAfterMS int64     `json:"retry_after_ms"`
	Refusal      *Refusal  `json:"refusal"`
	Evicted      *Eviction `json:"evicted"`
	Session      uint64    `json:"session"`
	Event        string    `json:"event"`
	Project      string    `json:"project"`
	Object       string    `json:"object"`
	Reason       string    `json:"reason"`
}

func (r *reply) err() error {
	if r.OK {
		return nil
	}
	return &Error{Code: r.Code, Message: r.Error, RetryAfter: time.Duration(r.RetryAfterMS) * time.Millisecond, Refusal: r.Refusal}
}

// waiter is a call waiting for its answer. ch is nil once the caller gave
// up; a late grant is then released rather than leaked. It is kept by value
// in pending so that a call allocates no waiter.
type waiter struct {
	ch chan reply
	op string
	// object and seq, for a spawn: its object, and its place among the
	// spawns of it (spawnBook.seq), so that a late grant given up on is
	// given back only if no later spawn's caller holds it; object, for a
	// sleep or a remove (the object's book).
	object string
	seq    uint64
	// pool and project, for an acquire: the lease it grants (Client.leases).
	pool, project string
}

// objState is what the client remembers of an object so it can register it
// again with a restarted daemon.
type objState struct {
	project  string
	resident bool
	touched  time.Time
}

// Client is one session with the permit daemon.
type Client struct {
	opts   Options
	nextID atomic.Uint64

	flush chan struct{} // wakes the flusher; capacity 1, so wakes coalesce
	// wmu guards the fields below. It is never held across a write: a
	// daemon that stops reading holds up the flusher only, and each call
	// still ends with its context (it used to wait for wmu, which the
	// flusher held while blocked in a write without a deadline).
	wmu   sync.Mutex
	wbuf  []byte   // requests for wconn the flusher has not taken yet
	spare []byte   // the flusher's other buffer, nil while it writes
	wconn net.Conn // the connection wbuf is for
	werr  error    // the last write error on wconn, reported to the next callers
	// drained is closed (and replaced) when the flusher takes wbuf while
	// roomWaiters calls wait for wbuf to go under maxPending.
	drained     chan struct{}
	roomWaiters int

	mu      sync.Mutex // guards the fields below
	conn    net.Conn
	down    bool // conn has ended (and no other is attached yet): calls fail at once
	pending map[uint64]waiter
	objects map[string]*objState
	// evicting counts, per object, the evict events read whose OnEvict
	// has not returned; confirming holds the objects put to sleep for an
	// eviction whose confirmation is on its way, each closed once it is
	// answered. A Spawn of the object waits for neither: it fails with
	// ErrEvicting on the first and waits for the second.
	evicting   map[string]int
	confirming map[string]chan struct{}
	// books are the objects' spawns and residences as this connection's
	// answers tell them (spawnBook); an object removed with no spawn of it
	// under way has none.
	books map[string]*spawnBook
	// leases are the acquire leases of this connection handed to callers
	// and not released; lost, those of connections that ended, until a
	// reconnect reports them (OnReconnect).
	leases map[uint64]Lease
	lost   []Lease
	closed bool
	done   chan struct{} // closed by Close

	afterDial func() // tests: runs between a reconnect's dial and its attach
}

// Dial connects to the daemon's permit socket.
func Dial(ctx context.Context, opts Options) (*Client, error) {
	if opts.Socket == "" {
		opts.Socket = DefaultSocket
	}
	c := &Client{opts: opts, pending: map[uint64]waiter{}, objects: map[string]*objState{},
		evicting: map[string]int{}, confirming: map[string]chan struct{}{}, books: map[string]*spawnBook{},
		leases: map[uint64]Lease{}, done: make(chan struct{}), flush: make(chan struct{}, 1), drained: make(chan struct{})}
	conn, err := c.dial(ctx)
	if err != nil {
		return nil, err
	}
	c.attach(conn)
	go c.flusher()
	return c, nil
}

// Bounds of the client's writes.
const (
	// writeTimeout bounds one write to the daemon (the daemon's own bound
	// on its writes): a daemon that reads nothing for that long is taken
	// for hung, and the connection is closed (and, with Reconnect,
	// dialled again).
	writeTimeout = 10 * time.Second
	// maxPending bounds the requests buffered while the flusher writes;
	// past it a call waits for room, or for its context.
	maxPending = 256 << 10
	// maxKeptBuf is the largest buffer kept for the next burst: a buffer
	// grown by a burst is not kept for an idle client.
	maxKeptBuf = 64 << 10
)

// flusher writes buffered requests out. Callers only append and wake it, so
// while it writes more callers append: under load one write carries a whole
// burst, which is what makes pipelining cheap for both ends.
func (c *Client) flusher() {
	for {
		select {
		case <-c.done:
			return
		case <-c.flush:
		}
		// Let the callers that are ready to run append first: on two cores
		// this turns one write per request into one write per burst.
		runtime.Gosched()
		c.wmu.Lock()
		buf, conn := c.wbuf, c.wconn
		c.wbuf, c.spare = c.spare[:0], nil
		if c.roomWaiters > 0 {
			close(c.drained)
			c.drained = make(chan struct{})
		}
		c.wmu.Unlock()
		var err error
		if len(buf) > 0 {
			conn.SetWriteDeadline(time.Now().Add(writeTimeout))
			_, err = conn.Write(buf)
		}
		c.wmu.Lock()
		if cap(buf) <= maxKeptBuf {
			c.spare = buf[:0]
		}
		if err != nil && c.wconn == conn {
			c.werr = err
			// The calls just written wait for answers that cannot
			// come: closed, the connection's reader ends and fails
			// them.
			conn.Close()
		}
		c.wmu.Unlock()
	}
}

// wake wakes the flusher.
func (c *Client) wake() {
	select {
	case c.flush <- struct{}{}:
	default:
	}
}

// lockRoom takes wmu once the buffer has room for a request, or returns
// ctx's error (wmu not held) if ctx ends first.
func (c *Client) lockRoom(ctx context.Context) error {
	c.wmu.Lock()
	for len(c.wbuf) >= maxPending && c.werr == nil {
		drained := c.drained
		c.roomWaiters++
		c.wmu.Unlock()
		c.wake()
		var err error
		select {
		case <-drained:
		case <-ctx.Done():
			err = ctx.Err()
		case <-c.done:
			err = ErrClosed
		}
		c.wmu.Lock()
		c.roomWaiters--
		if err != nil {
			c.wmu.Unlock()
			return err
		}
	}
	return nil
}

func (c *Client) dial(ctx context.Context) (net.Conn, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", c.opts.Socket)
	if err != nil {
		return nil, fmt.Errorf("dialing permit socket: %w", err)
	}
	return conn, nil
}

// attach makes conn the session's connection; false, and conn closed, if
// the client was closed meanwhile (a reconnect racing Close).
func (c *Client) attach(conn net.Conn) bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		conn.Close()
		return false
	}
	// Requests for the connection before are not sent on this one: their
	// calls failed with it.
	c.wbuf, c.wconn, c.werr = c.wbuf[:0], conn, nil
	if c.roomWaiters > 0 {
		close(c.drained)
		c.drained = make(chan struct{})
	}
	c.conn, c.down = conn, false
	// The residences of the connection before are no more, nor the late
	// grants held for a spawn's answer (their marks end here).
	for obj, b := range c.books {
		if b.back != nil {
			c.endMarkLocked(obj, b.back.done)
		}
	}
	c.books = map[string]*spawnBook{}
	c.mu.Unlock()
	go c.read(conn)
	return true
}

// Close ends the session; the daemon ends all its leases.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	close(c.done)
	conn := c.conn
	c.mu.Unlock()
	return conn.Close()
}

// read delivers answers and events until conn ends, then fails the calls it
// left unanswered and, with Reconnect, starts over on a new connection.
func (c *Client) read(conn net.Conn) {
	r := bufio.NewReaderSize(conn, 64<<10)
	for {
		line, err := r.ReadSlice('\n')
		if err != nil {
			break
		}
		var rp reply
		if !parseReply(line, &rp) {
			// A separate variable, so that rp stays on the stack on the
			// common path (encoding/json makes what it decodes into escape).
			slow := new(reply)
			if json.Unmarshal(line, slow) != nil {
				continue
			}
			rp = *slow
		}
		if rp.Event != "" {
			if rp.Event == "evict" || rp.Event == "dropped" {
				// Marked here, in the order of the lines read: a
				// Spawn made from now on is made knowing of it.
				c.mu.Lock()
				b := c.books[rp.Object]
				stale := rp.Lease != 0 && b != nil && b.lease != 0 && b.lease != rp.Lease
				if !stale {
					c.evicting[rp.Object]++
				}
				c.mu.Unlock()
				if !stale {
					go c.evicted(Eviction{Project: rp.Project, Object: rp.Object, Reason: rp.Reason, Lease: rp.Lease},
						rp.Event == "dropped")
				}
			}
			continue
		}
		c.mu.Lock()
		w, ok := c.pending[rp.ID]
		delete(c.pending, rp.ID)
		if ok && w.object != "" {
			c.bookLocked(w, &rp)
		}
		if ok && w.ch != nil && w.op == "acquire" && rp.OK && rp.Lease != 0 {
			// Its caller takes it: the answer is sent to it whether or
			// not it gives up meanwhile (call).
			c.leases[rp.Lease] = Lease{ID: rp.Lease, Pool: w.pool, Project: w.project}
		}
		c.mu.Unlock()
		switch {
		case !ok:
		case w.ch != nil:
			w.ch <- rp
		case rp.OK && rp.Lease != 0 && w.op == "acquire":
			// The caller gave up before the grant arrived.
			go c.call(context.Background(), request{Op: "release", Lease: rp.Lease})
		}
	}
	conn.Close()
	c.mu.Lock()
	if c.conn != conn {
		c.mu.Unlock()
		return
	}
	failed := c.pending
	c.pending = map[uint64]waiter{}
	c.down = true
	// The daemon ended this connection's leases with it.
	for _, l := range c.leases {
		c.lost = append(c.lost, l)
	}
	clear(c.leases)
	reconnect := c.opts.Reconnect && !c.closed
	c.mu.Unlock()
	for _, w := range failed {
		if w.ch != nil {
			w.ch <- reply{Code: "DISCONNECTED"}
		}
	}
	if reconnect {
		go c.reconnect()
	}
}

func (c *Client) reconnect() {
	backoff := 20 * time.Millisecond
	for {
		select {
		case <-c.done:
			return
		case <-time.After(backoff):
		}
		conn, err := c.dial(context.Background())
		if err != nil {
			backoff = min(2*backoff, time.Second)
			continue
		}
		if c.afterDial != nil {
			c.afterDial()
		}
		if !c.attach(conn) {
			return
		}
		err = c.reregister()
		c.mu.Lock()
		lost := c.lost
		c.lost = nil
		c.mu.Unlock()
		if len(lost) > 0 {
			sort.Slice(lost, func(i, j int) bool { return lost[i].ID < lost[j].ID })
			err = errors.Join(err, &LostLeasesError{Leases: lost})
		}
		if c.opts.OnReconnect != nil {
			c.opts.OnReconnect(err)
		}
		return
	}
}

// reregister spawns the resident objects again, least recently called first,
// so the new daemon's idleness order matches the old one's.
func (c *Client) reregister() error {
	type item struct {
		name string
		objState
	}
	c.mu.Lock()
	var items []item
	for name, o := range c.objects {
		if o.resident {
			items = append(items, item{name, *o})
		}
	}
	c.mu.Unlock()
	sort.Slice(items, func(i, j int) bool { return items[i].touched.Before(items[j].touched) })
	var errs []error
	for _, it := range items {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, err := c.Spawn(ctx, it.project, it.name)
		cancel()
		if errors.Is(err, ErrEvicting) {
			continue // being put away (an eviction of the connection before): asleep
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("re-registering %s: %w", it.name, err))
		}
	}
	return errors.Join(errs...)
}

// evicted runs OnEvict for ev and confirms. A Spawn of the object made
// meanwhile (ErrEvicting while OnEvict runs, a wait for the confirmation's
// answer after: waitConfirmed) is not sent: sent first, the daemon would
// take it for a call on the object its owner holds, and the confirmation
// after it would end the residence the runtime then loads.
//
// dropped: the daemon ended the residence itself (ReasonDropped); there is
// nothing to confirm, and the object is no longer resident here either
// (unless a spawn answered since gave it a residence of its own).
func (c *Client) evicted(ev Eviction, dropped bool) {
	var err error
	if c.opts.OnEvict != nil {
		err = c.opts.OnEvict(ev)
	}
	c.mu.Lock()
	if c.evicting[ev.Object]--; c.evicting[ev.Object] <= 0 {
		delete(c.evicting, ev.Object)
	}
	if dropped {
		b := c.books[ev.Object]
		if o := c.objects[ev.Object]; o != nil && (b == nil || b.lease == ev.Lease || b.lease == 0) {
			o.resident = false
		}
		c.mu.Unlock()
		return
	}
	if err != nil {
		c.mu.Unlock()
		return
	}
	done, prev := c.confirmingLocked(ev.Object)
	c.mu.Unlock()
	c.confirm(ev.Object, done, prev, func(ctx context.Context) {
		if ev.Lease != 0 {
			_, _ = c.Release(ctx, Lease{ID: ev.Lease, Pool: "residents", Project: ev.Project, Object: ev.Object})
			return
		}
		c.Sleep(ctx, ev.Object)
	})
}

// endMarkLocked ends the confirmation mark done of object. c.mu is held.
func (c *Client) endMarkLocked(object string, done chan struct{}) {
	if c.confirming[object] == done {
		delete(c.confirming, object)
	}
	close(done)
}

// confirmingLocked marks object as having a confirmation on its way, which
// a spawn of it made from now on waits for (waitConfirmed): done, closed by
// confirm; prev, the one before it, if any. c.mu is held.
func (c *Client) confirmingLocked(object string) (done, prev chan struct{}) {
	done, prev = make(chan struct{}), c.confirming[object]
	c.confirming[object] = done
	return done, prev
}

// confirm sends object's confirmation once prev's is answered (in order),
// within five seconds, and then ends its mark.
func (c *Client) confirm(object string, done, prev chan struct{}, send func(context.Context)) {
	defer func() {
		c.mu.Lock()
		c.endMarkLocked(object, done)
		c.mu.Unlock()
	}()
	if prev != nil {
		<-prev
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	send(ctx)
}

// request is one line to the server.
type request struct {
	ID      uint64
	Op      string
	Pool    string
	Project string
	Object  string
	Lease   uint64
	WaitMS  int64
}

func (rq *request) appendTo(b []byte) []byte {
	b = append(b, `{"id":`...)
	b = strconv.AppendUint(b, rq.ID, 10)
	b = append(b, `,"op":`...)
	b = wire.AppendString(b, rq.Op)
	if rq.Pool != "" {
		b = append(b, `,"pool":`...)
		b = wire.AppendString(b, rq.Pool)
	}
	if rq.Project != "" {
		b = append(b, `,"project":`...)
		b = wire.AppendString(b, rq.Project)
	}
	if rq.Object != "" {
		b = append(b, `,"object":`...)
		b = wire.AppendString(b, rq.Object)
	}
	if rq.Lease != 0 {
		b = append(b, `,"lease":`...)
		b = strconv.AppendUint(b, rq.Lease, 10)
	}
	if rq.WaitMS > 0 {
		b = append(b, `,"wait_ms":`...)
		b = strconv.AppendInt(b, rq.WaitMS, 10)
	}
	return append(b, '}', '\n')
}

var chanPool = sync.Pool{New: func() any { return make(chan reply, 1) }}

// call sends rq and waits for its answer. Concurrent callers share writes
// through the flusher, so pipelined calls cost one syscall per burst rather
// than one per call. It does no I/O itself: it ends with ctx whatever the
// daemon reads.
func (c *Client) call(ctx context.Context, rq request) (reply, error) {
	if err := ctx.Err(); err != nil {
		return reply{}, err
	}
	rq.ID = c.nextID.Add(1)
	// Room first, then the registration: a call given up while it waits
	// for room leaves nothing behind. wmu, then mu: the order attach
	// takes them in, so the two see one connection.
	if err := c.lockRoom(ctx); err != nil {
		return reply{}, err
	}
	ch := chanPool.Get().(chan reply)
	c.mu.Lock()
	if c.closed || c.down {
		closed := c.closed
		c.mu.Unlock()
		c.wmu.Unlock()
		chanPool.Put(ch)
		if closed {
			return reply{}, ErrClosed
		}
		// Nothing would answer: the connection has ended, and the
		// next one (Reconnect) starts from its own buffer.
		return reply{}, fmt.Errorf("%s: %w", rq.Op, ErrDisconnected)
	}
	w := waiter{ch: ch, op: rq.Op}
	switch rq.Op {
	case "spawn":
		b := c.books[rq.Object]
		if b == nil {
			b = &spawnBook{}
			c.books[rq.Object] = b
		}
		b.seq++
		w.object, w.seq = rq.Object, b.seq
	case "sleep", "remove":
		w.object = rq.Object
	case "acquire":
		w.pool, w.project = rq.Pool, rq.Project
	}
	c.pending[rq.ID] = w
	c.mu.Unlock()
	err := c.werr
	if err == nil {
		// Encoding into the buffer's free space copies nothing and
		// allocates nothing unless the line is longer than that space.
		c.wbuf = rq.appendTo(c.wbuf)
	}
	c.wmu.Unlock()
	if err != nil {
		c.forget(rq.ID)
		chanPool.Put(ch)
		return reply{}, fmt.Errorf("sending %s: %w: %w", rq.Op, ErrDisconnected, err)
	}
	c.wake()
	select {
	case rp := <-ch:
		chanPool.Put(ch)
		if rp.Code == "DISCONNECTED" {
			return reply{}, fmt.Errorf("%s: %w", rq.Op, ErrDisconnected)
		}
		return rp, nil
	case <-ctx.Done():
		c.mu.Lock()
		if _, ok := c.pending[rq.ID]; ok {
			w.ch = nil
			c.pending[rq.ID] = w
			c.mu.Unlock()
			return reply{}, ctx.Err()
		}
		c.mu.Unlock()
		// The answer is already on its way; take it so the channel can be reused.
		rp := <-ch
		chanPool.Put(ch)
		if rp.Code == "DISCONNECTED" {
			return reply{}, fmt.Errorf("%s: %w", rq.Op, ErrDisconnected)
		}
		return rp, nil
	}
}

func (c *Client) forget(id uint64) {
	c.mu.Lock()
	delete(c.pending, id)
	c.mu.Unlock()
}

// Acquire takes a permit of pool for project now, or returns an *Error that
// matches ErrRefused and says when to retry.
func (c *Client) Acquire(ctx context.Context, pool, project string) (Lease, error) {
	return c.AcquireWait(ctx, pool, project, 0)
}

// AcquireWait is Acquire that waits up to wait for a permit (woken by
// releases, FIFO per project) before refusing. The daemon waits at most ten
// minutes, and refuses with ErrTooManyWaiting while the session already has
// its bound of operations waiting (512 by default).
func (c *Client) AcquireWait(ctx context.Context, pool, project string, wait time.Duration) (Lease, error) {
	rp, err := c.call(ctx, request{Op: "acquire", Pool: pool, Project: project, WaitMS: wait.Milliseconds()})
	if err != nil {
		return Lease{}, err
	}
	if err := rp.err(); err != nil {
		return Lease{}, err
	}
	return Lease{ID: rp.Lease, Pool: pool, Project: project}, nil
}

// Release ends a lease. It reports whether this call ended it: false means
// the lease had already ended (released before, or its connection dropped).
// A resident's lease is released by putting the object to sleep. A release
// whose ctx ends first (a handler's request context, cancelled as its
// client went away) returns ctx's error and is sent all the same, in the
// background: a lease its caller gave up is never left held for the rest
// of the session.
func (c *Client) Release(ctx context.Context, l Lease) (bool, error) {
	c.mu.Lock()
	delete(c.leases, l.ID) // given up by its caller, whatever the answer
	c.mu.Unlock()
	rp, err := c.call(ctx, request{Op: "release", Lease: l.ID})
	if err != nil {
		if ctx.Err() != nil && !errors.Is(err, ErrClosed) && !errors.Is(err, ErrDisconnected) {
			go c.releaseLate(l)
		}
		return false, err
	}
	if err := rp.err(); err != nil {
		return false, err
	}
	if l.Object != "" && rp.Released {
		c.setResident(l.Object, "", false)
	}
	return rp.Released, nil
}

// lateRelease bounds the wait for a release sent past its caller's context
// (releaseLate): a daemon that reads but never answers is not waited on for
// ever.
const lateRelease = time.Minute

// releaseLate sends l's release for a Release whose context ended before the
// answer, perhaps before the request was sent. A second release of a lease
// is answered "already released", so sending it twice is harmless. A
// resident is marked asleep only if it still holds l (Spawn may have made it
// resident again since).
func (c *Client) releaseLate(l Lease) {
	ctx, cancel := context.WithTimeout(context.Background(), lateRelease)
	defer cancel()
	rp, err := c.call(ctx, request{Op: "release", Lease: l.ID})
	if err != nil || rp.err() != nil || !rp.Released || l.Object == "" {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if b, o := c.books[l.Object], c.objects[l.Object]; b != nil && b.lease == l.ID && o != nil {
		o.resident = false
	}
}

// Spawn makes object resident (a wake is a spawn). When the pool is full it
// waits while the daemon has some runtime put an idle object to sleep, up to
// a second, then fails with an *Error matching ErrTooManyResidents.
func (c *Client) Spawn(ctx context.Context, project, object string) (Lease, error) {
	if err := c.waitConfirmed(ctx, object); err != nil {
		return Lease{}, err
	}
	rp, err := c.call(ctx, request{Op: "spawn", Project: project, Object: object})
	if err != nil {
		return Lease{}, err
	}
	if err := rp.err(); err != nil {
		if rp.Code == "TOO_MANY_RESIDENTS" {
			// Not resident: an object being evicted that this runtime
			// still held loses its residence all the same.
			c.setResident(object, "", false)
		}
		return Lease{}, err
	}
	c.setResident(object, project, true)
	return Lease{ID: rp.Lease, Pool: "residents", Project: project, Object: object}, nil
}

// Touch records a call on a resident object; idleness is the time since.
func (c *Client) Touch(ctx context.Context, object string) error {
	rp, err := c.call(ctx, request{Op: "touch", Object: object})
	if err != nil {
		return err
	}
	if err := rp.err(); err != nil {
		return err
	}
	c.mu.Lock()
	if o := c.objects[object]; o != nil {
		o.touched = time.Now()
	}
	c.mu.Unlock()
	return nil
}

// Sleep tells the daemon object went to sleep, freeing its permit.
func (c *Client) Sleep(ctx context.Context, object string) error {
	rp, err := c.call(ctx, request{Op: "sleep", Object: object})
	if err != nil {
		return err
	}
	if err := rp.err(); err != nil {
		return err
	}
	c.setResident(object, "", false)
	return nil
}

// Remove tells the daemon object is gone.
func (c *Client) Remove(ctx context.Context, object string) error {
	rp, err := c.call(ctx, request{Op: "remove", Object: object})
	if err != nil {
		return err
	}
	if err := rp.err(); err != nil {
		return err
	}
	c.mu.Lock()
	delete(c.objects, object)
	c.mu.Unlock()
	return nil
}

// Ping round-trips a no-op, to check the session.
func (c *Client) Ping(ctx context.Context) error {
	rp, err := c.call(ctx, request{Op: "ping"})
	if err != nil {
		return err
	}
	return rp.err()
}

// spawnBook is what the answers read so far tell of an object's spawns
// and residence (Client.books), in the order of the connection's lines.
type spawnBook struct {
	seq      uint64 // spawns of it made (waiter.seq)
	answered uint64 // the latest of them answered, whatever the answer
	ok       uint64 // the latest of them answered with a residence to a caller still there
	// lease is its residence, as the answer of its latest spawn names it;
	// asleep once a sleep of it is answered, 0 if unknown. An evict event
	// of another lease is of one that has ended (the runtime put it to
	// sleep, or spawned it again, since): it is not handed to OnEvict,
	// which would unload the live residence.
	lease uint64
	// back is a residence granted to a spawn given up on, kept while a
	// later spawn of the object is unanswered (giveBack).
	back *heldBack
}

// asleep is spawnBook.lease once a sleep is answered: every lease is another.
const asleep = ^uint64(0)

type heldBack struct {
	lease, seq uint64
	done, prev chan struct{} // its confirmation's mark (confirmingLocked)
}

// bookLocked keeps rp, the answer of w (a spawn, sleep or remove of an
// object), in the object's book, and gives back the residence of a spawn
// given up on (giveBackLocked). c.mu is held.
func (c *Client) bookLocked(w waiter, rp *reply) {
	b := c.books[w.object]
	if b == nil {
		if w.op != "sleep" {
			return // removed, its book gone: nothing to keep
		}
		b = &spawnBook{}
		c.books[w.object] = b
	}
	switch w.op {
	case "spawn":
		b.answered = max(b.answered, w.seq)
		if rp.OK && rp.Lease != 0 {
			if w.ch == nil && rp.Note == "" {
				c.giveBackLocked(w.object, b, w.seq, rp.Lease)
			}
			if w.ch != nil {
				// Its caller has the answer (one given up holds
				// nothing, "already resident" or not).
				b.ok = max(b.ok, w.seq)
			}
			if w.seq == b.seq {
				b.lease = rp.Lease
			}
		}
		if h := b.back; h != nil && h.seq != w.seq {
			switch {
			case b.ok > h.seq:
				// A later spawn was answered with the residence: its
				// caller holds the object.
				b.back = nil
				c.endMarkLocked(w.object, h.done)
			case b.answered >= b.seq:
				// Every later spawn failed: nobody holds it.
				b.back = nil
				go c.confirm(w.object, h.done, h.prev, c.releaser(h.lease))
			}
		}
	case "sleep":
		if rp.OK {
			b.lease = asleep
		}
	case "remove":
		if rp.OK && b.answered == b.seq && b.back == nil {
			delete(c.books, w.object)
		}
	}
}

// giveBackLocked releases lease, the residence of spawn seq of object,
// whose caller gave up on it: at once if no spawn of the object came after
// it, or once every later one is answered, none with the residence; not at
// all if one is (its caller holds the object: "already resident", with
// this lease). A spawn made from now until then waits (waitConfirmed), so
// the release cannot end a residence it would begin. c.mu is held.
func (c *Client) giveBackLocked(object string, b *spawnBook, seq, lease uint64) {
	if b.ok > seq {
		return
	}
	done, prev := c.confirmingLocked(object)
	if b.seq == seq || b.answered >= b.seq {
		go c.confirm(object, done, prev, c.releaser(lease))
		return
	}
	if b.back != nil {
		// An older one still waiting: this one, as late, takes its place.
		c.endMarkLocked(object, b.back.done)
	}
	b.back = &heldBack{lease: lease, seq: seq, done: done, prev: prev}
}

// releaser is a confirmation that releases lease (confirm's send).
func (c *Client) releaser(lease uint64) func(context.Context) {
	return func(ctx context.Context) { c.call(ctx, request{Op: "release", Lease: lease}) }
}

// waitConfirmed waits until no confirmation of an eviction of object is on
// its way (evicted); ErrEvicting if an OnEvict of it has not returned.
func (c *Client) waitConfirmed(ctx context.Context, object string) error {
	for {
		c.mu.Lock()
		ch, running := c.confirming[object], c.evicting[object] > 0
		c.mu.Unlock()
		if running {
			return ErrEvicting
		}
		if ch == nil {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (c *Client) setResident(object, project string, resident bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	o := c.objects[object]
	if o == nil {
		if project == "" {
			return
		}
		o = &objState{project: project}
		c.objects[object] = o
	}
	o.resident = resident
	if resident {
		o.touched = time.Now()
	}
}
