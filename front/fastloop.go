// SPDX-License-Identifier: Apache-2.0

// A fast path's event loop: its epoll instance and what it owns (loop), the
// work posted to it from other goroutines (post), its pass (run: look,
// handle the events, send), the turns left for the next pass (later), its
// hold on its OS thread under load (loopHeat), the guard that keeps one
// connection's panic from ending it (contain), its drain, and the
// deadlines of its connections (expire).

package front

import (
	"bufio"
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// What a deadline ends.
const (
	dlNone = iota
	dlIdle
	dlHead
	dlWrite
	dlConnect
	dlAnswer
	dlUpIdle
	dlSend // the upstream takes no more of the request
	dlBody // the upstream sends no more of the answer's body (see armBody)
)

// loop is one event loop: an epoll instance, its clients and its idle
// upstream connections, all touched by its goroutine only.
type loop struct {
	fs      *fastServer
	f       *Front
	d       *directUpstream
	addr    unix.Sockaddr      // the upstream's: the loop's own copy (Connect writes into it); nil: dial
	dialCtx context.Context    // a dial's (see dial), canceled when the loop ends
	dialEnd context.CancelFunc // cancels dialCtx
	epfd    int
	efd     int // eventfd: posted work waits
	clients map[int32]*fclient
	// ring sends what a pass has for its sockets in one call (nil: each
	// with its own send(2)); sendC and sendU are the clients and upstream
	// connections with something to send, kept for the end of the pass.
	ring     *sendRing
	ringErr  error        // why the loop has no ring
	ringSent atomic.Int64 // sends made with the ring (tests read it)
	// ringRecvd is the reads made with the ring (tests read it); recvC
	// and recvU are the connections of the pass's reads (recvAll), rbuf
	// the buffer they read into.
	ringRecvd atomic.Int64
	recvC     []*fclient
	recvU     []*fupstream
	rbuf      []byte
	ringKept  [][]byte // the buffers of sends a broken ring may still read
	sending   bool     // sendAll goes on with the exchanges it sent for
	// mostRounds is the most rounds of sends one sendAll made (tests read
	// it: its continuations are bounded).
	mostRounds atomic.Int64
	// exchanges is how many exchanges the loop ended itself (tests read
	// it: the fast path was used).
	exchanges atomic.Int64
	sendC     []*fclient
	sendU     []*fupstream
	// The pass's sends for ring.send, and their spares.
	sfds    []int
	sbufs   [][]byte
	sres    []int32
	sendC2  []*fclient
	sendU2  []*fupstream
	sentC   []*fclient
	sentU   []*fupstream
	ups     map[int32]*fupstream
	gen     int32                // the last registration number (nextGen)
	idle    idlePool[*fupstream] // by key
	pending []*fclient           // dispatched, to be sent upstream
	again   []*fclient           // out of their turn's budget, served at the next pass
	buf     []byte
	obuf    []byte
	bw      *bufio.Writer
	now     time.Time
	check   time.Time   // the earliest deadline, or later
	fields  plainFields // the fields of the answer being relayed
	date    []byte      // Date of answers in dateSec
	dateSec int64
	drainBy time.Time // draining: every client closed by then; zero when not

	hot atomic.Bool // the loop holds its thread (loopHeat; tests read it)

	mu     sync.Mutex // guards the fields below
	posted []func()
	ended  bool // the loop returned and closed its descriptors (see post)

	// late runs the functions posted once the loop has ended, one at a
	// time.
	late sync.Mutex
}

func newLoop(fs *fastServer) (*loop, error) {
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll: %w", err)
	}
	efd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(epfd)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	lp := &loop{fs: fs, f: fs.f, d: fs.d, epfd: epfd, efd: efd, clients: map[int32]*fclient{}, ups: map[int32]*fupstream{},
		buf: make([]byte, fastReadBuf), bw: bufio.NewWriterSize(io.Discard, 4<<10)}
	if fs.addr != nil {
		lp.addr = copySockaddr(fs.addr)
	}
	// The loops and the direct path keep their idle connections within
	// one set of bounds.
	lp.idle.b = fs.d.sharedBudget()
	if !fs.f.cfg.PlainSends {
		// Without a ring (lp.ringErr) the loop sends with send(2).
		lp.ring, lp.ringErr = newSendRing(fastRingSends)
	}
	lp.dialCtx, lp.dialEnd = context.WithCancel(context.Background())
	if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, efd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(efd)}); err != nil {
		lp.closeFds()
		return nil, fmt.Errorf("epoll: %w", err)
	}
	return lp, nil
}

