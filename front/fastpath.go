// SPDX-License-Identifier: Apache-2.0

// The fast path's server: the listener's connections taken from Go's
// poller and spread over the event loops it starts (fastServer, serveFast,
// accept, add), and when the drain ends (stopBy). What each part of the
// fast path owns is in a file of its own: the loop and its polling in
// fastloop.go, the client connection's states in fastclient.go, the
// upstream connection's in fastupstream.go, the reads made with the
// io_uring in fastrecv.go, the sends (and the io_uring's use) in
// fastsend.go, the heads the loop writes in fastanswer.go, and the
// hand-over to net/http in fasthand.go.

package front

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/listen"
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
		f.log.Info("fast path: no io_uring, each answer and request is sent, and each socket read, with a system call of its own", "err", err)
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
