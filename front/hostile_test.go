// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A hostile upstream: a raw socket that answers each request as its case
// says, lying about lengths, framing and timing. Every honest answer
// carries the request's id in X-Id and in its body ("own-<id>"); every
// forged one says "forged". A client must get exactly its own answer, a
// 502, or an answer cut short (its head came, the body broke off), never
// another request's bytes.

// hostileCase is one way of answering request id. lateBytes, when set, is
// written delay after the answer, on the same connection.
type hostileCase struct {
	name   string
	method string // GET unless set
	// answer returns what the upstream writes for request id; close says
	// whether it then hangs up.
	answer func(id string) (raw string, close bool)
	late   func(id string) string
	// front is the outcome the front must give (and ReverseProxy may give
	// a weaker one: see outcomeRank).
	front outcome2
}

// outcome2 is what a client saw.
type outcome2 string

const (
	gotOwn   outcome2 = "own"   // its own answer, whole
	gotCut   outcome2 = "cut"   // its own head, then the body broke off (or no answer)
	got502   outcome2 = "502"   // the front's 502
	gotWrong outcome2 = "WRONG" // anything else: another request's bytes, a forged answer
)

// outcomeRank orders outcomes from the most to the least accepting: the
// front must be at least as strict (rank at least as high) as ReverseProxy.
func outcomeRank(o outcome2) int {
	switch o {
	case gotOwn:
		return 0
	case gotCut:
		return 1
	case got502:
		return 2
	}
	return -1
}

func ownBody(id string) string { return "own-" + id }

// honest is a well-formed answer for id with extra fields in the head.
func honest(id string, fields ...string) string {
	b := ownBody(id)
	return "HTTP/1.1 200 OK\r\nX-Id: " + id + "\r\n" + strings.Join(fields, "") +
		"Content-Length: " + strconv.Itoa(len(b)) + "\r\n\r\n" + b
}

// forged is a complete, well-formed answer that belongs to nobody.
const forged = "HTTP/1.1 200 OK\r\nX-Id: forged\r\nContent-Length: 6\r\n\r\nforged"

func chunked(s string) string { return fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(s), s) }

