// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"fmt"
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
	"sync/atomic"
	"testing"
	"time"
)

// seen is what the upstream received.
type seen struct {
	method, uri, host string
	header            http.Header
	body              string
	length            int64 // the request's ContentLength: -1 for chunked
	trailer           http.Header
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

// TestDirectMatchesReverseProxy sends the same requests through the direct
// path and through ReverseProxy (a twin front with the direct path off) and
// compares what the upstream received and what the client got back:
// hop-by-hop headers stripped both ways, X-Forwarded-*, the project header
// withheld, trailers, the front's own headers, bodies of known and unknown
// length (with a trailer), Te: trailers, queries net/url re-encodes; for an
// answer parsed by http.ReadResponse and for a plain one. The one
// differences: Expect: 100-continue is answered by the front (its server
// sends 100 Continue when the body is first read) and not passed on, and
// the values of a client's trailer are sent (ReverseProxy sends its names
// only).
func TestDirectMatchesReverseProxy(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer http.HandlerFunc
	}{{"trailed", trailedAnswer}, {"plain", plainAnswer}} {
		for _, rq := range []struct {
			name string
			make func(url string) *http.Request
		}{
			{"GET", func(url string) *http.Request {
				req, _ := http.NewRequest("GET", url+"/a/b%2Fc?q=1&r=2", nil)
				return req
			}},
			{"POST", func(url string) *http.Request {
				req, _ := http.NewRequest("POST", url+"/p", strings.NewReader(strings.Repeat("x", 70<<10)))
				req.Header.Set("Expect", "100-continue")
				return req
			}},
			{"chunked PUT with a trailer", func(url string) *http.Request {
				req, _ := http.NewRequest("PUT", url+"/c", io.MultiReader(strings.NewReader("piece one, "), strings.NewReader("piece two")))
				req.ContentLength = -1
				req.Trailer = http.Header{"X-Check": {"7"}, "X-Forwarded-For": {"6.6.6.6"}, "X-Real-Ip": {"6.6.6.6"},
					DefaultProjectHeader: {"beta"}}
				return req
			}},
			{"empty POST, Te: trailers", func(url string) *http.Request {
				req, _ := http.NewRequest("POST", url+"/e", nil)
				req.Header.Set("Te", "trailers, deflate")
				return req
			}},
			{"DELETE, query to re-encode", func(url string) *http.Request {
				req, _ := http.NewRequest("DELETE", url+"/d?a=1;b=2&c=%zz&d=%41", nil)
				return req
			}},
		} {
			t.Run(tc.name+"/"+rq.name, func(t *testing.T) { testDirectMatchesReverseProxy(t, tc.answer, rq.make) })
		}
	}
}

