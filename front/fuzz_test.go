// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/http/httpguts"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/answerfield"
)

// FuzzUpstreamHead compares the front's readers of an upstream answer head
// with http.ReadResponse: a head plainHead takes must be one ReadResponse
// takes too, with the same status, length, fields (less the hop-by-hop
// ones) and the same bytes left for the body; a head strictHead passes
// must be one whose framing ReadResponse reads as written. The seeds are
// the hostile-upstream cases and run with the tests; run it longer with
// go test ./front -run '^$' -fuzz FuzzUpstreamHead -fuzztime 60s.
func FuzzUpstreamHead(f *testing.F) {
	for _, tc := range hostileCases {
		raw, _ := tc.answer("1")
		f.Add([]byte(raw[:min(len(raw), 4096)]))
	}
	f.Add([]byte("HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nx-lower: v\r\nContent-Length: 2\r\n\r\nok"))
	f.Add([]byte("HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"))
	f.Add([]byte("HTTP/1.1 200 OK\r\nContent-Length: 00\r\n\r\n"))
	f.Add([]byte("HTTP/1.1 200\r\nContent-Length: 1\r\n\r\nx"))
	f.Fuzz(func(t *testing.T, raw []byte) {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		rr := bytes.NewReader(raw)
		rbr := bufio.NewReaderSize(rr, 16)
		resp, rerr := http.ReadResponse(rbr, req)
		consumed := len(raw) - rr.Len() - rbr.Buffered()

		br := bufio.NewReaderSize(bytes.NewReader(raw), len(raw)+16)
		_, _ = br.Peek(len(raw))
		dst := http.Header{}
		status, n, ok := plainHead(br, http.MethodGet, dst)
		if ok {
			if rerr != nil {
				t.Fatalf("plainHead took a head ReadResponse refuses (%v)", rerr)
			}
			if status != resp.StatusCode || n != resp.ContentLength {
				t.Fatalf("plainHead: %d length %d; ReadResponse: %d length %d", status, n, resp.StatusCode, resp.ContentLength)
			}
			if left := len(raw) - br.Buffered(); left != consumed {
				t.Fatalf("plainHead read %d bytes of head, ReadResponse %d", left, consumed)
			}
			want := resp.Header.Clone()
			for _, k := range answerfield.HopByHop() {
				want.Del(k)
			}
			if !equalHeader(dst, want) {
				t.Fatalf("plainHead fields %v, ReadResponse's %v", dst, want)
			}
			if err := strictHead(raw[:consumed]); err != nil {
				t.Fatalf("a plain head fails strictHead: %v", err)
			}
		}
		if rerr != nil || strictHead(raw[:consumed]) != nil {
			return
		}
		if resp.StatusCode < 100 || resp.StatusCode > 599 {
			t.Fatalf("strictHead passed status %d", resp.StatusCode)
		}
		// The framing as written is the framing read.
		head := string(raw[:consumed])
		lower := strings.ToLower(head)
		if strings.Contains(lower, "\ncontent-length:") && strings.Contains(lower, "\ntransfer-encoding:") {
			t.Fatal("strictHead passed both framings")
		}
		if strings.Count(lower, "\ncontent-length:") == 1 && resp.StatusCode >= 200 && resp.StatusCode != 204 && resp.StatusCode != 304 {
			_, v, _ := strings.Cut(lower, "\ncontent-length:")
			v, _, _ = strings.Cut(v, "\r\n")
			want, err := strconv.ParseInt(strings.Trim(v, " \t"), 10, 64)
			if err != nil || want != resp.ContentLength {
				t.Fatalf("Content-Length %q read as %d", v, resp.ContentLength)
			}
		}
	})
}