var hostileCases = []hostileCase{
	{name: "honest", answer: func(id string) (string, bool) { return honest(id), false }, front: gotOwn},
	{name: "body longer than Content-Length", answer: func(id string) (string, bool) {
		return honest(id) + forged, false
	}, front: gotOwn},
	{name: "second answer later", answer: func(id string) (string, bool) { return honest(id), false },
		late: func(string) string { return forged }, front: gotOwn},
	{name: "HEAD answered with a body", method: http.MethodHead, answer: func(id string) (string, bool) {
		return "HTTP/1.1 200 OK\r\nX-Id: " + id + "\r\nContent-Length: " + strconv.Itoa(len(forged)) + "\r\n\r\n" + forged, false
	}, front: gotOwn},
	{name: "204 with a body", answer: func(id string) (string, bool) {
		return "HTTP/1.1 204 No Content\r\nX-Id: " + id + "\r\n\r\n" + forged, false
	}, front: gotOwn},
	{name: "304 with a body", answer: func(id string) (string, bool) {
		return "HTTP/1.1 304 Not Modified\r\nX-Id: " + id + "\r\nContent-Length: 6\r\n\r\n" + forged, false
	}, front: gotOwn},
	{name: "chunked then more", answer: func(id string) (string, bool) {
		return "HTTP/1.1 200 OK\r\nX-Id: " + id + "\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(ownBody(id)) + forged, false
	}, front: gotOwn},
	{name: "body shorter than Content-Length", answer: func(id string) (string, bool) {
		return "HTTP/1.1 200 OK\r\nX-Id: " + id + "\r\nContent-Length: 100\r\n\r\n" + ownBody(id), true
	}, front: gotCut},
	{name: "Transfer-Encoding and Content-Length", answer: func(id string) (string, bool) {
		c := chunked(ownBody(id))
		return "HTTP/1.1 200 OK\r\nX-Id: " + id + "\r\nTransfer-Encoding: chunked\r\nContent-Length: " +
			strconv.Itoa(len(c)) + "\r\n\r\n" + c + forged, false
	}, front: got502},
	{name: "Content-Length twice, same value", answer: func(id string) (string, bool) {
		return honest(id, "Content-Length: "+strconv.Itoa(len(ownBody(id)))+"\r\n"), false
	}, front: got502},
	{name: "Content-Length twice, two values", answer: func(id string) (string, bool) {
		return honest(id, "Content-Length: 3\r\n") + forged, false
	}, front: got502},
	{name: "signed Content-Length", answer: func(id string) (string, bool) {
		b := ownBody(id)
		return "HTTP/1.1 200 OK\r\nX-Id: " + id + "\r\nContent-Length: +" + strconv.Itoa(len(b)) + "\r\n\r\n" + b, false
	}, front: got502},
	{name: "bare LF", answer: func(id string) (string, bool) {
		return strings.ReplaceAll(honest(id), "\r\n", "\n"), false
	}, front: got502},
	{name: "folded line", answer: func(id string) (string, bool) {
		return honest(id, "X-Fold: a\r\n b\r\n"), false
	}, front: got502},
	{name: "NUL in a value", answer: func(id string) (string, bool) {
		return honest(id, "X-Nul: a\x00b\r\n"), false
	}, front: got502},
	{name: "CR in a value", answer: func(id string) (string, bool) {
		return honest(id, "X-Cr: a\rb\r\n"), false
	}, front: got502},
	{name: "1xx flood", answer: func(id string) (string, bool) {
		return strings.Repeat("HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n", 1000) + honest(id), false
	}, front: got502},
	{name: "close mid-head", answer: func(id string) (string, bool) {
		return "HTTP/1.1 200 OK\r\nX-Id: " + id + "\r\nContent-Le", true
	}, front: got502},
	{name: "close mid-body", answer: func(id string) (string, bool) {
		return "HTTP/1.1 200 OK\r\nX-Id: " + id + "\r\nContent-Length: 50\r\n\r\n" + ownBody(id)[:3], true
	}, front: gotCut},
	{name: "head over the limit", answer: func(id string) (string, bool) {
		return honest(id, "X-Big: "+strings.Repeat("a", 2<<20)+"\r\n"), false
	}, front: got502},
	{name: "status 000", answer: func(id string) (string, bool) {
		return "HTTP/1.1 000 Zero\r\nX-Id: " + id + "\r\nContent-Length: 0\r\n\r\n", false
	}, front: got502},
	{name: "status 099", answer: func(id string) (string, bool) {
		return "HTTP/1.1 099 Low\r\nX-Id: " + id + "\r\nContent-Length: 0\r\n\r\n", false
	}, front: got502},
	{name: "status 600", answer: func(id string) (string, bool) {
		return "HTTP/1.1 600 High\r\nX-Id: " + id + "\r\nContent-Length: 0\r\n\r\n", false
	}, front: got502},
	{name: "101 unasked", answer: func(id string) (string, bool) {
		return "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n" + forged, false
	}, front: got502},
	{name: "answer before the request body", method: http.MethodPost, answer: func(id string) (string, bool) {
		return honest(id), false
	}, front: gotOwn},
}

// hostileUpstream serves hostileCases: the request's path is /<case index>/<id>.
type hostileUpstream struct {
	l     net.Listener
	conns atomic.Int64 // connections accepted
	mu    sync.Mutex   // guards open
	open  map[net.Conn]bool
}

func newHostileUpstream(t testing.TB) *hostileUpstream {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &hostileUpstream{l: l, open: map[net.Conn]bool{}}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		l.Close()
		u.mu.Lock()
		for c := range u.open {
			c.Close()
		}
		u.mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			u.conns.Add(1)
			u.mu.Lock()
			u.open[c] = true
			u.mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				u.serve(c)
				u.mu.Lock()
				delete(u.open, c)
				u.mu.Unlock()
				c.Close()
			}()
		}
	}()
	return u
}

func (u *hostileUpstream) openConns() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.open)
}

