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
	"sort"
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
	// Slices is how many turns "solo" and "both" take, alternating, each
	// lasting Phase/Slices (see timeline); 10.
	Slices      int
	Warmup      time.Duration // small runs this long before the solo phase starts counting; 500ms
	ServiceTime time.Duration // the upstream's fixed cost per request (or connection hold time); 20ms
	RetryPause  time.Duration // a refused writer's pause before it tries again; 10ms
	Sample      time.Duration // pool snapshot interval for permits held; 1ms
	Recompute   time.Duration // pool recompute period, as in the daemon; 1s
	TargetRatio float64       // our goal for small's p99 ratio; 2
	// ToDestination runs the connections drill against a destination
	// pool (RunConnections): PoolSize is the size of a destination pool
	// whose one destination is the drill's server, inside a node pool
	// destNodeFactor times larger that never fills.
	ToDestination bool
	Log           *slog.Logger

	// admission is how the HTTP drill's pool admits: by the rule, or by a
	// baseline the verdicts must fail (the tests run both).
	admission admission
}

// admission is a way for the requests pool to admit.
type admission int

const (
	// admitRule is the fair-share rule: what the drill is for.
	admitRule admission = iota
	// admitFIFO is first come, first served: every project may take the
	// whole pool (a plain semaphore, what a node has without the rule).
	admitFIFO
	// admitStaticCap caps every project at POOL - FLOOR, whatever else is
	// there: a static per-tenant cap as tight as the rule's at the floor.
	admitStaticCap
)

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
	if c.Slices <= 0 {
		c.Slices = 10
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

// timeline places the phases. Small runs from the warm-up to the end of the
// last "both" slice; big runs in every "both" slice and then, without a
// break, through "big-alone". With slices > 1, "solo" and "both" take turns
// in that many slices each (solo first, both last), so that whatever else the
// machine does while the drill runs (other processes, a compile, a GC of the
// drill's own load generators) falls on both sides of the ratio alike, instead
// of on whichever phase it happened to coincide with.
type timeline struct {
	start      time.Time // small's warm-up begins
	soloAt     time.Time // the first solo slice begins
	bigAloneAt time.Time
	endAt      time.Time
	spans      []span // every slice and big-alone, in order
}

// span is one slice of a phase.
type span struct {
	phase int // 0 solo, 1 both, 2 big-alone
	from  time.Time
	// count is when the slice starts counting: from, except in a solo
	// slice after a both slice, where it is when big's last request of
	// that slice ended (see settleGaps): small is not alone before.
	count time.Time
	to    time.Time
}

// interval is a time a project's writers send, [from, to).
type interval struct{ from, to time.Time }

func newTimeline(start time.Time, warmup, phase time.Duration, slices int) timeline {
	slices = max(slices, 1)
	tl := timeline{start: start, soloAt: start.Add(warmup)}
	at := tl.soloAt
	// Pair k of (solo, both) slices takes [2b(k), 2b(k+1)) after soloAt,
	// where b(k) = phase*k/slices: the slices add up to phase exactly.
	b := func(k int) time.Duration { return phase * time.Duration(k) / time.Duration(slices) }
	for i := range 2 * slices {
		k := i / 2
		to := tl.soloAt.Add(2 * b(k+1))
		if i%2 == 0 {
			to = tl.soloAt.Add(b(k) + b(k+1))
		}
		tl.spans = append(tl.spans, span{phase: i % 2, from: at, count: at, to: to})
		at = to
	}
	tl.bigAloneAt = at
	tl.endAt = at.Add(phase)
	tl.spans = append(tl.spans, span{phase: 2, from: at, count: at, to: tl.endAt})
	return tl
}

// settleGaps moves the count time of each solo slice that follows a both
// slice to when big's last request (or connection) sent in that both slice
// ended, so "solo" holds only what small did alone. Under load that can be
// far more than one service time.
func (tl timeline) settleGaps(big []result) {
	for i := 1; i < len(tl.spans); i++ {
		sp, prev := &tl.spans[i], tl.spans[i-1]
		if sp.phase != 0 || prev.phase != 1 {
			continue
		}
		for _, r := range big {
			if r.sent.Before(prev.from) || !r.sent.Before(prev.to) {
				continue
			}
			if end := r.sent.Add(r.latency); end.After(sp.count) {
				sp.count = end
			}
		}
		if sp.count.After(sp.to) {
			sp.count = sp.to
		}
	}
}

// spanAt returns the span t is in (counting small's requests from its count
// time), or nil during warm-up, in a gap and after the end. The spans follow
// each other, each ending where the next begins: a binary search, so that
// sorting every result and sample into spans stays O(n log spans).
func (tl timeline) spanAt(t time.Time) *span {
	i := sort.Search(len(tl.spans), func(i int) bool { return t.Before(tl.spans[i].to) })
	if i == len(tl.spans) || t.Before(tl.spans[i].count) {
		return nil
	}
	return &tl.spans[i]
}

// phaseAt returns the phase index (0 solo, 1 both, 2 big-alone) of t, or -1
// during warm-up, in a gap and after the end.
func (tl timeline) phaseAt(t time.Time) int {
	if sp := tl.spanAt(t); sp != nil {
		return sp.phase
	}
	return -1
}

// counted is how long phase i lasted, gaps excluded.
func (tl timeline) counted(i int) time.Duration {
	var d time.Duration
	for _, sp := range tl.spans {
		if sp.phase == i {
			d += sp.to.Sub(sp.count)
		}
	}
	return d
}

// sends returns when project's writers send.
func (tl timeline) sends(project string) []interval {
	if project == Small {
		return []interval{{tl.start, tl.bigAloneAt}}
	}
	var out []interval
	for _, sp := range tl.spans {
		if sp.phase == 0 {
			continue
		}
		if n := len(out); n > 0 && out[n-1].to.Equal(sp.from) {
			out[n-1].to = sp.to
			continue
		}
		out = append(out, interval{sp.from, sp.to})
	}
	return out
}

// result is one ask as a writer saw it. A refused ask is one result; an
// admitted one closes its chain, the asks a writer made for one request
// (refused, paused, asked again), and carries the chain: sent is its first
// ask, latency runs from there to the end of the response, and refusals
// counts the refused asks before it. An error ends a chain.
type result struct {
	sent     time.Time
	latency  time.Duration
	status   status
	refusals int
}

// chain follows one writer's asks for one request.
type chain struct {
	first    time.Time
	refusals int
}

// record adds the ask sent at sent, which took lat and ended with st, to
// the chain and returns its result.
func (c *chain) record(sent time.Time, lat time.Duration, st status) result {
	if c.refusals == 0 {
		c.first = sent
	}
	switch st {
	case statusOK:
		r := result{sent: c.first, latency: sent.Add(lat).Sub(c.first), status: st, refusals: c.refusals}
		*c = chain{}
		return r
	case statusRefused:
		c.refusals++
	default:
		*c = chain{}
	}
	return result{sent: sent, latency: lat, status: st}
}

// cut is the chain's result when its writer's interval ends while its
// request is still refused: a request that never got in, whose latency is
// at least from its first ask to end. Counted in the latencies as that
// lower bound, so that a scheme that keeps a project refused to the end of
// a phase does not leave those requests out of its p99; false if the chain
// holds no refusal.
func (c *chain) cut(end time.Time) (result, bool) {
	if c.refusals == 0 {
		return result{}, false
	}
	r := result{sent: c.first, latency: end.Sub(c.first), status: statusCut, refusals: c.refusals}
	*c = chain{}
	return r, true
}

type status int

const (
	statusOK status = iota
	statusRefused
	statusError
	statusCut // a request still refused at its interval's end (chain.cut)
)

// holdings is the sampler's record of the pool. Samples are kept and sorted
// into phases with the results, once the timeline's gaps are known.
type holdings struct {
	floor int
	// torn says that a read is not one instant of the pool: the kernel's
	// maps are read entry by entry while the programs change them, and a
	// project's held permits may be read before or after its admitted
	// count took the same admission. The pools package's snapshot is taken
	// under the pool's lock: all of it at one instant.
	torn bool
	// slack is how far past its share a project may be admitted while the
	// pool has room: 0 in package pools; in the kernel, CPUs - 1 (its
	// count is read before and added after, bpf/limiter.c).
	slack int

	mu      sync.Mutex // guards the fields below
	samples []sample
}

// sample is the pool as one read saw it, begun at at and ended at end: a
// read takes from microseconds to, on a loaded machine, milliseconds (a
// tick holding the limiter's lock, the sampler descheduled), and what it
// returns is the pool at some instant in between (or, torn, its parts at
// instants in between).
type sample struct {
	at, end time.Time
	inUse   int
	held    map[string]int
	// admitted is each project's count of admissions so far: where it
	// moved between two reads, the project was admitted in between.
	admitted map[string]uint64
}

// holdingsByPhase is the samples sorted into phases.
type holdingsByPhase struct {
	maxHeld  [3]map[string]int
	maxInUse [3]int
}

func newHoldings() *holdings { return &holdings{} }

func (h *holdings) observe(at, end time.Time, inUse int, held map[string]int, admitted map[string]uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.samples = append(h.samples, sample{at: at, end: end, inUse: inUse, held: held, admitted: admitted})
}

// mostInUse is the most permits in use in any sample, whenever it was
// taken: the rule never lets in_use pass POOL, in a phase or between.
func (h *holdings) mostInUse() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	most := 0
	for _, s := range h.samples {
		most = max(most, s.inUse)
	}
	return most
}

