// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/pools"
)

// loopOut sums, over the loops, the answers their clients have not taken.
func loopOut(fs *fastServer) (out int) {
	for _, lp := range fs.loops {
		done := make(chan struct{})
		lp.post(func() {
			for _, c := range lp.clients {
				out += len(c.out)
			}
			close(done)
		})
		<-done
	}
	return out
}

// TestFastPathPipelinedNoReadBounded: a client that pipelines requests
// and never reads gets no more answers buffered than the one it has not
// taken (the loop parsed every request and buffered every answer: 40 MiB
// for 20000 requests).
func TestFastPathPipelinedNoReadBounded(t *testing.T) {
	body := strings.Repeat("y", 2000)
	r := fastRig(t, rigOpts{poolSize: 4}, func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = io.WriteString(w, body)
	})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.(*net.TCPConn).SetReadBuffer(4096)
	reqs := strings.Repeat("GET /s HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n", 20000)
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	_, _ = io.WriteString(c, reqs)
	time.Sleep(500 * time.Millisecond)
	if out := loopOut(r.front.fast.Load()); out > 64<<10 {
		t.Errorf("%d bytes of answers buffered for a client that reads none", out)
	}
}

// TestFastPathRefusedFloodIterative: a client pipelining requests the
// front refuses, and reading the refusals, is served by a loop, not a
// recursion as deep as the flood (the loop's stack grew with every
// request: past 1 MiB here).
func TestFastPathRefusedFloodIterative(t *testing.T) {
	r := fastRig(t, rigOpts{poolSize: 4}, func(w http.ResponseWriter, req *http.Request) {})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	defer debug.SetMaxStack(debug.SetMaxStack(1 << 20))
	var got atomic.Int64
	go func() {
		n, _ := io.Copy(io.Discard, c)
		got.Add(n)
	}()
	chunk := []byte(strings.Repeat("GET / HTTP/1.1\r\nHost: x\r\n\r\n", 2048))
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	for range 400 {
		if _, err := c.Write(chunk); err != nil {
			break
		}
	}
	// The loop still answers someone else.
	h, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	_, _ = io.WriteString(h, "GET /a HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")
	_ = h.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := http.ReadResponse(bufio.NewReader(h), nil); err != nil {
		t.Fatal(err)
	}
}

// TestFastPathPipelinedNoReadReleases: the permit of an exchange whose
// answer a pipelining client does not read is given back after
// WriteTimeout (the idle deadline of the next request replaced the write
// deadline, and the permit was held for good).
func TestFastPathPipelinedNoReadReleases(t *testing.T) {
	body := strings.Repeat("x", 100<<10)
	r := fastRig(t, rigOpts{poolSize: 4, cfg: Config{WriteTimeout: 300 * time.Millisecond, IdleTimeout: 600 * time.Millisecond, ReadHeaderTimeout: 600 * time.Millisecond}}, func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		b := body[:1000]
		if req.URL.Path == "/b" {
			b = body
		}
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		_, _ = io.WriteString(w, b)
	})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.(*net.TCPConn).SetReadBuffer(4096)
	reqs := strings.Repeat("GET /s HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n", 20000) +
		"GET /b HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n"
	_ = c.SetWriteDeadline(time.Now().Add(time.Second))
	_, _ = io.WriteString(c, reqs)
	// Given back some 300ms after the client stops reading; waited for up
	// to 10s, as a loaded machine with -race took longer than 1.5s (CI),
	// and the permit held for good is what this catches.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		n := r.pool.Snapshot().InUse
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("permit held %d after 10s with WriteTimeout 300ms, IdleTimeout 600ms", n)
		}
	}
}

