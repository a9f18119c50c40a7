// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/answerfield"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// The fast path (Config.FastPath) serves the commonest exchange of the
// front in event loops of its own instead of net/http's server: see "Fast
// path" in the package documentation.

// Bounds of what the fast path takes itself; larger goes to net/http.
const (
	fastHeadMax   = 8 << 10  // a request head
	fastBodyMax   = 64 << 10 // a request body (buffered whole before admission)
	fastAnswerMax = 16 << 10 // an answer head not yet complete: past it, net/http's path reads it
	fastReadBuf   = 32 << 10
	fastKeepBuf   = 4 << 10 // an idle client's read buffer larger than this is let go
	fastRingSends = 256     // the most sends of one io_uring call (more take several)
	fastKeepOut   = 2 << 10 // a client's send buffer larger than this is let go once sent
)

// fastServer is the front's listener served by its event loops, with
// net/http's server behind it for the connections they hand over.
type fastServer struct {
	f      *Front
	d      *directUpstream
	loops  []*loop
	next   atomic.Uint32
	handed chan net.Conn // to net/http's server
	closed chan struct{} // closed with the listener
	once   sync.Once
	// acceptErr is what the listener failed with (set before closed is
	// closed), or nil.
	acceptErr error
	ln        net.Listener
	addr      unix.Sockaddr // the upstream's address; nil when it is a name (see serveFast)
	// wg counts the loops and the goroutines that may still post to them
	// or hold an admission (a ticket's waiter): Serve returns after them.
	wg sync.WaitGroup
	// handedN counts the connections handed to net/http's server.
	handedN atomic.Int64
	// stopAt is when the drain ends (monoNanos; 0 until Serve is told to
	// stop): see stopBy.
	stopAt atomic.Int64
}

// fastOK reports whether Serve may serve l on the fast path.
func (f *Front) fastOK(l net.Listener) bool {
	_, direct := f.up.(*directUpstream)
	_, tcp := l.Addr().(*net.TCPAddr)
	return f.cfg.FastPath && direct && tcp
}

// serveFast serves l with the event loops until ctx is done.
func (f *Front) serveFast(ctx context.Context, l net.Listener) error {
	d := f.up.(*directUpstream)
	fs := &fastServer{f: f, d: d, handed: make(chan net.Conn), closed: make(chan struct{}), ln: l}
	// An upstream given by its address is connected to by the loops
	// themselves. One given by a name (or with an IPv6 zone) is dialed
	// by net/http's path's dialer for each new connection, on a goroutine
	// (see loop.dial): the name is looked up each time and every address
	// tried, so an upstream that moves is followed as on net/http's path.
	if ap, err := netip.ParseAddrPort(d.addr); err == nil && ap.Addr().Zone() == "" {
		if a := ap.Addr().Unmap(); a.Is4() {
			fs.addr = &unix.SockaddrInet4{Port: int(ap.Port()), Addr: a.As4()}
		} else {
			fs.addr = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: a.As16()}
		}
	}
	// One loop fewer than GOMAXPROCS (at least one): a loop blocked in
	// epoll_wait while every other P is busy has its P handed to another
	// thread by the runtime (and the runtime's monitor then wakes every
	// 20us); with a P to spare it keeps it. (Measured on 2 cores: a
	// second loop took 0.93-0.99 of nginx's throughput instead of
	// 0.85-0.94, at 1.2x the CPU a request, and 1.4-1.6x at a moderate
	// load; giving the loops Ps of their own on top of GOMAXPROCS, or a
	// thread each, changed neither beyond the noise.)
	loops := max(1, runtime.GOMAXPROCS(0)-1)
	if f.fastLoops > 0 {
		loops = f.fastLoops
	}
	for range loops {
		lp, err := newLoop(fs)
		if err != nil {
			for _, lp := range fs.loops {
				lp.dialEnd()
				lp.closeFds()
			}
			return fmt.Errorf("front: %w", err)
		}
		fs.loops = append(fs.loops, lp)
	}
	if err := fs.loops[0].ringErr; err != nil {
		f.log.Info("fast path: no io_uring, each answer and request is sent with a system call of its own", "err", err)
	}
	f.fast.Store(fs) // once its loops are there (tests read them)
	for _, lp := range fs.loops {
		fs.wg.Add(1)
		go func() { defer fs.wg.Done(); lp.run() }()
	}
	fs.wg.Add(1) // it hands connections over, see hand
	go func() { defer fs.wg.Done(); fs.accept() }()
	stop := context.AfterFunc(ctx, func() {
		by := fs.stopBy(time.Now().Add(f.drainFor))
		for _, lp := range fs.loops {
			lp.post(func() { lp.drain(by) })
		}
	})
	defer stop()
	err := listen.ServeHTTP(ctx, f.Server(), clientListener{(*handedListener)(fs)}, f.drainFor)
	if ctx.Err() == nil {
		// The listener failed: the loops end with it.
		by := fs.stopBy(time.Now())
		for _, lp := range fs.loops {
			lp.post(func() { lp.drain(by) })
		}
	}
	fs.wg.Wait()
	f.waitHandlers()
	f.CloseIdle()
	if err != nil {
		return fmt.Errorf("front: %w", err)
	}
	return nil
}