func (u *hostileUpstream) serve(c net.Conn) {
	br := bufio.NewReader(c)
	var wmu sync.Mutex // the late writes and the next answer
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		parts := strings.Split(strings.TrimPrefix(req.URL.Path, "/"), "/")
		i, err := strconv.Atoi(parts[0])
		if err != nil || len(parts) != 2 || i < 0 || i >= len(hostileCases) {
			return
		}
		tc, id := hostileCases[i], parts[1]
		raw, hangUp := tc.answer(id)
		wmu.Lock()
		_, err = io.WriteString(c, raw)
		wmu.Unlock()
		if err != nil || hangUp {
			return
		}
		// Read the body only after answering (the case of answering
		// first); then the next request.
		if _, err := io.Copy(io.Discard, req.Body); err != nil {
			return
		}
		if tc.late != nil {
			late := tc.late(id)
			time.AfterFunc(lateDelay, func() {
				wmu.Lock()
				_, _ = io.WriteString(c, late)
				wmu.Unlock()
			})
		}
	}
}

// lateDelay is when a late answer comes; the next request waits for it.
const lateDelay = 30 * time.Millisecond

// hostileSend sends case i as request id through target from a fresh
// client connection and classifies what came back. A request with a body
// is written while its answer is read (hostileWriteReading), as curl does:
// net/http's Transport returns either the answer or the error of writing
// the body, whichever it sees first (golang/go#11745), so a proxy that
// passes on an answer given before the body and then closes, as net/http's
// server does, would be judged by the Transport's race.
func hostileSend(t testing.TB, target string, i int, id, project string) (outcome2, string) {
	req := hostileReq(target, i, id, project)
	if req.Body != nil {
		return hostileWriteReading(req)
	}
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	return hostileDo(&http.Client{Transport: tr}, req)
}

// hostileWriteReading sends req on a connection of its own, writing it
// (the head, then the body, whatever becomes of the write) while it reads
// the answer, and classifies what came back.
func hostileWriteReading(req *http.Request) (outcome2, string) {
	c, err := net.DialTimeout("tcp", req.URL.Host, 5*time.Second)
	if err != nil {
		return gotCut, "no connection: " + err.Error()
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	req.Close = true
	wrote := make(chan struct{})
	go func() { defer close(wrote); _ = req.Write(c) }()
	defer func() { c.Close(); <-wrote }()
	resp, err := http.ReadResponse(bufio.NewReader(c), req)
	return hostileClassify(req, resp, err)
}

// hostileReq is the request of case i with id: its method, and for a POST
// a body of 256 KiB (the upstream of "answer before the request body"
// answers before reading it).
func hostileReq(target string, i int, id, project string) *http.Request {
	method := hostileCases[i].method
	var body io.Reader
	switch method {
	case "":
		method = http.MethodGet
	case http.MethodPost:
		body = strings.NewReader(strings.Repeat("b", 256<<10))
	}
	req, _ := http.NewRequest(method, fmt.Sprintf("%s/%d/%s", target, i, id), body)
	req.Header.Set(DefaultProjectHeader, project)
	return req
}

// hostileDo sends req (whose path ends in its id) with cl and classifies
// what came back.
func hostileDo(cl *http.Client, req *http.Request) (outcome2, string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := cl.Do(req.WithContext(ctx))
	return hostileClassify(req, resp, err)
}

// hostileClassify classifies the answer to req (whose path ends in its id)
// resp, or err.
func hostileClassify(req *http.Request, resp *http.Response, err error) (outcome2, string) {
	id := req.URL.Path[strings.LastIndexByte(req.URL.Path, '/')+1:]
	if err != nil {
		return gotCut, "no answer: " + err.Error()
	}
	b, rerr := io.ReadAll(resp.Body)
	resp.Body.Close()
	got := fmt.Sprintf("%d X-Id=%q body=%q", resp.StatusCode, resp.Header.Get("X-Id"), b)
	if len(got) > 200 {
		got = got[:200]
	}
	switch {
	case resp.StatusCode == http.StatusBadGateway && resp.Header.Get("X-Id") == "":
		return got502, got
	case resp.Header.Get("X-Id") != id:
		return gotWrong, got
	case rerr != nil:
		if strings.Contains(string(b), "forged") || (len(b) > 0 && !strings.HasPrefix(ownBody(id), string(b))) {
			return gotWrong, got
		}
		return gotCut, got + " " + rerr.Error()
	case req.Method == http.MethodHead || resp.StatusCode == 204 || resp.StatusCode == 304 || resp.ContentLength == 0:
		if len(b) != 0 {
			return gotWrong, got
		}
		return gotOwn, got
	case string(b) == ownBody(id):
		return gotOwn, got
	}
	return gotWrong, got
}

// hostileFronts returns the front and, as the reference, net/http's stock
// ReverseProxy, both in front of u. Clients take turns, so each reuses the
// one pooled upstream connection while it lives.
func hostileFronts(t testing.TB, u *hostileUpstream) (front, stock string, f *Front) {
	t.Helper()
	front, f = hostileFront(t, u, nil)
	up := "http://" + u.l.Addr().String()
	target, _ := url.Parse(up)
	rp := httputil.NewSingleHostReverseProxy(target)
	rp.Transport = &http.Transport{}
	rp.ErrorLog = log.New(io.Discard, "", 0)
	sl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: rp, ErrorLog: log.New(io.Discard, "", 0)}
	go func() { _ = srv.Serve(sl) }()
	t.Cleanup(func() { _ = srv.Close(); rp.Transport.(*http.Transport).CloseIdleConnections() })
	return front, "http://" + sl.Addr().String(), f
}

