// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// boundUpstream is an HTTP/1.1 upstream that knows, for each connection
// the front holds open to it, the project of the last request on it (the
// request's path is /<project>).
type boundUpstream struct {
	srv  *httptest.Server
	mu   sync.Mutex
	open map[net.Conn]*string
}

type boundConnKey struct{}

func newBoundUpstream(t *testing.T) *boundUpstream {
	t.Helper()
	u := &boundUpstream{open: map[net.Conn]*string{}}
	u.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		project := strings.TrimPrefix(r.URL.Path, "/")
		u.mu.Lock()
		*r.Context().Value(boundConnKey{}).(*string) = project
		u.mu.Unlock()
		time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
		if r.URL.Query().Get("chunked") != "" {
			// Chunked: on the fast path the loop hands the exchange
			// to net/http's path, whose pool the connection goes to.
			w.(http.Flusher).Flush()
		}
		_, _ = io.WriteString(w, project)
	}))
	u.srv.Config.ConnContext = func(ctx context.Context, c net.Conn) context.Context {
		p := new(string)
		u.mu.Lock()
		u.open[c] = p
		u.mu.Unlock()
		return context.WithValue(ctx, boundConnKey{}, p)
	}
	u.srv.Config.ConnState = func(c net.Conn, s http.ConnState) {
		if s == http.StateClosed || s == http.StateHijacked {
			u.mu.Lock()
			delete(u.open, c)
			u.mu.Unlock()
		}
	}
	u.srv.Start()
	t.Cleanup(u.srv.Close)
	return u
}

// counts returns how many connections are open in all and of each project.
func (u *boundUpstream) counts() (int, map[string]int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	per := map[string]int{}
	for _, p := range u.open {
		per[*p]++
	}
	return len(u.open), per
}

// The idle bounds are the front's, not each pool's: with four fast-path
// loops, exchanges handed to net/http's path (chunked answers) and six
// projects, a cap of 1 idle connection a project and 3 in all hold for
// what the upstream sees open once the clients are done. (When each loop
// kept its own share, rounded up to 1, and the direct pool its own, one
// project held one idle connection in every loop and the total passed
// the bound.)
func TestIdleBoundsShared(t *testing.T) {
	type mode struct {
		name        string
		fast, plain bool
	}
	modes := []mode{{name: "fast-uring", fast: true}, {name: "fast-plain", fast: true, plain: true}, {name: "nethttp"}}
	if fastPathAlways {
		modes = modes[:1]
		if plainSendsAlways {
			modes = modes[1:2]
		}
	}
	const projects, perProject, total = 6, 1, 3
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			u := newBoundUpstream(t)
			routes := map[string]string{}
			for i := range projects {
				routes[fmt.Sprintf("p%d.test", i)] = fmt.Sprint("p", i)
			}
			f, err := New(Config{Upstream: u.srv.URL, Routes: routes, UpstreamIdlePerProject: perProject}, Deps{})
			if err != nil {
				t.Fatal(err)
			}
			f.cfg.FastPath, f.cfg.PlainSends = m.fast, m.plain
			f.fastLoops = 4
			d := f.up.(*directUpstream)
			d.maxIdle = total
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { defer close(done); _ = f.Serve(ctx, l) }()
			t.Cleanup(func() { cancel(); <-done })

			var wg sync.WaitGroup
			for i := range projects * 4 {
				project := fmt.Sprint("p", i%projects)
				wg.Go(func() {
					tr := &http.Transport{MaxIdleConnsPerHost: 1}
					defer tr.CloseIdleConnections()
					cl := &http.Client{Transport: tr, Timeout: 20 * time.Second}
					for k := range 30 {
						url := "http://" + l.Addr().String() + "/" + project
						if (i+k)%11 == 10 && i%2 == 0 {
							url += "?chunked=1"
						}
						req, _ := http.NewRequest("GET", url, nil)
						req.Host = project + ".test"
						resp, err := cl.Do(req)
						if err != nil {
							t.Errorf("%s: %v", project, err)
							return
						}
						body, _ := io.ReadAll(resp.Body)
						resp.Body.Close()
						if string(body) != project {
							t.Errorf("%s got %q", project, body)
						}
					}
				})
			}
			wg.Wait()
			over := func() string {
				n, per := u.counts()
				var bad []string
				if n > total {
					bad = append(bad, fmt.Sprintf("%d open in all (bound %d)", n, total))
				}
				for p, k := range per {
					if k > perProject {
						bad = append(bad, fmt.Sprintf("%d open of %s (bound %d)", k, p, perProject))
					}
				}
				return strings.Join(bad, ", ")
			}
			// The last answers reach the clients just before their
			// connections are put back (and what is past a bound closed).
			deadline := time.Now().Add(5 * time.Second)
			for over() != "" && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			if s := over(); s != "" {
				t.Errorf("idle upstream connections past the bounds: %s", s)
			}
			if m.fast {
				fs := f.fast.Load()
				if fs == nil {
					t.Fatal("the fast path did not serve")
				}
				var ex int64
				for _, lp := range fs.loops {
					ex += lp.exchanges.Load()
				}
				if ex == 0 || fs.handedN.Load() == 0 || len(fs.loops) != 4 {
					t.Errorf("%d loops ended %d exchanges and handed %d connections: want 4 loops, both > 0",
						len(fs.loops), ex, fs.handedN.Load())
				}
			}
		})
	}
}
