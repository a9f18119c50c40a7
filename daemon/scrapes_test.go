// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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

// bigGatherer answers with n gauges, an answer of some megabytes, and
// counts its gathers.
type bigGatherer struct {
	fams    []*dto.MetricFamily
	gathers atomic.Int32
}

func newBigGatherer(n int) *bigGatherer {
	name, help, typ := "fairshare_test_gauge", "a gauge of the test", dto.MetricType_GAUGE
	fam := &dto.MetricFamily{Name: &name, Help: &help, Type: &typ}
	for i := range n {
		k, v, val := "project", fmt.Sprintf("project-%08d-%s", i, strings.Repeat("x", 60)), float64(i)
		fam.Metric = append(fam.Metric, &dto.Metric{Label: []*dto.LabelPair{{Name: &k, Value: &v}}, Gauge: &dto.Gauge{Value: &val}})
	}
	return &bigGatherer{fams: []*dto.MetricFamily{fam}}
}

func (g *bigGatherer) Gather() ([]*dto.MetricFamily, error) {
	g.gathers.Add(1)
	return g.fams, nil
}

// TestScrapesNotHeldBySlowReaders: a client that asks for /metrics and
// never reads its answer holds no place once its answer is encoded: with
// maxScrapes such clients stuck in the write, another scrape is served.
// Before, promhttp held the place while it wrote, for up to the server's
// write timeout, and four such clients kept Prometheus at 503.
func TestScrapesNotHeldBySlowReaders(t *testing.T) {
	g := newBigGatherer(40000) // about 4 MB of text
	srv := httptest.NewServer(metricsHandler(g, slog.New(slog.DiscardHandler)))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var err error
		_ = c.Control(func(fd uintptr) { err = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
		return err
	}}
	for range maxScrapes {
		c, err := d.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := io.WriteString(c, "GET / HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
	}
	// Each has been gathered (and is being written to a client that
	// does not read).
	deadline := time.Now().Add(30 * time.Second)
	for g.gathers.Load() < maxScrapes {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d scrapes gathered", g.gathers.Load(), maxScrapes)
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Once they are encoded (a while under -race), their places are free
	// though their writes never end: another scrape is served. Held for
	// the writes, every scrape is 503 to the end.
	for {
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK && n >= 1<<20 {
			return
		}
		if resp.StatusCode != http.StatusServiceUnavailable || time.Now().After(deadline) {
			t.Fatalf("a scrape beside %d clients that do not read: %d, %d bytes; want 200 and the whole answer", maxScrapes, resp.StatusCode, n)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
