// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// The bounds these tests set are small; what they check is that a request
// ends within a few of them, with a deadline that only stops a hang from
// hanging the suite.
const limitsDeadline = 10 * time.Second

// TestSlowBodyFreesPool (the review's case): two requests of beta that send
// one byte of a 100-byte body and stall hold the whole pool of 2; once a
// read of their body has waited BodyReadTimeout they are answered 408 and
// their permits go back, so alpha, refused meanwhile, is served. On both
// paths.
func TestSlowBodyFreesPool(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		r := newRig(t, rigOpts{poolSize: 2, tweak: tweak, cfg: Config{BodyReadTimeout: 300 * time.Millisecond}},
			func(w http.ResponseWriter, req *http.Request) {
				if _, err := io.Copy(io.Discard, req.Body); err == nil {
					_, _ = io.WriteString(w, "ok")
				}
			})
		answers := slowPosts(t, r, 0)
		waitInUse(t, r.pool, 2)
		start := time.Now()
		if resp := r.get(t, "alpha", "/"); resp.StatusCode != http.StatusTooManyRequests {
			t.Errorf("alpha while beta holds the pool: %d, want 429", resp.StatusCode)
		}
		waitInUse(t, r.pool, 0)
		if resp := r.get(t, "alpha", "/"); resp.StatusCode != http.StatusOK {
			t.Errorf("alpha after beta's bodies stalled: %d, want 200", resp.StatusCode)
		}
		t.Logf("the pool was free %v after alpha's refusal", time.Since(start))
		for range 2 {
			if got := <-answers; !strings.HasPrefix(got, "408") {
				t.Errorf("a stalled body was answered %q, want 408", got)
			}
		}
	})
}

// TestTrickledBodyFreesPool: a client that sends one byte of its body just
// before each read's timeout holds its permit only until its body falls
// below BodyMinRate on average (counted from BodyReadTimeout after
// admission): a hostile review held a pool of 2 for good with a byte every
// 200 ms under a 300 ms read timeout. On both paths.
func TestTrickledBodyFreesPool(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		r := newRig(t, rigOpts{poolSize: 2, tweak: tweak,
			cfg: Config{BodyReadTimeout: 300 * time.Millisecond, BodyMinRate: 100}},
			func(w http.ResponseWriter, req *http.Request) {
				if _, err := io.Copy(io.Discard, req.Body); err == nil {
					_, _ = io.WriteString(w, "ok")
				}
			})
		answers := slowPosts(t, r, 200*time.Millisecond) // 5 bytes/s: never a read's timeout
		waitInUse(t, r.pool, 2)
		start := time.Now()
		waitInUse(t, r.pool, 0)
		t.Logf("the pool was free %v after the trickles began", time.Since(start))
		if resp := r.get(t, "alpha", "/"); resp.StatusCode != http.StatusOK {
			t.Errorf("alpha after beta's bodies trickled: %d, want 200", resp.StatusCode)
		}
		for range 2 {
			if got := <-answers; !strings.HasPrefix(got, "408") {
				t.Errorf("a trickled body was answered %q, want 408", got)
			}
		}
	})
}

// slowPosts sends two POSTs of beta's with a body of 1000 bytes of which
// one is sent at once, then one byte every trickle (0: none), and returns
// the status lines (or errors) they get.
func slowPosts(t *testing.T, r *rig, trickle time.Duration) <-chan string {
	t.Helper()
	answers := make(chan string, 2)
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	for range 2 {
		c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_, _ = io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nFairshare-Project: beta\r\nContent-Length: 1000\r\n\r\nx")
		if trickle > 0 {
			go func() {
				for {
					select {
					case <-stop:
						return
					case <-time.After(trickle):
						if _, err := io.WriteString(c, "x"); err != nil {
							return
						}
					}
				}
			}()
		}
		go func() {
			_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				answers <- err.Error()
				return
			}
			answers <- resp.Status
		}()
	}
	return answers
}