// TestFastPathReplayFresh: a request replayed after a reused connection
// turned out closed goes on a new connection, not on an idle one whose
// events are not handled yet: bytes an upstream sent there unasked are
// not taken for its answer (they were, 10 times in 10).
func TestFastPathReplayFresh(t *testing.T) {
	l := loopbackListen(t)
	var mu sync.Mutex
	conns := map[net.Conn]bool{} // the open ones
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns[c] = true
			mu.Unlock()
			go func() {
				br := bufio.NewReader(c)
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						mu.Lock()
						delete(conns, c)
						mu.Unlock()
						c.Close()
						return
					}
					if req.URL.Path == "/x" {
						// Close this one, and speak unasked on another.
						mu.Lock()
						var other net.Conn
						for o := range conns {
							if o != c {
								other = o
							}
						}
						delete(conns, c)
						mu.Unlock()
						c.Close()
						if other != nil {
							_, _ = io.WriteString(other, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 6\r\n\r\nSECRET")
						}
						return
					}
					time.Sleep(50 * time.Millisecond)
					_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 4\r\n\r\nwarm")
				}
			}()
		}
	}()
	front, _ := hostileFront(t, &hostileUpstream{l: l}, func(f *Front) { f.cfg.FastPath = true })
	addr := strings.TrimPrefix(front, "http://")
	get := func(path string) string {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_, _ = io.WriteString(c, "GET "+path+" HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return "err: " + err.Error()
		}
		b, _ := io.ReadAll(resp.Body)
		return fmt.Sprintf("%d %s", resp.StatusCode, b)
	}
	got := map[string]int{}
	for range 10 {
		var wg sync.WaitGroup
		for range 2 {
			wg.Add(1)
			go func() { defer wg.Done(); get("/warm") }()
		}
		wg.Wait()
		time.Sleep(20 * time.Millisecond)
		got[get("/x")]++
	}
	if got["200 SECRET"] > 0 {
		t.Errorf("bytes sent unasked became the replayed request's answer %d times in 10: %v", got["200 SECRET"], got)
	}
}

// TestFastPathHeadLimit: a head past request_head_bytes (below the
// loop's own 8 KiB) is refused as net/http refuses it, and holds nothing
// (the loop served it, and when its answer was resumed on net/http that
// refused it there: the admission was never finished).
func TestFastPathHeadLimit(t *testing.T) {
	r := fastRig(t, rigOpts{poolSize: 4, cfg: Config{MaxRequestHead: 1024}}, func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "chunk")
		w.(http.Flusher).Flush()
		_, _ = io.WriteString(w, "ed")
	})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.WriteString(c, "GET /a HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nX-Pad: "+strings.Repeat("p", 7000)+"\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("a 7 KiB head with request_head_bytes 1 KiB: %s, want 431", resp.Status)
	}
	waitInUse(t, r.pool, 0)
}

// TestFastPathAnswerThenFIN: an upstream that ends its answer and closes
// at once (without Connection: close) has its connection not pooled: the
// next request, a POST that is not replayed, got a 502 (9 times in 10).
func TestFastPathAnswerThenFIN(t *testing.T) {
	l := loopbackListen(t)
	go acceptEach(l, func(c net.Conn) {
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, req.Body)
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok")
	})
	front, _ := hostileFront(t, &hostileUpstream{l: l}, func(f *Front) { f.cfg.FastPath = true })
	addr := strings.TrimPrefix(front, "http://")
	got := map[string]int{}
	for i := range 20 {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		req := "GET /g HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n"
		if i%2 == 1 {
			req = "POST /p HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nContent-Length: 2\r\n\r\nhi"
		}
		_, _ = io.WriteString(c, req)
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			got["err"]++
		} else {
			got[req[:4]+resp.Status]++
		}
		c.Close()
		time.Sleep(10 * time.Millisecond)
	}
	if got["GET 200 OK"] != 10 || got["POST200 OK"] != 10 {
		t.Errorf("answers: %v, want 10 GET and 10 POST 200 OK", got)
	}
}