// accept takes the listener's connections (its caps and backoff apply)
// and gives each TCP one to a loop, the others to net/http's server.
// A transient error (out of descriptors, say) is waited out as net/http's
// server does; any other ends the front, and Serve returns it.
func (fs *fastServer) accept() {
	var backoff time.Duration
	for {
		c, err := fs.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Temporary() && !errors.Is(err, net.ErrClosed) { //nolint:staticcheck // as net/http's Server.Serve
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				fs.f.log.Warn("front: accept failed, retrying", "err", err, "backoff", backoff)
				t := time.NewTimer(backoff)
				select {
				case <-t.C:
					continue
				case <-fs.closed:
					t.Stop()
					return
				}
			}
			fs.shutErr(err)
			return
		}
		backoff = 0
		fs.add(c)
	}
}

func (fs *fastServer) shut() { fs.shutErr(nil) }

// shutErr ends the front's listening; err, when not nil, is what the
// listener failed with, for Serve to return.
func (fs *fastServer) shutErr(err error) {
	fs.once.Do(func() {
		fs.acceptErr = err
		close(fs.closed)
	})
}

// add moves c's socket from Go's poller to a loop: a duplicate of its
// descriptor goes to the loop and the original is closed (which takes it
// out of Go's poller); c itself is closed again when the loop is done with
// it, to give its place under the listener's caps back.
func (fs *fastServer) add(c net.Conn) {
	p := fs.f.newPeer(c)
	// The client's cgroup is found here, not on the loop at its first
	// request: the lookup is a netlink round trip (sock_diag), and a
	// flood of new connections would hold up the loop's other clients
	// for one each.
	fs.f.cgroupOf(p)
	tc, ok := p.conn.(*net.TCPConn)
	if !ok {
		fs.hand(&handedConn{Conn: c, peer: p})
		return
	}
	fd, err := dupConn(tc)
	if err != nil {
		fs.f.log.Debug("fast path: taking a connection", "err", err)
		fs.hand(&handedConn{Conn: c, peer: p})
		return
	}
	_ = tc.Close()
	lp := fs.loops[fs.next.Add(1)%uint32(len(fs.loops))]
	lp.post(func() { lp.addClient(fd, c, p) })
}

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

