// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// readTimeout is the UpstreamReadTimeout of these tests.
const readTimeout = 300 * time.Millisecond

// answerUpstream is an upstream that answers as each request's X-Answer
// field says, on the connection itself (hijacked: it writes the bytes it
// likes and holds the connection as long as it likes):
//
//	ok                       200 "ok"
//	stall cl|chunked N K     a body of N bytes (Content-Length, or chunked)
//	                         of which K are sent, then nothing more
//	trickle cl|chunked N P   a body of N bytes, one every P
//
// It records the front's connection each request came on (addrs), and
// when the front closed a stalled one (closed).
type answerUpstream struct {
	mu     sync.Mutex
	addrs  []string      // each request's connection, in order
	closed chan struct{} // one per stalled connection the front closed
	done   chan struct{} // closed when the test ends
}

func newAnswerUpstream(t *testing.T) *answerUpstream {
	u := &answerUpstream{closed: make(chan struct{}, 64), done: make(chan struct{})}
	t.Cleanup(func() { close(u.done) })
	return u
}

func (u *answerUpstream) addrsSoFar() []string {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]string(nil), u.addrs...)
}

func (u *answerUpstream) serve(w http.ResponseWriter, req *http.Request) {
	u.mu.Lock()
	u.addrs = append(u.addrs, req.RemoteAddr)
	u.mu.Unlock()
	f := strings.Fields(req.Header.Get("X-Answer"))
	if len(f) != 4 {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "ok")
		return
	}
	chunked := f[1] == "chunked"
	n, _ := strconv.Atoi(f[2])
	c, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return
	}
	defer c.Close()
	head := "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
	if chunked {
		head += "Transfer-Encoding: chunked\r\n\r\n"
	} else {
		head += "Content-Length: " + strconv.Itoa(n) + "\r\n\r\n"
	}
	piece := func(b string) string {
		if chunked && b != "" {
			return fmt.Sprintf("%x\r\n%s\r\n", len(b), b)
		}
		return b
	}
	if _, err := io.WriteString(c, head); err != nil {
		return
	}
	switch f[0] {
	case "stall":
		k, _ := strconv.Atoi(f[3])
		_, _ = io.WriteString(c, piece(strings.Repeat("b", k)))
		// Silent until the front closes the connection (a read of it
		// ends), or the test ends.
		ended := make(chan struct{})
		go func() {
			defer close(ended)
			_, _ = io.Copy(io.Discard, c)
		}()
		select {
		case <-ended:
			u.closed <- struct{}{}
		case <-u.done:
		}
	case "trickle":
		p, _ := time.ParseDuration(f[3])
		for range n {
			select {
			case <-time.After(p):
			case <-u.done:
				return
			}
			if _, err := io.WriteString(c, piece("b")); err != nil {
				return
			}
		}
		if chunked {
			_, _ = io.WriteString(c, "0\r\n\r\n")
		}
	}
}

// answerGet sends a GET of project with the X-Answer spec through client,
// and returns the body and the error the client met (nil: the answer was
// whole), and how long it took.
func answerGet(url string, client *http.Client, project, spec string) (string, error, time.Duration) {
	start := time.Now()
	req, _ := http.NewRequest("GET", url, nil)
	req.Header.Set(DefaultProjectHeader, project)
	if spec != "" {
		req.Header.Set("X-Answer", spec)
	}
	resp, err := client.Do(req)
	return readAnswer(resp, err, start)
}