func copySockaddr(sa unix.Sockaddr) unix.Sockaddr {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return &unix.SockaddrInet4{Port: a.Port, Addr: a.Addr}
	case *unix.SockaddrInet6:
		return &unix.SockaddrInet6{Port: a.Port, ZoneId: a.ZoneId, Addr: a.Addr}
	}
	return sa
}

func (lp *loop) closeFds() {
	unix.Close(lp.epfd)
	unix.Close(lp.efd)
	if lp.ring != nil {
		lp.ring.close()
		lp.ring = nil
	}
}

// post runs fn on the loop. Once the loop has ended, fn runs at once, on
// the caller's goroutine and one at a time, on the ended loop, whose
// clients are all closed: it gives back what it holds (a waiter's
// admission, an accepted connection) and touches no descriptor of the
// loop's. The eventfd is written under mu, where end cannot close it: a
// write after the close would go to whatever descriptor took its number
// (a client's socket, a file).
func (lp *loop) post(fn func()) {
	lp.mu.Lock()
	if !lp.ended {
		lp.posted = append(lp.posted, fn)
		var one = [8]byte{1}
		_, _ = unix.Write(lp.efd, one[:])
		lp.mu.Unlock()
		return
	}
	lp.mu.Unlock()
	lp.late.Lock()
	defer lp.late.Unlock()
	fn()
}

// end ends the loop when run returns: what it still has (every client
// and upstream connection, when epoll_wait failed) is given back, its
// descriptors are closed, and what was posted and not run yet runs on the
// ended loop, as what is posted from now on (see post).
func (lp *loop) end() {
	lp.dialEnd()
	if lp.drainBy.IsZero() {
		lp.drainBy = time.Now() // a client posted from now on is closed at once
	}
	for _, c := range lp.clients {
		lp.abort(c)
	}
	for _, u := range lp.ups {
		lp.closeUp(u)
	}
	lp.late.Lock()
	defer lp.late.Unlock()
	lp.mu.Lock()
	lp.ended = true
	fns := lp.posted
	lp.posted = nil
	lp.closeFds()
	lp.mu.Unlock()
	for _, fn := range fns {
		fn()
	}
}

func (lp *loop) runPosted() {
	var b [8]byte
	_, _ = unix.Read(lp.efd, b[:])
	lp.mu.Lock()
	fns := lp.posted
	lp.posted = nil
	lp.mu.Unlock()
	// Each on its own: a panic in one does not drop the others.
	for _, fn := range fns {
		lp.guarded(nil, nil, func(*loop, *fclient) { fn() })
	}
}

func (lp *loop) run() {
	defer lp.end()
	events := make([]unix.EpollEvent, 128)
	var ready, again []*fclient
	busy := false
	heat := loopHeat{events: cmp.Or(lp.f.fastHotEvents, fastHotEvents)}
	defer heat.cool()
	for {
		ms := 0
		if !busy && len(lp.pending) == 0 && len(lp.again) == 0 {
			// Nothing came at the last look: block. While events keep
			// coming the loop only looks: a blocking wait costs the
			// runtime a hand-off of the loop's P to another thread.
			// (Parking the loop in Go's own poller on the epoll
			// descriptor instead cost 14.2 against 12.6 us per request,
			// medians of 6 interleaved wrk runs.)
			ms = -1
			if !lp.check.IsZero() {
				ms = max(1, int(time.Until(lp.check)/time.Millisecond)+1)
			}
		}
		n, err := unix.EpollWait(lp.epfd, events, ms)
		if err != nil && err != unix.EINTR {
			lp.f.log.Error("fast path: epoll_wait", "err", err)
			return
		}
		if busy && n <= 0 && len(lp.pending) == 0 && len(lp.again) == 0 {
			busy = false
			if !heat.hot {
				// A hot loop's goroutine is locked to its thread:
				// its Gosched would hand the P to another thread
				// and back (futex calls, 5% of its samples).
				runtime.Gosched()
			}
			continue
		}
		busy = n > 0
		lp.now = time.Now()
		if heat.count(lp.now, max(n, 0)) {
			lp.hot.Store(heat.hot)
		}
		// The requests dispatched before this look are sent after its
		// events are handled: what came meanwhile (an idle upstream
		// connection that spoke, above all) is seen before any
		// connection is used again. Those dispatched now wait for the
		// next look.
		ready, lp.pending = lp.pending, ready[:0]
		lp.handle(events[:max(n, 0)])
		again, lp.again = lp.again, again[:0]
		for i, c := range again {
			c.again = false
			switch {
			case c.closed:
			case (c.state == csIdle || c.state == csHead) && (len(c.in) > 0 || c.readable):
				lp.guarded(c, nil, (*loop).serveClient)
			case c.state == csBody && c.up != nil && c.up.readable && len(c.out) == 0:
				lp.guarded(c, c.up, func(lp *loop, c *fclient) { lp.readUp(c.up) })
			}
			again[i] = nil
		}
		for i, c := range ready {
			if !c.closed && c.state == csSend {
				lp.guarded(c, nil, (*loop).send)
			}
			ready[i] = nil
		}
		if !lp.check.IsZero() && !lp.now.Before(lp.check) {
			lp.guarded(nil, nil, func(lp *loop, _ *fclient) { lp.expire() })
		}
		lp.sendAll()
		if !lp.drainBy.IsZero() {
			if !lp.now.Before(lp.drainBy) {
				for _, c := range lp.clients {
					lp.abort(c)
				}
			}
			if len(lp.clients) == 0 {
				for _, u := range lp.ups {
					lp.closeUp(u)
				}
				return
			}
		}
	}
}

