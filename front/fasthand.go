// SPDX-License-Identifier: Apache-2.0

// The hand-over from the fast path to net/http: a connection the loop does
// not serve itself goes to net/http's server for the rest of its life, with
// what the loop read of it and had not written (handedConn), and an exchange
// the loop began whose answer is not plain is finished there on the same
// upstream connection (resumed, serveResumed). Once net/http's server has
// stopped taking connections, serveLate serves the ones still handed over.

package front

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// hand gives net/http's server a connection, or serves it on a server
// of its own once that one has stopped taking them (Serve drains).
func (fs *fastServer) hand(c net.Conn) {
	fs.handedN.Add(1)
	select {
	case <-fs.closed:
		fs.serveLate(c)
		return
	default:
	}
	select {
	case fs.handed <- c:
	case <-fs.closed:
		fs.serveLate(c)
	}
}

// serveLate serves c, handed over after net/http's server stopped taking
// connections (an exchange in flight at the drain whose answer is not
// plain, a head that is not), on a server of its own: one exchange, as
// net/http's server answers during its shutdown, and not past the drain.
// A connection it cannot serve is closed, and its exchange given back
// (handedConn.Close).
func (fs *fastServer) serveLate(c net.Conn) {
	by := fs.stopBy(time.Now().Add(fs.f.drainFor))
	if !time.Now().Before(by) {
		c.Close()
		return
	}
	srv := fs.f.Server()
	srv.SetKeepAlivesEnabled(false)
	ended := make(chan struct{})
	var once sync.Once
	var hijacked atomic.Bool
	srv.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateHijacked {
			hijacked.Store(true)
		}
		if st == http.StateClosed || st == http.StateHijacked {
			once.Do(func() { close(ended) })
		}
	}
	ln := &oneListener{c: &clientConn{Conn: c}, addr: fs.ln.Addr(), closed: make(chan struct{})}
	go func() { _ = srv.Serve(ln) }()
	t := time.NewTimer(time.Until(by))
	defer t.Stop()
	select {
	case <-ended:
	case <-t.C:
	}
	_ = srv.Close()
	if hijacked.Load() {
		// An upgraded connection: its tunnel owns it, and ends it by
		// tunnel_timeout at the latest, as after net/http's Shutdown.
		return
	}
	c.Close() // if the server had not taken it yet
	if ln.taken.Load() {
		// Its handler sees the client gone and returns.
		select {
		case <-ended:
		case <-time.After(time.Second):
			fs.f.log.Warn("fast path: a connection served during the drain outlived it", "peer", c.RemoteAddr())
		}
	}
}

// oneListener accepts one connection, then none until it is closed.
type oneListener struct {
	c      net.Conn
	addr   net.Addr
	taken  atomic.Bool
	once   sync.Once
	closed chan struct{}
}

func (l *oneListener) Accept() (net.Conn, error) {
	if l.taken.CompareAndSwap(false, true) {
		return l.c, nil
	}
	<-l.closed
	return nil, net.ErrClosed
}