// hostileFront serves a front in front of u, changed by tweak (if not nil)
// before it serves.
func hostileFront(t testing.TB, u *hostileUpstream, tweak func(*Front)) (string, *Front) {
	t.Helper()
	f, err := New(Config{Upstream: "http://" + u.l.Addr().String(), TrustedPeers: []string{"127.0.0.1"}}, Deps{})
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
	return "http://" + l.Addr().String(), f
}

// TestHostileUpstream sends each case alone, then followed by an honest
// request on what would be the same pooled connection, through the front
// (its direct path, and its fallback: ReverseProxy over the front's own
// Transport) and through net/http's stock ReverseProxy: the front gives the
// case's outcome, never weaker than ReverseProxy's, and the honest request
// after it its own answer, on both of its paths.
func TestHostileUpstream(t *testing.T) {
	u := newHostileUpstream(t)
	front, twin, _ := hostileFronts(t, u)
	fallback, _ := hostileFront(t, u, func(f *Front) { f.up = nil })
	var n atomic.Int64
	next := func() string { return strconv.FormatInt(n.Add(1), 10) }
	for i, tc := range hostileCases {
		t.Run(tc.name, func(t *testing.T) {
			got, detail := hostileSend(t, front, i, next(), "alpha")
			rp, rpDetail := hostileSend(t, twin, i, next(), "alpha")
			t.Logf("front %s (%s); ReverseProxy %s (%s)", got, detail, rp, rpDetail)
			if got != tc.front {
				t.Errorf("front: %s (%s), want %s", got, detail, tc.front)
			}
			if outcomeRank(got) < outcomeRank(rp) {
				t.Errorf("front %s is less strict than ReverseProxy's %s", got, rp)
			}
			if fb, fbDetail := hostileSend(t, fallback, i, next(), "alpha"); outcomeRank(fb) < outcomeRank(rp) || fb == gotWrong {
				t.Errorf("the front's fallback: %s (%s), less strict than ReverseProxy's %s", fb, fbDetail, rp)
			}
			if tc.late != nil {
				time.Sleep(3 * lateDelay)
			}
			// The next client, of another project, gets its own answer
			// from the front. ReverseProxy's is only logged: net/http
			// finds an unsolicited answer with a background read that
			// races the next request (it gave another request's bytes
			// now and then), and the test is of the front.
			if got, detail := hostileSend(t, front, 0, next(), "beta"); got != gotOwn {
				t.Errorf("honest request after the case via the front: %s (%s)", got, detail)
			}
			if got, detail := hostileSend(t, fallback, 0, next(), "beta"); got != gotOwn {
				t.Errorf("honest request after the case via the front's fallback: %s (%s)", got, detail)
			}
			if got, detail := hostileSend(t, twin, 0, next(), "beta"); got != gotOwn {
				t.Logf("honest request after the case via ReverseProxy: %s (%s)", got, detail)
			}
		})
	}
}

