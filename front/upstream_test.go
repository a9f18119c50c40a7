// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// seen is what the upstream received.
type seen struct {
	method, uri, host string
	header            http.Header
}

// TestDirectMatchesReverseProxy sends the same GET through the direct path
// and through ReverseProxy (a twin front with the direct path off) and
// compares what the upstream received and what the client got back:
// hop-by-hop headers stripped both ways, X-Forwarded-*, the project header
// withheld, trailers, the front's own headers.
func TestDirectMatchesReverseProxy(t *testing.T) {
	var (
		mu  sync.Mutex
		got []seen
	)
	r := newRig(t, rigOpts{}, func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		got = append(got, seen{req.Method, req.RequestURI, req.Host, req.Header.Clone()})
		mu.Unlock()
		w.Header().Set("Connection", "X-Resp-Hop")
		w.Header().Set("X-Resp-Hop", "1")
		w.Header().Set("X-End", "2")
		w.Header().Set("Trailer", "X-Sum")
		w.Header().Set(DefaultCostHeader, "3")
		_, _ = io.WriteString(w, "body\n")
		w.Header().Set("X-Sum", "42")
	})
	twin, err := New(r.front.Config(), r.front.deps)
	if err != nil {
		t.Fatal(err)
	}
	twin.up = nil
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := twin.Server()
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close(); twin.CloseIdle() })

	type answer struct {
		status          int
		header, trailer http.Header
		body            string
	}
	do := func(base string) answer {
		req, _ := http.NewRequest("GET", base+"/a/b%2Fc?q=1&r=2", nil)
		req.Header.Set(DefaultProjectHeader, "alpha")
		req.Header.Set("Connection", "X-Hop")
		req.Header.Set("X-Hop", "1")
		req.Header.Set("Keep-Alive", "timeout=5")
		req.Header.Set("Proxy-Authorization", "secret")
		req.Header.Set("Forwarded", "for=192.0.2.9")
		req.Header.Set("X-Forwarded-Host", "spoofed")
		req.Header.Add("X-Forwarded-For", "192.0.2.7")
		req.Header.Add("X-Multi", "a")
		req.Header.Add("X-Multi", "b")
		req.Header.Set("Accept-Encoding", "identity")
		resp, err := r.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body := readAll(t, resp)
		resp.Header.Del("Date")
		return answer{resp.StatusCode, resp.Header, resp.Trailer, body}
	}
	direct := do(r.url)
	viaProxy := do("http://" + l.Addr().String())
	if len(got) != 2 {
		t.Fatalf("upstream saw %d requests", len(got))
	}
	// The two fronts listen on different ports, and queue waits differ.
	got[1].host = got[0].host
	got[1].header.Set("X-Forwarded-Host", got[0].header.Get("X-Forwarded-Host"))
	viaProxy.header.Set(HeaderQueueWait, direct.header.Get(HeaderQueueWait))
	if got[0].method != got[1].method || got[0].uri != got[1].uri || got[0].host != got[1].host {
		t.Errorf("request line: direct %+v, proxy %+v", got[0], got[1])
	}
	if !equalHeader(got[0].header, got[1].header) {
		t.Errorf("upstream saw\n direct %v\n proxy  %v", got[0].header, got[1].header)
	}
	for _, k := range []string{"X-Hop", "Keep-Alive", "Proxy-Authorization", "Forwarded", DefaultProjectHeader} {
		if v := got[0].header.Get(k); v != "" {
			t.Errorf("direct path passed %s: %q", k, v)
		}
	}
	if v := got[0].header.Get("X-Forwarded-For"); v != "127.0.0.1" {
		t.Errorf("X-Forwarded-For %q", v)
	}
	if direct.status != viaProxy.status || direct.body != viaProxy.body || !equalHeader(direct.header, viaProxy.header) ||
		!equalHeader(direct.trailer, viaProxy.trailer) {
		t.Errorf("client got\n direct %+v\n proxy  %+v", direct, viaProxy)
	}
	if direct.header.Get("X-Resp-Hop") != "" || direct.header.Get(DefaultCostHeader) != "" || direct.trailer.Get("X-Sum") != "42" ||
		direct.header.Get(HeaderClass) == "" {
		t.Errorf("direct answer: %+v", direct)
	}
	// The direct path kept its connection for the next request.
	r.front.up.mu.Lock()
	conns := len(r.front.up.idle)
	r.front.up.mu.Unlock()
	if conns != 1 {
		t.Errorf("%d idle upstream connections after one request, want 1", conns)
	}
}

func equalHeader(a, b http.Header) bool {
	return maps.EqualFunc(a, b, func(x, y []string) bool { return slices.Equal(x, y) })
}

// TestDirectStreams passes each piece of a GET answer of unknown length on
// as it arrives.
func TestDirectStreams(t *testing.T) {
	next := make(chan struct{})
	r := newRig(t, rigOpts{}, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = io.WriteString(w, "first\n")
		w.(http.Flusher).Flush()
		<-next
		_, _ = io.WriteString(w, "second\n")
	})
	resp := r.get(t, "alpha", "/")
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || line != "first\n" {
		t.Fatalf("first line %q, %v", line, err)
	}
	close(next)
	rest, _ := io.ReadAll(br)
	if string(rest) != "second\n" {
		t.Errorf("rest %q", rest)
	}
	waitInUse(t, r.pool, 0)
}

// TestDirectStaleConnection: an upstream that closes a kept-alive connection
// while it is idle (without Connection: close) costs the next request
// nothing: it goes again on a fresh connection.
func TestDirectStaleConnection(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	var accepted sync.WaitGroup
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			go func() {
				defer accepted.Done()
				defer c.Close()
				// One answer, as if keeping the connection, then hang up.
				br := bufio.NewReader(c)
				if _, err := http.ReadRequest(br); err != nil {
					return
				}
				_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
				time.Sleep(20 * time.Millisecond)
			}()
		}
	}()
	f, err := New(Config{Upstream: "http://" + l.Addr().String(), TrustedPeers: []string{"127.0.0.1"}}, Deps{})
	if err != nil {
		t.Fatal(err)
	}
	fl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := f.Server()
	go func() { _ = srv.Serve(fl) }()
	t.Cleanup(func() { _ = srv.Close(); f.CloseIdle() })
	client := &http.Client{Transport: &http.Transport{}}
	for i := range 3 {
		req, _ := http.NewRequest("GET", "http://"+fl.Addr().String()+"/", nil)
		req.Header.Set(DefaultProjectHeader, "alpha")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || string(body) != "ok\n" {
			t.Errorf("request %d: %d %q", i, resp.StatusCode, body)
		}
		time.Sleep(50 * time.Millisecond) // the upstream hangs up meanwhile
	}
}

// TestDirect1xx passes an informational answer (103 Early Hints) on to the
// client before the final one.
func TestDirect1xx(t *testing.T) {
	r := newRig(t, rigOpts{}, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		_, _ = io.WriteString(w, "ok\n")
	})
	var hints []string
	trace := &httptrace.ClientTrace{Got1xxResponse: func(_ int, h textproto.MIMEHeader) error {
		hints = append(hints, strings.Join(h["Link"], ","))
		return nil
	}}
	req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(t.Context(), trace), "GET", r.url, nil)
	req.Header.Set(DefaultProjectHeader, "alpha")
	resp, err := r.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); body != "ok\n" || resp.Header.Get("Link") != "" {
		t.Errorf("final answer %q, Link %q", body, resp.Header.Get("Link"))
	}
	if len(hints) != 1 || hints[0] != "</style.css>; rel=preload" {
		t.Errorf("hints %q", hints)
	}
}
