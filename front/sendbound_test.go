// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/pools"
)

// fallbackRig is a front on the fallback path (http.Transport) to an
// upstream over HTTP/1.1 or h2c, served as the daemon serves it.
type fallbackRig struct {
	addr string
	pool *pools.Pool
	f    *Front
}

func newFallbackRig(t *testing.T, h2c bool, cfg Config, upstream http.HandlerFunc) *fallbackRig {
	t.Helper()
	up := httptest.NewUnstartedServer(upstream)
	if h2c {
		up.Config.Protocols = new(http.Protocols)
		up.Config.Protocols.SetHTTP1(true)
		up.Config.Protocols.SetUnencryptedHTTP2(true)
	}
	up.Start()
	t.Cleanup(up.Close)
	r := &fallbackRig{}
	var err error
	if r.pool, err = pools.New(pools.Config{Name: "requests", Size: 4}, nil); err != nil {
		t.Fatal(err)
	}
	cfg.Upstream = up.URL
	cfg.UpstreamH2C = h2c
	cfg.TrustedPeers = []string{"127.0.0.0/8"}
	logs := &logBuffer{}
	if r.f, err = New(cfg, Deps{Requests: r.pool, Log: logs.logger()}); err != nil {
		t.Fatal(err)
	}
	r.f.up = nil // HTTP/1.1 too goes through http.Transport
	t.Cleanup(r.f.CloseIdle)
	srv := httptest.NewServer(r.f)
	t.Cleanup(srv.Close)
	r.addr = strings.TrimPrefix(srv.URL, "http://")
	return r
}

// postBody connects to addr and sends, from a goroutine of its own, a POST
// of beta's with a body of size zero bytes, which the other end may never
// take.
func postBody(t *testing.T, addr string, size int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		_, _ = fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\n%s: beta\r\nContent-Length: %d\r\n\r\n", DefaultProjectHeader, size)
		_, _ = c.Write(make([]byte, size))
	}()
	return c
}

// TestFallbackSendBound: on the fallback path, an upstream that stops
// taking a request body is bounded by WriteTimeout, as on the direct path
// and the fast path: one that never answers gets the client a 504, one
// that answered early has the answer cut, and the permit comes back
// either way, over HTTP/1.1 and over h2c (where the upstream stops by
// granting no flow-control window). Random body sizes past what the
// sockets' buffers and the h2c windows hold, with UpstreamReadTimeout off
// so that only the send's bound can end the exchange. Before, http.Transport
// wrote the body with no bound at all: the exchange held its permit and
// its place for as long as the upstream kept the connection open.
func TestFallbackSendBound(t *testing.T) {
	const bound = 300 * time.Millisecond
	for _, h2c := range []bool{false, true} {
		for _, early := range []bool{false, true} {
			t.Run(fmt.Sprintf("h2c=%v/early=%v", h2c, early), func(t *testing.T) {
				done := make(chan struct{})
				r := newFallbackRig(t, h2c, Config{WriteTimeout: bound, UpstreamReadTimeout: -1},
					func(w http.ResponseWriter, _ *http.Request) {
						if early {
							w.Header().Set("Content-Length", "100")
							w.WriteHeader(http.StatusOK)
							_, _ = io.WriteString(w, "x")
							_ = http.NewResponseController(w).Flush()
						}
						<-done // reads nothing of the body, sends nothing more
					})
				t.Cleanup(func() { close(done) }) // before the upstream's Close waits for its handlers
				for round := range 4 {
					// Past the sockets' buffers; over h2c also just past
					// the upstream's window (1 MiB), where the last piece
					// is what waits (it went untimed).
					size := 8<<20 + rand.IntN(8<<20)
					if h2c && round%2 == 1 {
						size = 1<<20 + 1 + rand.IntN(64<<10)
					}
					c := postBody(t, r.addr, size)
					waitInUse(t, r.pool, 1)
					start := time.Now()
					waitInUse(t, r.pool, 0)
					if d := time.Since(start); d > limitsDeadline/2 {
						t.Errorf("round %d: the exchange held its permit %v, want about WriteTimeout (%v)", round, d, bound)
					}
					_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
					resp, err := http.ReadResponse(bufio.NewReader(c), nil)
					switch {
					case err != nil && !early:
						t.Errorf("round %d: no answer: %v", round, err)
					case err != nil:
						// Cut before its head reached the client (HTTP/1.1's
						// is buffered): nothing, or a reset, to read.
					case !early && resp.StatusCode != http.StatusGatewayTimeout:
						t.Errorf("round %d: status %d, want 504", round, resp.StatusCode)
					case early:
						if n, err := io.Copy(io.Discard, resp.Body); err == nil || n >= 100 {
							t.Errorf("round %d: the early answer was not cut: %d bytes, %v", round, n, err)
						}
					}
					c.Close()
					if n := outcomeCount(t, r.f, "beta", "error"); n != float64(round+1) {
						t.Errorf("round %d: %v errors counted, want %d (the upstream's stall, not the client's)", round, n, round+1)
					}
				}
			})
		}
	}
}