// stopBy sets when the drain ends, to t or earlier, and returns it. The
// time returned keeps t's monotonic reading: read back as Unix time, a
// step of the wall clock back during the drain lengthened it by the step.
func (fs *fastServer) stopBy(t time.Time) time.Time {
	tn := monoNanos.Of(t)
	for {
		at := fs.stopAt.Load()
		if at != 0 && at <= tn {
			return t.Add(time.Duration(at - tn))
		}
		if fs.stopAt.CompareAndSwap(at, tn) {
			return t
		}
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

func dupConn(c syscall.Conn) (int, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return -1, err
	}
	nfd, derr := -1, error(nil)
	if err := rc.Control(func(fd uintptr) { nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return -1, err
	}
	return nfd, derr
}

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
		f.finish(a, p != nil, p != nil && clientGone(r))
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
	uc.awaiting = true
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
	uc.gotHead()
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

// Client connection states in a loop.
const (
	csIdle  = iota // waiting for a request
	csHead         // part of a request (head or body) read
	csAdmit        // admitted, waiting for the scheduler
	csSend         // dispatched, waiting for an upstream connection
	csUp           // sent upstream, waiting for the answer's head
	csBody         // relaying the answer's body
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
	closing  bool   // close once out is written
	serving  bool   // serveClient runs for it: nextRequest returns to it
	again    bool   // on the loop's again list
	queued   bool   // on the loop's sends (lp.ring)
	obase    []byte // out's buffer, kept while at most fastKeepOut
	deadline time.Time
	dl       int

	r       *http.Request
	raw     int // bytes of in the current request takes
	a       *admission
	up      *fupstream
	attempt int
	left    int64 // bytes of the answer's body still to come
	cancel  context.CancelFunc
	cw      captured
}

// fupstream is an upstream connection in a loop.
type fupstream struct {
	queued     bool // on the loop's sends (lp.ring)
	fd         int
	gen        int32 // its epoll registration (see loop.handle)
	in, out    []byte
	obase      []byte   // out's buffer, kept for the next request
	owner      *fclient // nil while idle
	connecting bool
	dialing    bool               // dial has not given it a descriptor yet
	dropped    bool               // ... and it was closed meanwhile
	dialStop   context.CancelFunc // stops its dial
	reused     bool
	got        bool // a byte of the answer came
	early      bool // ... before the whole request went out
	hup        bool // the upstream hung up, or the connection failed: never pooled
	readable   bool
	lastUsed   time.Time
	deadline   time.Time
	dl         int
	w          appendWriter
	// key is the requests the connection serves (see upKey), set by its
	// first; link is its place in the loop's idle pool.
	key  upKey
	link idleLink[*fupstream]
}

// appendWriter appends what is written to *b.
type appendWriter struct{ b *[]byte }

func (w appendWriter) Write(p []byte) (int, error) {
	*w.b = append(*w.b, p...)
	return len(p), nil
}

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
	ringKept [][]byte     // the buffers of sends a broken ring may still read
	sending  bool         // sendAll goes on with the exchanges it sent for
	// mostRounds is the most rounds of sends one sendAll made (tests read
	// it: its continuations are bounded).
	mostRounds atomic.Int64
	sendC      []*fclient
	sendU      []*fupstream
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

// sendAll sends what the pass left to send (the requests dispatched, then
// the answers) with the ring, in one call for up to fastRingSends of them,
// and goes on with each as its own send(2) would have: flushUp and
// flushClient send what the ring's left (a socket full), arm the deadline
// and continue the exchange. What they in turn have to send is sent
// before sendAll returns.
func (lp *loop) sendAll() {
	lp.sending = true
	rounds := int64(0)
	defer func() {
		lp.sending = false
		if rounds > lp.mostRounds.Load() {
			lp.mostRounds.Store(rounds)
		}
	}()
	for len(lp.sendC) > 0 || len(lp.sendU) > 0 {
		rounds++
		us, cs := lp.sendU, lp.sendC
		lp.sendU, lp.sendC = lp.sendU2[:0], lp.sendC2[:0]
		fds, bufs := lp.sfds[:0], lp.sbufs[:0]
		sentU, sentC := lp.sentU[:0], lp.sentC[:0]
		for _, u := range us {
			u.queued = false
			if u.fd >= 0 && !u.connecting && len(u.out) > 0 && lp.ups[int32(u.fd)] == u {
				sentU = append(sentU, u)
				fds, bufs = append(fds, u.fd), append(bufs, u.out)
			}
		}
		for _, c := range cs {
			c.queued = false
			if !c.closed && len(c.out) > 0 && lp.clients[int32(c.fd)] == c {
				sentC = append(sentC, c)
				fds, bufs = append(fds, c.fd), append(bufs, c.out)
			}
		}
		res := lp.sres[:0]
		for range fds {
			res = append(res, -int32(unix.EAGAIN)) // unsent: send(2) tries
		}
		for i := 0; i < len(fds) && lp.ring != nil; i += fastRingSends {
			j := min(len(fds), i+fastRingSends)
			if err := lp.ring.send(fds[i:j], bufs[i:j], res[i:j]); err != nil {
				lp.f.log.Error("fast path: io_uring failed; this loop sends with system calls of its own from now on", "err", err)
				if errors.Is(err, errRingBroken) {
					// A send whose result did not come may still
					// read its buffer: never given back.
					for k := i; k < j; k++ {
						if res[k] == sendUnknown {
							lp.ringKept = append(lp.ringKept, bufs[k])
						}
					}
				}
				lp.ring.close()
				lp.ring = nil
				break
			}
			lp.ringSent.Add(int64(j - i))
		}
		for i, u := range sentU {
			if res[i] == sendUnknown {
				// Perhaps sent: never again (a request twice).
				lp.guarded(u.owner, u, func(lp *loop, _ *fclient) { lp.upFailed(u, errRingBroken) })
				continue
			}
			wrote := res[i] > 0
			if wrote {
				u.out = u.out[res[i]:]
			}
			lp.guarded(u.owner, u, func(lp *loop, _ *fclient) { lp.flushUp(u, wrote) })
		}
		for i, c := range sentC {
			switch r := res[len(sentU)+i]; {
			case r > 0:
				c.out = c.out[r:]
			case r == sendUnknown:
				// Perhaps sent: an answer twice would answer the next
				// request.
				lp.guarded(c, nil, (*loop).abort)
				continue
			}
			// Not sent (a full socket, a client gone, an entry the
			// kernel refused): flushClient's send(2) tries, and aborts
			// on the error it meets.
			lp.guarded(c, nil, (*loop).flushClient)
		}
		clear(bufs) // no answer kept alive by the scratch
		clear(sentU)
		clear(sentC)
		clear(us)
		clear(cs)
		lp.sfds, lp.sbufs, lp.sres = fds, bufs, res
		lp.sentU, lp.sentC = sentU, sentC
		lp.sendU2, lp.sendC2 = us[:0], cs[:0]
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
		}
	}
	if !lp.drainBy.IsZero() {
		lp.setCheck(lp.drainBy)
	}
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

// send sends c's request upstream, on an idle connection or a new one.
func (lp *loop) send(c *fclient) {
	// A replay goes on a new connection: an idle one may have spoken
	// unasked in the events of this very look, not handled yet.
	u, err := lp.getUp(keyOf(c.a.x), c.attempt > 0)
	if err != nil {
		lp.failed(c, err)
		return
	}
	u.owner, c.up, c.state = c, u, csUp
	u.got, u.early = false, false
	u.out = u.obase[:0]
	lp.bw.Reset(u.w)
	lp.d.writeHead(lp.bw, c.r, c.a.x)
	_ = lp.bw.Flush()
	if c.r.ContentLength > 0 {
		u.out = append(u.out, c.in[c.raw-int(c.r.ContentLength):c.raw]...)
	}
	if cap(u.out) <= 8<<10 {
		u.obase = u.out[:0] // flushUp consumes out from its start
	}
	if u.connecting {
		return // sent once connected
	}
	if lp.ring != nil {
		if !u.queued {
			u.queued = true
			lp.sendU = append(lp.sendU, u)
		}
		return
	}
	lp.flushUp(u, false)
}

// getUp returns an idle upstream connection of key k or starts a new one
// for k; a new one when fresh.
func (lp *loop) getUp(k upKey, fresh bool) (*fupstream, error) {
	for !fresh {
		u, ok := lp.idle.take(k)
		if !ok {
			break
		}
		if lp.now.Sub(u.lastUsed) >= lp.d.idleFor {
			lp.closeUp(u)
			continue
		}
		u.reused = true
		u.setDeadline(lp, dlNone, time.Time{})
		return u, nil
	}
	if lp.addr == nil {
		u := lp.dial()
		u.key = k
		return u, nil
	}
	fam := unix.AF_INET
	if _, ok := lp.addr.(*unix.SockaddrInet6); ok {
		fam = unix.AF_INET6
	}
	fd, err := unix.Socket(fam, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dialing upstream: %w", err)
	}
	// As Go's dialer sets them (net.Dialer with KeepAlive 30s).
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1)
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, 30)
	_ = unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, 30)
	u := &fupstream{fd: fd, key: k}
	u.link.v = u
	u.w = appendWriter{&u.out}
	u.gen = lp.nextGen()
	if err := unix.EpollCtl(lp.epfd, unix.EPOLL_CTL_ADD, fd,
		&unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd), Pad: u.gen}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("dialing upstream: %w", err)
	}
	lp.ups[int32(fd)] = u
	err = unix.Connect(fd, lp.addr)
	switch err {
	case nil:
	case unix.EINPROGRESS:
		u.connecting = true
		u.setDeadline(lp, dlConnect, lp.now.Add(5*time.Second))
	default:
		lp.closeUp(u)
		return nil, fmt.Errorf("dialing upstream: %w", err)
	}
	return u, nil
}