// beside judges big's admissions past its share while small was there
// (VerdictBigBeside). The rule admits a project holding its share or more
// only while in_use < POOL - FLOOR, so right after such an admission big and
// small hold POOL - FLOOR together at most. Then small may still take
// permits up to POOL (it is under its share), and big only gives back: at
// any later moment big holds no more than it did, and small no less, as
// long as small was not admitted since. So a sample in "both" where big
// holds more than its share and small was not admitted since big's last
// admission must show big and small together at most POOL - FLOOR; where
// big was admitted at in_use == POOL - FLOOR (an off-by-one), they show
// one more, which the most big ever held alone (POOL - FLOOR) misses
// whenever small held a permit then.
//
// The samples say when: big's admitted count moved between sample jb-1 and
// jb (its last admission is in between) and stayed to sample k; small's
// did not move from jb-1 to k. Torn reads (the kernel, where an admitted
// count is added an instant after the holding it goes with, and a read may
// fall in between) need the next sample too: a count that trailed its
// holding in sample k has caught up there, so neither count may move up to
// k+1 either. share is big's share beside small; big is judged only above
// share + slack.
func (h *holdings) beside(tl timeline, share int) Beside {
	h.mu.Lock()
	defer h.mu.Unlock()
	ss := h.samples
	lag := 0
	if h.torn {
		lag = 1
	}
	bd := Beside{Share: share, Slack: h.slack}
	// lastB[i] (lastS[i]) is the latest sample at or before i where big's
	// (small's) admitted count differs from the sample before, 0 for none.
	lastB, lastS := make([]int, len(ss)), make([]int, len(ss))
	for i := 1; i < len(ss); i++ {
		lastB[i], lastS[i] = lastB[i-1], lastS[i-1]
		if ss[i].admitted[Big] != ss[i-1].admitted[Big] {
			lastB[i] = i
		}
		if ss[i].admitted[Small] != ss[i-1].admitted[Small] {
			lastS[i] = i
		}
	}
	for k := range ss {
		end := k + lag
		if end >= len(ss) {
			break
		}
		if sp := tl.spanOf(ss[k]); sp == nil || sp.phase != 1 {
			continue
		}
		jb := lastB[end]
		if jb == 0 || jb > k || ss[jb].admitted[Big] < ss[jb-1].admitted[Big] {
			continue // no admission of big seen, or one after k, or a reset
		}
		if lastS[end] > jb-1 {
			continue // small admitted since
		}
		b, sm := ss[k].held[Big], ss[k].held[Small]
		if b <= share+h.slack {
			continue
		}
		bd.Checked++
		if b+sm > bd.Together {
			bd.Together, bd.Big, bd.Small = b+sm, b, sm
			bd.AtS = ss[k].at.Sub(tl.soloAt).Seconds()
		}
	}
	return bd
}