// readAnswer reads resp's body (err: the request's error) for answerGet
// and rawGet: the body, the error the client met reading it or a status
// other than 200, and the time since start.
func readAnswer(resp *http.Response, err error, start time.Time) (string, error, time.Duration) {
	if err != nil {
		return "", err, time.Since(start)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err == nil && resp.StatusCode != http.StatusOK {
		err = fmt.Errorf("status %d", resp.StatusCode)
	}
	return string(b), err, time.Since(start)
}

// rawGet is answerGet over a connection of its own, in HTTP/1.1 with
// keep-alive (the fast path serves that itself; http.Transport would send
// a GET again on a reused connection closed before any answer, or ask for
// Connection: close on one that is not reused).
func rawGet(url, project, spec string) (string, error, time.Duration) {
	start := time.Now()
	c, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		return "", err, 0
	}
	defer c.Close()
	_ = c.SetDeadline(start.Add(limitsDeadline))
	fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\n%s: %s\r\nX-Answer: %s\r\n\r\n", DefaultProjectHeader, project, spec)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	return readAnswer(resp, err, start)
}

// TestUpstreamReadTimeout (the review's case): an upstream that sends an
// answer's head and then stops, right after the head or mid-body, held the
// exchange's permit and its place for as long as the client waited. Now a
// read of the body that waits UpstreamReadTimeout cuts the client's answer
// off (it cannot read as complete), closes the upstream connection, gives
// the permit and the place back and counts an error. Two such answers fill
// a pool of 2, and another project is served once they are cut; then,
// over rounds with random framing (Content-Length, chunked) and stall
// points, each answer is cut within a few timeouts and the project's next
// request is served on a new connection. On every path, HTTP/1.1 and
// (direct and fallback) h2c clients.
func TestUpstreamReadTimeout(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		up := newAnswerUpstream(t)
		r := newRig(t, rigOpts{poolSize: 2, tweak: tweak, cfg: Config{UpstreamReadTimeout: readTimeout}}, up.serve)
		r.client.Timeout = limitsDeadline
		h2 := &http.Transport{Protocols: new(http.Protocols)}
		h2.Protocols.SetUnencryptedHTTP2(true)
		t.Cleanup(h2.CloseIdleConnections)
		h2c := &http.Client{Transport: h2, Timeout: limitsDeadline}

		// Two stalled answers hold the pool of 2; alpha waits its turn.
		type result struct {
			err error
			d   time.Duration
		}
		cut := make(chan result, 2)
		for i := range 2 {
			go func() {
				_, err, d := rawGet(r.url, "beta", fmt.Sprintf("stall %s 100 10", []string{"cl", "chunked"}[i]))
				cut <- result{err, d}
			}()
		}
		waitInUse(t, r.pool, 2)
		if resp := r.get(t, "alpha", "/"); resp.StatusCode != http.StatusTooManyRequests {
			t.Errorf("alpha while beta's stalled answers hold the pool: %d, want 429", resp.StatusCode)
		}
		for range 2 {
			res := <-cut
			if res.err == nil {
				t.Error("a stalled answer reached the client whole")
			}
			if res.d < readTimeout-50*time.Millisecond || res.d > limitsDeadline/2 {
				t.Errorf("a stalled answer was cut after %v, want about %v", res.d, readTimeout)
			}
		}
		waitInUse(t, r.pool, 0)
		if body, err, _ := answerGet(r.url, r.client, "alpha", ""); err != nil || body != "ok" {
			t.Errorf("alpha after beta's answers were cut: %q %v", body, err)
		}
		waitOutcome(t, r.front, "beta", "error", 2)

		rnd := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
		failures := 2.0
		for round := range 8 {
			framing := []string{"cl", "chunked"}[rnd.IntN(2)]
			k := 0 // right after the head
			if rnd.IntN(3) > 0 {
				k = 1 + rnd.IntN(99)
			}
			spec := fmt.Sprintf("stall %s 100 %d", framing, k)
			before := len(up.addrsSoFar())
			how := "HTTP/1.1"
			body, err, d := "", error(nil), time.Duration(0)
			if round%4 == 3 { // (the fast path hands h2c to net/http's)
				how = "h2c"
				body, err, d = answerGet(r.url, h2c, "beta", spec)
			} else {
				body, err, d = rawGet(r.url, "beta", spec)
			}
			t.Logf("round %d (%s, %s): cut after %v with %d bytes: %v", round, spec, how, d, len(body), err)
			if err == nil {
				t.Errorf("round %d (%s, %s): the stalled answer reached the client whole: %d bytes", round, spec, how, len(body))
			}
			if len(body) > k {
				t.Errorf("round %d: the client got %d bytes of %d sent", round, len(body), k)
			}
			if d < readTimeout-50*time.Millisecond || d > limitsDeadline/2 {
				t.Errorf("round %d (%s, %s): cut after %v, want about %v", round, spec, how, d, readTimeout)
			}
			select {
			case <-up.closed:
			case <-time.After(limitsDeadline):
				t.Fatalf("round %d (%s): the front did not close the stalled upstream connection", round, spec)
			}
			waitInUse(t, r.pool, 0)
			failures++
			waitOutcome(t, r.front, "beta", "error", failures)
			// The next request of beta's is served, on another
			// connection than the one that stalled.
			if body, err, _ := answerGet(r.url, r.client, "beta", ""); err != nil || body != "ok" {
				t.Errorf("round %d: beta after its stalled answer: %q %v", round, body, err)
			}
			addrs := up.addrsSoFar()
			if len(addrs) != before+2 {
				t.Fatalf("round %d: the upstream saw %d requests, want 2", round, len(addrs)-before)
			}
			if stalled, next := addrs[before], addrs[before+1]; stalled == next {
				t.Errorf("round %d: beta's next request went on the stalled connection %s", round, stalled)
			}
			// Its permit comes back a moment after the client has read
			// the answer: the next round's stall must not be refused
			// for it (beta at its share of the pool of 2).
			waitInUse(t, r.pool, 0)
		}
		if logs := r.logs.String(); !strings.Contains(logs, errAnswerStalled.Error()) {
			t.Errorf("the stalls were not logged as such:\n%s", logs)
		}
	})
}