// dial starts a new upstream connection by the direct path's dialer, on a
// goroutine; the loop takes it when it comes (dialed). Until then the
// connection has no descriptor, and its request waits in out.
func (lp *loop) dial() *fupstream {
	u := &fupstream{fd: -1, connecting: true, dialing: true}
	u.link.v = u
	u.w = appendWriter{&u.out}
	// Its own context: the dial stops when the connection is dropped
	// (closeUp), as net/http's path stops it with the request's.
	ctx, stop := context.WithCancel(lp.dialCtx)
	u.dialStop = stop
	lp.fs.wg.Add(1)
	go func() {
		defer lp.fs.wg.Done()
		fd := -1
		conn, err := lp.d.dial(ctx, "tcp", lp.d.addr)
		if err == nil {
			if sc, ok := conn.(syscall.Conn); ok {
				fd, err = dupConn(sc)
			} else {
				err = fmt.Errorf("a %T has no descriptor", conn)
			}
			conn.Close()
		}
		lp.post(func() {
			defer lp.contain(u.owner, u)
			lp.dialed(u, fd, err)
		})
	}()
	return u
}

// dialed takes the connection dial started, or fails its exchange. One
// closed meanwhile (its client went away, the loop ended) is closed.
func (lp *loop) dialed(u *fupstream, fd int, err error) {
	u.dialing = false
	u.dialStop()
	lp.mu.Lock()
	ended := lp.ended
	lp.mu.Unlock()
	if u.dropped || ended {
		if fd >= 0 {
			unix.Close(fd)
		}
		return
	}
	if err == nil {
		u.fd, u.gen = fd, lp.nextGen()
		// The connection is there: the first event (room to write) sends
		// the request, as after a connect in progress.
		err = unix.EpollCtl(lp.epfd, unix.EPOLL_CTL_ADD, fd,
			&unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd), Pad: u.gen})
		if err == nil {
			lp.ups[int32(fd)] = u
			return
		}
		unix.Close(fd)
		u.fd = -1
	}
	lp.upFailed(u, fmt.Errorf("dialing upstream: %w", err))
}