// FuzzPooledExchanges plays whole exchanges on the direct path's pooled
// connections, and on the fallback (ReverseProxy), against an upstream that
// answers each request with bytes from the fuzzer: one of the hostile cases,
// then anything at all, every '@' in it replaced by the request's id. Each
// client gets its own answer (X-Id and body), a 502 or a cut answer, never
// another's: no body holds another request's id. The connections are socket
// pairs (real sockets, so the idle check is the real one), served by a
// goroutine per connection.
func FuzzPooledExchanges(f *testing.F) {
	tagged := "HTTP/1.1 200 OK\r\nX-Id: @\r\nContent-Length: 8\r\n\r\nforged@"
	for i := range hostileCases {
		f.Add([]byte{byte(i), 0, byte(i + 1), 0, 0, 0}, []byte(forged))
		f.Add([]byte{byte(i), 1, byte(i + 1), 1, 0, 1}, []byte(tagged))
		f.Add([]byte{byte(i), 5, byte(i), 1, byte(i), 4}, []byte(tagged))
		f.Add([]byte{0, 1, byte(i), 1, byte(i), 0}, []byte(""))
	}
	f.Add([]byte{0, 2, 0, 2, 0, 2}, []byte("HTTP/1.1 200 OK\r\nX-Id: x2\r\nContent-Length: 5\r\n\r\nown-x2"))
	f.Fuzz(func(t *testing.T, plan []byte, extra []byte) {
		if len(plan) > 12 || len(extra) > 8<<10 {
			return
		}
		type step struct {
			tc       int
			extra    string
			method   string
			fallback bool // through ReverseProxy, not the direct path
		}
		var steps []step
		for i := 0; i+1 < len(plan); i += 2 {
			tc := int(plan[i]) % len(hostileCases)
			s := step{tc: tc, method: hostileCases[tc].method, fallback: plan[i+1]&4 != 0}
			if s.method == "" {
				s.method = http.MethodGet
			}
			id := fuzzID(len(steps))
			switch plan[i+1] % 4 {
			case 1:
				s.extra = strings.ReplaceAll(string(extra), "@", id)
			case 2:
				s.extra = strings.ReplaceAll(string(extra[:len(extra)/2]), "@", id)
			}
			steps = append(steps, s)
		}
		fr, err := New(Config{Upstream: "http://upstream.test", TrustedPeers: []string{"192.0.2.1"},
			MaxUpstreamHead: 64 << 10}, Deps{})
		if err != nil {
			t.Fatal(err)
		}
		var (
			wg      sync.WaitGroup
			mu      sync.Mutex
			written = map[int]string{} // what the upstream sent in answer to request j
		)
		defer wg.Wait()
		defer fr.CloseIdle()
		direct := fr.up
		dial := func(context.Context, string, string) (net.Conn, error) {
			front, up, err := socketPair()
			if err != nil {
				return nil, err
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer up.Close()
				br := bufio.NewReader(up)
				for {
					_ = up.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					j, _ := strconv.Atoi(strings.TrimPrefix(req.URL.Path, "/"))
					s := steps[j]
					raw, hangUp := hostileCases[s.tc].answer(fuzzID(j))
					mu.Lock()
					written[j] += raw + s.extra
					mu.Unlock()
					_ = up.SetWriteDeadline(time.Now().Add(time.Second))
					if _, err := io.WriteString(up, raw+s.extra); err != nil || hangUp {
						return
					}
					// The body (a POST's) is read after the answer.
					if _, err := io.Copy(io.Discard, req.Body); err != nil {
						return
					}
				}
			}()
			return front, nil
		}
		direct.(*directUpstream).dial = dial
		fr.tr.DialContext = dial
		for j, s := range steps {
			var body io.Reader
			if s.method == http.MethodPost {
				body = strings.NewReader(strings.Repeat("b", 1+j*37%2048))
			}
			req := httptest.NewRequest(s.method, "/"+strconv.Itoa(j), body)
			req.Header.Set(DefaultProjectHeader, []string{"alpha", "beta"}[j%2])
			rec := httptest.NewRecorder()
			fr.up = direct
			if s.fallback {
				fr.up = nil
			}
			cut := serveCatching(fr, finalRecorder{rec}, req)
			// The answer is the front's 502, or came from what the
			// upstream sent for this request: its X-Id, and a body
			// that is part of those bytes (cut or not).
			id := fuzzID(j)
			b := rec.Body.String()
			mu.Lock()
			mine := written[j]
			mu.Unlock()
			switch {
			case rec.Code == http.StatusBadGateway && rec.Header().Get("X-Id") == "":
			case rec.Header().Get("X-Id") != id:
				t.Fatalf("request %d (%s): answer of X-Id %q (%d %q)", j, hostileCases[s.tc].name, rec.Header().Get("X-Id"), rec.Code, b)
			case !strings.Contains(mine, b):
				t.Fatalf("request %d (%s): body %q is not from its own answer %q", j, hostileCases[s.tc].name, b, mine)
			case !cut && b != ownBody(id) && b != "" && !strings.Contains(mine, "\r\n\r\n"+b) &&
				// ReverseProxy takes a head ended by bare line feeds.
				!(s.fallback && (strings.Contains(mine, "\n\n"+b) || strings.Contains(mine, "\n\r\n"+b))):
				t.Fatalf("request %d (%s): whole body %q", j, hostileCases[s.tc].name, b)
			}
			for k := range steps {
				if k != j && strings.Contains(b, fuzzID(k)) {
					t.Fatalf("request %d (%s, fallback %v): body %q holds request %d's id",
						j, hostileCases[s.tc].name, s.fallback, b, k)
				}
			}
		}
	})
}