// TestSlowReaderFreesPool: a client that does not read a large answer holds
// its request only until a write to it has waited WriteTimeout: then its
// connection is closed and its permit goes back. On both paths.
func TestSlowReaderFreesPool(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		chunk := strings.Repeat("a", 64<<10)
		r := newRig(t, rigOpts{poolSize: 2, tweak: tweak, cfg: Config{WriteTimeout: 300 * time.Millisecond}},
			func(w http.ResponseWriter, req *http.Request) {
				for i := 0; i < 1024 && req.Context().Err() == nil; i++ { // 64 MiB at most
					if _, err := io.WriteString(w, chunk); err != nil {
						return
					}
				}
			})
		c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.(*net.TCPConn).SetReadBuffer(4 << 10)
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: beta\r\n\r\n")
		waitInUse(t, r.pool, 1)
		start := time.Now()
		waitInUse(t, r.pool, 0)
		t.Logf("permit back %v after the request was admitted", time.Since(start))
	})
}

// TestUpstreamHeadTimeout: an upstream that has not begun its answer
// UpstreamHeadTimeout after the whole request went out costs the client a
// 504, on both paths, for a GET and for a POST whose body takes longer
// than the bound to arrive (the wait starts when it is all out).
func TestUpstreamHeadTimeout(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		release := make(chan struct{})
		t.Cleanup(func() { close(release) })
		r := newRig(t, rigOpts{tweak: tweak, cfg: Config{UpstreamHeadTimeout: 300 * time.Millisecond}},
			func(w http.ResponseWriter, req *http.Request) {
				b, _ := io.ReadAll(req.Body)
				if string(b) == "slow" {
					_, _ = io.WriteString(w, "ok")
					return
				}
				select {
				case <-release:
				case <-req.Context().Done():
				}
			})
		r.client.Timeout = limitsDeadline
		start := time.Now()
		resp := r.get(t, "alpha", "/")
		if resp.StatusCode != http.StatusGatewayTimeout {
			t.Errorf("silent upstream: %d, want 504", resp.StatusCode)
		}
		if d := time.Since(start); d > limitsDeadline/2 {
			t.Errorf("504 after %v", d)
		}
		waitInUse(t, r.pool, 0)
		// A body that takes 600ms to arrive, then a prompt answer.
		pr, pw := io.Pipe()
		go func() {
			_, _ = io.WriteString(pw, "sl")
			time.Sleep(600 * time.Millisecond)
			_, _ = io.WriteString(pw, "ow")
			pw.Close()
		}()
		req, _ := http.NewRequest("POST", r.url, pr)
		req.Header.Set(DefaultProjectHeader, "alpha")
		resp, err := r.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if body := readAll(t, resp); resp.StatusCode != 200 || body != "ok" {
			t.Errorf("slow body, prompt answer: %d %q", resp.StatusCode, body)
		}
	})
}

// TestTunnelBounded: an upgraded connection (the upstream switches
// to WebSocket and echoes) holds its request's permit for TunnelTimeout at
// most, then both ends are closed and the permit goes back.
func TestTunnelBounded(t *testing.T) {
	r := newRig(t, rigOpts{cfg: Config{TunnelTimeout: 400 * time.Millisecond}}, func(w http.ResponseWriter, req *http.Request) {
		if req.Header.Get("Upgrade") != "websocket" {
			http.Error(w, "no", http.StatusBadRequest)
			return
		}
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		_, _ = io.Copy(c, brw)
	})
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(limitsDeadline))
	_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("upgrade: %v %v", resp, err)
	}
	start := time.Now()
	_, _ = io.WriteString(c, "ping\n")
	if line, err := br.ReadString('\n'); err != nil || line != "ping\n" {
		t.Fatalf("echo through the tunnel: %q %v", line, err)
	}
	if n := r.pool.Snapshot().InUse; n != 1 {
		t.Errorf("the tunnel holds %d permits, want 1", n)
	}
	// It keeps talking; the tunnel closes all the same.
	for {
		if _, err := io.WriteString(c, "ping\n"); err != nil {
			break
		}
		if _, err := br.ReadString('\n'); err != nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	d := time.Since(start)
	waitInUse(t, r.pool, 0)
	if d > limitsDeadline/2 {
		t.Errorf("the tunnel lasted %v", d)
	}
	t.Logf("the tunnel closed after %v", d)
}

