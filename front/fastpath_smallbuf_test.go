// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/pools"
)

// smallBufsEnv names, in the process inSmallBuffers starts, the test it
// runs there.
const smallBufsEnv = "FAIRSHARE_FRONT_SMALL_BUFFERS_TEST"

// inSmallBuffers runs the calling test again in a process of its own, in
// a network namespace of its own whose TCP send buffers are 4 KiB
// (net.ipv4.tcp_wmem): there a request body of some tens of KiB does not
// fit in the kernel's buffers between the front and an upstream that does
// not read it yet, as it does on a host's loopback. It reports true in
// that process, where the caller goes on with the test; in the test's own
// it waits for that run, passes its output and verdict on, and reports
// false. It needs root (a network namespace, and its sysctl).
func inSmallBuffers(t *testing.T) bool {
	t.Helper()
	if os.Getenv(smallBufsEnv) == t.Name() {
		if err := testutil.LoopbackUp(); err != nil {
			t.Fatalf("bringing lo up: %v", err)
		}
		if err := os.WriteFile("/proc/sys/net/ipv4/tcp_wmem", []byte("4096 4096 4096"), 0); err != nil {
			t.Fatalf("small send buffers: %v", err)
		}
		return true
	}
	testutil.RequireRoot(t)
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^"+t.Name()+"$", "-test.v", "-test.count=1", "-test.timeout=1m")
	// A race-enabled binary sleeps a second before it exits, unless told
	// not to (GORACE's atexit_sleep_ms; a later setting wins).
	cmd.Env = append(os.Environ(), smallBufsEnv+"="+t.Name(), "GORACE="+strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	// The namespace ends with the process, which ends with this thread.
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Pdeathsig: syscall.SIGKILL}
	runtime.LockOSThread()
	out, err := cmd.CombinedOutput()
	runtime.UnlockOSThread()
	t.Logf("in a network namespace with 4 KiB send buffers:\n%s", out)
	if err != nil {
		t.Errorf("the run in its own network namespace failed: %v", err)
	}
	return false
}

// smallRcvbufListen listens on loopback with a receive buffer of 2 KiB
// for the connections it accepts: an upstream that does not read takes
// little. The listener is closed when the test ends.
func smallRcvbufListen(t *testing.T) net.Listener {
	t.Helper()
	lc := net.ListenConfig{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 2048) })
		if err != nil {
			return err
		}
		return serr
	}}
	l, err := lc.Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// smallRig is a front on the fast path, with a requests pool of 4, before
// a raw upstream, both in the network namespace of inSmallBuffers.
type smallRig struct {
	addr string
	pool *pools.Pool
	// whole is the size of the request the next connection sends: the
	// front's listener hands a connection over only once that much came.
	whole atomic.Int64
	// dialer dials the front for post.
	dialer net.Dialer
}

// newSmallRig serves, until the test ends, an upstream whose listener
// takes little (smallRcvbufListen) and that serves each connection with
// serve, and a smallRig's front with cfg before it. quit, which serve may
// wait on, is closed when the test ends, once the front stopped. The test
// fails if the front logged a panic (a loop contains one, and its client
// may have been answered already). Call it in the run inSmallBuffers
// starts.
func newSmallRig(t *testing.T, cfg Config, serve func(c net.Conn, quit <-chan struct{})) *smallRig {
	t.Helper()
	ul := smallRcvbufListen(t)
	quit := make(chan struct{})
	t.Cleanup(func() { close(quit) })
	go acceptEach(ul, func(c net.Conn) { serve(c, quit) })
	r := &smallRig{}
	logs := &logBuffer{}
	t.Cleanup(func() {
		if l := logs.String(); strings.Contains(l, "panic") {
			t.Errorf("the front logged a panic: %s", l)
		}
	})
	var err error
	r.pool, err = pools.New(pools.Config{Name: "requests", Size: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Upstream = "http://" + ul.Addr().String()
	cfg.TrustedPeers = []string{"127.0.0.1"}
	cfg.FastPath = true
	f, err := New(cfg, Deps{Requests: r.pool, Log: logs.logger()})
	if err != nil {
		t.Fatal(err)
	}
	l := loopbackListen(t)
	r.addr = l.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = f.Serve(ctx, wholeRequests{l, &r.whole}) }()
	t.Cleanup(func() { cancel(); <-done })
	for f.fast.Load() == nil {
		time.Sleep(time.Millisecond)
	}
	return r
}

// wholeRequests hands a connection out once *want bytes came on it (or
// after 2s): the loop finds the whole request at its first read, and
// serves it. (One whose body came after its head would go to net/http's
// server; a request of some tens of KiB is seldom split over loopback,
// but may be.)
type wholeRequests struct {
	net.Listener
	want *atomic.Int64
}

func (l wholeRequests) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		return c, nil
	}
	buf := make([]byte, l.want.Load())
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	_ = rc.Read(func(fd uintptr) bool {
		n, _, err := syscall.Recvfrom(int(fd), buf, syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		return n >= len(buf) || n == 0 || (err != nil && err != syscall.EAGAIN)
	})
	_ = c.SetReadDeadline(time.Time{})
	return c, nil
}

