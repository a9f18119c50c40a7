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
	"strings"
	"sync"
	"testing"
	"time"
)

// switchingUpstream is an upstream of raw bytes that switches protocols
// whenever a request asks it to (Connection: upgrade and an Upgrade field),
// to whatever protocol the request named, and echoes from then on; any
// other request is answered 200 "plain". It records every byte it reads,
// and the fields of each request by its X-Case.
type switchingUpstream struct {
	addr string

	mu   sync.Mutex // guards the fields below
	read bytes.Buffer
	seen map[string]http.Header
}

func newSwitchingUpstream(t *testing.T) *switchingUpstream {
	t.Helper()
	l := loopbackListen(t)
	u := &switchingUpstream{addr: l.Addr().String(), seen: map[string]http.Header{}}
	go acceptEach(l, u.serve)
	return u
}

func (u *switchingUpstream) Write(p []byte) (int, error) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.read.Write(p)
}

func (u *switchingUpstream) serve(c net.Conn) {
	br := bufio.NewReader(io.TeeReader(c, u))
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		u.mu.Lock()
		u.seen[req.Header.Get("X-Case")] = req.Header
		u.mu.Unlock()
		if up := req.Header.Get("Upgrade"); up != "" && hasToken(req.Header["Connection"], "upgrade") {
			fmt.Fprintf(c, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: %s\r\n\r\n", up)
			_, _ = io.Copy(c, br)
			return
		}
		if _, err := io.Copy(io.Discard, req.Body); err != nil {
			return
		}
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nplain")
	}
}

