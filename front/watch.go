// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fairshare-dev/fairshare/internal/clock"
)

// errClientGone marks an upstream failure caused by the client going away:
// the watch aborted the upstream exchange. Under Front.Serve the watch
// fires from the failed read itself, a moment before net/http cancels the
// request's context, so the context alone cannot tell yet.
var errClientGone = errors.New("the client went away")

// clientListener hands out its connections as clientConns.
type clientListener struct{ net.Listener }

func (l clientListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &clientConn{Conn: c}, nil
}

// clientConn is a client connection of Front.Serve that tells the upstream
// exchange in flight when the client goes away. While an HTTP/1 handler
// runs, net/http reads the connection in the background, and a read that
// fails other than by a deadline is the client gone (or the connection
// closed): that is when net/http cancels the request's context. Hearing it
// here instead of through context.AfterFunc on that context spares each
// request an allocated context, map and channel and two locks on the
// request's context: five allocations and a fortieth of the front's CPU.
type clientConn struct {
	net.Conn
	// writeFor bounds each write to the client (Config.WriteTimeout), set
	// before the connection is served; 0 leaves writes unbounded.
	writeFor time.Duration
	// wdlNext is when the write deadline is next moved on (monoNanos): it is
	// moved at most every writeFor/4, so a write that starts has between
	// 3/4 of writeFor and all of it.
	wdlNext atomic.Int64

	mu   sync.Mutex // guards the fields below
	gone bool       // a read failed: the client will not read an answer
	up   *upConn    // the upstream connection being watched for, or nil
	shot bool       // the watch fired: up was aborted
}

func (c *clientConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
		c.mu.Lock()
		c.gone = true
		up := c.up
		if up != nil {
			c.up, c.shot = nil, true
		}
		c.mu.Unlock()
		if up != nil {
			up.abort()
		}
	}
	return n, err
}

// monoNanos is the front's clock for the times it keeps as int64 (the
// write deadline's renewals, the drain's end): a step of the wall clock
// does not move them. Read as Unix time, a step back held the renewals
// back while the deadline, which the runtime keeps on the monotonic
// clock, ran out under a client that reads.
var monoNanos = clock.NewNanos(nil)

// Write writes to the client within writeFor: a client that stops reading
// its answer does not hold the request (and its permit) for longer.
func (c *clientConn) Write(p []byte) (int, error) {
	if c.writeFor > 0 {
		if now := time.Now(); monoNanos.Of(now) >= c.wdlNext.Load() {
			_ = c.Conn.SetWriteDeadline(now.Add(c.writeFor))
			c.wdlNext.Store(monoNanos.Of(now.Add(c.writeFor / 4)))
		}
	}
	return c.Conn.Write(p)
}

// CloseWrite half-closes a TCP connection, as net/http does before closing
// one (its type assertion would not see through the embedding).
func (c *clientConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// watch aborts up when the client goes away, at once if it already has.
func (c *clientConn) watch(up *upConn) {
	c.mu.Lock()
	gone := c.gone
	if gone {
		c.shot = true
	} else {
		c.up, c.shot = up, false
	}
	c.mu.Unlock()
	if gone {
		up.abort()
	}
}

// isGone reports whether a read of the connection failed.
func (c *clientConn) isGone() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gone
}

// unwatch ends the watch and reports whether it had not fired.
func (c *clientConn) unwatch() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.up = nil
	return !c.shot
}

// clientWatch is the watch on the client during one upstream exchange:
// on the front's own connection (see clientConn) or, for HTTP/2 and
// connections served by another server, on the request's context.
type clientWatch struct {
	cc   *clientConn
	stop func() bool // context.AfterFunc's, when cc is nil
}

// clientGone reports whether the client went away: a read of its
// connection failed (Front.Serve), or the request's context ended.
func (w clientWatch) clientGone(ctx context.Context) bool {
	return (w.cc != nil && w.cc.isGone()) || ctx.Err() != nil
}

// end ends the watch and reports whether it had not fired (the client is
// still there), as context.AfterFunc's stop does.
func (w clientWatch) end() bool {
	if w.cc != nil {
		return w.cc.unwatch()
	}
	return w.stop()
}
