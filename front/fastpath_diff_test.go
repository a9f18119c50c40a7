// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// seenDump is what the upstream saw of a request, in a stable form.
func seenDump(req *http.Request) string {
	var b strings.Builder
	host := req.Host
	if strings.HasPrefix(host, "127.0.0.1:") {
		host = "(upstream)" // Host the front fills in when the client sent none
	}
	fmt.Fprintf(&b, "%s %s %s host=%q cl=%d te=%v\n", req.Method, req.RequestURI, req.Proto, host, req.ContentLength, req.TransferEncoding)
	keys := make([]string, 0, len(req.Header))
	for k := range req.Header {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "%s: %q\n", k, req.Header[k])
	}
	body, _ := io.ReadAll(req.Body)
	fmt.Fprintf(&b, "body=%q\n", body)
	return b.String()
}

var dateLine = regexp.MustCompile(`(?m)^Date: .*\r\n`)

// diffExchange sends raw on a fresh connection and returns the answers that
// came within the deadline, each as http.ReadResponse read it.
func diffExchange(t *testing.T, url, raw string) string {
	c, err := net.Dial("tcp", strings.TrimPrefix(url, "http://"))
	if err != nil {
		t.Error(err)
		return ""
	}
	defer c.Close()
	_, _ = io.WriteString(c, raw)
	_ = c.SetReadDeadline(time.Now().Add(1500 * time.Millisecond))
	br := bufio.NewReader(c)
	var out strings.Builder
	for {
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			break
		}
		b, _ := httputil.DumpResponse(resp, true)
		out.Write(b)
		out.WriteString("----\n")
		if resp.Close {
			break
		}
	}
	return out.String()
}

func sortedHeads(s string) string {
	var parts []string
	for _, ans := range strings.Split(s, "----\n") {
		head, body, _ := strings.Cut(ans, "\r\n\r\n")
		lines := strings.Split(head, "\r\n")
		if len(lines) > 1 {
			sort.Strings(lines[1:])
		}
		parts = append(parts, strings.Join(lines, "\r\n")+"\r\n\r\n"+body)
	}
	return strings.Join(parts, "----\n")
}