// A loop under load keeps its OS thread and blocks without the Gosched:
// its goroutine then stops moving between the runtime's threads (the
// Gosched let another thread take it), which at saturation served 1.06
// times the requests (see Cost in doc.go). Under a light load the unlocked
// loop with its Gosched is the cheaper: locked without the Gosched it took
// 1.2 times the CPU a request (wrk against an upstream of 5 ms), and
// locked with it 1.10 times at the moderate rate, each Gosched handing the
// P to another thread and back. So the lock follows the load: a loop is
// hot while a window of hotWindow saw at least fastHotEvents events (40k
// a second: some 20k requests, at about two events a request; tests set
// Front.fastHotEvents).
const (
	hotWindow     = 10 * time.Millisecond
	fastHotEvents = 400
)

// loopHeat is a loop's load, counted in events per hotWindow, and whether
// the loop holds its OS thread for it.
type loopHeat struct {
	events int       // the threshold: events in a window that make it hot
	seen   int       // events in the current window
	since  time.Time // the current window's start
	hot    bool      // the loop's goroutine is locked to its thread
}

// count adds the n events of a look at now, and at a window's end locks
// or unlocks the calling goroutine's thread for the load of the window;
// it reports whether it did.
func (h *loopHeat) count(now time.Time, n int) (switched bool) {
	h.seen += n
	if now.Sub(h.since) < hotWindow {
		return false
	}
	hot := h.seen >= h.events
	h.since, h.seen = now, 0
	if hot == h.hot {
		return false
	}
	if hot {
		runtime.LockOSThread()
	} else {
		runtime.UnlockOSThread()
	}
	h.hot = hot
	return true
}

// cool unlocks the thread of a loop that ends hot.
func (h *loopHeat) cool() {
	if h.hot {
		runtime.UnlockOSThread()
		h.hot = false
	}
}

func (lp *loop) handle(evs []unix.EpollEvent) {
	if lp.ring != nil {
		lp.guarded(nil, nil, func(lp *loop, _ *fclient) { lp.recvAll(evs) })
		defer lp.recvDone()
	}
	for _, ev := range evs {
		if int(ev.Fd) == lp.efd {
			lp.guarded(nil, nil, func(lp *loop, _ *fclient) { lp.runPosted() })
			continue
		}
		// An event carries the registration it is for (Pad): one for a
		// connection closed earlier in this batch, whose descriptor
		// number a new one took meanwhile, is not the new one's.
		if c := lp.clients[ev.Fd]; c != nil && c.gen == ev.Pad {
			lp.clientEventGuarded(c, ev.Events)
		} else if u := lp.ups[ev.Fd]; u != nil && u.gen == ev.Pad {
			lp.upEventGuarded(u, ev.Events)
		}
	}
}

// The loop's work on a connection runs guarded, as net/http's server
// guards a handler: a panic in it (a defect the loop's tests did not find,
// or in a dependency the front calls, such as the daemon's membership)
// aborts that connection's exchange, is logged with its stack, and the
// loop goes on serving the others; it does not end the daemon.

func (lp *loop) guarded(c *fclient, u *fupstream, fn func(*loop, *fclient)) {
	defer lp.contain(c, u)
	fn(lp, c)
}

func (lp *loop) clientEventGuarded(c *fclient, ev uint32) {
	defer lp.contain(c, c.up)
	lp.clientEvent(c, ev)
}

