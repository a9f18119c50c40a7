// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
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
	time.Sleep(1500 * time.Millisecond)
	if n := r.pool.Snapshot().InUse; n != 0 {
		t.Errorf("permit held %d after 1.5s with WriteTimeout 300ms, IdleTimeout 600ms", n)
	}
}
