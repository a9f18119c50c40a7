// SPDX-License-Identifier: Apache-2.0

// A client connection in a fast path's loop and its states (csIdle to
// csBody): its requests read and parsed, each admitted by Front.admit and
// dispatched (the wait for the scheduler on a goroutine of its own), the
// next request after an answer, and the connection's end (abort,
// closeClient).

package front

import (
	"context"
	"io"
	"net"
	"net/http"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/scheduler"
)

// Client connection states in a loop.
const (
	csIdle  = iota // waiting for a request
	csHead         // part of a request (head or body) read
	csAdmit        // admitted, waiting for the scheduler
	csSend         // dispatched, waiting for an upstream connection
	csUp           // sent upstream, waiting for the answer's head
	csBody         // relaying the answer's body
)

// fclient is a client connection in a loop.
type fclient struct {
	fd       int
	gen      int32    // its epoll registration (see loop.handle)
	c        net.Conn // as accepted
	p        *peer
	remote   string
	in, out  []byte
	state    int
	readable bool // an edge came that was not read to its end
	served   int
	closed   bool
	closing  bool // close once out is written
	serving  bool // serveClient runs for it: nextRequest returns to it
	again    bool // on the loop's again list
	queued   bool // on the loop's sends (lp.ring)
	// pre: the pass's recvAll read c (its bytes appended to in): the
	// read readClient makes next; preMore: it filled its buffer, more may
	// wait; preEnd: it found the end of the stream, or failed.
	pre, preMore, preEnd bool
	obase                []byte // out's buffer, kept while at most fastKeepOut
	deadline             time.Time
	dl                   int

	r       *http.Request
	raw     int // bytes of in the current request takes
	a       *admission
	up      *fupstream
	attempt int
	left    int64 // bytes of the answer's body still to come
	cancel  context.CancelFunc
	cw      captured
}

// addClient takes a client connection.
func (lp *loop) addClient(fd int, conn net.Conn, p *peer) {
	c := &fclient{fd: fd, c: conn, p: p, remote: conn.RemoteAddr().String()}
	if !lp.drainBy.IsZero() {
		lp.closeClient(c)
		return
	}
	c.gen = lp.nextGen()
	if err := unix.EpollCtl(lp.epfd, unix.EPOLL_CTL_ADD, fd,
		&unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd), Pad: c.gen}); err != nil {
		lp.f.log.Debug("fast path: epoll_ctl", "err", err)
		lp.closeClient(c)
		return
	}
	lp.clients[int32(fd)] = c
	// The first request has ReadHeaderTimeout from the start, as with
	// net/http.
	c.setDeadline(lp, dlIdle, lp.now.Add(lp.f.cfg.ReadHeaderTimeout))
	c.readable = true
	lp.guarded(c, nil, (*loop).serveClient)
}

func (lp *loop) clientEvent(c *fclient, ev uint32) {
	if ev&(unix.EPOLLERR|unix.EPOLLHUP|unix.EPOLLRDHUP) != 0 {
		// The client went away (or half-closed): as net/http's read of
		// the connection failing, the exchange is over.
		if c.state == csIdle || c.state == csHead {
			if ev&unix.EPOLLIN != 0 && ev&(unix.EPOLLERR|unix.EPOLLHUP) == 0 && c.state == csHead {
				c.readable = true
			}
		}
		lp.abort(c)
		return
	}
	if ev&unix.EPOLLOUT != 0 && len(c.out) > 0 {
		lp.flushClient(c)
		if c.closed {
			return
		}
	}
	if ev&unix.EPOLLIN != 0 {
		c.readable = true
		if c.state == csIdle || c.state == csHead {
			lp.serveClient(c)
		}
	}
}

// The loops read and write sockets with package syscall, not x/sys/unix:
// the race detector sees an order between a write and a later read only
// through the one package's annotations, and Go's net uses syscall's.

// readClient reads what the client sent, while the edge lasts and the
// buffer has room; false when the connection ended.
func (lp *loop) readClient(c *fclient) bool {
	if c.pre {
		// recvAll made this read already.
		c.pre = false
		if c.preEnd {
			c.preEnd = false
			return false
		}
		c.readable = c.preMore
	}
	for c.readable && len(c.in) < fastHeadMax+fastBodyMax {
		n, err := syscall.Read(c.fd, lp.buf)
		switch {
		case n > 0:
			c.in = append(c.in, lp.buf[:n]...)
			if n < len(lp.buf) {
				c.readable = false
			}
		case err == unix.EAGAIN:
			c.readable = false
		case err == unix.EINTR:
		default:
			return false
		}
	}
	return true
}

// fastTurn bounds the requests of one client served in one pass of its
// loop: a client pipelining without end (and reading its answers) waits
// for the next pass and lets the others' events be handled.
const fastTurn = 64

