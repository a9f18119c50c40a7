// SPDX-License-Identifier: Apache-2.0

package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// dashboardMetrics reads deploy/grafana/fairshare.json and returns every
// fairshare metric its panels and variables query, and the panels that do
// not say what they answer.
func dashboardMetrics(t *testing.T) (names []string, undescribed []string) {
	t.Helper()
	raw, err := os.ReadFile("../../deploy/grafana/fairshare.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Panels []struct {
			Type, Title, Description string
			Targets                  []struct{ Expr string }
		}
		Templating struct {
			List []struct{ Definition string }
		}
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	metric := regexp.MustCompile(`\bfairshare_[a-z0-9_]+`)
	seen := map[string]bool{}
	add := func(expr string) {
		for _, m := range metric.FindAllString(expr, -1) {
			seen[m] = true
		}
	}
	for _, p := range d.Panels {
		if p.Type != "row" && strings.TrimSpace(p.Description) == "" {
			undescribed = append(undescribed, p.Title)
		}
		for _, tg := range p.Targets {
			add(tg.Expr)
		}
	}
	for _, v := range d.Templating.List {
		add(v.Definition)
	}
	for m := range seen {
		names = append(names, m)
	}
	sort.Strings(names)
	return names, undescribed
}

// TestDashboardQueriesExist starts the daemon with the kernel side, the
// front and the permit API, gives every family something to show (a
// request, a rate refusal, a dry-run refusal), scrapes /metrics and checks
// that every metric the dashboard queries is there: a renamed metric would
// leave a panel empty without a word. Every panel says what it answers.
func TestDashboardQueriesExist(t *testing.T) {
	names, undescribed := dashboardMetrics(t)
	if len(names) < 20 {
		t.Fatalf("only %d metrics found in the dashboard: %v", len(names), names)
	}
	if len(undescribed) > 0 {
		t.Errorf("panels without a description of what they answer: %v", undescribed)
	}
	// The last request stays at the upstream until the end, so the
	// scheduler has a participant to show.
	hold := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			select {
			case <-hold:
			case <-r.Context().Done():
			}
		}
		io.WriteString(w, "ok")
	}))
	t.Cleanup(up.Close)
	upURL, release := up.URL, func() { close(hold) }
	n := newNode(t, fmt.Sprintf("pools: {requests: {size: 2, floor: 1}}\nconnections: {exempt: [ops]}\n"+
		"front: {listen: '127.0.0.1:0', upstream: %q, trusted_peers: ['127.0.0.1']}\n", upURL))
	if err := os.MkdirAll(filepath.Join(n.root, "ops"), 0o755); err != nil {
		t.Fatal(err)
	}
	n.start()
	defer release()
	if _, errOut, code := n.cli("policy", "set", "--requests-per-sec", "1", "--enforce=false", "alpha"); code != 0 {
		t.Fatalf("policy set: %s", errOut)
	}
	for _, path := range []string{"/x", "/x", "/hold"} {
		go func() {
			req, _ := http.NewRequest("GET", "http://"+n.r.Front+path, nil)
			req.Header.Set("Fairshare-Project", "alpha")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}
	var missing []string
	eventually(t, func() error {
		m := n.metrics()
		missing = missing[:0]
		for _, name := range names {
			if !regexp.MustCompile(`(?m)^` + name + `[{ ]`).MatchString(m) {
				missing = append(missing, name)
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("/metrics lacks what the dashboard queries: %v", missing)
		}
		return nil
	})
}