func (l *oneListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

func (l *oneListener) Addr() net.Addr { return l.addr }

// handedListener is the listener net/http's server serves: the
// connections the loops hand over.
type handedListener fastServer

func (l *handedListener) Accept() (net.Conn, error) {
	select {
	case <-l.closed:
		return nil, l.closedErr()
	default:
	}
	select {
	case c := <-l.handed:
		return c, nil
	case <-l.closed:
		return nil, l.closedErr()
	}
}

// closedErr is what Accept returns once the listener is closed: what it
// failed with, or net.ErrClosed.
func (l *handedListener) closedErr() error {
	if l.acceptErr != nil {
		return l.acceptErr
	}
	return net.ErrClosed
}

func (l *handedListener) Close() error {
	err := l.ln.Close()
	(*fastServer)(l).shut()
	return err
}

func (l *handedListener) Addr() net.Addr { return l.ln.Addr() }

// handedConn is a connection a loop handed to net/http's server: what the
// loop had read from it is read first (prefix), what it had not written yet
// is written first (out), the client's facts are the ones already found
// (peer), and an exchange the loop began is finished by the first request
// (resume; see Front.serveResumed), or given back when the connection is
// closed before.
type handedConn struct {
	net.Conn
	orig   net.Conn // as accepted: closing it gives its place back
	prefix []byte
	out    []byte
	peer   *peer
	f      *Front

	mu      sync.Mutex // guards the fields below
	resume  *resumed
	dropped bool      // closed with resume not taken: it was given back
	headBy  time.Time // the bound of the head begun in the loop (see SetReadDeadline)
}

func (c *handedConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

func (c *handedConn) Write(p []byte) (int, error) {
	if len(c.out) > 0 {
		if _, err := c.Conn.Write(c.out); err != nil {
			return 0, err
		}
		c.out = nil
	}
	return c.Conn.Write(p)
}

func (c *handedConn) Close() error {
	err := c.Conn.Close()
	if c.orig != nil {
		_ = c.orig.Close()
	}
	c.mu.Lock()
	res := c.resume
	if res != nil {
		c.resume, c.dropped = nil, true
	}
	c.mu.Unlock()
	if res != nil {
		res.drop(c.f)
	}
	return err
}

// take returns the exchange the connection was handed over with, once;
// dropped: it was given back, the connection closed before.
func (c *handedConn) take() (res *resumed, dropped bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	res, c.resume = c.resume, nil
	return res, c.dropped
}

// SetReadDeadline keeps the bound of a head begun in the loop (headBy):
// net/http's server bounds a head by its ReadHeaderTimeout from the hand-
// over, and the deadline it sets first is cut to headBy; the one it sets
// once the head is read (none: the front's server has no ReadTimeout)
// ends the bound.
func (c *handedConn) SetReadDeadline(t time.Time) error {
	c.mu.Lock()
	if !c.headBy.IsZero() {
		if t.IsZero() {
			c.headBy = time.Time{}
		} else if t.After(c.headBy) {
			t = c.headBy
		}
	}
	c.mu.Unlock()
	return c.Conn.SetReadDeadline(t)
}

func (c *handedConn) NetConn() net.Conn { return c.Conn }

func (c *handedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// resumed is an exchange a loop began (the request admitted and sent
// upstream, all of it or a part) and net/http's path finishes: the
// answer's head was not one the loop relays itself.
type resumed struct {
	a      *admission
	uc     *upConn
	reused bool
	early  bool // the answer began before the whole request went out
	// rest is what the loop had not written of the request yet (the end
	// of its head, its body): it is sent while the answer is read.
	rest []byte
	// headBy is when the wait for the answer's head ends (the loop's
	// UpstreamHeadTimeout from when the request was all out); zero when
	// the request is not all out yet.
	headBy time.Time
}

// headWait is how long the resumed exchange waits for the answer's head:
// what is left of the loop's wait, or all of it when that had not begun.
func (res *resumed) headWait(all time.Duration) time.Duration {
	if res.headBy.IsZero() {
		return all
	}
	return max(time.Until(res.headBy), 0)
}

// drop ends an exchange handed over that nobody will finish: its
// upstream connection is closed and its admission finished.
func (res *resumed) drop(f *Front) {
	res.uc.c.Close()
	res.a.x.outcome = outcomeError
	f.finish(res.a, false, false)
}

// takeResume returns the exchange r's connection was handed over with,
// once; dropped: it was given back (see handedConn.take).
func takeResume(r *http.Request) (res *resumed, dropped bool) {
	p, ok := r.Context().Value(peerKey{}).(*peer)
	if !ok || p.cc == nil {
		return nil, false
	}
	hc, ok := p.cc.Conn.(*handedConn)
	if !ok {
		return nil, false
	}
	return hc.take()
}

// serveResumed finishes an exchange a loop began: r is the request again,
// as net/http's server read it from what the loop handed over, already
// admitted and sent upstream.
func (f *Front) serveResumed(w http.ResponseWriter, r *http.Request, res *resumed) {
	a := res.a
	defer func() {
		p := recover()
		f.finish(a, p != nil, p != nil && (clientGone(r) || a.x.gone))
		if p != nil {
			panic(p)
		}
	}()
	x := a.x
	x.w = w
	d := f.up.(*directUpstream)
	ans, err := d.resume(r, x, res)
	if err != nil {
		f.upstreamFailed(w, r, x, err)
		return
	}
	f.relay(w, r, x, ans)
}

// resume reads the answer to the request of res, which a loop sent on
// res.uc, as roundTrip does after sending. The answer began before the
// loop wrote all of the request when res.rest is not empty: the rest goes
// out while the answer is read (sendRest), as roundTrip's sender sends a
// body, for an upstream may start its answer at once and end it only
// once it has read the whole body.
func (d *directUpstream) resume(r *http.Request, x *exchange, res *resumed) (upAnswer, error) {
	uc := res.uc
	cc := peerOf(r).cc
	w := clientWatch{cc: cc}
	cc.watch(uc)
	uc.begin(true)
	var send *bodySend
	switch {
	case len(res.rest) > 0:
		send = d.sendRest(uc, res.rest)
	case res.early:
		send = &bodySend{ended: true, err: errEarlyAnswer}
		uc.sent(res.headWait(d.headFor))
	default:
		uc.sent(res.headWait(d.headFor))
	}
	resp, err := d.readAnswer(uc, r, x, res.reused)
	uc.gotHead(d.readFor)
	if err != nil {
		fired := !w.end()
		if send != nil {
			// An upstream that stopped taking the request is the cause
			// of what followed.
			if serr := send.end(uc); errors.Is(serr, errSendStalled) {
				err = serr
			}
		}
		uc.c.Close()
		if fired {
			return upAnswer{}, fmt.Errorf("%w: %w", errClientGone, err)
		}
		return upAnswer{}, err
	}
	return upAnswer{Response: resp, conn: uc, watch: w, send: send}, nil
}

// sendPiece is what sendRest writes at a time, each piece within
// directUpstream.sendFor.
const sendPiece = 4 << 10

// sendRest writes rest, the end of a request a loop began, on uc from a
// goroutine of its own while the answer is read, each piece within
// d.sendFor (armSend): an upstream that stops taking it has its exchange
// aborted then (sendFailed: the answer's head not yet read fails, 504; an
// answer being relayed is cut off), rather than holding the request, and
// its permit, for as long as its answer may last. The sender is ended
// with the answer (bodySend.end stops it if the upstream answered without
// reading it all), and as the answer began before the request was all out
// the connection is never reused: no byte of this request can reach
// another.
func (d *directUpstream) sendRest(uc *upConn, rest []byte) *bodySend {
	s := &bodySend{done: make(chan error, 1), early: true}
	go func() {
		var err error
		for len(rest) > 0 && err == nil {
			d.armSend(uc)
			var n int
			n, err = uc.c.Write(rest[:min(len(rest), sendPiece)])
			rest = rest[n:]
		}
		if err != nil {
			err = d.sendFailed(uc, err)
		} else {
			uc.sent(d.headFor)
		}
		s.done <- err
	}()
	return s
}

// prefixConn reads prefix before the connection.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}

// fileConn makes a net.Conn of fd, which it closes (the net.Conn has a
// duplicate in Go's poller).
func fileConn(fd int) (net.Conn, error) {
	file := os.NewFile(uintptr(fd), "")
	c, err := net.FileConn(file)
	file.Close()
	return c, err
}

// resume hands c, with its exchange on u, to net/http's path.
func (lp *loop) resume(c *fclient, u *fupstream) {
	_ = unix.EpollCtl(lp.epfd, unix.EPOLL_CTL_DEL, u.fd, nil)
	delete(lp.ups, int32(u.fd))
	c.up, u.owner = nil, nil
	nc, err := fileConn(u.fd)
	if err != nil {
		c.a.x.outcome = outcomeError
		lp.f.finish(c.a, false, false)
		c.a = nil
		lp.abort(c)
		return
	}
	// It goes on serving the project it was dialed for.
	prefix := bytes.Clone(u.in)
	if u.preSet {
		// What recvAll read and readUp did not take (readUp takes it
		// before it gets here): the end of the stream or an error is
		// found again by net/http's path's own read.
		prefix = append(prefix, u.pre...)
	}
	uc := lp.d.newUpConn(&prefixConn{Conn: nc, prefix: prefix}, u.key)
	// u is dropped: what it had not written (u.out) is the resumed
	// exchange's alone, sent by it.
	res := &resumed{a: c.a, uc: uc, reused: u.reused, early: u.early || len(u.out) > 0, rest: u.out}
	if u.dl == dlAnswer {
		res.headBy = u.deadline // the wait for the head goes on, not anew
	}
	lp.hand(c, res)
}

// hand gives the client connection to net/http's server for the rest of
// its life, with what the loop read of it and had yet to write.
func (lp *loop) hand(c *fclient, res *resumed) {
	_ = unix.EpollCtl(lp.epfd, unix.EPOLL_CTL_DEL, c.fd, nil)
	delete(lp.clients, int32(c.fd))
	c.closed = true
	c.a = nil
	nc, err := fileConn(c.fd)
	if err != nil {
		if res != nil {
			res.drop(lp.f)
		}
		_ = c.c.Close()
		return
	}
	hc := &handedConn{Conn: nc, orig: c.c, prefix: bytes.Clone(c.in), out: bytes.Clone(c.out), peer: c.p, f: lp.f, resume: res}
	if c.dl == dlHead || (c.dl == dlIdle && c.served == 0) {
		hc.headBy = c.deadline // a head begun, or the first one's bound from the accept
	}
	lp.fs.wg.Add(1) // the loop counts in fs.wg: never 0 here
	go func() { defer lp.fs.wg.Done(); lp.fs.hand(hc) }()
}
