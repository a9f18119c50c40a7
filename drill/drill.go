// SPDX-License-Identifier: Apache-2.0

package drill

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/front"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// Project names used by both drills.
const (
	Small = "small"
	Big   = "big"
)

// Phase names, in order.
const (
	PhaseSolo     = "solo"
	PhaseBoth     = "both"
	PhaseBigAlone = "big-alone"
)

// SeedRatio is the specification's bound on small's p99 under contention,
// as a multiple of its solo p99.
const SeedRatio = 3.0

// ErrVerdict is returned (wrapped) by callers that turn a failed verdict into
// an error, such as the CLI.
var ErrVerdict = errors.New("drill verdict failed")

// ErrOverran means the drill's requests did not finish long after the last
// phase ended: something is stuck.
var ErrOverran = errors.New("drill overran its phases by 30s")

// Config sets the drill's knobs. Zero fields take the defaults noted.
type Config struct {
	PoolSize     int           // requests (or connections) pool; 8
	BigWriters   int           // 16
	SmallWriters int           // 2
	Phase        time.Duration // length of each phase; 5s
	Warmup       time.Duration // small runs this long before the solo phase starts counting; 500ms
	ServiceTime  time.Duration // the upstream's fixed cost per request (or connection hold time); 20ms
	RetryPause   time.Duration // a refused writer's pause before it tries again; 10ms
	Sample       time.Duration // pool snapshot interval for permits held; 1ms
	Recompute    time.Duration // pool recompute period, as in the daemon; 1s
	TargetRatio  float64       // our goal for small's p99 ratio; 2
	Log          *slog.Logger
}

func (c Config) withDefaults() Config {
	def := func(v *time.Duration, d time.Duration) {
		if *v <= 0 {
			*v = d
		}
	}
	if c.PoolSize <= 0 {
		c.PoolSize = 8
	}
	if c.BigWriters <= 0 {
		c.BigWriters = 16
	}
	if c.SmallWriters <= 0 {
		c.SmallWriters = 2
	}
	def(&c.Phase, 5*time.Second)
	def(&c.Warmup, 500*time.Millisecond)
	def(&c.ServiceTime, 20*time.Millisecond)
	def(&c.RetryPause, 10*time.Millisecond)
	def(&c.Sample, time.Millisecond)
	def(&c.Recompute, time.Second)
	if c.TargetRatio <= 0 {
		c.TargetRatio = 2
	}
	if c.Log == nil {
		c.Log = slog.New(slog.DiscardHandler)
	}
	return c
}

// timeline places the phases: small runs from 0 to the end of "both", big
// from the start of "both" to the end.
type timeline struct {
	start             time.Time
	warmup, phase     time.Duration
	soloAt, bothAt    time.Time
	bigAloneAt, endAt time.Time
}

func newTimeline(start time.Time, warmup, phase time.Duration) timeline {
	tl := timeline{start: start, warmup: warmup, phase: phase}
	tl.soloAt = start.Add(warmup)
	tl.bothAt = tl.soloAt.Add(phase)
	tl.bigAloneAt = tl.bothAt.Add(phase)
	tl.endAt = tl.bigAloneAt.Add(phase)
	return tl
}

// phaseAt returns the phase index (0 solo, 1 both, 2 big-alone) of t, or -1
// during warm-up and after the end.
func (tl timeline) phaseAt(t time.Time) int {
	switch {
	case t.Before(tl.soloAt):
		return -1
	case t.Before(tl.bothAt):
		return 0
	case t.Before(tl.bigAloneAt):
		return 1
	case t.Before(tl.endAt):
		return 2
	}
	return -1
}

// phaseStart returns when phase i begins.
func (tl timeline) phaseStart(i int) time.Time {
	return [3]time.Time{tl.soloAt, tl.bothAt, tl.bigAloneAt}[i]
}

// result is one request (or connection) as a writer saw it.
type result struct {
	sent    time.Time
	latency time.Duration
	status  status
}

type status int

const (
	statusOK status = iota
	statusRefused
	statusError
)

// holdings is the sampler's record of the pool, per phase.
type holdings struct {
	// settle is how long into a phase the rule takes to see the new set of
	// active projects: 0 for the requests pool (a project joins the active
	// set at its first ask), one control-loop period for the kernel's
	// connection pool (the share in the maps is rewritten by Tick).
	settle time.Duration

	mu       sync.Mutex // guards the fields below
	maxHeld  [3]map[string]int
	settled  [3]map[string]int // maxHeld, counting only samples from settle into the phase on
	maxInUse [3]int
	floor    int
}

func newHoldings() *holdings {
	h := &holdings{}
	for i := range h.maxHeld {
		h.maxHeld[i] = map[string]int{}
		h.settled[i] = map[string]int{}
	}
	return h
}

func (h *holdings) observe(tl timeline, at time.Time, inUse int, held map[string]int) {
	phase := tl.phaseAt(at)
	if phase < 0 {
		return
	}
	settled := !at.Before(tl.phaseStart(phase).Add(h.settle))
	h.mu.Lock()
	defer h.mu.Unlock()
	h.maxInUse[phase] = max(h.maxInUse[phase], inUse)
	for p, n := range held {
		h.maxHeld[phase][p] = max(h.maxHeld[phase][p], n)
		if settled {
			h.settled[phase][p] = max(h.settled[phase][p], n)
		}
	}
}

