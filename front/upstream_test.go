// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"io"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
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

// trailedAnswer is an upstream answer with a Connection field and a
// trailer, which http.ReadResponse parses on the direct path.
func trailedAnswer(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Connection", "X-Resp-Hop")
	w.Header().Set("X-Resp-Hop", "1")
	w.Header().Set("X-End", "2")
	w.Header().Set("Trailer", "X-Sum")
	w.Header().Set(DefaultCostHeader, "3")
	_, _ = io.WriteString(w, "body\n")
	w.Header().Set("X-Sum", "42")
}

// plainAnswer is an upstream answer with a plain head (see plainHead): a
// hop-by-hop field, a field name not in canonical form, the cost and
// refusal fields the front consumes.
func plainAnswer(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Keep-Alive", "timeout=5")
	w.Header()["x-lower"] = []string{"v"}
	w.Header().Set("X-End", "2")
	w.Header().Set(DefaultCostHeader, "3")
	w.Header().Set(HeaderRefused, "share")
	w.Header().Set("Content-Type", "text/plain")
	w.Header().Set("Content-Length", "5")
	_, _ = io.WriteString(w, "body\n")
}

// TestDirectMatchesReverseProxy sends the same GET through the direct path
// and through ReverseProxy (a twin front with the direct path off) and
// compares what the upstream received and what the client got back:
// hop-by-hop headers stripped both ways, X-Forwarded-*, the project header
// withheld, trailers, the front's own headers; for an answer parsed by
// http.ReadResponse and for a plain one.
func TestDirectMatchesReverseProxy(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer http.HandlerFunc
	}{{"trailed", trailedAnswer}, {"plain", plainAnswer}} {
		t.Run(tc.name, func(t *testing.T) { testDirectMatchesReverseProxy(t, tc.answer) })
	}
}

func testDirectMatchesReverseProxy(t *testing.T, upstream http.HandlerFunc) {
	var (
		mu  sync.Mutex
		got []seen
	)
	r := newRig(t, rigOpts{}, func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		got = append(got, seen{req.Method, req.RequestURI, req.Host, req.Header.Clone()})
		mu.Unlock()
		upstream(w, req)
	})
	twin, err := New(r.front.Config(), r.front.deps)
	if err != nil {
		t.Fatal(err)
	}
	twin.up = nil
	// One request at a time: the fallback may keep its connection here (it
	// does not in the front, TestHostileConcurrent), so that the upstream's
	// answer does not change with a Connection: close.
	twin.tr.DisableKeepAlives = false
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
	if direct.header.Get("X-Resp-Hop") != "" || direct.header.Get("Keep-Alive") != "" || direct.header.Get(DefaultCostHeader) != "" ||
		direct.header.Get(HeaderRefused) != "" || direct.header.Get("X-End") != "2" || direct.header.Get(HeaderClass) == "" ||
		direct.body != "body\n" {
		t.Errorf("direct answer: %+v", direct)
	}
	if direct.header.Get("Trailer") != "" && direct.trailer.Get("X-Sum") != "42" {
		t.Errorf("direct answer announced a trailer and sent %v", direct.trailer)
	}
	// The direct path kept its connection for the next request.
	d := r.front.up.(*directUpstream)
	d.mu.Lock()
	conns := len(d.idle)
	d.mu.Unlock()
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

