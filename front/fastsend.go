// SPDX-License-Identifier: Apache-2.0

// What a fast path's loop writes to its sockets: during a pass the requests
// and answers wait in their connections' buffers (writeClient, send), and at
// the pass's end all go out in one io_uring call (sendAll; the ring itself
// is sendRing in uring.go), or each with its own send(2) without the ring;
// flushClient and flushUp send what a socket did not take and go on with
// the exchange.

package front

import (
	"errors"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

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
		if u.owner != nil && u.owner.state == csBody {
			lp.armBody(u) // the answer came early: its body's wait goes on
		} else {
			u.setDeadline(lp, dlNone, time.Time{})
		}
	}
	if hungUp {
		lp.readUp(u)
	}
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
	if c.state == csBody && c.up != nil && c.up.dl == dlBody {
		// The loop waits on the upstream again (see armBody).
		lp.armBody(c.up)
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
