// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// slowGatherer counts the gathers running at once, each held until release.
type slowGatherer struct {
	running, most atomic.Int32
	release       chan struct{}
}

func (g *slowGatherer) Gather() ([]*dto.MetricFamily, error) {
	n := g.running.Add(1)
	for m := g.most.Load(); n > m && !g.most.CompareAndSwap(m, n); m = g.most.Load() {
	}
	<-g.release
	g.running.Add(-1)
	return nil, nil
}

// TestScrapesBounded: at most maxScrapes scrapes of /metrics read the node
// at once (each reads the kernel's maps under the lock the control loop
// needs); the others are answered 503 at once. Before, any local user could
// hold as many reads as connections.
func TestScrapesBounded(t *testing.T) {
	g := &slowGatherer{release: make(chan struct{})}
	var _ prometheus.Gatherer = g
	srv := httptest.NewServer(metricsHandler(g, slog.New(slog.DiscardHandler)))
	defer srv.Close()
	const scrapes = 3 * maxScrapes
	codes := make(chan int, scrapes)
	var wg sync.WaitGroup
	for range scrapes {
		wg.Go(func() {
			resp, err := http.Get(srv.URL)
			if err != nil {
				t.Error(err)
				codes <- 0
				return
			}
			resp.Body.Close()
			codes <- resp.StatusCode
		})
	}
	// The refused answer at once; wait for them before letting the others go.
	refused := 0
	for refused < scrapes-maxScrapes {
		select {
		case c := <-codes:
			if c != http.StatusServiceUnavailable {
				close(g.release)
				t.Fatalf("a scrape past the bound was answered %d before any ended", c)
			}
			refused++
		case <-time.After(10 * time.Second):
			close(g.release)
			wg.Wait()
			t.Fatalf("%d scrapes read the node at once, %d refused: want %d reading, the rest refused at once",
				g.most.Load(), refused, maxScrapes)
		}
	}
	close(g.release)
	wg.Wait()
	close(codes)
	for c := range codes {
		if c != http.StatusOK {
			t.Errorf("a scrape within the bound was answered %d", c)
		}
	}
	if m := g.most.Load(); m > maxScrapes {
		t.Errorf("%d scrapes read the node at once, want at most %d", m, maxScrapes)
	}
}
