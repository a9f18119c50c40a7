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
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// h2Ask sends one request of the given pseudo-header and header fields on a
// new h2c connection (prior knowledge) and returns the answer's status and
// body, or status 0 if the server reset the stream or ended the connection.
func h2Ask(t *testing.T, addr string, fields [][2]string) (int, string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, limitsDeadline)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(limitsDeadline))
	if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	for _, f := range fields {
		_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
	}
	if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
		t.Fatal(err)
	}
	status := 0
	var body strings.Builder
	dec := hpack.NewDecoder(4096, func(f hpack.HeaderField) {
		if f.Name == ":status" {
			fmt.Sscanf(f.Value, "%d", &status)
		}
	})
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return 0, ""
		}
		switch f := f.(type) {
		case *http2.SettingsFrame:
			if !f.IsAck() {
				_ = fr.WriteSettingsAck()
			}
		case *http2.HeadersFrame:
			if _, err := dec.Write(f.HeaderBlockFragment()); err != nil {
				t.Fatal(err)
			}
			if f.StreamEnded() {
				return status, body.String()
			}
		case *http2.DataFrame:
			body.Write(f.Data())
			if f.StreamEnded() {
				return status, body.String()
			}
		case *http2.RSTStreamFrame, *http2.GoAwayFrame:
			return 0, ""
		}
	}
}

// TestH2MalformedHeadRefused: net/http's HTTP/2 server hands a handler a
// method that is not a token and a query holding spaces (it refuses only
// control bytes), and the front wrote them into the upstream's request
// line: "GET /v1/x /healthz" was routed and charged as /healthz and served
// as /v1/x by an upstream lenient about spaces; "HEAD " was a HEAD to the
// upstream and not to the front, which then waited for a body that never
// came, holding its permit and place. Now the front answers 400 itself and
// nothing reaches the upstream. 300 rounds of random malformed methods,
// queries and authorities, with the fast path on and off; a well-formed
// request on the same front is served.
func TestH2MalformedHeadRefused(t *testing.T) {
	for _, fast := range []bool{false, true} {
		t.Run(fmt.Sprintf("fastpath=%v", fast), func(t *testing.T) {
			r := newRig(t, rigOpts{poolSize: 4, cfg: Config{FastPath: fast}}, func(w http.ResponseWriter, req *http.Request) {
				w.Header().Set("Content-Length", "20")
				if req.Method != http.MethodHead {
					_, _ = io.WriteString(w, strings.Repeat("x", 20))
				}
			})
			addr := strings.TrimPrefix(r.url, "http://")
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 3))
			words := []string{"GET", "HEAD", "POST", "/v1/x", "/healthz", "HTTP/1.1"}
			word := func() string { return words[rng.IntN(len(words))] }
			for round := range 150 {
				method, path, authority := "GET", "/healthz", "x"
				// own: the front must refuse it itself (Go's HTTP/2 server
				// passes it on); otherwise the server may refuse it first.
				own := true
				switch rng.IntN(5) {
				case 0:
					method = word() + " " + word()
				case 1:
					method = word() + strings.Repeat(" ", 1+rng.IntN(3))
				case 2:
					method = strings.Repeat(" ", 1+rng.IntN(2)) + word()
				case 3:
					path = "/healthz?a" + []string{" ", "  "}[rng.IntN(2)] + word()
				case 4:
					authority, own = "x"+[]string{" ", "/", "\\", "{"}[rng.IntN(4)]+"y", false
				}
				status, body := h2Ask(t, addr, [][2]string{{":method", method}, {":scheme", "http"}, {":path", path},
					{":authority", authority}, {strings.ToLower(DefaultProjectHeader), "alpha"}})
				if own && (status != http.StatusBadRequest || !strings.HasPrefix(body, "fairshare: ")) {
					t.Fatalf("round %d: %q %q %q: %d %q, want the front's 400", round, method, path, authority, status, body)
				}
				if !own && status != 0 && status != http.StatusBadRequest {
					t.Fatalf("round %d: %q %q %q: %d %q, want 400 or a reset", round, method, path, authority, status, body)
				}
				if got := r.hits.Load(); got != 0 {
					t.Fatalf("round %d: %q %q %q reached the upstream", round, method, path, authority)
				}
			}
			waitInUse(t, r.pool, 0)
			status, body := h2Ask(t, addr, [][2]string{{":method", "GET"}, {":scheme", "http"}, {":path", "/healthz?a=b%20c"},
				{":authority", "x"}, {strings.ToLower(DefaultProjectHeader), "alpha"}})
			if status != http.StatusOK || len(body) != 20 || r.hits.Load() != 1 {
				t.Fatalf("a well-formed request: %d %q, %d upstream hits", status, body, r.hits.Load())
			}
		})
	}
}
