// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// drainRig is a front served by Front.Serve itself (its event loops when
// Config.FastPath), whose stop drains it as the daemon's shutdown does.
type drainRig struct {
	addr  string
	pool  *pools.Pool
	front *Front
	// stop tells Serve to stop and returns once it has returned.
	stop func()
}

// serveDrain serves a front with a requests pool of 4 before the upstream
// at upAddr, with sched (nil: none) and a drain of drainFor.
func serveDrain(t *testing.T, upAddr string, cfg Config, sched *scheduler.Scheduler, drainFor time.Duration) *drainRig {
	t.Helper()
	return serveDrainOn(t, loopbackListen(t), upAddr, cfg, sched, drainFor)
}

// serveDrainOn is serveDrain on the listener l.
func serveDrainOn(t *testing.T, l net.Listener, upAddr string, cfg Config, sched *scheduler.Scheduler, drainFor time.Duration) *drainRig {
	t.Helper()
	pool, err := pools.New(pools.Config{Name: "requests", Size: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Upstream = "http://" + upAddr
	if cfg.TrustedPeers == nil {
		cfg.TrustedPeers = []string{"127.0.0.0/8"}
	}
	f, err := New(cfg, Deps{Requests: pool, Sched: sched})
	if err != nil {
		t.Fatal(err)
	}
	f.drainFor = drainFor
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { defer close(served); _ = f.Serve(ctx, l) }()
	stop := func() { cancel(); <-served }
	t.Cleanup(stop)
	deadline := time.Now().Add(5 * time.Second)
	for f.cfg.FastPath && f.fast.Load() == nil {
		if time.Now().After(deadline) {
			t.Fatal("the fast path did not start")
		}
		time.Sleep(time.Millisecond)
	}
	return &drainRig{addr: l.Addr().String(), pool: pool, front: f, stop: stop}
}

// silentUpstream is an upstream that reads a request and never answers
// (until the front closes the connection).
func silentUpstream(t *testing.T) string {
	t.Helper()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(limitsDeadline):
		}
	}))
	t.Cleanup(up.Close)
	return strings.TrimPrefix(up.URL, "http://")
}