func (lp *loop) upEventGuarded(u *fupstream, ev uint32) {
	defer lp.contain(u.owner, u)
	lp.upEvent(u, ev)
}

// contain recovers a panic of the loop's work on c and u (either may be
// nil), and ends them.
func (lp *loop) contain(c *fclient, u *fupstream) {
	v := recover()
	if v == nil {
		return
	}
	lp.f.log.Error("fast path: a panic serving a connection; its exchange is aborted and the loop goes on",
		"panic", v, "stack", string(debug.Stack()))
	defer func() {
		if v := recover(); v != nil {
			// Aborting it failed too: its descriptors are closed
			// without the exchange's accounting.
			lp.f.log.Error("fast path: a panic aborting a connection; it is closed", "panic", v)
			if c != nil {
				lp.closeClient(c)
			}
			if u != nil {
				lp.closeUp(u)
			}
		}
	}()
	if c != nil {
		lp.abort(c)
	}
	if u != nil {
		lp.closeUp(u)
	}
}

// nextGen returns a registration number for epoll's data, never 0 (the
// eventfd's).
func (lp *loop) nextGen() int32 {
	lp.gen++
	if lp.gen == 0 {
		lp.gen++
	}
	return lp.gen
}

// drain stops taking requests: idle clients are closed now, the others
// after their exchange, and every one by `by`, or by an earlier end a drain
// posted before asked for (the stop and a failed listener post theirs in
// either order).
func (lp *loop) drain(by time.Time) {
	if !lp.drainBy.IsZero() && lp.drainBy.Before(by) {
		by = lp.drainBy
	}
	lp.drainBy = by
	lp.setCheck(by)
	for _, c := range lp.clients {
		if c.state != csIdle {
			continue // closed after its exchange (nextRequest)
		}
		// Closed now, or once it took the rest of its last answer, as
		// net/http's Shutdown closes a connection after the answer in
		// flight. (One whose head began is still served.)
		c.closing = true
		if len(c.out) == 0 {
			lp.closeClient(c)
		}
	}
}

func (lp *loop) setCheck(t time.Time) {
	if lp.check.IsZero() || t.Before(lp.check) {
		lp.check = t
	}
}

func (c *fclient) setDeadline(lp *loop, kind int, t time.Time) {
	c.dl, c.deadline = kind, t
	if kind != dlNone {
		lp.setCheck(t)
	}
}

func (u *fupstream) setDeadline(lp *loop, kind int, t time.Time) {
	u.dl, u.deadline = kind, t
	if kind != dlNone {
		lp.setCheck(t)
	}
}

// expire ends what waited past its deadline and finds the next one.
func (lp *loop) expire() {
	now := lp.now
	lp.check = time.Time{}
	for _, c := range lp.clients {
		if c.dl == dlNone {
			continue
		}
		if now.Before(c.deadline) {
			lp.setCheck(c.deadline)
			continue
		}
		switch c.dl {
		case dlIdle, dlHead:
			// As net/http does: no answer.
			lp.closeClient(c)
		case dlWrite:
			lp.abort(c)
		}
	}
	for _, u := range lp.ups {
		if u.dl == dlNone {
			continue
		}
		if now.Before(u.deadline) {
			lp.setCheck(u.deadline)
			continue
		}
		switch u.dl {
		case dlUpIdle:
			lp.closeUp(u)
		case dlConnect:
			lp.upFailed(u, fmt.Errorf("dialing upstream: %w", os.ErrDeadlineExceeded))
		case dlAnswer:
			lp.upFailed(u, fmt.Errorf("reading upstream answer: %w", os.ErrDeadlineExceeded))
		case dlSend:
			lp.upFailed(u, lp.d.stalled(os.ErrDeadlineExceeded))
		case dlBody:
			if c := u.owner; c != nil && len(c.out) > 0 {
				// The loop does not read while the client has not
				// taken the last piece (WriteTimeout bounds that): the
				// upstream is not waited on.
				lp.armBody(u)
				continue
			}
			lp.upFailed(u, fmt.Errorf("reading upstream answer: %w: no byte for %v: %w",
				errAnswerStalled, lp.d.readFor, os.ErrDeadlineExceeded))
		}
	}
	if !lp.drainBy.IsZero() {
		lp.setCheck(lp.drainBy)
	}
}

// later puts c on the again list: its next turn (a request, a piece of an
// answer) comes in the next pass.
func (lp *loop) later(c *fclient) {
	if !c.again {
		c.again = true
		lp.again = append(lp.again, c)
	}
}
