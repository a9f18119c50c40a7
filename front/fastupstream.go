// SPDX-License-Identifier: Apache-2.0

// An upstream connection in a fast path's loop: taken from the loop's idle
// pool or connected (getUp, dial), the request sent on it (send), the
// answer's head and body relayed to the client (answerHead, relayBody), and
// the connection back in the pool or closed at the exchange's end
// (endExchange, upFailed, closeUp).

package front

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

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
	// preSet: the pass's recvAll read u: pre and preErr are what it read
	// (see readPre), for readUp to take before it reads itself; preMore:
	// the read filled its buffer.
	preSet, preMore bool
	pre             []byte
	preErr          error
	lastUsed        time.Time
	deadline        time.Time
	dl              int
	w               appendWriter
	// key is the requests the connection serves (see upKey), from its
	// dial; link is its place in the loop's idle pool.
	key  upKey
	link idleLink[*fupstream]
}

// appendWriter appends what is written to *b.
type appendWriter struct{ b *[]byte }

func (w appendWriter) Write(p []byte) (int, error) {
	*w.b = append(*w.b, p...)
	return len(p), nil
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
		return lp.dial(k), nil
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
func (lp *loop) dial(k upKey) *fupstream {
	u := &fupstream{fd: -1, key: k, connecting: true, dialing: true}
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

// readUp reads the answer while the edge lasts and the client takes it.
func (lp *loop) readUp(u *fupstream) {
	for u.readable || u.preSet {
		c := u.owner
		if c == nil || (c.state == csBody && len(c.out) > 0) {
			return
		}
		var b []byte
		var err error
		if u.preSet {
			b, err = u.readPre()
		} else {
			var n int
			n, err = syscall.Read(u.fd, lp.buf)
			if n > 0 {
				b = lp.buf[:n]
				if n < len(lp.buf) {
					u.readable = false
				}
			}
		}
		switch n := len(b); {
		case n > 0:
			if !u.got && len(u.out) > 0 {
				u.early = true
			}
			u.got = true
			if c.state == csUp {
				u.in = append(u.in, b...)
				lp.answerHead(c, u)
			} else {
				lp.relayBody(c, u, b)
			}
		case err == unix.EAGAIN:
			u.readable = false
		case err == unix.EINTR:
		default:
			if err == nil {
				err = io.EOF
			}
			if !u.got && u.reused && !errors.Is(err, errRingBroken) {
				// (A read the ring may have made is no stale
				// connection's: its request is not made again.)
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
	lp.armBody(u)
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
	lp.armBody(u)
	lp.writeClient(c, b)
	if !c.closed && c.left == 0 {
		lp.endExchange(c)
	}
}

// armBody bounds the loop's wait for the next piece of the answer's body
// on u by UpstreamReadTimeout from now, as each read of it is bounded on
// net/http's path (upConn.armRead): an upstream that stops sending fails
// the exchange then, the answer cut off, rather than hold its permit and
// its place for as long as the client waits. The wait begins anew with
// each piece, and when the client has taken the last one (flushClient):
// while it has not, the loop does not read.
func (lp *loop) armBody(u *fupstream) {
	if len(u.out) > 0 && u.dl == dlSend {
		// The request still goes out (an answer that came early): one
		// deadline at a time, and the send's (WriteTimeout) holds until
		// flushUp has sent it all, which then arms this one.
		return
	}
	if lp.d.readFor > 0 {
		u.setDeadline(lp, dlBody, lp.now.Add(lp.d.readFor))
	} else if u.dl != dlNone {
		u.setDeadline(lp, dlNone, time.Time{})
	}
}

// endExchange ends c's exchange when the answer's body is all relayed.
func (lp *loop) endExchange(c *fclient) {
	u := c.up
	c.up, u.owner = nil, nil
	if u.early || u.hup || len(u.in) > 0 || u.readable || u.preSet || !lp.drainBy.IsZero() {
		lp.closeUp(u)
	} else {
		u.lastUsed = lp.now
		u.setDeadline(lp, dlUpIdle, lp.now.Add(lp.d.idleFor))
		// The loops and the direct path share the bounds (see
		// idleBudget): what is evicted may be u itself.
		if old, evicted := lp.idle.put(u.key, &u.link, lp.d.perKey(), lp.d.maxIdle); evicted {
			lp.closeUp(old)
		}
	}
	lp.exchanges.Add(1)
	lp.f.finish(c.a, false, false)
	c.a = nil
	lp.nextRequest(c)
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
	u.preSet, u.pre, u.preErr = false, nil, nil
	unix.Close(u.fd)
}