// sendGet opens a connection to addr and sends a GET of project alpha on
// it.
func sendGet(t *testing.T, addr, path string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := c.Write([]byte("GET " + path + " HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestFastPathDrainWaiterReleased: a request still waiting for the
// scheduler when the drain's time is up gives its permit back before
// Serve returns (its waiter posted to a loop that had returned, and the
// permit was held for good: in use 1 after Serve returned).
func TestFastPathDrainWaiterReleased(t *testing.T) {
	sched, err := scheduler.New(scheduler.Config{MaxInFlight: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sctx, scancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); _ = sched.Run(sctx) }()
	defer func() { scancel(); <-ran }()
	r := serveDrain(t, silentUpstream(t), Config{MaxInFlight: 1, FastPath: true}, sched, 300*time.Millisecond)
	sendGet(t, r.addr, "/held")    // dispatched: the upstream holds it
	sendGet(t, r.addr, "/waiting") // waits for the scheduler
	waitInUse(t, r.pool, 2)
	r.stop()
	if n := r.pool.Snapshot().InUse; n != 0 {
		t.Errorf("in use %d after Serve returned, want 0", n)
	}
}

// TestFastPathPostAfterEnd: work posted to a loop that has ended runs (on
// the ended loop) and writes nothing to the descriptor number its eventfd
// had: here a file opened after the loop ended took that number, and the
// post wrote 8 bytes into it.
func TestFastPathPostAfterEnd(t *testing.T) {
	r := serveDrain(t, silentUpstream(t), Config{FastPath: true}, nil, 300*time.Millisecond)
	lp := r.front.fast.Load().loops[0]
	r.stop()
	// Open files until one takes the eventfd's number (the lowest free
	// number goes first).
	var file *os.File
	dir := t.TempDir()
	for i := 0; i < 256 && file == nil; i++ {
		f, err := os.OpenFile(filepath.Join(dir, "f"), os.O_RDWR|os.O_CREATE, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if int(f.Fd()) == lp.efd {
			file = f
		}
	}
	ran := false
	lp.post(func() { ran = true })
	if !ran {
		t.Error("a function posted to the ended loop did not run")
	}
	if file == nil {
		t.Skipf("no file took the eventfd's number %d", lp.efd)
	}
	if st, err := file.Stat(); err != nil || st.Size() != 0 {
		t.Errorf("a file that took the eventfd's number holds %d bytes after a post (%v), want 0", st.Size(), err)
	}
}

// chunkedUpstream answers every request after delay with a chunked
// "hello", then waits for the front to close the connection and reports
// on closed whether it did (sent nothing more) within limitsDeadline.
func chunkedUpstream(t *testing.T, delay time.Duration) (addr string, closed <-chan bool) {
	t.Helper()
	ul := loopbackListen(t)
	ch := make(chan bool, 16)
	go acceptEach(ul, func(c net.Conn) {
		br := bufio.NewReader(c)
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, req.Body)
		time.Sleep(delay)
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
		_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
		_, err = br.ReadByte()
		ch <- err != nil && !errors.Is(err, os.ErrDeadlineExceeded) // EOF, or a reset
	})
	return ul.Addr().String(), ch
}

// drainPaths runs fn on the fast path and on net/http's, both served by
// Front.Serve.
func drainPaths(t *testing.T, fn func(t *testing.T, fast bool)) {
	t.Run("direct", func(t *testing.T) { fn(t, false) })
	t.Run("fast", func(t *testing.T) { fn(t, true) })
}

// answerDuringStop stops r while c waits for its answer, and returns the
// answer ("status body", or the error).
func answerDuringStop(t *testing.T, r *drainRig, c net.Conn) string {
	t.Helper()
	stopped := make(chan struct{})
	go func() { defer close(stopped); r.stop() }()
	_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
	answer := ""
	if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err != nil {
		answer = "no answer: " + err.Error()
	} else {
		b, _ := io.ReadAll(resp.Body)
		answer = resp.Status + " " + string(b)
	}
	<-stopped
	return answer
}

// TestDrainResumedAnswered: an exchange in flight when Serve is told to
// stop, whose answer is not plain (chunked) and comes during the drain,
// is answered, its permit is given back before Serve returns and its
// upstream connection closed. On the fast path it was handed to net/http's
// server after that server had stopped taking connections, and closed:
// the client got EOF and the permit was held for good (in use 1).
func TestDrainResumedAnswered(t *testing.T) {
	drainPaths(t, func(t *testing.T, fast bool) {
		up, upClosed := chunkedUpstream(t, 300*time.Millisecond)
		r := serveDrain(t, up, Config{FastPath: fast}, nil, 2*time.Second)
		c := sendGet(t, r.addr, "/slow")
		waitInUse(t, r.pool, 1)
		if got := answerDuringStop(t, r, c); got != "200 OK hello" {
			t.Errorf("the answer during the drain: %q, want 200 OK hello", got)
		}
		if n := r.pool.Snapshot().InUse; n != 0 {
			t.Errorf("in use %d after Serve returned, want 0", n)
		}
		if !<-upClosed {
			t.Error("the upstream connection was not closed")
		}
	})
}

// TestFastPathDrainHandedHeadAnswered: a request whose head began before
// Serve was told to stop and whose rest (a chunked body, which the loops
// hand to net/http's server) came during the drain is answered, as the
// loops answer a plain one (the connection was closed: EOF). net/http's
// own server closes such a connection unanswered (Server.Shutdown).
func TestFastPathDrainHandedHeadAnswered(t *testing.T) {
	up, _ := chunkedUpstream(t, 0)
	r := serveDrain(t, up, Config{FastPath: true}, nil, 2*time.Second)
	c, err := net.Dial("tcp", r.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = io.WriteString(c, "POST /up HTTP/1.1\r\nHost: x\r\n")
	loopUntil(t, r.front, "the loop to have the head's start", headBegun)
	fs := r.front.fast.Load()
	go func() {
		// The rest comes once the drain has begun and net/http's server
		// takes no more connections (else the test fails on no answer).
		if !loopWait(r.front, draining) {
			return
		}
		select {
		case <-fs.closed:
		case <-time.After(limitsDeadline):
			return
		}
		_, _ = io.WriteString(c, "Fairshare-Project: alpha\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
	}()
	if got := answerDuringStop(t, r, c); got != "200 OK hello" {
		t.Errorf("the answer during the drain: %q, want 200 OK hello", got)
	}
	if n := r.pool.Snapshot().InUse; n != 0 {
		t.Errorf("in use %d after Serve returned, want 0", n)
	}
}

// TestHandedConnCloseGivesBack: a connection handed over with an
// exchange that is closed before the exchange was resumed (the server
// could not serve it) gives the permit back and closes the upstream
// connection; a request read from it after that is not sent again.
func TestHandedConnCloseGivesBack(t *testing.T) {
	up, upClosed := chunkedUpstream(t, 0)
	r := serveDrain(t, up, Config{FastPath: true}, nil, time.Second)
	d := r.front.up.(*directUpstream)
	req := httptest.NewRequest("GET", "/", nil)
	req.Header.Set(DefaultProjectHeader, "alpha")
	a := r.front.admit(httptest.NewRecorder(), req, &peer{addr: netip.MustParseAddr("127.0.0.1")})
	if a == nil {
		t.Fatal("not admitted")
	}
	r.front.dispatched(a, 0, nil)
	uc, _, err := d.dialNew(context.Background(), upKey{})
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.WriteString(uc.c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
	client, server := net.Pipe()
	defer client.Close()
	hc := &handedConn{Conn: server, f: r.front, resume: &resumed{a: a, uc: uc}}
	if n := r.pool.Snapshot().InUse; n != 1 {
		t.Fatalf("in use %d, want 1", n)
	}
	hc.Close()
	if n := r.pool.Snapshot().InUse; n != 0 {
		t.Errorf("in use %d after the handed connection closed, want 0", n)
	}
	if !<-upClosed {
		t.Error("the upstream connection was not closed")
	}
	if res, dropped := hc.take(); res != nil || !dropped {
		t.Errorf("take after the close: %v, %v; want nil, dropped", res, dropped)
	}
}

// TestHalfClosedClientNotAnswered: a client that sends its request and
// half-closes its connection is taken as gone, as nginx does by default
// (499, proxy_ignore_client_abort off) and net/http's server does (the
// request's context ends): its exchange is aborted, its permit given
// back, and it reads no answer, never a success the upstream did not
// give. net/http's path wrote an empty 200 (the handler returned without
// writing), whether the request was at the upstream or queued for the
// scheduler. On every path.
func TestHalfClosedClientNotAnswered(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		release := make(chan struct{})
		r := newRig(t, rigOpts{poolSize: 4, tweak: tweak, cfg: Config{MaxInFlight: 1}}, func(w http.ResponseWriter, req *http.Request) {
			if req.URL.Path == "/hold" {
				select {
				case <-release:
				case <-req.Context().Done():
				}
			}
			time.Sleep(100 * time.Millisecond)
			w.Header().Set("Content-Type", "text/plain")
			_, _ = io.WriteString(w, "ok")
		})
		addr := strings.TrimPrefix(r.url, "http://")
		halfClosed := func(path string) string {
			c := sendGet(t, addr, path)
			_ = c.(*net.TCPConn).CloseWrite()
			_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
			b, err := io.ReadAll(c)
			if errors.Is(err, os.ErrDeadlineExceeded) {
				return string(b) + " (the connection stayed open)"
			}
			return string(b) // a reset is no answer either
		}
		if got := halfClosed("/a"); got != "" {
			t.Errorf("a half-closed client read %q, want nothing", got)
		}
		waitInUse(t, r.pool, 0)
		held := sendGet(t, addr, "/hold") // the scheduler's one slot
		waitInUse(t, r.pool, 1)
		if got := halfClosed("/queued"); got != "" {
			t.Errorf("a half-closed client queued for the scheduler read %q, want nothing", got)
		}
		waitInUse(t, r.pool, 1)
		close(release)
		_ = held.SetReadDeadline(time.Now().Add(limitsDeadline))
		if resp, err := http.ReadResponse(bufio.NewReader(held), nil); err != nil || resp.StatusCode != http.StatusOK {
			t.Errorf("the request holding the slot: %v, %v; want 200", resp, err)
		}
		waitInUse(t, r.pool, 0)
	})
}

// TestHalfClosedMidStreamNotComplete: a client that half-closes while an
// answer of unknown length streams to it (its head and a first piece out)
// never reads an answer that ends well: the front aborts it rather than
// end it with a last chunk. Random pauses before the half-close, on every
// path.
func TestHalfClosedMidStreamNotComplete(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		r := newRig(t, rigOpts{poolSize: 4, tweak: tweak}, func(w http.ResponseWriter, req *http.Request) {
			fl := w.(http.Flusher)
			for i := range 40 {
				if _, err := fmt.Fprintf(w, "piece %d\n", i); err != nil {
					return
				}
				fl.Flush()
				select {
				case <-req.Context().Done():
					return
				case <-time.After(25 * time.Millisecond):
				}
			}
		})
		addr := strings.TrimPrefix(r.url, "http://")
		for i := range 4 {
			c := sendGet(t, addr, "/stream")
			br := bufio.NewReader(c)
			_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("round %d: the head: %v", i, err)
			}
			if _, err := io.ReadFull(resp.Body, make([]byte, len("piece 0\n"))); err != nil {
				t.Fatalf("round %d: the first piece: %v", i, err)
			}
			time.Sleep(time.Duration(i*37%100) * time.Millisecond)
			_ = c.(*net.TCPConn).CloseWrite()
			rest, err := io.ReadAll(resp.Body)
			if err == nil {
				t.Errorf("round %d: a half-closed client read an answer that ended well (%d more bytes)", i, len(rest))
			}
			c.Close()
			waitInUse(t, r.pool, 0)
		}
	})
}

// TestFastPathWithdrawnTicketAnswered: a request whose ticket the
// scheduler reports withdrawn when the loop looks (TryWait: ok, with an
// error) is answered 503, as net/http's path answers it, and its permit
// given back; the loop dispatched only a ticket without error and left
// this one admitted for good (in use 1, no answer). No scheduler
// withdraws a ticket by itself today, so the loop is handed one
// withdrawn by hand: the scheduler does not run, and the queued ticket
// is withdrawn with Done.
func TestFastPathWithdrawnTicketAnswered(t *testing.T) {
	sched, err := scheduler.New(scheduler.Config{MaxInFlight: 1}, nil)
	if err != nil {
		t.Fatal(err)
	}
	r := serveDrain(t, silentUpstream(t), Config{FastPath: true}, sched, time.Second)
	ln := loopbackListen(t)
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	conn, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	fd, err := dupConn(conn.(*net.TCPConn))
	if err != nil {
		t.Fatal(err)
	}
	lp := r.front.fast.Load().loops[0]
	settled := make(chan error, 1)
	lp.post(func() {
		lp.addClient(fd, conn, r.front.newPeer(conn))
		c := lp.clients[int32(fd)]
		c.in = append(c.in, "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n"...)
		req, n, v := plainRequest(c.in, fastHeadMax, fastBodyMax)
		if v != reqPlain {
			settled <- errors.New("the request is not plain")
			return
		}
		req.Body, req.RemoteAddr = http.NoBody, c.remote
		c.r, c.raw = req, n
		c.cw.reset()
		a := r.front.admit(&c.cw, c.r, c.p)
		if a == nil || a.ticket == nil {
			settled <- errors.New("not admitted with a ticket")
			return
		}
		c.a = a
		a.ticket.Done(0) // queued: withdrawn
		class, ok, err := a.ticket.TryWait()
		if !ok || err == nil {
			settled <- errors.New("the ticket is not reported withdrawn")
			return
		}
		lp.settled(c, a, class, err)
		settled <- nil
	})
	if err := <-settled; err != nil {
		t.Fatal(err)
	}
	_ = client.SetReadDeadline(time.Now().Add(limitsDeadline))
	resp, err := http.ReadResponse(bufio.NewReader(client), nil)
	if err != nil || resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("a withdrawn ticket's request: %v, %v; want 503", resp, err)
	}
	if n := r.pool.Snapshot().InUse; n != 0 {
		t.Errorf("in use %d after a withdrawn ticket, want 0", n)
	}
}