// TestFallbackSlowClientBodyNotBlamed: the send's bound counts only the
// upstream's time: a client that pauses twice WriteTimeout between pieces
// of its body (within BodyReadTimeout) has its request served whole on the
// fallback path, over HTTP/1.1 and h2c.
func TestFallbackSlowClientBodyNotBlamed(t *testing.T) {
	const bound = 200 * time.Millisecond
	for _, h2c := range []bool{false, true} {
		t.Run(fmt.Sprintf("h2c=%v", h2c), func(t *testing.T) {
			r := newFallbackRig(t, h2c, Config{WriteTimeout: bound, BodyReadTimeout: 20 * bound},
				func(w http.ResponseWriter, req *http.Request) {
					n, err := io.Copy(io.Discard, req.Body)
					fmt.Fprintf(w, "%d %v", n, err)
				})
			const pieces, piece = 4, 1000
			c, err := net.Dial("tcp", r.addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\n%s: beta\r\nContent-Length: %d\r\n\r\n", DefaultProjectHeader, pieces*piece)
			for range pieces {
				time.Sleep(2 * bound)
				if _, err := c.Write(make([]byte, piece)); err != nil {
					t.Fatal(err)
				}
			}
			_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			if want := fmt.Sprintf("%d <nil>", pieces*piece); resp.StatusCode != http.StatusOK || string(b) != want {
				t.Errorf("a slow client got %d %q, want 200 %q", resp.StatusCode, b, want)
			}
			waitInUse(t, r.pool, 0)
		})
	}
}

// TestFallbackH2EarlyRefusalNotCut: an h2c upstream that refuses at once
// (403) without reading a large request body, and sends its answer slowly,
// over longer than WriteTimeout: http.Transport drops the body (an answer
// of 300 or more), so the request is out and its bound over; the answer is
// relayed whole. (The watch stayed armed, behind ReverseProxy's Close that
// does nothing, and cut the answer at WriteTimeout.)
func TestFallbackH2EarlyRefusalNotCut(t *testing.T) {
	const bound = 300 * time.Millisecond
	r := newFallbackRig(t, true, Config{WriteTimeout: bound, UpstreamReadTimeout: -1},
		func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Length", "20")
			w.WriteHeader(http.StatusForbidden)
			for range 20 {
				_, _ = io.WriteString(w, "x")
				_ = http.NewResponseController(w).Flush()
				time.Sleep(3 * bound / 20 * 2)
			}
		})
	for round := range 2 {
		size := 8<<20 + rand.IntN(8<<20)
		c := postBody(t, r.addr, size)
		_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		b, err := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusForbidden || len(b) != 20 || err != nil {
			t.Errorf("round %d: %d, %d bytes of 20, %v; want the refusal whole", round, resp.StatusCode, len(b), err)
		}
		c.Close()
		waitInUse(t, r.pool, 0)
	}
}

// TestFallbackH2SlowSteadyUpstream: an h2c upstream that reads a request
// body slowly but steadily (32 KiB every 50 ms, each piece well within
// WriteTimeout) is served, on a connection whose SETTINGS let the
// transport take 512 KiB pieces of the body at once: each counted out only
// once the whole had a window, which took longer than WriteTimeout and was
// a 504.
func TestFallbackH2SlowSteadyUpstream(t *testing.T) {
	const bound = 300 * time.Millisecond
	r := newFallbackRig(t, true, Config{WriteTimeout: bound, UpstreamReadTimeout: -1},
		func(w http.ResponseWriter, req *http.Request) {
			n, buf := 0, make([]byte, 32<<10)
			for {
				m, err := io.ReadFull(req.Body, buf)
				n += m
				if err != nil {
					break
				}
				time.Sleep(50 * time.Millisecond)
			}
			fmt.Fprintf(w, "%d", n)
		})
	post := func(size int) (int, string) {
		c := postBody(t, r.addr, size)
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(3 * limitsDeadline))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	post(1) // the connection up, its SETTINGS in
	size := 3<<19 + rand.IntN(64<<10)
	if code, body := post(size); code != http.StatusOK || body != fmt.Sprint(size) {
		t.Errorf("a slow, steady upstream: %d %q, want 200 %d", code, body, size)
	}
	waitInUse(t, r.pool, 0)
}

// deadlineConn records its read deadlines' settings.
type deadlineConn struct {
	net.Conn
	sets int
}

func (c *deadlineConn) SetReadDeadline(time.Time) error { c.sets++; return nil }

// TestTimedBodyReadAfterClose: http.Transport's writer goes on reading a
// request body past the handler's end while its connection takes it. A
// Read after the handler closed the body touches neither the body nor the
// server's deadline (an HTTP/2 stream's deadline setter, its state freed
// with the handler, panicked on a nil pointer and killed the process: CI,
// under the fallback path's send bound), and a second Close does nothing.
func TestTimedBodyReadAfterClose(t *testing.T) {
	for _, h2 := range []bool{false, true} {
		c := &deadlineConn{}
		b := &timedBody{ReadCloser: io.NopCloser(strings.NewReader("some body")), d: time.Second, start: time.Now(), conn: c, h2: h2}
		if n, err := b.Read(make([]byte, 4)); n != 4 || err != nil {
			t.Fatalf("h2 %v: read before Close: %d %v", h2, n, err)
		}
		if err := b.Close(); err != nil {
			t.Fatal(err)
		}
		sets := c.sets
		if n, err := b.Read(make([]byte, 4)); n != 0 || err != http.ErrBodyReadAfterClose {
			t.Errorf("h2 %v: read after Close: %d %v, want 0 and ErrBodyReadAfterClose", h2, n, err)
		}
		_ = b.Close()
		if c.sets != sets {
			t.Errorf("h2 %v: the deadline was set %d times after Close", h2, c.sets-sets)
		}
	}
}