func testDirectMatchesReverseProxy(t *testing.T, upstream http.HandlerFunc, newReq func(url string) *http.Request) {
	var (
		mu  sync.Mutex
		got []seen
		// The direct path keeps a connection whose request body went out
		// whole before any answer came, and cannot tell when the answer
		// arrives while it is still asking the kernel: so the upstream
		// answers the direct front's body only once it has asked.
		sent     = make(chan struct{}, 1)
		waitSent atomic.Bool
	)
	r := newRig(t, rigOpts{}, func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		mu.Lock()
		got = append(got, seen{req.Method, req.RequestURI, req.Host, req.Header.Clone(), string(body), req.ContentLength, req.Trailer})
		mu.Unlock()
		if waitSent.Load() && len(body) > 0 {
			select {
			case <-sent:
			case <-time.After(2 * time.Second):
			}
		}
		upstream(w, req)
	})
	r.front.up.(*directUpstream).sentHook = func() {
		select {
		case sent <- struct{}{}:
		default:
		}
	}
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
		req := newReq(base)
		req.Header.Set(DefaultProjectHeader, "alpha")
		req.Header.Set("Connection", "X-Hop")
		req.Header.Set("X-Hop", "1")
		req.Header.Set("Keep-Alive", "timeout=5")
		req.Header.Set("Proxy-Authorization", "secret")
		req.Header.Set("Forwarded", "for=192.0.2.9")
		req.Header.Set("X-Forwarded-Host", "spoofed")
		req.Header.Set("X-Forwarded-Proto", "https")
		for _, k := range sentClaims {
			req.Header[k] = []string{"spoofed"}
		}
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
	waitSent.Store(true)
	direct := do(r.url)
	waitSent.Store(false)
	viaProxy := do("http://" + l.Addr().String())
	if len(got) != 2 {
		t.Fatalf("upstream saw %d requests", len(got))
	}
	// The two fronts listen on different ports, and queue waits differ.
	got[1].host = got[0].host
	viaProxy.header.Set(HeaderQueueWait, direct.header.Get(HeaderQueueWait))
	if got[0].method != got[1].method || got[0].uri != got[1].uri || got[0].host != got[1].host {
		t.Errorf("request line: direct %+v, proxy %+v", got[0], got[1])
	}
	// ReverseProxy announces the client's trailer and sends it empty; the
	// direct path sends its values. Neither passes the project header or a
	// proxy claim as a trailer.
	for i := range got {
		for _, k := range []string{"X-Forwarded-For", "X-Real-Ip", DefaultProjectHeader} {
			if v, ok := got[i].trailer[k]; ok {
				t.Errorf("request %d: the client's trailer %s reached the upstream: %q", i, k, v)
			}
		}
	}
	if got[0].body != got[1].body || got[0].length != got[1].length ||
		!slices.Equal(slices.Sorted(maps.Keys(got[0].trailer)), slices.Sorted(maps.Keys(got[1].trailer))) ||
		(got[0].trailer != nil && got[0].trailer.Get("X-Check") != "7") {
		t.Errorf("request body: direct %d bytes (length %d, trailer %v), proxy %d (length %d, trailer %v)",
			len(got[0].body), got[0].length, got[0].trailer, len(got[1].body), got[1].length, got[1].trailer)
	}
	if v := got[0].header.Get("Expect"); v != "" {
		t.Errorf("direct path passed Expect: %q", v)
	}
	got[1].header.Del("Expect")
	if !equalHeader(got[0].header, got[1].header) {
		t.Errorf("upstream saw\n direct %v\n proxy  %v", got[0].header, got[1].header)
	}
	// Nor a proxy claim of the client's, and the front adds only
	// X-Forwarded-For over plain HTTP (TestForwardedProtoOverTLS).
	for _, k := range []string{"X-Hop", "Keep-Alive", "Proxy-Authorization", "Forwarded", DefaultProjectHeader,
		"X-Forwarded-Host", "X-Forwarded-Proto"} {
		if v, ok := got[0].header[k]; ok {
			t.Errorf("direct path passed %s: %q", k, v)
		}
	}
	for k, v := range got[0].header {
		for _, c := range sentClaims {
			if strings.EqualFold(strings.ReplaceAll(k, "_", "-"), strings.ReplaceAll(c, "_", "-")) {
				t.Errorf("direct path passed the client's %s as %s: %q", c, k, v)
			}
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
	// The direct path kept its connection for the next request: it puts
	// it back after the answer's last byte is written to the client, so
	// the client may see the answer a moment before.
	conns := 0
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		conns = idleUpstreams(r.front)
		if conns == 1 || time.Now().After(deadline) {
			break
		}
	}
	if conns != 1 {
		t.Errorf("%d idle upstream connections 2 s after one request, want 1", conns)
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

// TestDirectBodies: requests with bodies on the direct path. An upstream
// that answers before reading a large body has its answer passed on, and
// its connection is not reused, nor is it when the answer began before the
// whole body went out (what the upstream left unread of it would be taken
// for the next request); a client that asks Expect: 100-continue is
// told to go on by the front once its request is admitted, and its body
// arrives; a client that breaks off its body frees its permit and the
// upstream connection is not reused for another request.
func TestDirectBodies(t *testing.T) {
	var (
		mu  sync.Mutex
		seq []string // path@connection of each request the upstream saw
	)
	entered := make(chan struct{})
	r := newRig(t, rigOpts{}, func(w http.ResponseWriter, req *http.Request) {
		mu.Lock()
		seq = append(seq, req.URL.Path+"@"+req.RemoteAddr)
		mu.Unlock()
		switch req.URL.Path {
		case "/refuse":
			w.WriteHeader(http.StatusRequestEntityTooLarge)
			_, _ = io.WriteString(w, "too big\n")
		case "/close":
			// An answer, and the connection closed with the body unread.
			w.Header().Set("Connection", "close")
			_, _ = io.WriteString(w, "closed\n")
		case "/early":
			// The head goes out before the rest of the body comes.
			_ = http.NewResponseController(w).EnableFullDuplex()
			defer req.Body.Close() // golang/go#68560
			w.WriteHeader(http.StatusOK)
			w.(http.Flusher).Flush()
			close(entered)
			_, _ = io.Copy(io.Discard, req.Body)
			_, _ = io.WriteString(w, "early\n")
		default:
			b, err := io.ReadAll(req.Body)
			if err != nil {
				return
			}
			_, _ = fmt.Fprintf(w, "got %d\n", len(b))
		}
	})
	post := func(path string, body io.Reader, expect bool) (int, string, error) {
		req, _ := http.NewRequest("POST", r.url+path, body)
		req.Header.Set(DefaultProjectHeader, "alpha")
		if expect {
			req.Header.Set("Expect", "100-continue")
		}
		tr := &http.Transport{ExpectContinueTimeout: 10 * time.Second}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
		if err != nil {
			return 0, "", err
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode, string(b), err
	}

	if status, body, err := post("/", strings.NewReader("warm"), false); status != 200 || body != "got 4\n" {
		t.Fatalf("POST: %d %q %v", status, body, err)
	}
	// 8 MiB the upstream never reads: more than the sockets hold.
	status, body, err := post("/refuse", strings.NewReader(strings.Repeat("b", 8<<20)), false)
	if status != http.StatusRequestEntityTooLarge || body != "too big\n" {
		t.Errorf("upstream that answers first: %d %q %v", status, body, err)
	}
	waitInUse(t, r.pool, 0)
	start := time.Now()
	if status, body, err := post("/", strings.NewReader("after"), true); status != 200 || body != "got 5\n" {
		t.Errorf("POST with Expect: %d %q %v", status, body, err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Expect: 100-continue took %v: the front did not send 100 Continue", d)
	}
	mu.Lock()
	if n := len(seq); seq[n-1][strings.Index(seq[n-1], "@"):] == seq[n-2][strings.Index(seq[n-2], "@"):] {
		t.Errorf("the connection of an answer that came before its body was reused: %q", seq)
	}
	mu.Unlock()

	// An upstream that answers and hangs up on a body of 200 KiB: the
	// client still sends all of it, the front stops reading it.
	for range 5 {
		if status, body, err := post("/close", strings.NewReader(strings.Repeat("c", 200<<10)), false); status != 200 || body != "closed\n" {
			t.Logf("upstream that hangs up: %d %q %v", status, body, err)
		}
	}
	if logs := r.logs.String(); strings.Contains(logs, "panic") {
		t.Errorf("the front's server panicked: %s", logs)
	}

	// An answer that began before the body was all sent.
	c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = io.WriteString(c, "POST /early HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nContent-Length: 10\r\n\r\n01234")
	<-entered
	_, _ = io.WriteString(c, "56789")
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err != nil || resp.StatusCode != 200 || readAll(t, resp) != "early\n" {
		t.Errorf("early answer: %v %v", resp, err)
	}
	if status, body, err := post("/", strings.NewReader("next"), false); status != 200 || body != "got 4\n" {
		t.Errorf("POST after an early answer: %d %q %v", status, body, err)
	}
	mu.Lock()
	if n := len(seq); seq[n-1][strings.Index(seq[n-1], "@"):] == seq[n-2][strings.Index(seq[n-2], "@"):] {
		t.Errorf("the connection of an answer that began before its body was sent was reused: %q", seq)
	}
	mu.Unlock()

	// A body broken off: Content-Length 1000, 10 bytes, then a close.
	c, err = net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.WriteString(c, "POST / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nContent-Length: 1000\r\n\r\n0123456789")
	waitInUse(t, r.pool, 1)
	c.Close()
	waitInUse(t, r.pool, 0)
	if status, body, err := post("/", strings.NewReader("next"), false); status != 200 || body != "got 4\n" {
		t.Errorf("POST after a broken one: %d %q %v", status, body, err)
	}
	mu.Lock()
	if n := len(seq); seq[n-1][strings.Index(seq[n-1], "@"):] == seq[n-2][strings.Index(seq[n-2], "@"):] {
		t.Errorf("the connection of a broken body was reused: %q", seq)
	}
	mu.Unlock()
}

// TestDirectBodySentLate: a sender that reports its body sent only after
// the answer is over (the upstream read the body and answered while the
// sender was not yet back) has its connection aborted to be stopped; that
// connection is never reused, whatever the sender reports then (it was, and
// the next request failed on a connection past its deadline: 3 in 70,000
// POSTs under wrk).
func TestDirectBodySentLate(t *testing.T) {
	r := newRig(t, rigOpts{tweak: func(f *Front) {
		f.up.(*directUpstream).sentHook = func() { time.Sleep(20 * time.Millisecond) }
	}}, func(w http.ResponseWriter, req *http.Request) {
		b, _ := io.ReadAll(req.Body)
		_, _ = fmt.Fprintf(w, "got %d\n", len(b))
	})
	for i := range 3 {
		req, _ := http.NewRequest("POST", r.url, strings.NewReader("body"))
		req.Header.Set(DefaultProjectHeader, "alpha")
		resp, err := r.client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if body := readAll(t, resp); resp.StatusCode != 200 || body != "got 4\n" {
			t.Errorf("POST %d: %d %q", i, resp.StatusCode, body)
		}
	}
}

// paths runs fn for the direct path and for the fallback (ReverseProxy),
// with the tweak that sends every request through the latter.
func paths(t *testing.T, fn func(t *testing.T, tweak func(*Front))) {
	t.Run("direct", func(t *testing.T) { fn(t, nil) })
	t.Run("fallback", func(t *testing.T) { fn(t, func(f *Front) { f.up = nil }) })
	t.Run("fast", func(t *testing.T) { fn(t, func(f *Front) { f.cfg.FastPath = true }) })
}

// rawRoundTrip sends raw on a fresh connection to addr and returns what
// came back until the connection closed or went quiet. It may run on a
// goroutine of the test's: a failure is an Error.
func rawRoundTrip(t *testing.T, addr, raw string) string {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Error(err)
		return ""
	}
	defer c.Close()
	if _, err := io.WriteString(c, raw); err != nil {
		t.Error(err)
		return ""
	}
	var out strings.Builder
	buf := make([]byte, 4096)
	for {
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		n, err := c.Read(buf)
		out.Write(buf[:n])
		if err != nil {
			return out.String()
		}
	}
}

// TestInformationalAnswers: an informational answer (103 Early Hints)
// reaches an HTTP/1.1 client without the front's own fields the upstream
// put in it, and never an HTTP/1.0 client (RFC 9110 15.2), on both paths.
func TestInformationalAnswers(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		r := newRig(t, rigOpts{tweak: tweak}, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Link", "</style.css>; rel=preload")
			w.Header().Set(HeaderClass, "forged")
			w.Header().Set(HeaderQueueWait, "forged")
			// Hop-by-hop fields are the upstream's connection's, not
			// the client's.
			w.Header().Set("Keep-Alive", "timeout=1")
			w.Header().Set("Proxy-Connection", "close")
			w.Header().Set("Connection", "X-Hop")
			w.Header().Set("X-Hop", "hop")
			w.WriteHeader(http.StatusEarlyHints)
			clear(w.Header())
			_, _ = io.WriteString(w, "ok\n")
		})
		addr := strings.TrimPrefix(r.url, "http://")
		got := rawRoundTrip(t, addr, "GET / HTTP/1.0\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")
		if !strings.HasPrefix(got, "HTTP/1.0 200") && !strings.HasPrefix(got, "HTTP/1.1 200") {
			t.Errorf("HTTP/1.0 client got %q, want the final answer first", got)
		}
		got = rawRoundTrip(t, addr, "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nConnection: close\r\n\r\n")
		hints, final, _ := strings.Cut(got, "\r\n\r\n")
		if !strings.HasPrefix(hints, "HTTP/1.1 103") || !strings.Contains(hints, "Link: </style.css>") {
			t.Errorf("HTTP/1.1 client got %q, want 103 with its Link first", got)
		}
		if strings.Contains(got, "forged") || !strings.Contains(final, "HTTP/1.1 200") {
			t.Errorf("the upstream's front fields reached the client: %q", got)
		}
		for _, hop := range []string{"Keep-Alive", "Proxy-Connection", "X-Hop", "timeout=1"} {
			if strings.Contains(hints, hop) {
				t.Errorf("the 103's hop-by-hop field %s reached the client: %q", hop, hints)
			}
		}
	})
}

