// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"net"
	"net/http"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/peercred"
)

// A request that waits in the scheduler's queue on net/http's path does not
// always hear its client hang up. net/http reads the connection in the
// background, and cancels the request's context when that read fails, but
// for a request with a body only once the handler has read the body to its
// end, which the front does at dispatch; and the read is of one byte, which
// ends it when it comes: a client that sends the start of its next request
// (pipelining) and hangs up has that byte taken and its hang-up unheard. So
// a client that left would keep its permit and its place in the queue until
// dispatch, and then have its request sent upstream with nobody to read the
// answer. Every HTTP/1 request that has to wait has its connection looked at
// while it waits (hangupEvery): a peer that shut its side (POLLRDHUP,
// whatever data is still unread before it; the front takes a half-closed
// client for a gone one everywhere), or an error on it, ends the wait as if
// the context were cancelled. The watch ends at dispatch: a client that
// pipelined before it left is heard after that only when its answer is
// written, its exchange bounded by UpstreamHeadTimeout and WriteTimeout as
// any other (a watch for every request sent upstream would cost each one a
// goroutine and a timer). The fast path hears the hang-up itself, and an
// HTTP/2 stream through its context.

// hangupEvery is how often a queued request's connection is looked at.
const hangupEvery = 100 * time.Millisecond

// needsHangupWatch says whether r's context may not end when its client
// hangs up while it waits: any HTTP/1 request (see above).
func needsHangupWatch(r *http.Request) bool { return r.ProtoMajor == 1 }

// watchHangup is ctx, cancelled once the client of p hangs up; stop ends
// the watch.
func watchHangup(ctx context.Context, p *peer) (_ context.Context, stop func()) {
	sc, ok := servedConn(p).(syscall.Conn)
	if !ok {
		return ctx, func() {}
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return ctx, func() {}
	}
	ctx, cancel := context.WithCancelCause(ctx)
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(hangupEvery)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if hungUp(raw) {
				cancel(errClientGone)
				return
			}
		}
	}()
	return ctx, func() { close(done); cancel(nil) }
}

// servedConn is the socket p's requests are read from: the one net/http
// serves, which for a connection the fast path handed over is a descriptor
// of its own (p.conn, as accepted, is closed by then).
func servedConn(p *peer) net.Conn {
	if p.cc == nil {
		return p.conn
	}
	c := p.cc.Conn
	if hc, ok := c.(*handedConn); ok {
		c = hc.Conn
	}
	return peercred.Unwrap(c)
}

// hungUp says whether the peer of raw shut its side of the connection, or
// the connection failed: a poll that does not wait.
func hungUp(raw syscall.RawConn) bool {
	gone := false
	_ = raw.Control(func(fd uintptr) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		n, err := unix.Poll(pfd, 0)
		gone = err == nil && n > 0 && pfd[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0
	})
	return gone
}