// TestHeadBoundFromAccept: a client that connects, waits 0.7 of
// ReadHeaderTimeout, then trickles a head that never ends is cut at
// ReadHeaderTimeout from the accept, as net/http's server cuts it, with a
// plain head (the loop's) and one the loop hands to net/http's server (a
// bare LF). The loop restarted the bound at the head's first byte, and
// net/http's server restarted it at the hand-over: both cut it at 1.7.
// On every path.
func TestHeadBoundFromAccept(t *testing.T) {
	const limit = 600 * time.Millisecond
	paths(t, func(t *testing.T, tweak func(*Front)) {
		r := newRig(t, rigOpts{tweak: tweak, cfg: Config{ReadHeaderTimeout: limit}}, ok)
		for _, tc := range []struct{ name, first, more string }{
			{"plain", "GET / HTTP/1.1\r\n", "X-Trickle: a\r\n"},
			{"handed", "GET / HTTP/1.1\nHost: x\n", "X-Trickle: a\n"},
		} {
			t.Run(tc.name, func(t *testing.T) {
				start := time.Now()
				c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				closed := make(chan time.Duration, 1)
				go func() {
					_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
					_, _ = io.Copy(io.Discard, c)
					closed <- time.Since(start)
				}()
				time.Sleep(limit * 7 / 10)
				_, _ = io.WriteString(c, tc.first)
				tick := time.NewTicker(limit / 10)
				defer tick.Stop()
				for {
					select {
					case d := <-closed:
						t.Logf("cut %v after the connect", d)
						if d < limit*9/10 || d > limit*13/10 {
							t.Errorf("a head trickled from 0.7 of ReadHeaderTimeout %v was cut %v after the connect, want about %v", limit, d, limit)
						}
						return
					case <-tick.C:
						_, _ = io.WriteString(c, tc.more)
					}
				}
			})
		}
	})
}