// serveClient reads and serves the client's requests until one waits,
// or its turn is spent (then it goes on at the loop's next pass). It
// loops, and does not recurse: nextRequest returns to it.
func (lp *loop) serveClient(c *fclient) {
	if c.serving {
		return
	}
	c.serving = true
	defer func() { c.serving = false }()
	for turn := 0; !c.closed && (c.state == csIdle || c.state == csHead); turn++ {
		if c.closing || len(c.out) > 0 {
			return // the next request once the client took its answers
		}
		if turn == fastTurn {
			lp.later(c)
			return
		}
		if !lp.readClient(c) {
			lp.closeClient(c)
			return
		}
		if len(c.in) == 0 {
			return
		}
		r, n, v := plainRequest(c.in, min(fastHeadMax, lp.f.cfg.MaxRequestHead), fastBodyMax)
		switch v {
		case reqMore:
			if c.state == csIdle {
				c.state = csHead
				by := lp.now.Add(lp.f.cfg.ReadHeaderTimeout)
				if c.served == 0 && c.dl == dlIdle {
					// The first head's bound runs from the accept, as
					// with net/http: its first byte does not move it.
					by = c.deadline
				}
				c.setDeadline(lp, dlHead, by)
			}
			return
		case reqOther:
			lp.hand(c, nil)
			return
		}
		total := n + int(r.ContentLength)
		if len(c.in) < total {
			// A body that did not come with its head is read as it
			// comes, after admission, by net/http's path (an upstream
			// may answer it piece by piece, and its bounds are
			// BodyReadTimeout and BodyMinRate there).
			lp.hand(c, nil)
			return
		}
		c.raw = total
		r.RemoteAddr = c.remote
		if r.ContentLength > 0 {
			r.Body = fastBody{}
		} else {
			r.Body = http.NoBody
		}
		c.r = r
		c.served++
		c.setDeadline(lp, dlNone, time.Time{})
		lp.admit(c)
	}
}

// fastBody stands for a request body the loop holds: hasBody sees one.
type fastBody struct{}

func (fastBody) Read([]byte) (int, error) { return 0, io.EOF }
func (fastBody) Close() error             { return nil }

// admit admits c's request with the front's own decision (Front.admit).
func (lp *loop) admit(c *fclient) {
	c.cw.reset()
	a := lp.f.admit(&c.cw, c.r, c.p)
	if a == nil {
		lp.writeCaptured(c)
		lp.nextRequest(c)
		return
	}
	c.a, c.attempt = a, 0
	if a.ticket == nil {
		lp.f.dispatched(a, 0, nil)
		lp.dispatch(c)
		return
	}
	if class, ok, err := a.ticket.TryWait(); ok {
		lp.settled(c, a, class, err)
		return
	}
	c.state = csAdmit
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel = cancel
	t := a.ticket
	lp.fs.wg.Add(1) // the loop counts in fs.wg: never 0 here
	go func() {
		defer lp.fs.wg.Done()
		class, err := t.Wait(ctx)
		lp.post(func() {
			defer lp.contain(c, nil)
			lp.admitted(c, a, class, err)
		})
	}()
}

// admitted continues c's request after its wait for the scheduler.
func (lp *loop) admitted(c *fclient, a *admission, class scheduler.Class, err error) {
	c.cancel()
	lp.settled(c, a, class, err)
}

// settled continues c's request once its ticket has left the scheduler's
// queue (class and err from its wait): dispatched, it goes upstream;
// withdrawn, it is answered as net/http's path answers it
// (Front.unscheduled) and finished, never left admitted.
func (lp *loop) settled(c *fclient, a *admission, class scheduler.Class, err error) {
	ok := lp.f.dispatched(a, class, err)
	if c.closed {
		// The client went away meanwhile (abort withdrew the ticket).
		lp.f.finish(a, false, true)
		return
	}
	if !ok {
		c.cw.reset()
		lp.f.unscheduled(&c.cw, c.r, a.x, err)
		lp.f.finish(a, false, false)
		c.a = nil
		lp.answerCaptured(c)
		return
	}
	lp.dispatch(c)
}

func (lp *loop) dispatch(c *fclient) {
	c.state = csSend
	lp.pending = append(lp.pending, c)
}

// nextRequest forgets the request served and goes on to the next.
func (lp *loop) nextRequest(c *fclient) {
	if c.closed {
		return
	}
	c.in = c.in[:copy(c.in, c.in[c.raw:])]
	if len(c.in) == 0 && cap(c.in) > fastKeepBuf {
		c.in = nil // an idle connection holds no large buffer
	}
	c.raw, c.r = 0, nil
	c.state = csIdle
	if !lp.drainBy.IsZero() {
		c.closing = true
	}
	if c.closing {
		if len(c.out) == 0 {
			lp.closeClient(c)
		}
		return
	}
	if c.dl != dlWrite {
		c.setDeadline(lp, dlIdle, lp.now.Add(lp.f.cfg.IdleTimeout))
	}
	if len(c.in) > 0 || c.readable {
		lp.serveClient(c)
	}
}

// answerCaptured ends c's request with the answer the front wrote into
// c.cw, or with none (the connection closed) when it aborted it.
func (lp *loop) answerCaptured(c *fclient) {
	if c.cw.abort {
		lp.closeClient(c)
		return
	}
	lp.writeCaptured(c)
	lp.nextRequest(c)
}

// abort ends c and the exchange it has in flight: the client went away,
// or stopped reading.
func (lp *loop) abort(c *fclient) {
	if c.closed {
		return
	}
	if c.a != nil {
		switch c.state {
		case csAdmit:
			// The waiter withdraws the ticket and finishes (admitted).
			c.cancel()
		default:
			c.a.x.outcome = outcomeCanceled
			lp.f.finish(c.a, false, true)
		}
		c.a = nil
	}
	if u := c.up; u != nil {
		c.up, u.owner = nil, nil
		lp.closeUp(u)
	}
	lp.closeClient(c)
}

func (lp *loop) closeClient(c *fclient) {
	if c.closed && lp.clients[int32(c.fd)] != c {
		return
	}
	c.closed = true
	delete(lp.clients, int32(c.fd))
	unix.Close(c.fd)
	_ = c.c.Close()
}