// TestEarlyAnswerThenSilentBody: the upstream answers a POST before reading
// its body and drops the connection (an error page, a reset), the client
// reads the answer, sends a little more of its body and goes silent with
// its connection open. net/http's Close of a body not read to its end reads
// up to 256 KiB more of it, and did so with no deadline once a read had
// lifted the body's: the handler never returned and its permit was held for
// as long as the client kept the connection. Now the body's Close is
// bounded by BodyReadTimeout. On every path, with the upstream resetting,
// closing or only not reading, the client's extra bytes sent at random
// moments; the pool of 1 is free again each time.
func TestEarlyAnswerThenSilentBody(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		var mode atomic.Int32
		r := newRig(t, rigOpts{poolSize: 1, tweak: tweak, cfg: Config{BodyReadTimeout: 200 * time.Millisecond}},
			func(w http.ResponseWriter, req *http.Request) {
				m := mode.Load()
				if m == 2 {
					// Answer, never read: net/http discards at most 256 KiB
					// after the handler, and the body is larger.
					w.WriteHeader(http.StatusNotFound)
					return
				}
				c, _, err := http.NewResponseController(w).Hijack()
				if err != nil {
					return
				}
				_, _ = io.WriteString(c, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
				if tc, ok := c.(*net.TCPConn); ok && m == 0 {
					_ = tc.SetLinger(0) // a reset
				}
				c.Close()
			})
		rnd := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
		for round := range 12 {
			mode.Store(int32(round % 3))
			c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
			if err != nil {
				t.Fatal(err)
			}
			// What is left of the body after the client stops is under
			// the 256 KiB net/http's Close reads to keep the connection.
			first, extra := rnd.IntN(64<<10), 1+rnd.IntN(4096)
			fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\nFairshare-Project: beta\r\nContent-Length: %d\r\n\r\n",
				first+extra+1+rnd.IntN(200<<10))
			_, _ = c.Write(make([]byte, first))
			_ = c.SetReadDeadline(time.Now().Add(limitsDeadline))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
			resp.Body.Close()
			time.Sleep(time.Duration(rnd.IntN(50)) * time.Millisecond)
			_, _ = c.Write(make([]byte, extra))
			// Silent from here, the connection open.
			start := time.Now()
			waitInUse(t, r.pool, 0)
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("round %d: the permit was held %v after the client went silent", round, d)
			}
			c.Close()
		}
		if resp := r.get(t, "alpha", "/"); resp.StatusCode != http.StatusNotFound {
			t.Errorf("alpha after the rounds: %d, want the upstream's 404", resp.StatusCode)
		}
	})
}

// TestTunnelBoundedSilentClient: the tunnel's upstream side ends first (a
// WebSocket's close answered and the upstream gone), and the client keeps
// its connection open and says nothing more. ReverseProxy closed only the
// upstream's end at TunnelTimeout and went on waiting for the client, so
// the tunnel held its permit for as long as the client liked. Now the
// client's connection is closed at TunnelTimeout too. With the client
// silent from the start, after a word, and after the upstream's close.
func TestTunnelBoundedSilentClient(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) { tunnelSilentClient(t, tweak) })
}

func tunnelSilentClient(t *testing.T, tweak func(*Front)) {
	r := newRig(t, rigOpts{tweak: tweak, cfg: Config{TunnelTimeout: 400 * time.Millisecond}}, func(w http.ResponseWriter, req *http.Request) {
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = io.WriteString(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
		if req.URL.Path == "/closer" {
			// Answers one line, then closes.
			if line, err := brw.ReadString('\n'); err == nil {
				_, _ = io.WriteString(c, line)
			}
			return
		}
		_, _ = io.Copy(c, brw)
	})
	for _, tc := range []struct{ path, say string }{{"/echo", ""}, {"/echo", "hi\n"}, {"/closer", "bye\n"}} {
		c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		_ = c.SetDeadline(time.Now().Add(limitsDeadline))
		fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", tc.path)
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
			t.Fatalf("%v: upgrade: %v %v", tc, resp, err)
		}
		start := time.Now()
		if tc.say != "" {
			_, _ = io.WriteString(c, tc.say)
			if line, err := br.ReadString('\n'); err != nil || line != tc.say {
				t.Fatalf("%v: through the tunnel: %q %v", tc, line, err)
			}
		}
		// Silent from here; the front must end the tunnel.
		_, err = br.ReadString('\n')
		d := time.Since(start)
		waitInUse(t, r.pool, 0)
		if err == nil || d > limitsDeadline/2 {
			t.Errorf("%v: the tunnel lasted %v (%v)", tc, d, err)
		}
		t.Logf("%v: the tunnel closed after %v", tc, d)
		c.Close()
	}
}