// loopbackListen listens on a port of 127.0.0.1 until the test ends.
func loopbackListen(t testing.TB) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// acceptEach serves each connection l accepts with handle, on a goroutine
// of its own, and closes it after; it returns when l is closed.
func acceptEach(l net.Listener, handle func(c net.Conn)) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			handle(c)
		}()
	}
}

// smallSendBuf gives each accepted connection a 4 KiB send buffer, so that
// an answer of some KiB waits in the loop for its client to read it.
type smallSendBuf struct{ net.Listener }

func (l smallSendBuf) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		_ = c.(*net.TCPConn).SetWriteBuffer(4096)
	}
	return c, err
}

// onLoop runs fn on the fast path's first loop and waits for it.
func onLoop(f *Front, fn func(lp *loop)) {
	lp := f.fast.Load().loops[0]
	done := make(chan struct{})
	lp.post(func() { defer close(done); fn(lp) })
	<-done
}

// loopUntil waits, looking on the fast path's first loop, until cond holds
// there; the test fails after limitsDeadline, saying what it waited for.
func loopUntil(t *testing.T, f *Front, what string, cond func(lp *loop) bool) {
	t.Helper()
	if !loopWait(f, cond) {
		t.Fatalf("waiting for %s: not within %v", what, limitsDeadline)
	}
}