// TestOwnFieldsNotFromUpstream: the front's own fields (class, queue
// wait, refusal, the cost header) come from the front or not at all: not
// from an upstream's head when the front has no class to give (no
// scheduler), nor from its trailer, announced or not, on both paths.
func TestOwnFieldsNotFromUpstream(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set(HeaderClass, "forged")
			w.Header().Set("Trailer", HeaderClass+", X-Sum")
			_, _ = io.WriteString(w, "body\n")
			w.Header().Set(HeaderClass, "forged")
			w.Header().Set("X-Sum", "42")
			w.Header().Set(http.TrailerPrefix+HeaderQueueWait, "forged")
			w.Header().Set(http.TrailerPrefix+DefaultCostHeader, "9")
			w.Header().Set(http.TrailerPrefix+HeaderRefused, "forged")
		}))
		t.Cleanup(up.Close)
		f, err := New(Config{Upstream: up.URL, TrustedPeers: []string{"127.0.0.1"}}, Deps{})
		if err != nil {
			t.Fatal(err)
		}
		if tweak != nil {
			tweak(f)
		}
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = f.Serve(ctx, l) }()
		t.Cleanup(func() { cancel(); <-done })
		req, _ := http.NewRequest("GET", "http://"+l.Addr().String()+"/", nil)
		req.Header.Set(DefaultProjectHeader, "alpha")
		req.Header.Set("Te", "trailers")
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body := readAll(t, resp)
		if body != "body\n" || resp.Trailer.Get("X-Sum") != "42" {
			t.Errorf("answer %q, trailer %v: want the body and X-Sum", body, resp.Trailer)
		}
		for _, h := range []http.Header{resp.Header, resp.Trailer} {
			for _, k := range []string{HeaderClass, HeaderQueueWait, HeaderRefused, DefaultCostHeader} {
				if v := h.Get(k); v != "" && (k != HeaderQueueWait || v == "forged") {
					t.Errorf("%s: %q reached the client (header %v, trailer %v)", k, v, resp.Header, resp.Trailer)
				}
			}
		}
		if strings.Contains(resp.Header.Get("Trailer"), HeaderClass) {
			t.Errorf("announced trailer %q", resp.Header.Get("Trailer"))
		}
	})
}