// post dials the front and sends a POST of body to path, head and body in
// one write, and once whole, to the loop (a body over the loop's 64 KiB
// goes to net/http's server, and so to the direct path).
func (r *smallRig) post(t *testing.T, path string, body string) net.Conn {
	t.Helper()
	req := fmt.Sprintf("POST %s HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
	r.whole.Store(int64(len(req)))
	if len(body) > fastBodyMax {
		r.whole.Store(0) // net/http's server reads it, whole or not
	}
	c, err := r.dialer.Dial("tcp", r.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.(*net.TCPConn).SetWriteBuffer(256 << 10)
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	return c
}

// gotAnswer reads, within 5s, what the front answers on c: "status body",
// after "status; " for each 1xx answer before it, with ": " and the error
// where the body broke off; or "no answer: " and the error.
func gotAnswer(c net.Conn) string {
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(c)
	var got string
	for {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			return got + "no answer: " + err.Error()
		}
		if resp.StatusCode < 200 {
			got += fmt.Sprintf("%d; ", resp.StatusCode)
			continue
		}
		b, err := io.ReadAll(resp.Body)
		got += fmt.Sprintf("%d %s", resp.StatusCode, b)
		if err != nil {
			got += ": " + err.Error()
		}
		return got
	}
}

// TestFastPathUpstreamResetWhileSending: an upstream that resets its
// connection while the loop still has request body to write is answered
// 502, once. The write failing ended the exchange but left the
// connection's owner set, so the same event went on to read the closed
// descriptor (or one reused by then) and failed the exchange a second
// time, on a nil admission: a panic (3 runs in 3), which ended the daemon
// before the loops contained panics, and is logged now.
func TestFastPathUpstreamResetWhileSending(t *testing.T) {
	if !inSmallBuffers(t) {
		return
	}
	r := newSmallRig(t, Config{}, func(c net.Conn, _ <-chan struct{}) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
			time.Sleep(50 * time.Millisecond)
		}
		_ = c.(*net.TCPConn).SetLinger(0) // the close is a reset
	})
	for range 3 {
		c := r.post(t, "/reset", strings.Repeat("b", 60000))
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("no answer: %v", err)
		}
		if resp.StatusCode != http.StatusBadGateway {
			t.Errorf("upstream reset while the request went out: %s, want 502", resp.Status)
		}
		c.Close()
		waitInUse(t, r.pool, 0)
	}
}

// TestFastPathAnswerThenReset: an upstream that answers a request whose
// body it will not read and hangs up (a reset, as the body is unread)
// while the loop still has body to write has its answer relayed, as
// net/http's path relays it: a 413 of its own (the client got 502, 3 times
// in 3), or a chunked answer, which the loop hands over.
func TestFastPathAnswerThenReset(t *testing.T) {
	if !inSmallBuffers(t) {
		return
	}
	r := newSmallRig(t, Config{}, func(c net.Conn, _ <-chan struct{}) {
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			return
		}
		if req.URL.Path == "/plain" {
			_, _ = io.WriteString(c, "HTTP/1.1 413 Request Entity Too Large\r\nContent-Type: text/plain\r\nContent-Length: 7\r\n\r\ntoo big")
		} else {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nclosed\r\n0\r\n\r\n")
		}
	})
	for range 3 {
		for path, want := range map[string]string{"/plain": "413 too big", "/chunked": "200 closed"} {
			c := r.post(t, path, strings.Repeat("b", 60000))
			if got := gotAnswer(c); got != want {
				t.Errorf("%s: answered and reset: client got %q, want %q", path, got, want)
			}
			c.Close()
			waitInUse(t, r.pool, 0)
		}
	}
}