// loopWait is loopUntil for any goroutine: false after limitsDeadline.
func loopWait(f *Front, cond func(lp *loop) bool) bool {
	for deadline := time.Now().Add(limitsDeadline); ; time.Sleep(2 * time.Millisecond) {
		ok := false
		onLoop(f, func(lp *loop) { ok = cond(lp) })
		if ok {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}

// headBegun: a client's head has begun in the loop (it is served during
// a drain; an idle client is closed at the drain's start).
func headBegun(lp *loop) bool {
	for _, fc := range lp.clients {
		if fc.state == csHead {
			return true
		}
	}
	return false
}

// draining: the loop has begun to drain.
func draining(lp *loop) bool { return !lp.drainBy.IsZero() }

// TestFastPathDrainClosesAfterAnswerInFlight: a client whose last answer
// is still being written when Serve is told to stop (it reads slowly)
// gets that answer, and then its connection is closed, as net/http's
// Shutdown closes a connection after the answer in flight. The loop left
// it open and serving new requests until the drain's end (Serve returned
// 3s after the stop with a 3s drain, and a request sent meanwhile was
// answered).
func TestFastPathDrainClosesAfterAnswerInFlight(t *testing.T) {
	// The answer is written at once, so that the loop reads it whole and
	// ends the exchange with most of it still to write to the client.
	body := strings.Repeat("y", 24<<10)
	ul := loopbackListen(t)
	go acceptEach(ul, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			if _, err := http.ReadRequest(br); err != nil {
				return
			}
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"+body)
		}
	})
	r := serveDrainOn(t, smallSendBuf{loopbackListen(t)}, ul.Addr().String(), Config{FastPath: true}, nil, 3*time.Second)
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 2048) })
	}}
	c, err := d.Dial("tcp", r.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET /a HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	// Until the answer is all read from upstream and waits for the client.
	waiting := false
	for deadline := time.Now().Add(limitsDeadline); !waiting && time.Now().Before(deadline); {
		onLoop(r.front, func(lp *loop) {
			for _, fc := range lp.clients {
				waiting = fc.state == csIdle && len(fc.out) > 0
			}
		})
		time.Sleep(5 * time.Millisecond)
	}
	if !waiting {
		t.Fatal("the answer never waited in the loop for its client")
	}
	start := time.Now()
	stopped := make(chan struct{})
	go func() { defer close(stopped); r.stop() }()
	// The loop drains before the client takes the rest of its answer:
	// else it would be idle, not draining, when it sends the next request.
	loopUntil(t, r.front, "the loop to drain", draining)
	_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("the answer in flight: %v", err)
	}
	if n, err := io.Copy(io.Discard, resp.Body); n != int64(len(body)) || err != nil {
		t.Fatalf("the answer in flight: %d bytes, %v", n, err)
	}
	_, _ = io.WriteString(c, "GET /b HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")
	if resp, err := http.ReadResponse(br, nil); err == nil {
		t.Errorf("a request sent after the stop was answered: %s", resp.Status)
	}
	<-stopped
	if took := time.Since(start); took >= r.front.drainFor {
		t.Errorf("Serve returned %v after the stop, at the drain's end (%v): the client's connection was kept", took, r.front.drainFor)
	}
}

