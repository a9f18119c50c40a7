// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestQueuedClientPipelinesThenHangsUp: a request without a body waits in
// the queue, and its client sends the first byte of a next request and
// hangs up. net/http reads one byte ahead of a request without a body, and
// cancels its context when that read fails; a byte that arrives ends that
// read, and the hang-up after it went unheard: the request kept its permit
// and its place, and was sent upstream for nobody once dispatched. Now every
// HTTP/1 request that waits has its connection looked at. On net/http's
// server, on the fast path's hand-over (a Connection field sends the
// connection there) and on the fast path itself, with and without the
// stray byte, after a random pause: the queue empties, the permits go back
// and no such request reaches the upstream. A client that pipelines a
// whole request and stays is served, both requests in turn.
func TestQueuedClientPipelinesThenHangsUp(t *testing.T) {
	for _, v := range []struct {
		name   string
		fast   bool
		fields string
		rounds int
	}{
		{"net/http", false, "Connection: keep-alive\r\n", 200},
		{"handed over", true, "Connection: keep-alive\r\n", 200},
		{"fast path", true, "", 50},
	} {
		t.Run(v.name, func(t *testing.T) {
			release := make(chan struct{})
			var once sync.Once
			open := func() { once.Do(func() { close(release) }) }
			t.Cleanup(open)
			entered := make(chan struct{}, 1)
			var queuedHits atomic.Int64
			r := newRig(t, rigOpts{poolSize: 64, cfg: Config{MaxInFlight: 1, FastPath: v.fast}}, func(w http.ResponseWriter, req *http.Request) {
				switch {
				case req.URL.Path == "/hold":
					entered <- struct{}{}
					select {
					case <-release:
					case <-req.Context().Done():
						return
					}
				case strings.HasPrefix(req.URL.Path, "/queued"):
					queuedHits.Add(1)
				}
				_, _ = io.WriteString(w, "done")
			})
			held, heldDone := make(chan int, 1), make(chan struct{})
			go func() {
				defer close(heldDone)
				req, _ := http.NewRequest("GET", r.url+"/hold", nil)
				req.Header.Set(DefaultProjectHeader, "alpha")
				resp, err := r.client.Do(req)
				if err != nil {
					held <- 0
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				held <- resp.StatusCode
			}()
			t.Cleanup(func() { open(); <-heldDone })
			<-entered
			addr := strings.TrimPrefix(r.url, "http://")
			head := "GET /queued HTTP/1.1\r\nHost: x\r\nFairshare-Project: alpha\r\n" + v.fields + "\r\n"

			seed := time.Now().UnixNano()
			t.Logf("seed %d", seed)
			rng := rand.New(rand.NewPCG(uint64(seed), 0))
			const batch = 10
			for done := 0; done < v.rounds; done += batch {
				var wg sync.WaitGroup
				for range batch {
					pause := time.Duration(rng.IntN(61)) * time.Millisecond
					stray := rng.IntN(2) == 1
					wg.Go(func() {
						c, err := net.Dial("tcp", addr)
						if err != nil {
							t.Error(err)
							return
						}
						defer c.Close()
						_, _ = io.WriteString(c, head)
						time.Sleep(pause)
						if stray {
							_, _ = io.WriteString(c, "G")
						}
					})
				}
				wg.Wait()
				waitQueueEmpty(t, r, 1, fmt.Sprintf("after round %d", done+batch))
			}

			// A client that pipelines a whole request and stays.
			c, err := net.Dial("tcp", addr)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(limitsDeadline))
			_, _ = io.WriteString(c, head+strings.Replace(head, "/queued", "/queued-next", 1))
			waitInUse(t, r.pool, 2)
			time.Sleep(3 * hangupEvery)
			if n := r.pool.Snapshot().InUse; n != 2 {
				t.Errorf("a client that pipelined and stayed: %d permits in use, want 2", n)
			}
			open()
			if s := <-held; s != http.StatusOK {
				t.Errorf("the held request: status %d", s)
			}
			br := bufio.NewReader(c)
			for _, p := range []string{"/queued", "/queued-next"} {
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					t.Fatalf("the pipelined %s: %v", p, err)
				}
				if b, _ := io.ReadAll(resp.Body); resp.StatusCode != http.StatusOK || string(b) != "done" {
					t.Errorf("the pipelined %s: %s %q", p, resp.Status, b)
				}
				resp.Body.Close()
			}
			waitInUse(t, r.pool, 0)
			if n := queuedHits.Load(); n != 2 {
				t.Errorf("the upstream got %d queued requests, want 2 (the pipelined client's): requests whose client hung up reached it", n)
			}
		})
	}
}

// waitQueueEmpty waits until no request of r is queued and inUse permits
// are held; the deadline only stops a leak from hanging the test.
func waitQueueEmpty(t *testing.T, r *rig, inUse int, when string) {
	t.Helper()
	deadline := time.Now().Add(limitsDeadline)
	for {
		queued := 0
		for _, ps := range r.sched.Snapshot().Participants {
			queued += ps.Queue
		}
		held := r.pool.Snapshot().InUse
		if queued == 0 && held == inUse {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %d requests still queued, %d permits in use (want %d): a client that hung up kept its place", when, queued, held, inUse)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