// fuzzID is the id of request j of a fuzzed run: one no other request's
// body or id contains.
func fuzzID(j int) string { return fmt.Sprintf("x%dy", j) }

// serveCatching serves req, reporting whether the handler aborted the
// answer (panic(http.ErrAbortHandler), which net/http turns into a cut
// connection).
func serveCatching(f *Front, w http.ResponseWriter, req *http.Request) (cut bool) {
	defer func() {
		if p := recover(); p != nil {
			if p != http.ErrAbortHandler {
				panic(p)
			}
			cut = true
		}
	}()
	f.ServeHTTP(w, req)
	return false
}

// socketPair returns two connected unix stream sockets as net.Conns.
func socketPair() (net.Conn, net.Conn, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	conns := make([]net.Conn, 2)
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			return nil, nil, err
		}
		conns[i] = c
	}
	return conns[0], conns[1], nil
}

// finalRecorder records the final answer only: httptest.ResponseRecorder
// would keep a 1xx as the status.
type finalRecorder struct{ *httptest.ResponseRecorder }

func (r finalRecorder) WriteHeader(code int) {
	if code >= 100 && code < 200 {
		return
	}
	r.ResponseRecorder.WriteHeader(code)
}

// FuzzRequestHead compares the fast path's reader of a client's request
// head (plainRequest) with http.ReadRequest, which net/http's server uses: a
// head plainRequest takes must be one ReadRequest takes too, with the same
// method, target, Host, fields and Content-Length, and the same bytes left
// for the body; net/http's server refuses a few more (a missing Host, a
// host it finds bad), which plainRequest must refuse too. The seeds run
// with the tests; run it longer with
// go test ./front -run '^$' -fuzz FuzzRequestHead -fuzztime 60s.
func FuzzRequestHead(f *testing.F) {
	for _, s := range []string{
		"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
		"POST /a?b=c HTTP/1.1\r\nHost: x:80\r\nContent-Length: 3\r\n\r\nabc",
		"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
		"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: +1\r\n\r\nx",
		"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n",
		"GET / HTTP/1.1\nHost: x\n\n",
		"GET / HTTP/1.1\r\nHost: x\r\nX : a\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
		"GET / HTTP/1.1\r\n\r\n",
		"GET http://a/ HTTP/1.1\r\nHost: b\r\n\r\n",
		"GET /%zz HTTP/1.1\r\nHost: x\r\n\r\n",
		"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
		"GET / HTTP/1.0\r\nHost: x\r\n\r\n",
		"GET / HTTP/1.1\r\nHost: x\r\nfairshare_project: a\r\nX-Forwarded-For: 1.2.3.4\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		r, n, v := plainRequest(raw, fastHeadMax, fastBodyMax)
		if v != reqPlain {
			return
		}
		rr := bytes.NewReader(raw)
		br := bufio.NewReader(rr)
		want, err := http.ReadRequest(br)
		if err != nil {
			t.Fatalf("plainRequest took a head ReadRequest refuses (%v)", err)
		}
		if consumed := len(raw) - rr.Len() - br.Buffered(); consumed != n {
			t.Fatalf("plainRequest read %d bytes of head, ReadRequest %d", n, consumed)
		}
		if r.Method != want.Method || r.RequestURI != want.RequestURI || r.Host != want.Host ||
			r.ContentLength != want.ContentLength || r.URL.String() != want.URL.String() ||
			r.ProtoMajor != want.ProtoMajor || r.ProtoMinor != want.ProtoMinor || r.Close || want.Close {
			t.Fatalf("plainRequest %s %q host %q length %d; ReadRequest %s %q host %q length %d close %v",
				r.Method, r.RequestURI, r.Host, r.ContentLength, want.Method, want.RequestURI, want.Host, want.ContentLength, want.Close)
		}
		if len(want.TransferEncoding) > 0 || want.Header["Expect"] != nil {
			t.Fatalf("plainRequest took a request with %v / Expect", want.TransferEncoding)
		}
		if !equalHeader(r.Header, want.Header) {
			t.Fatalf("plainRequest fields %v, ReadRequest's %v", r.Header, want.Header)
		}
		// What net/http's server checks beyond ReadRequest.
		if want.Host == "" || len(want.Header["Host"]) > 0 || !httpguts.ValidHostHeader(want.Host) {
			t.Fatalf("plainRequest took Host %q, which net/http's server refuses", want.Host)
		}
		for k, vv := range want.Header {
			if !httpguts.ValidHeaderFieldName(k) {
				t.Fatalf("field name %q", k)
			}
			for _, v := range vv {
				if !httpguts.ValidHeaderFieldValue(v) {
					t.Fatalf("field value %q", v)
				}
			}
		}
	})
}