// TestFastPathResumeSendsBody: an exchange the loop hands to net/http's
// path (a chunked answer) before it wrote the whole request body upstream
// has the rest of the body sent there while the answer is read. The
// upstream begins its answer at once and reads the body 200ms later: it
// got 7041 bytes of 60000 and answered them (200 "got 7041 of 60000",
// after its own 2s wait for the rest); now all of them. Its connection is
// not reused: the client's next request, on the same connection, goes
// upstream on another and gets its own answer.
func TestFastPathResumeSendsBody(t *testing.T) {
	if !inSmallBuffers(t) {
		return
	}
	var conns atomic.Int64
	got := make(chan int64, 4)
	r := newSmallRig(t, Config{}, func(c net.Conn, _ <-chan struct{}) {
		conns.Add(1)
		br := bufio.NewReaderSize(c, 1024)
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			// The answer begins at once; the body is read after.
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
			time.Sleep(200 * time.Millisecond)
			_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
			n, err := io.Copy(io.Discard, req.Body)
			got <- n
			msg := fmt.Sprintf("%s got %d of %d", req.URL.Path, n, req.ContentLength)
			_, _ = fmt.Fprintf(c, "%x\r\n%s\r\n0\r\n\r\n", len(msg), msg)
			if err != nil {
				return
			}
		}
	})
	body := strings.Repeat("b", 60000)
	c := r.post(t, "/post", body)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	if want := "/post got 60000 of 60000"; resp.StatusCode != 200 || string(b) != want || err != nil {
		t.Errorf("client got %s %q (%v), want 200 %q", resp.Status, b, err, want)
	}
	if n := <-got; n != int64(len(body)) {
		t.Errorf("the upstream received %d bytes of a %d-byte body", n, len(body))
	}
	waitInUse(t, r.pool, 0)

	_, _ = io.WriteString(c, "GET /next HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")
	resp, err = http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err = io.ReadAll(resp.Body)
	if want := "/next got 0 of 0"; string(b) != want || err != nil {
		t.Errorf("next request on the connection: %s %q (%v), want %q", resp.Status, b, err, want)
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("%d upstream connections for 2 requests: the resumed exchange's was reused", n)
	}
	waitInUse(t, r.pool, 0)
}

// TestFastPathResumeUpstreamNotReading: an upstream that answers at once
// and never reads the request body (the part the loop wrote fills the
// sockets' buffers, the rest waits in the hand-over's sender) does not
// hold the exchange past the front's timeouts: a whole answer is relayed
// and the sender stopped at its end; a chunked answer it never ends is
// cut off, and a 100 Continue it never follows gets 504, once no piece of
// the body was taken for WriteTimeout. The permit is
// given back each time. (Before, the rest of the body was dropped, and the
// cut and the 504 never came: the answer's body is read without a
// deadline, and its head awaited for UpstreamHeadTimeout, a minute.)
func TestFastPathResumeUpstreamNotReading(t *testing.T) {
	if !inSmallBuffers(t) {
		return
	}
	r := newSmallRig(t, Config{WriteTimeout: 500 * time.Millisecond}, func(c net.Conn, quit <-chan struct{}) {
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			return
		}
		answer := map[string]string{
			"/whole":    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nwhole\r\n0\r\n\r\n",
			"/unended":  "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nhalf\r\n",
			"/continue": "HTTP/1.1 100 Continue\r\n\r\n",
		}[req.URL.Path]
		_, _ = io.WriteString(c, answer)
		<-quit // not a byte of the body read
	})
	body := strings.Repeat("b", 60000)
	for _, tc := range []struct {
		path string
		want string // status and body the client reads, up to an error
	}{
		{"/whole", "200 whole"},
		{"/unended", "200 half: unexpected EOF"},
		{"/continue", "100; 504 fairshare: the upstream did not answer in time\n"},
	} {
		start := time.Now()
		c := r.post(t, tc.path, body)
		if got := gotAnswer(c); got != tc.want {
			t.Errorf("%s: client got %q after %v, want %q", tc.path, got, time.Since(start), tc.want)
		}
		c.Close()
		waitInUse(t, r.pool, 0)
	}
}