// TestUpgradeOnlyWebSocket: the front tunnels WebSocket upgrades only. A
// request that asks for h2c, or for a protocol the front does not know, is
// served as the plain HTTP/1.1 request it also is (RFC 9110 7.8 lets a
// server ignore Upgrade; an h2c client then goes on in HTTP/1.1, RFC 7540
// 3.2): the upstream never reads an Upgrade or HTTP2-Settings field from
// it, and the client never gets a 101 for it. Before, any upgrade went
// through, and an upstream that switched to h2c carried any number of
// requests past admission, the rates and the scheduler, and past the
// cleaning of their fields, for tunnel_timeout. A WebSocket upgrade still
// works, offered alone or among others. On every path, with the names and
// tokens in any case, as token lists, and with Connection in one field or
// two.
func TestUpgradeOnlyWebSocket(t *testing.T) {
	paths(t, func(t *testing.T, tweak func(*Front)) {
		u := newSwitchingUpstream(t)
		f, err := New(Config{Upstream: "http://" + u.addr, TrustedPeers: []string{"127.0.0.1"}}, Deps{})
		if err != nil {
			t.Fatal(err)
		}
		if tweak != nil {
			tweak(f)
		}
		l := loopbackListen(t)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); _ = f.Serve(ctx, l) }()
		t.Cleanup(func() { cancel(); <-done })

		const settings = "AAMAAABkAARAAAAAAAIAAAAA"
		plain := []struct{ name, method, head string }{
			{"h2c", "GET", "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: " + settings + "\r\n"},
			{"h2c in lower case", "GET", "connection: upgrade, http2-settings\r\nupgrade: h2c\r\nhttp2-settings: " + settings + "\r\n"},
			{"H2C", "GET", "Connection: UPGRADE, HTTP2-SETTINGS\r\nUpgrade: H2C\r\nHTTP2-Settings: " + settings + "\r\n"},
			{"h2c with a body", "POST", "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: " + settings + "\r\nContent-Length: 5\r\n"},
			{"h2c, settings not listed", "GET", "Connection: Upgrade\r\nUpgrade: h2c\r\nHTTP2-Settings: " + settings + "\r\n"},
			{"h2c, no Connection", "GET", "Upgrade: h2c\r\nHTTP2-Settings: " + settings + "\r\n"},
			{"h2c, Connection in two fields", "GET", "Connection: keep-alive\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nHTTP2-Settings: " + settings + "\r\n"},
			{"foo, h2c", "GET", "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: foo, h2c\r\nHTTP2-Settings: " + settings + "\r\n"},
			{"h2c, foo in two fields", "GET", "Connection: Upgrade\r\nUpgrade: h2c\r\nUpgrade: foo\r\nHTTP2-Settings: " + settings + "\r\n"},
			{"unknown", "GET", "Connection: Upgrade\r\nUpgrade: foo/2\r\n"},
			{"unknown, upgrade among others", "GET", "Connection: keep-alive,upgrade , te\r\nTE: trailers\r\nUpgrade: echo\r\n"},
			{"websocket, not in Connection", "GET", "Connection: keep-alive\r\nUpgrade: websocket\r\n"},
			{"websocket, HTTP/1.0", "GET", "Connection: Upgrade\r\nUpgrade: websocket\r\n"},
		}
		for i, tc := range plain {
			c, err := net.Dial("tcp", l.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			_ = c.SetDeadline(time.Now().Add(limitsDeadline))
			proto, body := "HTTP/1.1", ""
			if strings.HasSuffix(tc.name, "HTTP/1.0") {
				proto = "HTTP/1.0"
			}
			if tc.method == "POST" {
				body = "hello"
			}
			id := fmt.Sprintf("plain-%d", i)
			fmt.Fprintf(c, "%s / %s\r\nHost: x\r\nFairshare-Project: alpha\r\nX-Case: %s\r\n%s\r\n%s", tc.method, proto, id, tc.head, body)
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			got, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || string(got) != "plain" {
				t.Errorf("%s: answered %s %q, want the upstream's plain 200", tc.name, resp.Status, got)
			}
			if proto == "HTTP/1.1" {
				// The connection goes on in HTTP/1.1.
				fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nX-Case: %s-next\r\n\r\n", id)
				resp, err := http.ReadResponse(br, nil)
				if err != nil || resp.StatusCode != http.StatusOK {
					t.Errorf("%s: the next request on the connection: %v %v", tc.name, resp, err)
				} else {
					resp.Body.Close()
				}
			}
			c.Close()
			u.mu.Lock()
			h := u.seen[id]
			u.mu.Unlock()
			if h == nil {
				t.Errorf("%s: the request did not reach the upstream", tc.name)
			}
			for _, k := range []string{"Upgrade", "Http2-Settings"} {
				if h[k] != nil {
					t.Errorf("%s: the upstream read %s: %q", tc.name, k, h[k])
				}
			}
		}

		tunnels := []struct{ name, head, want string }{
			{"websocket", "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n", "websocket"},
			{"WebSocket among others", "Connection: keep-alive, Upgrade\r\nUpgrade: WebSocket\r\n", "WebSocket"},
			{"h2c, websocket", "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c, websocket\r\nHTTP2-Settings: " + settings + "\r\n", "websocket"},
			{"foo then websocket in two fields", "connection: upgrade\r\nupgrade: foo\r\nupgrade: websocket\r\n", "websocket"},
		}
		for i, tc := range tunnels {
			c, err := net.Dial("tcp", l.Addr().String())
			if err != nil {
				t.Fatal(err)
			}
			_ = c.SetDeadline(time.Now().Add(limitsDeadline))
			id := fmt.Sprintf("tunnel-%d", i)
			fmt.Fprintf(c, "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nX-Case: %s\r\n%s\r\n", id, tc.head)
			br := bufio.NewReader(c)
			resp, err := http.ReadResponse(br, nil)
			if err != nil || resp.StatusCode != http.StatusSwitchingProtocols {
				t.Fatalf("%s: %v %v, want 101", tc.name, resp, err)
			}
			if got := resp.Header.Get("Upgrade"); got != tc.want {
				t.Errorf("%s: switched to %q, want %q", tc.name, got, tc.want)
			}
			_, _ = io.WriteString(c, "ping\n")
			if line, err := br.ReadString('\n'); err != nil || line != "ping\n" {
				t.Errorf("%s: through the tunnel: %q %v", tc.name, line, err)
			}
			c.Close()
			u.mu.Lock()
			h := u.seen[id]
			u.mu.Unlock()
			if got := h["Upgrade"]; len(got) != 1 || got[0] != tc.want {
				t.Errorf("%s: the upstream read Upgrade %q, want %q alone", tc.name, got, tc.want)
			}
			if h["Http2-Settings"] != nil {
				t.Errorf("%s: the upstream read HTTP2-Settings", tc.name)
			}
		}

		u.mu.Lock()
		raw := strings.ToLower(u.read.String())
		u.mu.Unlock()
		for _, s := range []string{"h2c", "http2-settings", settings} {
			if strings.Contains(raw, strings.ToLower(s)) {
				t.Errorf("the upstream read %q", s)
			}
		}
		waitHandlersDone(t, f)
	})
}

// waitHandlersDone waits until no handler of f runs: its requests and
// tunnels have all ended.
func waitHandlersDone(t *testing.T, f *Front) {
	t.Helper()
	deadline := time.Now().Add(limitsDeadline)
	for f.handlers.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d handlers still running", f.handlers.Load())
		}
		time.Sleep(2 * time.Millisecond)
	}
}