// Run runs the HTTP drill and returns its report. A failed verdict is in the
// report (Report.Pass), not an error; errors are for a drill that could not
// run.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg = cfg.withDefaults()
	ctx, cancelCause := context.WithCancelCause(ctx)
	cancel := func() { cancelCause(context.Canceled) }
	defer cancel()
	var bg sync.WaitGroup
	defer bg.Wait()
	defer cancel()

	// The upstream: a fixed service time per request.
	upL, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("listening for the upstream: %w", err)
	}
	up := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t := time.NewTimer(cfg.ServiceTime)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.Context().Done():
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})}
	bg.Add(1)
	go func() { defer bg.Done(); _ = up.Serve(upL) }()
	defer up.Close()

	pool, err := pools.New(pools.Config{Name: "requests", Size: cfg.PoolSize}, nil)
	if err != nil {
		return nil, fmt.Errorf("requests pool: %w", err)
	}
	sched, err := scheduler.New(scheduler.Config{MaxInFlight: cfg.PoolSize}, nil)
	if err != nil {
		return nil, fmt.Errorf("scheduler: %w", err)
	}
	bg.Add(1)
	go func() { defer bg.Done(); _ = sched.Run(ctx) }()
	// The drill is its own edge: its load generators on loopback name
	// their project in the header.
	f, err := front.New(front.Config{Upstream: "http://" + upL.Addr().String(), MaxInFlight: cfg.PoolSize,
		TrustedPeers: []string{"127.0.0.1"}},
		front.Deps{Requests: pool, Rates: pools.NewRates(nil), Sched: sched, Log: cfg.Log})
	if err != nil {
		return nil, fmt.Errorf("front: %w", err)
	}
	frontL, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("listening for the front: %w", err)
	}
	bg.Add(1)
	go func() { defer bg.Done(); _ = f.Serve(ctx, frontL) }()
	url := "http://" + frontL.Addr().String() + "/"

	tl := newTimeline(time.Now(), cfg.Warmup, cfg.Phase)
	// A request that never comes back must not hang the drill: give the
	// whole run a generous deadline.
	watchdog := time.AfterFunc(time.Until(tl.endAt)+30*time.Second, func() { cancelCause(ErrOverran) })
	defer watchdog.Stop()
	hold := newHoldings()
	hold.floor = pool.Snapshot().Floor
	bg.Add(2)
	go func() {
		defer bg.Done()
		every(ctx, cfg.Recompute, tl.endAt, pool.Recompute)
	}()
	go func() {
		defer bg.Done()
		every(ctx, cfg.Sample, tl.endAt, func() {
			s := pool.Snapshot()
			held := make(map[string]int, len(s.Projects))
			for _, p := range s.Projects {
				held[p.Project] = p.Held
			}
			hold.observe(tl, time.Now(), s.InUse, held)
		})
	}()

	send := func(client *http.Client, project string) (time.Duration, status, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return 0, statusError, err
		}
		req.Header.Set(front.DefaultProjectHeader, project)
		t0 := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			return 0, statusError, err
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		lat := time.Since(t0)
		switch {
		case err != nil:
			return lat, statusError, err
		case resp.StatusCode == http.StatusOK:
			return lat, statusOK, nil
		case resp.StatusCode == http.StatusTooManyRequests:
			return lat, statusRefused, nil
		}
		return lat, statusError, fmt.Errorf("status %d", resp.StatusCode)
	}
	small := startWriters(ctx, cfg, Small, cfg.SmallWriters, tl.start, tl.bigAloneAt, send)
	big := startWriters(ctx, cfg, Big, cfg.BigWriters, tl.bothAt, tl.endAt, send)
	smallRes, bigRes := small.wait(), big.wait()
	overran := ctx.Err() != nil
	cancel()
	up.Close()
	bg.Wait()
	f.CloseIdle()
	if overran {
		if err := context.Cause(ctx); err != nil && !errors.Is(err, context.Canceled) {
			return nil, err
		}
		return nil, fmt.Errorf("drill interrupted: %w", context.Cause(ctx))
	}
	rep := buildReport("requests", cfg, tl, hold, map[string][]result{Small: smallRes, Big: bigRes})
	return rep, nil
}

// every calls fn every period until ctx is done or until is reached.
func every(ctx context.Context, period time.Duration, until time.Time, fn func()) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if now.After(until) {
				return
			}
			fn()
		}
	}
}

// sendFunc performs one request (or connection) for project.
type sendFunc func(client *http.Client, project string) (time.Duration, status, error)

type writers struct {
	wg  sync.WaitGroup
	mu  sync.Mutex // guards the fields below
	res []result
}

// startWriters starts n closed-loop writers for project that send from
// start until stop (a request sent before stop is completed).
func startWriters(ctx context.Context, cfg Config, project string, n int, start, stop time.Time, send sendFunc) *writers {
	ws := &writers{}
	tr := &http.Transport{MaxIdleConnsPerHost: n + 4, DisableCompression: true}
	client := &http.Client{Transport: tr}
	for range n {
		ws.wg.Add(1)
		go func() {
			defer ws.wg.Done()
			var mine []result
			defer func() {
				ws.mu.Lock()
				ws.res = append(ws.res, mine...)
				ws.mu.Unlock()
			}()
			if !sleepUntil(ctx, start) {
				return
			}
			for ctx.Err() == nil {
				now := time.Now()
				if !now.Before(stop) {
					return
				}
				lat, st, err := send(client, project)
				if ctx.Err() != nil {
					return
				}
				mine = append(mine, result{sent: now, latency: lat, status: st})
				if st != statusOK {
					if err != nil {
						cfg.Log.Debug("drill request failed", "project", project, "err", err)
					}
					sleepUntil(ctx, time.Now().Add(cfg.RetryPause))
				}
			}
		}()
	}
	go func() { ws.wg.Wait(); tr.CloseIdleConnections() }()
	return ws
}

func (ws *writers) wait() []result {
	ws.wg.Wait()
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return ws.res
}

// sleepUntil sleeps until t; false when ctx ended first.
func sleepUntil(ctx context.Context, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-timer.C:
		return true
	}
}