// TestFastPathSameAsNetHTTP sends unusual but legal requests (and some the
// fast path hands to net/http's server) to a front on the fast path and to
// one on net/http's path, and compares what the upstream saw and what the
// client got, as http.ReadResponse reads it (keys in canonical form), but
// for Date and the order of header lines. (From the fourth review, which
// found no difference.) TestFastPathAnswerSameAsNetHTTP varies the answer.
func TestFastPathSameAsNetHTTP(t *testing.T) {
	var mu sync.Mutex
	seen := map[string][]string{}
	up := func(w http.ResponseWriter, req *http.Request) {
		d := seenDump(req)
		mu.Lock()
		seen[req.Header.Get("X-Case")] = append(seen[req.Header.Get("X-Case")], d)
		mu.Unlock()
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", "3")
		_, _ = io.WriteString(w, "ok\n")
	}
	// Room for every case at once (a refusal would differ by timing).
	fast := fastRig(t, rigOpts{poolSize: 256}, up)
	slow := newRig(t, rigOpts{poolSize: 256, tweak: func(f *Front) { f.cfg.FastPath = false }}, up)
	longURI := "/" + strings.Repeat("a", 8<<10-200)
	many := ""
	for i := range 63 {
		many += fmt.Sprintf("X-H%d: v\r\n", i)
	}
	cases := map[string]string{
		"cl0get":  "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n",
		"cl0post": "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n",
		"cl00":    "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 00\r\n",
		"getbody": "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n",
		"semi":    "GET /a?b=c;d HTTP/1.1\r\nHost: x\r\n",
		"dslash":  "GET //x/../y HTTP/1.1\r\nHost: x\r\n",
		"dup":     "GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nx-a: 2\r\n",
		"hop":     "GET / HTTP/1.1\r\nHost: x\r\nKeep-Alive: 5\r\nProxy-Connection: keep-alive\r\nTE: trailers, deflate\r\nProxy-Authorization: x\r\n",
		"claims":  "GET / HTTP/1.1\r\nHost: x\r\nFairshare_Project: beta\r\nX_Forwarded_For: 1.2.3.4\r\nForwarded: for=1.2.3.4\r\nX-Forwarded-Host: evil\r\nX-Real-Ip: 9.9.9.9\r\n",
		"claims2": "GET / HTTP/1.1\r\nHost: x\r\nX-Forwarded-Scheme: https\r\nx_forwarded_ssl: on\r\nX-Forwarded-Port: 443\r\nX-Scheme: https\r\nClient-IP: 6.6.6.6\r\n" +
			"True-Client-Ip: 6.6.6.6\r\nX_Cluster_Client_Ip: 6.6.6.6\r\nX-Url-Scheme: https\r\nFront-End-Https: on\r\nX-Forwarded: for=6.6.6.6\r\nForwarded-For: 6.6.6.6\r\nX-Keep: 1\r\n",
		"lower":      "get / HTTP/1.1\r\nHost: x\r\n",
		"hostport":   "GET / HTTP/1.1\r\nHost: X.example:80\r\n",
		"longuri":    "GET " + longURI + " HTTP/1.1\r\nHost: x\r\n",
		"many":       "GET / HTTP/1.1\r\nHost: x\r\n" + many,
		"tabs":       "GET / HTTP/1.1\r\nHost: x\r\nX-T: \ta b\t\r\n",
		"emptyval":   "GET / HTTP/1.1\r\nHost: x\r\nX-E:\r\n",
		"hostlast":   "GET / HTTP/1.1\r\nX-B: 1\r\nhost: x\r\n",
		"dup-host":   "GET / HTTP/1.1\r\nHost: x\r\nHost: x\r\n",
		"frag":       "GET /a#b HTTP/1.1\r\nHost: x\r\n",
		"pct":        "GET /a%2Fb?x=%41 HTTP/1.1\r\nHost: x\r\n",
		"ipv6host":   "GET / HTTP/1.1\r\nHost: [::1]:80\r\n",
		"obsbody":    "DELETE / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n",
		"hostUnder":  "GET / HTTP/1.1\r\nHost: a_b\r\n",
		"cookie2":    "GET / HTTP/1.1\r\nHost: x\r\nCookie: a=1\r\nCookie: b=2\r\n",
		"proj-lower": "GET / HTTP/1.1\r\nHost: x\r\nfairshare-project: alpha\r\n",
		"abs":        "GET http://y.example/p?q=1 HTTP/1.1\r\nHost: x\r\n",
		"star":       "OPTIONS * HTTP/1.1\r\nHost: x\r\n",
		"h10ka":      "GET / HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n",
		"h10":        "GET / HTTP/1.0\r\n",
		"close":      "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n",
		"expect":     "POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n",
		"head":       "HEAD / HTTP/1.1\r\nHost: x\r\n",
		"connhdr":    "GET / HTTP/1.1\r\nHost: x\r\nConnection: X-Drop\r\nX-Drop: 1\r\n",
		"framing": "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer_Encoding: chunked\r\nContent_Length: 99\r\n" +
			"keep_alive: 5\r\nCONNECTION_: x\r\nProxy_Connection: close\r\nTrailer_: x\r\nx_te: 1\r\nUpgrade_: h2c\r\nExpect_: 100-continue\r\nHost_: y\r\n",
		"pipe":  "GET /1 HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nX-Case: pipe\r\n\r\nGET /2 HTTP/1.0\r\nHost: x\r\n",
		"pipe2": "GET /1 HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\nFairshare-Project: alpha\r\nX-Case: pipe2\r\n\r\nGET /2 HTTP/1.1\r\nHost: x\r\n",
	}
	// All at once: each waits out its answers' read deadline.
	var wg sync.WaitGroup
	for name, head := range cases {
		wg.Go(func() { exchangeBoth(t, name, head, fast, slow, &mu, seen) })
	}
	wg.Wait()
}