// TestFastPathStaleEventDropped: an event of one epoll_wait batch for a
// client the loop closed earlier in the same batch, whose descriptor number
// a new connection took meanwhile (the accept goroutine's dup gets the
// lowest free number, and the new client is added by a post run in the
// same batch), does not reach the new connection. The closed client's
// hang-up aborted the new one before it was served.
func TestFastPathStaleEventDropped(t *testing.T) {
	r := fastRig(t, rigOpts{}, ok)
	ln := loopbackListen(t)
	accept := func() (client, server net.Conn) {
		client, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		server, err = ln.Accept()
		if err != nil {
			t.Fatal(err)
		}
		return client, server
	}
	ca, sa := accept()
	defer ca.Close()
	cb, sb := accept()
	defer cb.Close()
	res := make(chan error, 1)
	onLoop(r.front, func(lp *loop) {
		fdA, err := dupConn(sa.(*net.TCPConn))
		if err != nil {
			res <- err
			return
		}
		_ = sa.Close()
		lp.addClient(fdA, sa, r.front.newPeer(sa))
		a := lp.clients[int32(fdA)]
		stale := unix.EpollEvent{Fd: int32(fdA), Pad: a.gen, Events: unix.EPOLLIN | unix.EPOLLRDHUP}
		lp.closeClient(a) // earlier in the batch (its upstream's event, say)
		fdB, err := dupConn(sb.(*net.TCPConn))
		if err != nil {
			res <- err
			return
		}
		_ = sb.Close()
		if fdB != fdA {
			// As the kernel numbers it when fdA is the lowest free.
			if err := unix.Dup3(fdB, fdA, unix.O_CLOEXEC); err != nil {
				res <- err
				return
			}
			unix.Close(fdB)
			fdB = fdA
		}
		lp.addClient(fdB, sb, r.front.newPeer(sb))
		lp.handle([]unix.EpollEvent{stale}) // later in the batch: A's hang-up
		if b := lp.clients[int32(fdB)]; b == nil || b.closed {
			res <- fmt.Errorf("the new client was closed by the old one's event")
			return
		}
		res <- nil
	})
	if err := <-res; err != nil {
		t.Fatal(err)
	}
	_, _ = io.WriteString(cb, "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")
	_ = cb.SetReadDeadline(time.Now().Add(limitsDeadline))
	resp, err := http.ReadResponse(bufio.NewReader(cb), nil)
	if err != nil {
		t.Fatalf("the new client got no answer: %v", err)
	}
	resp.Body.Close()
}

// TestFastPathIdleClientBuffers: a keep-alive client idle after a 30 KB
// POST and a 200 KB answer it read slowly keeps no large buffer in the
// loop: 300 idle connections after a 60 KB POST held 56 KB of heap each,
// against 10 KB on net/http's server.
func TestFastPathIdleClientBuffers(t *testing.T) {
	r := fastRig(t, rigOpts{}, func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.Copy(io.Discard, req.Body)
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", strconv.Itoa(200<<10))
		_, _ = io.WriteString(w, strings.Repeat("a", 200<<10))
	})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := strings.Repeat("z", 30<<10) // comes with its head: the loop serves it
	br := bufio.NewReader(c)
	for range 2 {
		if _, err := io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nContent-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"+body); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // the loop holds what the socket does not
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			t.Fatal(err)
		}
	}
	// The loop lets the buffers go once it has seen the last send
	// complete, which may come after the client read it all (io_uring).
	state := ""
	released := func(lp *loop) bool {
		if len(lp.clients) != 1 {
			state = fmt.Sprintf("the loop has %d clients, want the test's", len(lp.clients))
			return false
		}
		for _, fc := range lp.clients {
			if cap(fc.in) > fastKeepBuf || cap(fc.out) > fastKeepBuf {
				state = fmt.Sprintf("an idle client holds buffers of %d and %d bytes", cap(fc.in), cap(fc.out))
				return false
			}
		}
		return true
	}
	if !loopWait(r.front, released) {
		t.Errorf("after %v: %s", limitsDeadline, state)
	}
}

