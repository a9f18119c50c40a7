// SPDX-License-Identifier: Apache-2.0

// What a fast path's loop reads from its sockets at the start of a pass:
// the first read of each socket the pass's events found readable, all in
// one io_uring call (recvAll, with the loop's ring of uring.go), kept on
// the connection until its own read takes it (readClient, readUp), and
// what the pass did not take settled at its end (recvDone).

package front

import (
	"bytes"
	"cmp"
	"errors"
	"io"
	"syscall"

	"golang.org/x/sys/unix"
)

// Bounds of the reads one pass makes with the ring.
const (
	fastRecvArena = 64 << 10 // shared by the pass's reads, each at most fastReadBuf
	fastRecvMost  = 128      // reads of one call (the most events of a look); more read with read(2)
)

// recvAll reads, in one call of the ring, each socket that the events evs
// report readable and whose handling would read it first: a client
// waiting for (the rest of) a request, and an upstream connection whose
// answer is being relayed to a client that took what it was sent. The
// read is the one readClient or readUp would have made at the event, made
// a little earlier: its bytes are kept on the connection (a client's
// appended to what it sent before, as readClient appends them; an
// upstream's kept apart until readUp takes them) with what the read
// found (the end of the stream, an error, whether it filled its buffer).
// Each read has a share of the pass's arena; one that fills it leaves the
// socket readable, for read(2) to go on. An event the ring did not read
// for is handled as without it.
func (lp *loop) recvAll(evs []unix.EpollEvent) {
	cs, us := lp.recvC[:0], lp.recvU[:0]
	for _, ev := range evs {
		if ev.Events&unix.EPOLLIN == 0 || int(ev.Fd) == lp.efd || len(cs)+len(us) == fastRecvMost {
			continue
		}
		if c := lp.clients[ev.Fd]; c != nil && c.gen == ev.Pad {
			if clientReadsFirst(c, ev.Events) {
				cs = append(cs, c)
			}
		} else if u := lp.ups[ev.Fd]; u != nil && u.gen == ev.Pad && upReadsFirst(u) {
			us = append(us, u)
		}
	}
	lp.recvC, lp.recvU = cs, us
	n := len(cs) + len(us)
	if n < 2 {
		// One read is one system call either way.
		lp.recvC, lp.recvU = cs[:0], us[:0]
		return
	}
	if lp.rbuf == nil {
		lp.rbuf = make([]byte, cmp.Or(lp.f.fastRecvArena, fastRecvArena))
	}
	slot := min(fastReadBuf, len(lp.rbuf)/n)
	fds, bufs, res := lp.sfds[:0], lp.sbufs[:0], lp.sres[:0]
	for i, c := range cs {
		fds, bufs = append(fds, c.fd), append(bufs, lp.rbuf[i*slot:(i+1)*slot])
	}
	for i, u := range us {
		j := len(cs) + i
		fds, bufs = append(fds, u.fd), append(bufs, lp.rbuf[j*slot:(j+1)*slot])
	}
	for range fds {
		res = append(res, recvUntried)
	}
	defer func() {
		clear(bufs)
		lp.sfds, lp.sbufs, lp.sres = fds, bufs, res
	}()
	if err := lp.ring.recv(fds, bufs, res); err != nil {
		lp.f.log.Error("fast path: io_uring failed; this loop reads and sends with system calls of its own from now on", "err", err)
		if errors.Is(err, errRingBroken) {
			// A read whose result did not come may still write into
			// the arena: never given back, nor used again.
			lp.ringKept = append(lp.ringKept, lp.rbuf)
			lp.rbuf = nil
		}
		lp.ring.close()
		lp.ring = nil
	}
	for i, c := range cs {
		switch r := res[i]; {
		case r == recvUntried || r == -int32(unix.EINTR):
			continue // read(2) reads it
		case r > 0:
			c.in = append(c.in, bufs[i][:r]...)
			c.preMore = int(r) == slot
		case r == -int32(unix.EAGAIN):
			c.preMore = false
		default:
			// The end of the stream, an error, or a read that may have
			// taken bytes that are lost (sendUnknown): the connection
			// ends at its read, as when read(2) fails.
			c.preEnd = true
		}
		c.pre = true
	}
	for i, u := range us {
		switch r := res[len(cs)+i]; {
		case r == recvUntried || r == -int32(unix.EINTR):
			continue
		case r > 0:
			u.pre = bufs[len(cs)+i][:r]
			u.preMore = int(r) == slot
		case r == 0:
			// The end of the stream, as read(2) says it: nothing and
			// no error.
		case r == sendUnknown:
			u.preErr = errRingBroken
		default:
			u.preErr = syscall.Errno(-r)
		}
		u.preSet = true
	}
	lp.ringRecvd.Add(int64(n))
}

// clientReadsFirst reports whether handling a readable event ev of c reads
// c first (clientEvent: it serves c's next request).
func clientReadsFirst(c *fclient, ev uint32) bool {
	return ev&(unix.EPOLLERR|unix.EPOLLHUP|unix.EPOLLRDHUP) == 0 && !c.closed && !c.closing &&
		(c.state == csIdle || c.state == csHead) && len(c.out) == 0 && len(c.in) < fastHeadMax+fastBodyMax
}

// upReadsFirst reports whether handling a readable event of u reads u
// first (upEvent: readUp relays its answer; a request not all sent yet is
// sent before).
func upReadsFirst(u *fupstream) bool {
	c := u.owner
	return c != nil && !u.connecting && u.fd >= 0 && len(u.out) == 0 && !(c.state == csBody && len(c.out) > 0)
}

// recvDone settles, at the end of the pass's events, the reads recvAll
// made that no readClient or readUp took: their connections count as
// readable (a read finds what is left, or nothing), and an upstream
// connection's bytes are moved out of the arena, which the next pass
// reads into.
func (lp *loop) recvDone() {
	for i, c := range lp.recvC {
		if c.pre {
			c.pre, c.preEnd = false, false
			if !c.closed {
				// Its bytes are in c.in already; an end of the stream
				// is read again (and an error then ends it as the end).
				c.readable = true
			}
		}
		lp.recvC[i] = nil
	}
	for i, u := range lp.recvU {
		if u.preSet {
			if lp.ups[int32(u.fd)] == u {
				u.pre = bytes.Clone(u.pre)
				u.preMore, u.readable = true, true
			} else {
				u.preSet, u.pre, u.preErr = false, nil, nil
			}
		}
		lp.recvU[i] = nil
	}
	lp.recvC, lp.recvU = lp.recvC[:0], lp.recvU[:0]
}

// readPre is what recvAll read of u, taken as readUp's read: the bytes,
// and the error read(2) would have returned (nil with no bytes: the end of
// the stream).
func (u *fupstream) readPre() ([]byte, error) {
	b, err := u.pre, u.preErr
	u.readable = u.preMore
	u.preSet, u.pre, u.preErr, u.preMore = false, nil, nil, false
	if len(b) == 0 && err == nil {
		return nil, io.EOF
	}
	return b, err
}