func (lp *loop) upEvent(u *fupstream, ev uint32) {
	c := u.owner
	if c == nil {
		// Idle: anything but room to write is the upstream speaking
		// unasked, or hanging up.
		if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			if ev&unix.EPOLLIN != 0 && ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) == 0 {
				lp.f.unasked("bytes arrived on an idle upstream connection")
			}
			lp.closeUp(u)
		}
		return
	}
	if u.connecting {
		if ev&(unix.EPOLLOUT|unix.EPOLLERR|unix.EPOLLHUP) == 0 {
			return
		}
		if e, err := unix.GetsockoptInt(u.fd, unix.SOL_SOCKET, unix.SO_ERROR); err != nil || e != 0 {
			if err == nil {
				err = syscall.Errno(e)
			}
			lp.upFailed(u, fmt.Errorf("dialing upstream: %w", err))
			return
		}
		u.connecting = false
		u.setDeadline(lp, dlNone, time.Time{})
	}
	if ev&unix.EPOLLOUT != 0 && len(u.out) > 0 {
		lp.flushUp(u, false)
		if u.owner != c {
			return
		}
	}
	if ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		// Remembered: the answer may end before the end of stream is
		// read, and the connection must not go back to the pool.
		u.hup = true
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		u.readable = true
		lp.readUp(u)
	}
}

// flushUp writes what is left of the request; wrote: part of it was just
// written (by the ring).
func (lp *loop) flushUp(u *fupstream, wrote bool) {
	hungUp := false
	for len(u.out) > 0 {
		n, err := syscall.Write(u.fd, u.out)
		if err == unix.EAGAIN {
			// Each piece the upstream takes within WriteTimeout, as
			// on net/http's path (directUpstream.armSend).
			if u.owner != nil && lp.d.sendFor > 0 && (wrote || u.dl == dlNone) {
				u.setDeadline(lp, dlSend, lp.now.Add(lp.d.sendFor))
			}
			return
		}
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			// The upstream hung up while the request went out: what it
			// answered before is still relayed, as on net/http's path
			// (an upstream may answer, 413 say, and close on a body it
			// will not read); the read that finds no more fails the
			// exchange (and a reused connection's is a stale one).
			u.early, u.hup, u.readable = true, true, true
			hungUp = true
			break
		}
		u.out = u.out[n:]
		wrote = true
	}
	u.out = u.out[:0]
	if u.got {
		u.early = true
	}
	if u.owner != nil && u.owner.state == csUp {
		u.setDeadline(lp, dlAnswer, lp.now.Add(lp.d.headFor))
	} else if u.dl == dlSend {
		u.setDeadline(lp, dlNone, time.Time{})
	}
	if hungUp {
		lp.readUp(u)
	}
}