// TestPlainHead parses what a net/http upstream sends as a plain head, and
// leaves every other head unread and the client's header untouched.
func TestPlainHead(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(plainAnswer))
	t.Cleanup(srv.Close)
	c, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	if _, err := br.Peek(1); err != nil {
		t.Fatal(err)
	}
	for br.Buffered() < 10 || !strings.Contains(peekAll(br), "\r\n\r\nbody\n") {
		// The head and body of this small answer come in one write;
		// wait until they are all buffered.
		if _, err := br.Peek(br.Buffered() + 1); err != nil {
			t.Fatalf("reading the answer: %v (have %q)", err, peekAll(br))
		}
	}
	if raw := peekAll(br); !strings.Contains(raw, "\r\nKeep-Alive: timeout=5\r\n") {
		t.Fatalf("the upstream sent no hop-by-hop field to drop: %q", raw)
	}
	dst := http.Header{}
	status, n, ok := plainHead(br, http.MethodGet, dst)
	if !ok || status != 200 || n != 5 {
		t.Fatalf("net/http answer %q: plain %v, status %d, length %d", peekAll(br), ok, status, n)
	}
	if rest := peekAll(br); rest != "body\n" {
		t.Errorf("left after the head: %q", rest)
	}
	want := http.Header{"X-Lower": {"v"}, "X-End": {"2"}, DefaultCostHeader: {"3"}, HeaderRefused: {"share"},
		"Content-Type": {"text/plain"}, "Content-Length": {"5"}, "Date": dst["Date"]}
	if dst.Get("Date") == "" || !equalHeader(dst, want) {
		t.Errorf("fields %v, want %v", dst, want)
	}

	const ok200 = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: 1\r\n\r\nok"
	for _, tc := range []struct {
		name, head, method string
		dst                http.Header
	}{
		{"HEAD", ok200, http.MethodHead, nil},
		{"client header not empty", ok200, http.MethodGet, http.Header{"X-B": {"2"}}},
		{"head not all buffered", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", http.MethodGet, nil},
		{"HTTP/1.0", "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", http.MethodGet, nil},
		{"1xx", "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n", http.MethodGet, nil},
		{"204", "HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n", http.MethodGet, nil},
		{"304", "HTTP/1.1 304 Not Modified\r\nContent-Length: 2\r\n\r\n", http.MethodGet, nil},
		{"status not 3 digits", "HTTP/1.1 2000 OK\r\nContent-Length: 2\r\n\r\nok", http.MethodGet, nil},
		{"no length", "HTTP/1.1 200 OK\r\nX-A: 1\r\n\r\nok", http.MethodGet, nil},
		{"chunked", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", http.MethodGet, nil},
		{"connection", "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", http.MethodGet, nil},
		{"trailer", "HTTP/1.1 200 OK\r\nTrailer: X-S\r\nContent-Length: 2\r\n\r\nok", http.MethodGet, nil},
		{"two lengths", "HTTP/1.1 200 OK\r\nContent-Length: 2\r\ncontent-length: 2\r\n\r\nok", http.MethodGet, nil},
		{"field twice", "HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nContent-Length: 2\r\nSet-Cookie: b=2\r\n\r\nok", http.MethodGet, nil},
		{"signed length", "HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\nok", http.MethodGet, nil},
		{"folded line", "HTTP/1.1 200 OK\r\nX-A: 1\r\n 2\r\nContent-Length: 2\r\n\r\nok", http.MethodGet, nil},
		{"space before colon", "HTTP/1.1 200 OK\r\nX-A : 1\r\nContent-Length: 2\r\n\r\nok", http.MethodGet, nil},
		{"bare LF in a value", "HTTP/1.1 200 OK\r\nX-A: 1\nX-B: 2\r\nContent-Length: 2\r\n\r\nok", http.MethodGet, nil},
		{"control character", "HTTP/1.1 200 OK\r\nX-A: 1\x00\r\nContent-Length: 2\r\n\r\nok", http.MethodGet, nil},
		{"no colon", "HTTP/1.1 200 OK\r\nX-A\r\nContent-Length: 2\r\n\r\nok", http.MethodGet, nil},
	} {
		br := bufio.NewReader(strings.NewReader(tc.head))
		if _, err := br.Peek(len(tc.head)); err != nil {
			t.Fatal(err)
		}
		dst := tc.dst
		if dst == nil {
			dst = http.Header{}
		}
		before := maps.Clone(dst)
		if _, _, ok := plainHead(br, tc.method, dst); ok {
			t.Errorf("%s: taken as plain", tc.name)
		}
		if peekAll(br) != tc.head || !equalHeader(dst, before) {
			t.Errorf("%s: left %q unread and header %v, want all of it and %v", tc.name, peekAll(br), dst, before)
		}
	}
}

// peekAll returns what br holds without reading it.
func peekAll(br *bufio.Reader) string {
	b, _ := br.Peek(br.Buffered())
	return string(b)
}