// deafUpstream reads what comes and never answers, until the front closes
// the connection (silentUpstream's handler would not see that before it
// read a chunked body).
func deafUpstream(t *testing.T) string {
	t.Helper()
	return testutil.Sink(t, loopbackListen(t)).Addr().String()
}

// TestServeWaitsForHandedRequests: a request in flight on net/http's server
// (on the fast path: handed to it, its body chunked) at an upstream that
// never answers, when the drain ends: the server closes its connection,
// and Serve returns once the request gave its permit back. It returned at
// the drain's end with the permit still held (in use 1).
func TestServeWaitsForHandedRequests(t *testing.T) {
	drainPaths(t, func(t *testing.T, fast bool) {
		r := serveDrain(t, deafUpstream(t), Config{FastPath: fast, UpstreamHeadTimeout: limitsDeadline}, nil, 300*time.Millisecond)
		c, err := net.Dial("tcp", r.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_, _ = io.WriteString(c, "POST /up HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
		waitInUse(t, r.pool, 1)
		start := time.Now()
		r.stop()
		t.Logf("Serve returned %v after the stop", time.Since(start))
		if n := r.pool.Snapshot().InUse; n != 0 {
			t.Errorf("in use %d after Serve returned, want 0", n)
		}
	})
}

// TestFastPathDrainUpgradeKept: a connection upgraded during the drain
// (its head began before the stop, and asked for an upgrade) keeps its
// tunnel past the drain's end, as net/http's Shutdown leaves hijacked
// connections alone: the server of its own that served the hand-over
// closed it right after the 101.
func TestFastPathDrainUpgradeKept(t *testing.T) {
	ul := loopbackListen(t)
	go acceptEach(ul, func(c net.Conn) {
		br := bufio.NewReader(c)
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		_, _ = io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		_, _ = io.Copy(c, br) // echo
	})
	// Long enough for the hand-over, the upstream's dial and its 101 on a
	// busy machine: a drain that ended first would close the connection
	// before the upgrade, and the test would fail for that.
	r := serveDrain(t, ul.Addr().String(), Config{FastPath: true}, nil, 2*time.Second)
	c, err := net.Dial("tcp", r.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET /echo HTTP/1.1\r\nHost: x\r\n"); err != nil {
		t.Fatal(err)
	}
	// A client idle at the stop is closed at once: its head must have
	// begun in the loop.
	loopUntil(t, r.front, "the loop to have the head's start", headBegun)
	fs := r.front.fast.Load()
	stopped := make(chan struct{})
	go func() { defer close(stopped); r.stop() }()
	// The rest of the head comes once the loop drains and net/http's
	// server takes no more connections: the upgrade is served during the
	// drain, by a server of its own (serveLate).
	loopUntil(t, r.front, "the loop to drain", draining)
	select {
	case <-fs.closed:
	case <-time.After(limitsDeadline):
		t.Fatal("net/http's server still takes connections after the stop")
	}
	if _, err := io.WriteString(c, "Fairshare-Project: alpha\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("answer %s, want 101", resp.Status)
	}
	<-stopped
	// Past the drain's end (Serve may return before it).
	end := time.Now().Add(time.Duration(fs.stopAt.Load() - monoNanos.Now()))
	time.Sleep(time.Until(end) + 100*time.Millisecond)
	if _, err := io.WriteString(c, "ping"); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	if _, err := io.ReadFull(br, b); err != nil || string(b) != "ping" {
		t.Fatalf("the tunnel after the drain: %q, %v", b, err)
	}
}