// idleUpstreams counts the front's idle upstream connections: the direct
// path's pool and, under the fast path, its loops'.
func idleUpstreams(f *Front) int {
	d := f.up.(*directUpstream)
	d.mu.Lock()
	n := d.idle.len()
	d.mu.Unlock()
	if fs := f.fast.Load(); fs != nil {
		for _, lp := range fs.loops {
			done := make(chan int)
			lp.post(func() { done <- lp.idle.len() })
			n += <-done
		}
	}
	return n
}

// sentClaims are headers, in the spellings a client may choose, that
// upstream frameworks read as a proxy's word on the client's address or
// scheme: none may reach the upstream from a client.
var sentClaims = []string{"X-Forwarded-Scheme", "X-Forwarded-Ssl", "X-Forwarded-Port", "X-Forwarded-Prefix",
	"X-Real-Ip", "X_Real_IP", "Client-Ip", "X-Client-Ip", "True-Client-Ip", "X-Url-Scheme", "Front-End-Https",
	"x_forwarded_ssl", "X_FORWARDED_PROTO"}

// TestForwardedProtoOverTLS: the front's handler mounted on a TLS server
// tells the upstream so (X-Forwarded-Proto: https), on the direct path and
// on ReverseProxy's alike, whatever the client claimed; over plain HTTP it
// sends no X-Forwarded-Proto (testDirectMatchesReverseProxy), and never an
// X-Forwarded-Host, which would repeat the Host line.
func TestForwardedProtoOverTLS(t *testing.T) {
	for _, direct := range []bool{true, false} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			var mu sync.Mutex
			var seenHeader http.Header
			o := rigOpts{}
			if !direct {
				o.tweak = func(f *Front) { f.up = nil } // before it serves
			}
			r := newRig(t, o, func(w http.ResponseWriter, req *http.Request) {
				mu.Lock()
				seenHeader = req.Header.Clone()
				mu.Unlock()
				ok(w, req)
			})
			srv := httptest.NewTLSServer(r.front)
			t.Cleanup(srv.Close)
			req, _ := http.NewRequest(http.MethodGet, srv.URL+"/", nil)
			req.Header.Set(DefaultProjectHeader, "alpha")
			req.Header.Set("X-Forwarded-Proto", "http")
			req.Header.Set("X-Forwarded-Host", "spoofed")
			req.Header.Set("X-Forwarded-For", "192.0.2.7")
			resp, err := srv.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			if body := readAll(t, resp); resp.StatusCode != http.StatusOK || body != "ok\n" {
				t.Fatalf("answer %d %q", resp.StatusCode, body)
			}
			mu.Lock()
			defer mu.Unlock()
			if got := seenHeader.Values("X-Forwarded-Proto"); len(got) != 1 || got[0] != "https" {
				t.Errorf("X-Forwarded-Proto %q, want https", got)
			}
			if got := seenHeader.Values("X-Forwarded-For"); len(got) != 1 || got[0] != "127.0.0.1" {
				t.Errorf("X-Forwarded-For %q, want 127.0.0.1", got)
			}
			if got, ok := seenHeader["X-Forwarded-Host"]; ok {
				t.Errorf("X-Forwarded-Host %q passed", got)
			}
		})
	}
}