// TestUpstreamReadTimeoutTrickle: an upstream that sends its body slowly,
// a byte every sixth of UpstreamReadTimeout, is never waited on that long:
// its answers, Content-Length and chunked, reach the client whole, however
// long they take together. On every path.
func TestUpstreamReadTimeoutTrickle(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		up := newAnswerUpstream(t)
		r := newRig(t, rigOpts{tweak: tweak, cfg: Config{UpstreamReadTimeout: readTimeout}}, up.serve)
		r.client.Timeout = 3 * limitsDeadline
		const n = 30 // at 50ms a byte, 1.5s: five timeouts, with room for a loaded machine's stalls
		var wg sync.WaitGroup
		for _, framing := range []string{"cl", "chunked"} {
			wg.Go(func() {
				spec := fmt.Sprintf("trickle %s %d %v", framing, n, readTimeout/6)
				body, err, d := answerGet(r.url, r.client, "beta", spec)
				if err != nil || body != strings.Repeat("b", n) {
					t.Errorf("%s: %q %v after %v, want the whole answer", spec, body, err, d)
				}
			})
		}
		wg.Wait()
		waitInUse(t, r.pool, 0)
		if got := outcomeCount(t, r.front, "beta", "error"); got != 0 {
			t.Errorf("%v errors counted", got)
		}
	})
}