// readUp reads the answer while the edge lasts and the client takes it.
func (lp *loop) readUp(u *fupstream) {
	for u.readable {
		c := u.owner
		if c == nil || (c.state == csBody && len(c.out) > 0) {
			return
		}
		n, err := syscall.Read(u.fd, lp.buf)
		switch {
		case n > 0:
			if n < len(lp.buf) {
				u.readable = false
			}
			if !u.got && len(u.out) > 0 {
				u.early = true
			}
			u.got = true
			if c.state == csUp {
				u.in = append(u.in, lp.buf[:n]...)
				lp.answerHead(c, u)
			} else {
				lp.relayBody(c, u, lp.buf[:n])
			}
		case err == unix.EAGAIN:
			u.readable = false
		case err == unix.EINTR:
		default:
			if err == nil {
				err = io.EOF
			}
			if !u.got && u.reused {
				err = fmt.Errorf("%w: %w", errStaleConn, err)
			}
			lp.upFailed(u, fmt.Errorf("reading upstream answer: %w", err))
			return
		}
	}
}

// answerHead relays the answer's head when it is plain, and hands the
// exchange to net/http's path otherwise.
func (lp *loop) answerHead(c *fclient, u *fupstream) {
	// The answer's fields go from the loop's one plainFields straight
	// into the head written (appendAnswer), with no header map between:
	// building, reading and clearing one cost about 0.4 us a request
	// (BenchmarkOverhead against the build with the map: 0.955 times the
	// CPU a request and 1.033 times the throughput, medians of 5).
	fs := &lp.fields
	status, length, n, ok := fs.parse(u.in, c.r.Method)
	if !ok {
		if !bytes.Contains(u.in, []byte("\r\n\r\n")) && len(u.in) < fastAnswerMax {
			return // more to come
		}
		lp.resume(c, u)
		return
	}
	if _, typed := fs.get("Content-Type"); length > 0 && !typed {
		// net/http's server would sniff one: its path answers.
		lp.resume(c, u)
		return
	}
	u.setDeadline(lp, dlNone, time.Time{})
	x := c.a.x
	cost, _ := fs.get(lp.f.costKey)
	lp.f.answered(x, cost)
	body := u.in[n:]
	extra := int64(len(body)) > length
	if extra {
		body = body[:length]
	}
	c.left = length - int64(len(body))
	c.state = csBody
	lp.obuf = lp.appendAnswer(lp.obuf[:0], status, fs, x)
	lp.obuf = append(lp.obuf, body...)
	u.in = u.in[:0]
	if extra {
		lp.f.unasked("bytes after the end of an upstream answer")
		u.early = true // not reused
	}
	lp.writeClient(c, lp.obuf)
	if !c.closed && c.left == 0 {
		lp.endExchange(c)
	}
}

