// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// h2Stall is an h2c client (prior knowledge) that opens streams and never
// gives the server room to answer: its streams' window is window bytes,
// never opened further. It counts the streams the server reset.
type h2Stall struct {
	c      net.Conn
	fr     *http2.Framer
	mu     sync.Mutex
	wmu    sync.Mutex // guards fr's writes
	resets map[uint32]bool
	next   uint32
}

func dialH2Stall(t *testing.T, addr string, window uint32) *h2Stall {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	s := &h2Stall{c: c, fr: http2.NewFramer(c, c), resets: map[uint32]bool{}, next: 1}
	if err := s.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: window}); err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			f, err := s.fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if !f.IsAck() {
					s.wmu.Lock()
					_ = s.fr.WriteSettingsAck()
					s.wmu.Unlock()
				}
			case *http2.RSTStreamFrame:
				s.mu.Lock()
				s.resets[f.StreamID] = true
				s.mu.Unlock()
			}
		}
	}()
	return s
}

// get opens a stream: a GET of path as project.
func (s *h2Stall) get(t *testing.T, project, path string) {
	t.Helper()
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range [][2]string{{":method", "GET"}, {":scheme", "http"}, {":path", path}, {":authority", "x"},
		{strings.ToLower(DefaultProjectHeader), project}} {
		_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if err := s.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: s.next, BlockFragment: hb.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	s.next += 2
}

func (s *h2Stall) reset() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.resets)
}

// TestH2ClosedWindowFreesPool: an h2c client that never opens its streams'
// flow-control window held each stream's permit for as long as it kept the
// connection: the stream's writes wait for the window, the socket never
// blocks, and no deadline fired. Now a write that waits past WriteTimeout
// resets its stream. Streams of windows 0 to 1000 bytes, answers of 64 KiB
// to 256 KiB (past what the server buffers), sent at once or streamed; each time the pool is free again
// within a few WriteTimeouts while the connections stay open, and a
// well-behaved project is served; a stream whose writes keep moving, and
// one that idles longer than WriteTimeout between writes, are not reset.
func TestH2ClosedWindowFreesPool(t *testing.T) {
	for _, fast := range []bool{false, true} {
		t.Run(fmt.Sprintf("fastpath=%v", fast), func(t *testing.T) {
			r := newRig(t, rigOpts{poolSize: 3, cfg: Config{FastPath: fast, WriteTimeout: 300 * time.Millisecond}},
				func(w http.ResponseWriter, req *http.Request) {
					var n int
					var pause time.Duration
					fmt.Sscanf(req.URL.Query().Get("n"), "%d", &n)
					fmt.Sscanf(req.URL.Query().Get("pause"), "%v", &pause)
					if pause > 0 {
						// Idle longer than WriteTimeout between two writes.
						_, _ = io.WriteString(w, "a")
						w.(http.Flusher).Flush()
						time.Sleep(pause)
						_, _ = io.WriteString(w, "b")
						return
					}
					chunk := max(1, n/(1+rand.IntN(8)))
					for left := n; left > 0; left -= chunk {
						if _, err := w.Write(make([]byte, min(chunk, left))); err != nil {
							return
						}
						w.(http.Flusher).Flush()
					}
				})
			addr := strings.TrimPrefix(r.url, "http://")
			rnd := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 2))
			for round := range 6 {
				conns := 1 + rnd.IntN(2)
				var stalls []*h2Stall
				opened := 0
				for range conns {
					s := dialH2Stall(t, addr, uint32(rnd.IntN(1001)))
					stalls = append(stalls, s)
					for range 1 + rnd.IntN(2) {
						if opened < 2 { // beta alone takes the pool less its floor
							s.get(t, "beta", fmt.Sprintf("/?n=%d", 64<<10+rnd.IntN(192<<10)))
							opened++
						}
					}
				}
				waitInUse(t, r.pool, opened)
				start := time.Now()
				waitInUse(t, r.pool, 0)
				d := time.Since(start)
				// The resets reach the client a moment after the
				// permits go back.
				resets := 0
				for end := time.Now().Add(5 * time.Second); resets != opened && time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
					resets = 0
					for _, s := range stalls {
						resets += s.reset()
					}
				}
				if d > 5*time.Second || resets != opened {
					t.Fatalf("round %d: %d stalled streams held the pool %v, %d reset", round, opened, d, resets)
				}
				resp := r.get(t, "alpha", "/?n=100000")
				if b, _ := io.ReadAll(resp.Body); resp.StatusCode != 200 || len(b) != 100000 {
					t.Fatalf("round %d: alpha after the stalls: %d, %d bytes", round, resp.StatusCode, len(b))
				}
				resp.Body.Close()
			}
			// A stream idle between writes for longer than WriteTimeout
			// is not reset: only a write in progress is bounded.
			p := new(http.Protocols)
			p.SetUnencryptedHTTP2(true)
			tr := &http.Transport{Protocols: p}
			defer tr.CloseIdleConnections()
			req, _ := http.NewRequest("GET", r.url+"/?pause=700ms", nil)
			req.Header.Set(DefaultProjectHeader, "alpha")
			resp, err := (&http.Client{Transport: tr, Timeout: limitsDeadline}).Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.ProtoMajor != 2 || string(b) != "ab" || err != nil {
				t.Fatalf("a stream idle between writes: HTTP/%d %q %v, want HTTP/2 \"ab\"", resp.ProtoMajor, b, err)
			}
		})
	}
}

// TestH2EarlyAnswerEndsAtOnce: over HTTP/2 through ReverseProxy, an upstream
// that answers while the client's body is still open (a gRPC call it ends,
// an early error during an upload) ends the exchange at once. The timed
// body's Close waited for the Read in progress, ReverseProxy's sender
// waiting on a client with nothing to say, until body_read_timeout: the
// end of the answer, and the permit, were held that long. (The direct
// path does not relay an HTTP/2 answer before the body ends: there the
// client gets 408 at body_read_timeout, as before.)
func TestH2EarlyAnswerEndsAtOnce(t *testing.T) {
	r := newRig(t, rigOpts{poolSize: 4, tweak: func(f *Front) { f.up = nil }, cfg: Config{BodyReadTimeout: 5 * time.Second}},
		func(w http.ResponseWriter, req *http.Request) {
			_, _ = io.WriteString(w, "done early")
		})
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: p}
	defer tr.CloseIdleConnections()
	for round := range 3 {
		pr, pw := io.Pipe()
		defer pw.Close()
		go func() { _, _ = pw.Write([]byte("the start of a long upload")) }()
		req, _ := http.NewRequest("POST", r.url+"/", pr)
		req.Header.Set(DefaultProjectHeader, "alpha")
		start := time.Now()
		resp, err := (&http.Client{Transport: tr, Timeout: limitsDeadline}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		d := time.Since(start)
		if err != nil || string(b) != "done early" || resp.ProtoMajor != 2 {
			t.Fatalf("round %d: HTTP/%d %q %v", round, resp.ProtoMajor, b, err)
		}
		waitInUse(t, r.pool, 0)
		freed := time.Since(start)
		if d > 2*time.Second || freed > 2*time.Second {
			t.Errorf("round %d: the answer ended after %v, the permit went back after %v (body_read_timeout 5s)", round, d, freed)
		}
	}
}