// TestFastPathResumeHangUpKeepsAnswer: an upstream that sends the whole of
// a chunked answer after the exchange was handed over and then hangs up on
// the body it did not read (a reset) has all of it relayed to a client
// that reads it late: the sender of the body fails on the reset, and does
// not abort the reading of what the upstream answered before.
func TestFastPathResumeHangUpKeepsAnswer(t *testing.T) {
	if !inSmallBuffers(t) {
		return
	}
	answer := strings.Repeat("a", 48<<10)
	r := newSmallRig(t, Config{}, func(c net.Conn, _ <-chan struct{}) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
		time.Sleep(100 * time.Millisecond) // handed over
		_, _ = fmt.Fprintf(c, "%x\r\n%s\r\n0\r\n\r\n", len(answer), answer)
		time.Sleep(100 * time.Millisecond) // all of it at the front
	})
	// The client takes little at a time: most of the answer waits at the
	// front when the reset comes.
	r.dialer.Control = func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}
	c := r.post(t, "/", strings.Repeat("b", 60000))
	time.Sleep(400 * time.Millisecond)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || string(b) != answer || err != nil {
		t.Errorf("client got %s and %d bytes of the %d answered (%v)", resp.Status, len(b), len(answer), err)
	}
	c.Close()
	waitInUse(t, r.pool, 0)
}

// TestDirectUpstreamNotReading: on the direct path (a body over the fast
// path's 64 KiB), an upstream that takes no piece of the request body for
// WriteTimeout has the exchange aborted: one that never answers gets 504,
// one whose chunked answer never ends has it cut off, and the permit goes
// back. (Before, the body's sender waited for good, the wait for the
// answer's head began only once the body was out, the client's leaving
// went unseen as nobody read its connection, and the permit was held for
// good: in use 1 ten seconds after the client closed.)
func TestDirectUpstreamNotReading(t *testing.T) {
	if !inSmallBuffers(t) {
		return
	}
	r := newSmallRig(t, Config{WriteTimeout: 500 * time.Millisecond}, func(c net.Conn, quit <-chan struct{}) {
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			return
		}
		if req.URL.Path == "/unended" {
			_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nhalf\r\n")
		}
		<-quit // not a byte of the body read
	})
	body := strings.Repeat("b", 200<<10)
	for _, tc := range []struct{ path, want string }{
		{"/silent", "504 fairshare: the upstream did not answer in time\n"},
		{"/unended", "200 half: unexpected EOF"},
	} {
		c := r.post(t, tc.path, body)
		if got := gotAnswer(c); got != tc.want {
			t.Errorf("%s: client got %q, want %q", tc.path, got, tc.want)
		}
		c.Close()
		waitInUse(t, r.pool, 0)
	}
}

// TestFastPathUpstreamNotReading: in the loop, an upstream that takes no
// piece of a request body for WriteTimeout has the exchange aborted, as
// on the direct path: one that never answers gets 504, and the permit
// goes back (the loop waited for it for as long as the client did: no
// answer after 5s, in use 1).
func TestFastPathUpstreamNotReading(t *testing.T) {
	if !inSmallBuffers(t) {
		return
	}
	r := newSmallRig(t, Config{WriteTimeout: 500 * time.Millisecond}, func(c net.Conn, quit <-chan struct{}) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
			<-quit // not a byte of the body read, no answer
		}
	})
	for range 2 {
		c := r.post(t, "/silent", strings.Repeat("b", 60000))
		if got, want := gotAnswer(c), "504 fairshare: the upstream did not answer in time\n"; got != want {
			t.Errorf("client got %q, want %q", got, want)
		}
		// The client stays: the loop gives the permit back on its own.
		waitInUse(t, r.pool, 0)
		c.Close()
	}
}
