// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/events"
)

// events runs 'fairshare events --json' with args and returns what it
// printed.
func (n *node) events(args ...string) []events.Event {
	n.t.Helper()
	out, errOut, code := n.cli(append([]string{"events", "--json"}, args...)...)
	if code != 0 {
		n.t.Fatalf("events: exit %d: %s", code, errOut)
	}
	var evs []events.Event
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if line == "" {
			continue
		}
		var e events.Event
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			n.t.Fatalf("events --json printed %q: %v", line, err)
		}
		evs = append(evs, e)
	}
	return evs
}

func ofKind(evs []events.Event, source, kind string) []events.Event {
	var out []events.Event
	for _, e := range evs {
		if e.Source == source && e.Kind == kind {
			out = append(out, e)
		}
	}
	return out
}

// holdingUpstream answers each request once release is closed.
func holdingUpstream(t *testing.T) (url string, release func()) {
	ch := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-ch:
		case <-r.Context().Done():
		}
		io.WriteString(w, "ok")
	}))
	t.Cleanup(up.Close)
	var once bool
	return up.URL, func() {
		if !once {
			once = true
			close(ch)
		}
	}
}

// TestFrontEventsAndDryRun drives the front of a real daemon: a share
// refusal and a request naming no project come out of 'fairshare events
// --json' with their fields; then 'policy set --enforce=false' puts the
// project in dry-run, and it is admitted past the pool while each would-be
// refusal is counted (status, /metrics, events). The flights pool, in
// dry-run by configuration, does the same for the permit API; events.log
// holds the same events; a 403 from an untrusted peer and a rate refusal name
// the peer and the reason.
func TestFrontEventsAndDryRun(t *testing.T) {
	upURL, release := holdingUpstream(t)
	logPath := filepath.Join(t.TempDir(), "events.log")
	sock := filepath.Join(t.TempDir(), "front.sock")
	n := newNode(t, fmt.Sprintf("pools: {requests: {size: 4, floor: 1}, flights: {size: 2, floor: 1, enforce: false}}\n"+
		"front: {listen: '127.0.0.1:0', socket: %q, upstream: %q, trusted_peers: ['127.0.0.1']}\nevents: {log: %s}\n", sock, upURL, logPath))
	n.start()
	get := func(project string) chan int {
		done := make(chan int, 1)
		go func() {
			req, _ := http.NewRequest("GET", "http://"+n.r.Front+"/x", nil)
			if project != "" {
				req.Header.Set("Fairshare-Project", project)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				done <- -1
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			done <- resp.StatusCode
		}()
		return done
	}
	var held []chan int
	for range 4 {
		held = append(held, get("alpha"))
	}
	eventually(t, func() error {
		if p := pool(n.status(), "requests"); p.InUse != 4 {
			return fmt.Errorf("in use %d, want 4", p.InUse)
		}
		return nil
	})
	if code := <-get("alpha"); code != 429 {
		t.Fatalf("alpha's 5th request on a full pool: %d, want 429", code)
	}
	if code := <-get(""); code != 400 {
		t.Fatalf("a request naming no project: %d, want 400", code)
	}
	evs := n.events("--pool", "requests")
	ref := ofKind(evs, events.SourceFront, events.KindRefused)
	if len(ref) != 2 {
		t.Fatalf("front refusals: %+v, want 2", evs)
	}
	if e := ref[0]; e.Project != "alpha" || e.Reason != events.ReasonShare || e.Held != 4 || e.InUse != 4 ||
		e.Share != 4 || e.PoolSize != 4 || !strings.HasPrefix(e.Remote, "127.0.0.1:") || e.Seq == 0 {
		t.Errorf("share refusal: %+v", e)
	}
	if e := ref[1]; e.Reason != events.ReasonNoIdent || !strings.HasPrefix(e.Remote, "127.0.0.1:") || !strings.HasPrefix(e.Detail, "400") {
		t.Errorf("identity refusal: %+v", e)
	}
	if got := n.events("--project", "beta"); len(got) != 0 {
		t.Errorf("--project beta: %+v", got)
	}

	// Dry-run for alpha alone, live.
	if out, errOut, code := n.cli("policy", "set", "--enforce=false", "alpha"); code != 0 || !strings.Contains(out, "dry-run") {
		t.Fatalf("policy set --enforce=false: %d %s %s", code, out, errOut)
	}
	for range 2 {
		held = append(held, get("alpha"))
	}
	eventually(t, func() error {
		p := pool(n.status(), "requests")
		if pr := project(p, "alpha"); p.InUse != 6 || p.WouldRefuse != 2 || pr.WouldRefuse != 2 || !pr.DryRun || p.Refused != 1 {
			return fmt.Errorf("requests pool in dry-run for alpha: %+v", p)
		}
		return nil
	})
	if code := <-get(""); code != 400 {
		t.Fatalf("dry-run of a project does not admit a request naming none: %d", code)
	}
	would := ofKind(n.events("--project", "alpha"), events.SourceFront, events.KindWouldRefuse)
	if len(would) != 2 || would[0].InUse != 4 || would[1].InUse != 5 || would[0].Reason != events.ReasonShare {
		t.Errorf("would_refuse events: %+v", would)
	}
	m := n.metrics()
	for _, want := range []string{`fairshare_project_would_refuse_total{pool="requests",project="alpha"} 2`,
		`fairshare_pool_would_refuse_total{pool="requests"} 2`, `fairshare_front_would_refuse_total{reason="share"} 2`,
		`fairshare_pool_enforced{pool="requests"} 1`, `fairshare_pool_enforced{pool="flights"} 0`} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	release()
	for _, ch := range held {
		if code := <-ch; code != 200 {
			t.Errorf("a held request ended %d", code)
		}
	}

	// A project header from an untrusted peer (the unix socket trusts
	// nobody) is a 403 with the peer named; a rate refusal names its reason.
	overSock := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	req, _ := http.NewRequest("GET", "http://front/x", nil)
	req.Header.Set("Fairshare-Project", "alpha")
	if resp, err := overSock.Do(req); err != nil || resp.StatusCode != http.StatusForbidden {
		t.Fatalf("a header over the unix socket: %v %v, want 403", resp, err)
	} else {
		resp.Body.Close()
	}
	if _, errOut, code := n.cli("policy", "set", "--requests-per-sec", "1", "rl"); code != 0 {
		t.Fatalf("policy set: %s", errOut)
	}
	codes := []int{<-get("rl"), <-get("rl")}
	if codes[1] != 429 {
		t.Fatalf("rl at 1 request/s: %v, want the second refused", codes)
	}
	var untrusted, rate int
	for _, e := range ofKind(n.events(), events.SourceFront, events.KindRefused) {
		switch {
		case e.Reason == events.ReasonUntrust && e.Remote == "unix" && strings.HasPrefix(e.Detail, "403"):
			untrusted++
		case e.Reason == events.ReasonRate && e.Project == "rl" && strings.HasPrefix(e.Remote, "127.0.0.1:"):
			rate++
		}
	}
	if untrusted != 1 || rate != 1 {
		t.Errorf("front refusals: %d untrusted (403), %d rate; want 1 and 1", untrusted, rate)
	}

	// The flights pool is in dry-run by configuration: a third permit on a
	// pool of 2 is admitted and counted.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, client.Options{Socket: n.r.Permits})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i := range 3 {
		if _, err := c.Acquire(ctx, "flights", "gamma"); err != nil {
			t.Fatalf("flights permit %d in dry-run: %v", i, err)
		}
	}
	p := pool(n.status(), "flights")
	if p.InUse != 3 || p.WouldRefuse != 1 || !p.DryRun {
		t.Errorf("flights in dry-run: %+v", p)
	}
	pe := ofKind(n.events("--pool", "flights"), events.SourcePermits, events.KindWouldRefuse)
	if len(pe) != 1 || pe[0].Project != "gamma" || pe[0].Reason != events.ReasonShare || pe[0].InUse != 2 || !strings.HasPrefix(pe[0].Remote, "uid 0 pid ") {
		t.Errorf("permit API would_refuse: %+v", pe)
	}

	// events.log has them too, one JSON object a line (flushed each tick).
	eventually(t, func() error {
		b, err := os.ReadFile(logPath)
		if err != nil {
			return err
		}
		kinds := map[string]int{}
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			var e events.Event
			if err := json.Unmarshal([]byte(line), &e); err != nil {
				return fmt.Errorf("events.log line %q: %v", line, err)
			}
			kinds[e.Source+"/"+e.Kind]++
		}
		if kinds["front/refused"] != 5 || kinds["front/would_refuse"] != 2 || kinds["permits/would_refuse"] != 1 {
			return fmt.Errorf("events.log: %v", kinds)
		}
		return nil
	})
}