// spanOf is the span sample s was read in, nil if none: a read begun in
// one span and ended in another (or outside any) is in none, since the
// state it returns may be either's (a solo slice's last read returning big's
// permits of the both slice begun meanwhile).
func (tl timeline) spanOf(s sample) *span {
	sp := tl.spanAt(s.at)
	if sp == nil || tl.spanAt(s.end) != sp {
		return nil
	}
	return sp
}

func (h *holdings) byPhase(tl timeline) holdingsByPhase {
	var b holdingsByPhase
	for i := range b.maxHeld {
		b.maxHeld[i] = map[string]int{}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, s := range h.samples {
		sp := tl.spanOf(s)
		if sp == nil {
			continue
		}
		i := sp.phase
		b.maxInUse[i] = max(b.maxInUse[i], s.inUse)
		for p, n := range s.held {
			b.maxHeld[i][p] = max(b.maxHeld[i][p], n)
		}
	}
	return b
}

// bins returns, per project and per slice of width w from the first solo
// slice on, the most permits the project held in the samples of the slice.
// A project with no sample above zero in a slice is shown holding 0.
func (h *holdings) bins(tl timeline, w time.Duration, projects []string) []HeldBin {
	h.mu.Lock()
	defer h.mu.Unlock()
	most := map[string]map[int]int{}
	last := 0
	for _, p := range projects {
		most[p] = map[int]int{}
	}
	for _, s := range h.samples {
		if s.at.Before(tl.soloAt) || tl.spanOf(s) == nil {
			continue
		}
		i := int(s.at.Sub(tl.soloAt) / w)
		last = max(last, i)
		for _, p := range projects {
			most[p][i] = max(most[p][i], s.held[p])
		}
	}
	var out []HeldBin
	for _, p := range projects {
		for i := 0; i <= last; i++ {
			out = append(out, HeldBin{Project: p, StartS: (time.Duration(i) * w).Seconds(), Held: most[p][i]})
		}
	}
	return out
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
	// A cap in place of the rule (pools.Pool.SetCaps): a project under its
	// cap is admitted while in_use < POOL, first come, first served.
	switch cfg.admission {
	case admitFIFO:
		pool.SetCaps(map[string]int{}, cfg.PoolSize)
	case admitStaticCap:
		pool.SetCaps(map[string]int{}, cfg.PoolSize-pool.Snapshot().Floor)
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

	tl := newTimeline(time.Now(), cfg.Warmup, cfg.Phase, cfg.Slices)
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
			at := time.Now()
			s := pool.Snapshot()
			held := make(map[string]int, len(s.Projects))
			admitted := make(map[string]uint64, len(s.Projects))
			for _, p := range s.Projects {
				held[p.Project] = p.Held
				admitted[p.Project] = p.Admitted
			}
			hold.observe(at, time.Now(), s.InUse, held, admitted)
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
	small := startWriters(ctx, cfg, Small, cfg.SmallWriters, tl.sends(Small), send)
	big := startWriters(ctx, cfg, Big, cfg.BigWriters, tl.sends(Big), send)
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

// startWriters starts n closed-loop writers for project that send during
// each of the intervals (a request sent before an interval's end is
// completed).
func startWriters(ctx context.Context, cfg Config, project string, n int, when []interval, send sendFunc) *writers {
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
			for _, iv := range when {
				if !sleepUntil(ctx, iv.from) {
					return
				}
				// A chain still refused when the interval ends is
				// counted cut (chain.cut), its refusals counted too.
				var ch chain
				for ctx.Err() == nil && time.Now().Before(iv.to) {
					now := time.Now()
					lat, st, err := send(client, project)
					if ctx.Err() != nil {
						return
					}
					mine = append(mine, ch.record(now, lat, st))
					if st != statusOK {
						if err != nil {
							cfg.Log.Debug("drill request failed", "project", project, "err", err)
						}
						sleepUntil(ctx, time.Now().Add(cfg.RetryPause))
					}
				}
				if r, ok := ch.cut(time.Now()); ok {
					mine = append(mine, r)
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