// TestHostileSequences runs random sequences of the cases, one client
// after another, through the front: each gets its case's outcome, whatever
// came before it on the pooled connection.
func TestHostileSequences(t *testing.T) {
	u := newHostileUpstream(t)
	front, _, _ := hostileFronts(t, u)
	rng := rand.New(rand.NewPCG(1, 2))
	id := 0
	for seq := range 4 {
		order := rng.Perm(len(hostileCases))
		for _, i := range order {
			id++
			got, detail := hostileSend(t, front, i, strconv.Itoa(id), []string{"alpha", "beta"}[id%2])
			if got != hostileCases[i].front {
				t.Errorf("sequence %d, %s: %s (%s), want %s", seq, hostileCases[i].name, got, detail, hostileCases[i].front)
			}
			if hostileCases[i].late != nil && seq%2 == 0 {
				time.Sleep(3 * lateDelay)
			}
		}
	}
	t.Logf("%d requests on %d upstream connections", id, u.conns.Load())
}

// TestHostileConcurrent: clients of two projects at once, half of them
// sending hostile cases and half honest requests (GET, POST with a body,
// Te: trailers, a ';' in the query), through the front as it is and
// through its fallback alone (the direct path off: every request through
// ReverseProxy and http.Transport): no request gets another exchange's
// bytes and every honest one gets its own answer. The fallback's upstream
// transport is held to two connections, so that a connection a hostile
// answer ends on is handed at once to a request waiting for one:
// http.Transport looks for unasked bytes in a background read that loses
// that race (with keep-alive, 3 honest requests in 2,400 got another's
// answer in the review; here, dozens per run). Cases whose bytes come late,
// after the next request went out, are left out: no HTTP/1.1 client can
// tell those from the next answer (the check at reuse and the sweep are
// for them, TestIdleUpstreamWatched). Nor does net/http write a line to
// the standard logger per unasked answer (it did, with no limit, through
// the fallback's kept-alive connections).
func TestHostileConcurrent(t *testing.T) {
	var stdlog logBuffer
	log.SetOutput(&stdlog)
	t.Cleanup(func() { log.SetOutput(os.Stderr) })
	var hostile []int
	head := -1
	for i, tc := range hostileCases {
		if tc.late == nil && tc.name != "honest" && tc.name != "head over the limit" {
			hostile = append(hostile, i)
		}
		if tc.name == "HEAD answered with a body" {
			head = i
		}
	}
	for _, path := range []struct {
		name  string
		tweak func(*Front)
	}{
		{"front", nil},
		{"fallback", func(f *Front) { f.up, f.tr.MaxConnsPerHost = nil, 2 }},
	} {
		t.Run(path.name, func(t *testing.T) {
			u := newHostileUpstream(t)
			front, _ := hostileFront(t, u, path.tweak)
			const clients, each = 16, 150
			var (
				wg             sync.WaitGroup
				mu             sync.Mutex
				wrong, notOwn  []string
				honestN, other atomic.Int64
			)
			for g := range clients {
				wg.Add(1)
				go func() {
					defer wg.Done()
					tr := &http.Transport{MaxIdleConnsPerHost: 1}
					defer tr.CloseIdleConnections()
					cl := &http.Client{Transport: tr}
					project := []string{"alpha", "beta"}[g%2]
					for k := range each {
						id := fmt.Sprintf("g%dk%d", g, k)
						var req *http.Request
						switch {
						case g%4 < 2 && k%2 == 0:
							// The case that beats http.Transport's
							// background check most often.
							req = hostileReq(front, head, id, project)
						case g%4 < 2:
							req = hostileReq(front, hostile[(g*7+k)%len(hostile)], id, project)
						}
						switch {
						case g%4 >= 2:
							req = honestReq(front, k, id, project)
						case k%3 == 1:
							// What sent a request to the fallback
							// before the direct path took it.
							req.Header.Set("Te", "trailers")
						case k%3 == 2:
							req.URL.RawQuery = "a=1;b=2"
						}
						got, detail := hostileDo(cl, req)
						mu.Lock()
						switch {
						case got == gotWrong:
							wrong = append(wrong, req.Method+" "+req.URL.Path+": "+detail)
						case g%4 >= 2 && got != gotOwn:
							notOwn = append(notOwn, req.Method+" "+req.URL.Path+": "+detail)
						}
						mu.Unlock()
						if g%4 >= 2 {
							honestN.Add(1)
						} else {
							other.Add(1)
						}
					}
				}()
			}
			wg.Wait()
			t.Logf("%d honest and %d hostile requests on %d upstream connections: %d got another's bytes, %d honest not their own answer",
				honestN.Load(), other.Load(), u.conns.Load(), len(wrong), len(notOwn))
			if n := strings.Count(stdlog.String(), "Unsolicited response"); n > 0 {
				t.Errorf("net/http logged %d unasked answers to the standard logger", n)
			}
			for i, w := range wrong {
				if i == 5 {
					break
				}
				t.Errorf("another exchange's bytes: %s", w)
			}
			for i, w := range notOwn {
				if i == 5 {
					break
				}
				t.Errorf("honest request not answered its own: %s", w)
			}
		})
	}
}