// TestEventsFollow: --follow prints what comes after it started, in text,
// and ends on SIGINT with status 0.
func TestEventsFollow(t *testing.T) {
	n := newNode(t, "front: {listen: '127.0.0.1:0', upstream: 'http://127.0.0.1:1'}\n")
	n.start()
	cmd := exec.Command(binary, "events", "--config", n.cfg, "--follow")
	cmd.Env = cleanEnv()
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	lines := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	// Until the stream is up, requests are sent again.
	deadline := time.After(10 * time.Second)
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for got := ""; !strings.Contains(got, "reason=no_project"); {
		select {
		case got = <-lines:
		case <-tick.C:
			if resp, err := http.Get("http://" + n.r.Front + "/x"); err == nil {
				resp.Body.Close()
			}
		case <-deadline:
			t.Fatal("no event came through --follow in 10s")
		}
	}
	cmd.Process.Signal(os.Interrupt)
	if err := cmd.Wait(); err != nil {
		t.Errorf("events --follow after SIGINT: %v", err)
	}
}

// TestFrontDryRunPool: the requests pool in dry-run by configuration
// admits requests past POOL through the front, counting each would-be
// refusal in status and /metrics.
func TestFrontDryRunPool(t *testing.T) {
	upURL, release := holdingUpstream(t)
	n := newNode(t, fmt.Sprintf("pools: {requests: {size: 2, floor: 1, enforce: false}}\n"+
		"front: {listen: '127.0.0.1:0', upstream: %q, trusted_peers: ['127.0.0.1']}\n", upURL))
	n.start()
	var done []chan int
	for range 4 {
		ch := make(chan int, 1)
		done = append(done, ch)
		go func() {
			req, _ := http.NewRequest("GET", "http://"+n.r.Front+"/x", nil)
			req.Header.Set("Fairshare-Project", "alpha")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				ch <- -1
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			ch <- resp.StatusCode
		}()
	}
	eventually(t, func() error {
		p := pool(n.status(), "requests")
		if p.InUse != 4 || p.WouldRefuse != 2 || p.Refused != 0 || !p.DryRun {
			return fmt.Errorf("requests in dry-run: %+v", p)
		}
		return nil
	})
	m := n.metrics()
	for _, want := range []string{`fairshare_pool_would_refuse_total{pool="requests"} 2`, `fairshare_pool_enforced{pool="requests"} 0`,
		`fairshare_front_would_refuse_total{reason="share"} 2`} {
		if !strings.Contains(m, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	release()
	for _, ch := range done {
		if code := <-ch; code != 200 {
			t.Errorf("a request in dry-run ended %d", code)
		}
	}
}