// exchangeBoth sends case name to fast, then to slow, and compares.
func exchangeBoth(t *testing.T, name, head string, fast, slow *rig, mu *sync.Mutex, seen map[string][]string) {
	{
		body := ""
		switch name {
		case "getbody":
			body = "abc"
		case "obsbody", "expect", "framing":
			body = "zz"
		}
		proj := "Fairshare-Project: alpha\r\n"
		if name == "proj-lower" {
			proj = ""
		}
		raw := head + proj + "X-Case: " + name + "\r\n\r\n" + body
		a := sortedHeads(dateLine.ReplaceAllString(diffExchange(t, fast.url, raw), ""))
		b := sortedHeads(dateLine.ReplaceAllString(diffExchange(t, slow.url, raw), ""))
		if a != b {
			t.Errorf("%s: client saw\nfast:\n%s\nnet/http:\n%s", name, a, b)
		}
		mu.Lock()
		s := seen[name]
		mu.Unlock()
		if len(s) == 2 && s[0] != s[1] {
			t.Errorf("%s: upstream saw\nfirst:\n%s\nsecond:\n%s", name, s[0], s[1])
		} else if len(s) == 4 && (s[0] != s[2] || s[1] != s[3]) {
			t.Errorf("%s: upstream saw\n%s", name, s)
		} else if len(s) != 2 && len(s) != 0 && len(s) != 4 {
			t.Errorf("%s: upstream saw %d requests", name, len(s))
		}
		// Equal is not enough for the claims: both paths must drop them,
		// and framing fields spelt with '_' (an upstream reading them as
		// the fields would frame the request by the client's word).
		for _, d := range s {
			if name == "framing" {
				for _, k := range []string{"transfer_encoding", "content_length", "keep_alive", "proxy_connection"} {
					if strings.Contains(strings.ToLower(d), k) {
						t.Errorf("%s: the upstream got %s:\n%s", name, k, d)
					}
				}
				for _, k := range []string{"x_te", "connection_", "trailer_", "upgrade_", "expect_", "host_"} {
					if !strings.Contains(strings.ToLower(d), k) {
						t.Errorf("%s: the upstream did not get %s, which frames nothing:\n%s", name, k, d)
					}
				}
			}
			for _, v := range map[string][]string{"claims": {"1.2.3.4", "9.9.9.9", "evil", "beta"},
				"claims2": {"6.6.6.6", "https", ": on", "443"}}[name] {
				if strings.Contains(d, v) {
					t.Errorf("%s: the upstream got the client's claim %q:\n%s", name, v, d)
				}
			}
		}
	}
}