// TestFastPathPanicContained: a panic in the loop's work on one connection
// (here in the daemon's membership lookup the front calls, Deps.ProjectOf)
// ends that connection, is logged, and the loop goes on serving the
// others, as net/http's server contains a handler's panic; it ended the
// process.
func TestFastPathPanicContained(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(ok))
	defer up.Close()
	var boom atomic.Bool
	pool, err := pools.New(pools.Config{Name: "requests", Size: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	logs := &logBuffer{}
	f, err := New(Config{FastPath: true, Upstream: up.URL}, Deps{Requests: pool, Log: slog.New(slog.NewTextHandler(logs, nil)),
		ProjectOf: func(uint64) (string, error) {
			if boom.Load() {
				panic("a defect in the membership")
			}
			return "alpha", nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { defer close(served); _ = f.Serve(ctx, l) }()
	defer func() { cancel(); <-served }()
	get := func() (int, error) {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			return 0, err
		}
		defer c.Close()
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n")
		_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	boom.Store(true)
	if code, err := get(); err == nil {
		t.Errorf("the request whose lookup panicked was answered %d", code)
	}
	boom.Store(false)
	if code, err := get(); err != nil || code != http.StatusOK {
		t.Fatalf("the next request: %d, %v", code, err)
	}
	if !strings.Contains(logs.String(), "a defect in the membership") {
		t.Errorf("the panic was not logged:\n%s", logs.String())
	}
	waitInUse(t, pool, 0)
}

// A pipelined batch of two projects whose first answer is not plain (it is
// chunked: the exchange is resumed on net/http's path, and the connection
// with it) keeps its order and bodies, and every permit goes back. (From
// the fourth review, which found it sound.)
func TestFastPathPipelinedResume(t *testing.T) {
	r := fastRig(t, rigOpts{poolSize: 4}, func(w http.ResponseWriter, req *http.Request) {
		b, _ := io.ReadAll(req.Body)
		w.Header().Set("Content-Type", "text/plain")
		if strings.HasPrefix(req.URL.Path, "/chunk") {
			w.(http.Flusher).Flush()
		}
		_, _ = io.WriteString(w, req.URL.Path+":"+string(b))
	})
	for i := range 20 {
		c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		reqs := "POST /chunk1 HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nContent-Length: 3\r\n\r\nabc" +
			"GET /plain2 HTTP/1.1\r\nHost: x\r\nFairshare-Project: beta\r\n\r\n" +
			"POST /chunk3 HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nContent-Length: 2\r\n\r\nde" +
			"GET /plain4 HTTP/1.1\r\nHost: x\r\nFairshare-Project: beta\r\n\r\n"
		_, _ = io.WriteString(c, reqs)
		_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
		br := bufio.NewReader(c)
		for _, want := range []string{"/chunk1:abc", "/plain2:", "/chunk3:de", "/plain4:"} {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("round %d, waiting for %s: %v", i, want, err)
			}
			b, _ := io.ReadAll(resp.Body)
			if string(b) != want {
				t.Fatalf("round %d: got %q, want %q", i, b, want)
			}
		}
		c.Close()
	}
	waitInUse(t, r.pool, 0)
}

// An answer head the loop hands over unfinished (past 16 KiB) is waited
// for until UpstreamHeadTimeout from when the request went out, as on
// net/http's path, not for a whole new UpstreamHeadTimeout from the hand-
// over. (The fourth review: the wait began anew, up to twice the bound.)
func TestFastPathResumedHeadBound(t *testing.T) {
	ul := loopbackListen(t)
	go acceptEach(ul, func(c net.Conn) {
		if _, err := http.ReadRequest(bufio.NewReader(c)); err != nil {
			return
		}
		time.Sleep(800 * time.Millisecond)
		head := "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
		for i := 0; len(head) < 20<<10; i++ {
			head += fmt.Sprintf("X-Filler-%d: %s\r\n", i, strings.Repeat("f", 100))
		}
		_, _ = io.WriteString(c, head) // and never the end of it
		_, _ = io.Copy(io.Discard, c)
	})
	r := fastRig(t, rigOpts{cfg: Config{UpstreamHeadTimeout: time.Second}, tweak: func(f *Front) {
		f.up.(*directUpstream).addr = ul.Addr().String()
	}}, ok)
	start := time.Now()
	resp := r.get(t, "alpha", "/")
	readAll(t, resp)
	took := time.Since(start)
	if resp.StatusCode != http.StatusGatewayTimeout || took > 1500*time.Millisecond {
		t.Errorf("%d after %v; want 504 after the 1s bound", resp.StatusCode, took.Round(time.Millisecond))
	}
	waitInUse(t, r.pool, 0)
}