// relayBody passes a piece of the answer's body on.
func (lp *loop) relayBody(c *fclient, u *fupstream, b []byte) {
	if int64(len(b)) > c.left {
		b = b[:c.left]
		lp.f.unasked("bytes after the end of an upstream answer")
		u.early = true
	}
	c.left -= int64(len(b))
	lp.writeClient(c, b)
	if !c.closed && c.left == 0 {
		lp.endExchange(c)
	}
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
	uc := lp.d.newUpConn(&prefixConn{Conn: nc, prefix: bytes.Clone(u.in)})
	uc.key = u.key // it goes on serving the project it was dialed for
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

// endExchange ends c's exchange when the answer's body is all relayed.
func (lp *loop) endExchange(c *fclient) {
	u := c.up
	c.up, u.owner = nil, nil
	if u.early || u.hup || len(u.in) > 0 || u.readable || !lp.drainBy.IsZero() {
		lp.closeUp(u)
	} else {
		u.lastUsed = lp.now
		u.setDeadline(lp, dlUpIdle, lp.now.Add(lp.d.idleFor))
		// The loops share the bounds.
		n := len(lp.fs.loops)
		if old, evicted := lp.idle.put(u.key, &u.link, max(1, lp.d.perKey()/n), max(1, lp.d.maxIdle/n)); evicted {
			lp.closeUp(old)
		}
	}
	lp.f.finish(c.a, false, false)
	c.a = nil
	lp.nextRequest(c)
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

// upFailed ends the exchange on u, which failed.
func (lp *loop) upFailed(u *fupstream, err error) {
	c := u.owner
	replay := c != nil && c.state == csUp && errors.Is(err, errStaleConn) && c.attempt == 0 && replayable(c.r)
	lp.closeUp(u)
	if c == nil {
		return
	}
	// u is no one's: the event being handled (see upEvent) does not go on
	// with it, to read a closed descriptor and fail c a second time.
	c.up, u.owner = nil, nil
	if replay {
		c.attempt++
		lp.send(c)
		return
	}
	lp.failed(c, err)
}

// failed answers c's request, which the upstream did not answer, as
// net/http's path does (Front.upstreamFailed); an answer broken mid-body
// is cut off.
func (lp *loop) failed(c *fclient, err error) {
	if c.state == csBody {
		lp.f.log.Debug("upstream answer cut short", "project", c.a.x.project, "err", err)
		c.a.x.outcome = outcomeError
		lp.f.finish(c.a, false, false)
		c.a = nil
		lp.closeClient(c)
		return
	}
	c.cw.reset()
	lp.f.upstreamFailed(&c.cw, c.r, c.a.x, err)
	lp.f.finish(c.a, false, false)
	c.a = nil
	lp.answerCaptured(c)
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

// writeCaptured writes the answer the front wrote into c.cw.
func (lp *loop) writeCaptured(c *fclient) {
	h := c.cw.h
	if h.Get("Connection") == "close" {
		c.closing = true
	}
	if h["Content-Length"] == nil {
		h["Content-Length"] = []string{strconv.Itoa(len(c.cw.body))}
	}
	lp.obuf = appendHead(lp.obuf[:0], c.cw.status, h, lp.dateNow())
	lp.obuf = append(lp.obuf, c.cw.body...)
	lp.writeClient(c, lp.obuf)
}

// writeClient writes b to the client, keeping what it does not take.
func (lp *loop) writeClient(c *fclient, b []byte) {
	if c.closed {
		return
	}
	if lp.ring != nil {
		// Sent at the end of the pass (sendAll), with the others; a
		// client whose socket was full takes the rest on its EPOLLOUT,
		// under the WriteTimeout armed then.
		waiting := len(c.out) > 0 && !c.queued
		if len(c.out) == 0 {
			c.out = c.obase[:0]
		}
		c.out = append(c.out, b...)
		if cap(c.out) <= fastKeepOut {
			c.obase = c.out[:0]
		}
		if !waiting && !c.queued {
			c.queued = true
			lp.sendC = append(lp.sendC, c)
		}
		return
	}
	if len(c.out) > 0 {
		c.out = append(c.out, b...)
		return
	}
	for len(b) > 0 {
		n, err := syscall.Write(c.fd, b)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			break
		}
		if err != nil {
			lp.abort(c)
			return
		}
		b = b[n:]
	}
	if len(b) > 0 {
		c.out = append(c.out, b...)
		if c.dl != dlWrite {
			c.setDeadline(lp, dlWrite, lp.now.Add(lp.f.cfg.WriteTimeout))
		}
	}
}

// flushClient writes what the client had not taken.
func (lp *loop) flushClient(c *fclient) {
	for len(c.out) > 0 {
		n, err := syscall.Write(c.fd, c.out)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			c.setDeadline(lp, dlWrite, lp.now.Add(lp.f.cfg.WriteTimeout))
			return
		}
		if err != nil {
			lp.abort(c)
			return
		}
		c.out = c.out[n:]
	}
	c.out = nil // what a slow client made the loop hold is let go (obase keeps a small one)
	if c.dl == dlWrite {
		c.setDeadline(lp, dlNone, time.Time{})
		if c.state == csIdle {
			c.setDeadline(lp, dlIdle, lp.now.Add(lp.f.cfg.IdleTimeout))
		}
	}
	if c.closing && c.state == csIdle {
		lp.closeClient(c)
		return
	}
	if (c.state == csIdle || c.state == csHead) && (len(c.in) > 0 || c.readable) {
		if lp.sending {
			// After the ring's sends, the client's next request waits
			// for the next pass, as a client's turns do (fastTurn):
			// served here, a client pipelining requests the loop
			// answers itself (refusals) would have all of them served
			// before any other client.
			lp.later(c)
			return
		}
		lp.serveClient(c)
		return
	}
	if c.state == csBody && c.up != nil && c.up.readable {
		if lp.sending {
			// Likewise the next piece of a long answer: a fast
			// upstream and a fast client would keep sendAll relaying
			// it to the end before the loop looked at anyone else.
			lp.later(c)
			return
		}
		lp.readUp(c.up)
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

func (lp *loop) closeUp(u *fupstream) {
	if u.dialing {
		u.dropped = true // dialed closes it
		u.dialStop()
		return
	}
	if lp.ups[int32(u.fd)] != u {
		return
	}
	delete(lp.ups, int32(u.fd))
	lp.idle.remove(&u.link)
	unix.Close(u.fd)
}

// appendAnswer appends the head of x's answer: the upstream's status and
// fields (fs) less the hop-by-hop ones and those the front sets or
// consumes, then the front's own (what annotate sets on net/http's path),
// and a Date if the upstream sent none.
func (lp *loop) appendAnswer(b []byte, status int, fs *plainFields, x *exchange) []byte {
	b = appendStatusLine(b, status)
	dated := false
	for _, f := range fs.f[:fs.n] {
		if lp.f.own(f.key) || answerfield.IsHopByHop(f.key) {
			continue
		}
		dated = dated || f.key == "Date"
		b = appendField(b, f.key, f.value)
	}
	for _, v := range classOf(x) {
		b = appendField(b, HeaderClass, v)
	}
	for _, v := range queueWaitOf(x) {
		b = appendField(b, HeaderQueueWait, v)
	}
	if !dated {
		b = appendField(b, "Date", lp.dateNow())
	}
	return append(b, "\r\n"...)
}

// appendStatusLine appends the status line net/http's server writes.
func appendStatusLine(b []byte, status int) []byte {
	b = append(b, "HTTP/1.1 "...)
	b = strconv.AppendInt(b, int64(status), 10)
	b = append(b, ' ')
	if t := http.StatusText(status); t != "" {
		b = append(b, t...)
	} else {
		b = append(b, "status code "...)
		b = strconv.AppendInt(b, int64(status), 10)
	}
	return append(b, "\r\n"...)
}

// appendField appends the field line "k: v".
func appendField[V string | []byte](b []byte, k string, v V) []byte {
	b = append(b, k...)
	b = append(b, ": "...)
	b = append(b, v...)
	return append(b, "\r\n"...)
}

// appendHead appends an HTTP/1.1 answer head, as net/http's server writes
// one (with a Date when the header has none).
func appendHead(b []byte, status int, h http.Header, date []byte) []byte {
	b = appendStatusLine(b, status)
	for k, vv := range h {
		for _, v := range vv {
			b = appendField(b, k, v)
		}
	}
	if h["Date"] == nil {
		b = appendField(b, "Date", date)
	}
	return append(b, "\r\n"...)
}

// dateNow is the Date of an answer now, formatted once a second.
func (lp *loop) dateNow() []byte {
	if sec := lp.now.Unix(); sec != lp.dateSec || lp.date == nil {
		lp.dateSec = sec
		lp.date = lp.now.UTC().AppendFormat(lp.date[:0], http.TimeFormat)
	}
	return lp.date
}

// captured is an http.ResponseWriter that keeps the answer the front
// writes (a refusal, an error) for the loop to send.
type captured struct {
	h      http.Header
	status int
	body   []byte
	abort  bool // no answer: the connection is closed (noAnswer)
}

func (w *captured) reset() {
	if w.h == nil {
		w.h = make(http.Header, 4)
	}
	clear(w.h) // the front writes it only while the loop holds it
	w.status, w.body, w.abort = 0, w.body[:0], false
}

func (w *captured) Header() http.Header { return w.h }

func (w *captured) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}

func (w *captured) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	w.body = append(w.body, p...)
	return len(p), nil
}

// newPeer records the client of c, as accepted, for the peer lookups of
// its requests.
func (f *Front) newPeer(c net.Conn) *peer {
	p := &peer{conn: c}
	// The daemon's listeners wrap their connections (internal/listen) and
	// have looked a loopback client's socket up already: its cgroup is
	// taken from there rather than asked for again.
	if lc, ok := c.(interface{ PeerCgroup() uint64 }); ok {
		if id := lc.PeerCgroup(); id != 0 {
			p.once.Do(func() { p.cgroup = id })
		}
	}
	// The socket the peer lookups need is behind NetConn.
	p.conn = peercred.Unwrap(c)
	if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		p.addr = ta.AddrPort().Addr().Unmap()
	}
	return p
}