// TestFastPathAnswerSameAsNetHTTP has an upstream answer in raw bytes, in
// heads plain enough for the fast path, and compares the raw bytes each
// client got from a front on the fast path and from one on net/http's
// path, but for Date and the order of header lines. The upstream's copies
// of the front's own fields and its hop-by-hop fields, in any case, reach
// neither client, and a client gets exactly one Date (the upstream's when
// it sent one) and one queue wait, the front's. (From the review of the loop's answer without a header
// map, which found no difference.)
func TestFastPathAnswerSameAsNetHTTP(t *testing.T) {
	answers := map[string]string{
		"forged": "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nx-lower: a\r\nX_Under: b\r\nX-Empty:\r\nX-WS:   a  b \t\r\n" +
			"fairshare-class: forged\r\nfairshare-queue-wait: forged\r\nfairshare-refused: forged\r\nfairshare-work-units: 5\r\nkeep-alive: forged\r\n" +
			"proxy-connection: forged\r\nte: forged\r\nupgrade: forged\r\nproxy-authenticate: forged\r\nproxy-authorization: forged\r\n" +
			"date: Tue, 01 Dec 2026 00:00:00 GMT\r\n\r\nabc",
		"canonical": "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1\r\nFairshare-Class: P1\r\nFairshare-Queue-Wait: 9\r\n" +
			"Fairshare-Refused: share\r\nFairshare-Work-Units: 2\r\nKeep-Alive: forged\r\nX-Up: kept\r\n\r\nz",
		"cl007":     "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 007\r\n\r\nabcdefg",
		"cl0":       "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
		"clspace":   "HTTP/1.1 200 OK\r\nContent-Type: a\r\nContent-Length:  1 \r\n\r\nz",
		"noreason":  "HTTP/1.1 299\r\nContent-Type: a\r\nContent-Length: 1\r\n\r\nz",
		"reason":    "HTTP/1.1 599 Weird Reason\r\nContent-Type: a\r\nContent-Length: 1\r\n\r\nz",
		"404":       "HTTP/1.1 404 Not Found\r\nContent-Type: a\r\nContent-Length: 1\r\n\r\nz",
		"emptytype": "HTTP/1.1 200 OK\r\nContent-Type:\r\nContent-Length: 5\r\n\r\n<html",
		"emptydate": "HTTP/1.1 200 OK\r\nContent-Type: a\r\nDate:\r\nContent-Length: 1\r\n\r\nz",
		"encoding":  "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Encoding: gzip\r\nContent-Length: 5\r\n\r\n<html",
		"extra":     "HTTP/1.1 200 OK\r\nContent-Type: a\r\nContent-Length: 1\r\n\r\nzHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
		"badcost":   "HTTP/1.1 200 OK\r\nContent-Type: a\r\nFairshare-Work-Units: -3\r\nContent-Length: 1\r\n\r\nz",
		"cookie":    "HTTP/1.1 200 OK\r\nContent-Type: a\r\nSet-Cookie: a=b; Path=/; HttpOnly\r\nContent-Length: 1\r\n\r\nz",
		"colons":    "HTTP/1.1 200 OK\r\nContent-Type: a\r\nX-C:a:b: c\r\nX-T: a\tb\r\nContent-Length: 1\r\n\r\nz",
	}
	up := func(w http.ResponseWriter, req *http.Request) {
		c, bw, err := w.(http.Hijacker).Hijack()
		if err != nil {
			return
		}
		_, _ = bw.WriteString(answers[req.Header.Get("X-Case")])
		_ = bw.Flush()
		c.Close()
	}
	fast := fastRig(t, rigOpts{poolSize: 64}, up)
	slow := newRig(t, rigOpts{poolSize: 64, tweak: func(f *Front) { f.cfg.FastPath = false }}, up)
	var wg sync.WaitGroup
	for name := range answers {
		wg.Go(func() {
			raw := "GET / HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\nX-Case: " + name + "\r\n\r\n"
			fastGot := rawRoundTrip(t, strings.TrimPrefix(fast.url, "http://"), raw)
			slowGot := rawRoundTrip(t, strings.TrimPrefix(slow.url, "http://"), raw)
			noDate := regexp.MustCompile(`(?im)^date:.*\r\n`)
			if a, b := sortedHeads(noDate.ReplaceAllString(fastGot, "")), sortedHeads(noDate.ReplaceAllString(slowGot, "")); a != b {
				t.Errorf("%s: client saw\nfast:\n%q\nnet/http:\n%q", name, a, b)
			}
			for _, got := range []string{fastGot, slowGot} {
				head, _, _ := strings.Cut(strings.ToLower(got), "\r\n\r\n")
				if strings.Contains(head, "forged") || strings.Count(head, "\r\ndate:") != 1 ||
					strings.Contains(head, "fairshare-work-units") || strings.Contains(head, "fairshare-refused") ||
					strings.Count(head, "\r\nfairshare-queue-wait:") != 1 || strings.Contains(head, "fairshare-queue-wait: 9") ||
					strings.Contains(head, "fairshare-class: p1") {
					t.Errorf("%s: the upstream's word on the front's fields, a hop-by-hop field or a second Date reached the client:\n%q", name, got)
				}
				// The upstream's own fields pass, its Date among them.
				if want := map[string]string{"forged": "\r\ndate: tue, 01 dec 2026 00:00:00 gmt\r\n", "canonical": "\r\nx-up: kept"}[name]; want != "" && !strings.Contains(head+"\r\n", want) {
					t.Errorf("%s: the client did not get the upstream's %q:\n%q", name, strings.TrimSpace(want), got)
				}
			}
		})
	}
	wg.Wait()
}