// TestEarlyAnswerKeepsTheSendBound: an upstream that answers at once (its
// head and a byte of a longer body), never reads the rest of a large
// request body, and then says nothing, is bounded by WriteTimeout, the
// bound of the request's send, whether UpstreamReadTimeout is on or off:
// the permit comes back. On the fast path the body's wait took the loop's
// one deadline from the send's: with the read bound off, nothing bounded
// the exchange any more. On every path: the fallback's http.Transport
// bounded no send of a request body at all (sendBody).
func TestEarlyAnswerKeepsTheSendBound(t *testing.T) {
	for _, read := range []time.Duration{-1, 10 * time.Second} {
		t.Run(fmt.Sprintf("read=%v", read), func(t *testing.T) {
			paths(t, func(t *testing.T, tweak func(*Front)) {
				done := make(chan struct{})
				t.Cleanup(func() { close(done) })
				r := newRig(t, rigOpts{tweak: tweak, cfg: Config{UpstreamReadTimeout: read, WriteTimeout: readTimeout}},
					func(w http.ResponseWriter, _ *http.Request) {
						c, _, err := http.NewResponseController(w).Hijack()
						if err != nil {
							return
						}
						defer c.Close()
						_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100\r\n\r\nx")
						<-done // reads nothing more, sends nothing more
					})
				const size = 32 << 20 // past what the sockets' buffers hold
				c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				go func() {
					_, _ = fmt.Fprintf(c, "POST / HTTP/1.1\r\nHost: x\r\n%s: beta\r\nContent-Length: %d\r\n\r\n", DefaultProjectHeader, size)
					_, _ = c.Write(make([]byte, size))
				}()
				waitInUse(t, r.pool, 1)
				start := time.Now()
				waitInUse(t, r.pool, 0)
				if d := time.Since(start); d > limitsDeadline/2 {
					t.Errorf("the exchange held its permit %v, want about WriteTimeout (%v)", d, readTimeout)
				}
			})
		})
	}
}

// TestUpstreamReadTimeoutOff: UpstreamReadTimeout below 0 bounds no read:
// a stalled answer waits for the upstream (here until the client gives
// up), as before the bound.
func TestUpstreamReadTimeoutOff(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		up := newAnswerUpstream(t)
		r := newRig(t, rigOpts{tweak: tweak, cfg: Config{UpstreamReadTimeout: -1}}, up.serve)
		r.client.Timeout = 4 * readTimeout
		_, err, d := answerGet(r.url, r.client, "beta", "stall cl 100 10")
		var ne net.Error
		if err == nil || !(errors.As(err, &ne) && ne.Timeout()) || d < r.client.Timeout {
			t.Errorf("with no bound, a stalled answer ended after %v: %v; want the client's own timeout", d, err)
		}
		waitInUse(t, r.pool, 0)
	})
}

// TestUpstreamReadTimeoutSlowClient: while the client does not take the
// answer the front does not read the upstream's, and that is not the
// upstream's stall: a client that pauses three times its
// UpstreamReadTimeout (within WriteTimeout) several times over a large
// answer gets all of it. On every path.
func TestUpstreamReadTimeoutSlowClient(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		const size = 16 << 20
		r := newRig(t, rigOpts{tweak: tweak, cfg: Config{UpstreamReadTimeout: readTimeout, WriteTimeout: 10 * readTimeout}},
			func(w http.ResponseWriter, _ *http.Request) {
				w.Header().Set("Content-Type", "application/octet-stream")
				w.Header().Set("Content-Length", strconv.Itoa(size))
				chunk := make([]byte, 64<<10)
				for range size / len(chunk) {
					if _, err := w.Write(chunk); err != nil {
						return
					}
				}
			})
		c, err := net.Dial("tcp", strings.TrimPrefix(r.url, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.(*net.TCPConn).SetReadBuffer(64 << 10)
		_ = c.SetDeadline(time.Now().Add(3 * limitsDeadline))
		fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\n%s: beta\r\n\r\n", DefaultProjectHeader)
		resp, err := http.ReadResponse(bufio.NewReaderSize(c, 4<<10), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		got := int64(0)
		buf := make([]byte, 4<<10)
		for range 3 {
			time.Sleep(3 * readTimeout)
			n, err := io.ReadFull(resp.Body, buf)
			got += int64(n)
			if err != nil {
				t.Fatalf("after %d bytes: %v", got, err)
			}
		}
		n, err := io.Copy(io.Discard, resp.Body)
		if got += n; err != nil || got != size {
			t.Errorf("a slow client got %d bytes of %d: %v", got, size, err)
		}
		waitInUse(t, r.pool, 0)
		if n := outcomeCount(t, r.front, "beta", "error"); n != 0 {
			t.Errorf("%v errors counted", n)
		}
	})
}