// honestReq is the k-th honest request with id, in turn a GET, a POST
// with a body, a GET with Te: trailers and a GET with a ';' in its query.
func honestReq(target string, k int, id, project string) *http.Request {
	url := fmt.Sprintf("%s/0/%s", target, id)
	var req *http.Request
	switch k % 4 {
	case 0:
		req, _ = http.NewRequest(http.MethodGet, url, nil)
	case 1:
		req, _ = http.NewRequest(http.MethodPost, url, strings.NewReader(strings.Repeat("p", 1+k*37%4096)))
	case 2:
		req, _ = http.NewRequest(http.MethodGet, url, nil)
		req.Header.Set("Te", "trailers")
	case 3:
		req, _ = http.NewRequest(http.MethodGet, url+"?a=1;b=2", nil)
	}
	req.Header.Set(DefaultProjectHeader, project)
	return req
}

// TestIdleUpstreamWatched: a pooled connection on which the upstream
// speaks unasked is closed by the front within a few sweeps, with no
// request to find it.
func TestIdleUpstreamWatched(t *testing.T) {
	u := newHostileUpstream(t)
	front, _, f := hostileFronts(t, u)
	late := -1
	for i, tc := range hostileCases {
		if tc.late != nil {
			late = i
		}
	}
	if got, detail := hostileSend(t, front, late, "1", "alpha"); got != gotOwn {
		t.Fatalf("late case: %s (%s)", got, detail)
	}
	time.Sleep(3 * lateDelay)
	if got, _ := hostileSend(t, front, 0, "2", "alpha"); got != gotOwn {
		t.Fatal("honest answer")
	}
	// Two connections were used (the first closed when the late bytes
	// were found): the second is idle now and quiet.
	deadline := time.Now().Add(5 * time.Second)
	for u.openConns() > 1 {
		if time.Now().After(deadline) {
			t.Fatalf("%d upstream connections open", u.openConns())
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Now it speaks while idle: a sweep closes it.
	if got, _ := hostileSend(t, front, late, "3", "alpha"); got != gotOwn {
		t.Fatal("late case again")
	}
	for u.openConns() > 0 {
		if time.Now().After(deadline.Add(5 * time.Second)) {
			d := f.up.(*directUpstream)
			d.mu.Lock()
			n := d.idle.len()
			d.mu.Unlock()
			t.Fatalf("the idle connection that spoke is still open (%d pooled)", n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestClientLimits: a request head over MaxRequestHead is answered 431; a
// client that does not finish its head within ReadHeaderTimeout, or leaves
// its kept-alive connection idle past IdleTimeout, is disconnected.
func TestClientLimits(t *testing.T) {
	r := newRig(t, rigOpts{cfg: Config{MaxRequestHead: 4 << 10, ReadHeaderTimeout: 200 * time.Millisecond,
		IdleTimeout: 300 * time.Millisecond}}, ok)
	addr := strings.TrimPrefix(r.url, "http://")
	dial := func() (net.Conn, *bufio.Reader) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		return c, bufio.NewReader(c)
	}
	c, br := dial()
	big := "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nX-Big: " + strings.Repeat("a", 16<<10) + "\r\n\r\n"
	_, _ = io.WriteString(c, big)
	if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("16 KiB head: %v %v, want 431", resp, err)
	}

	c, br = dial()
	start := time.Now()
	_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\n")
	if _, err := br.ReadByte(); err == nil {
		t.Error("a half-sent head got an answer")
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("a half-sent head held the connection %v", d)
	}

	c, br = dial()
	_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n\r\n")
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("request: %v %v", resp, err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	start = time.Now()
	if _, err := br.ReadByte(); err == nil {
		t.Error("an idle connection got bytes")
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("an idle connection stayed open %v", d)
	}
}
