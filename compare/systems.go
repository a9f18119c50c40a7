// SPDX-License-Identifier: Apache-2.0

package compare

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"
	fq "k8s.io/apiserver/pkg/util/flowcontrol/fairqueuing"
	"k8s.io/apiserver/pkg/util/flowcontrol/fairqueuing/eventclock"
	"k8s.io/apiserver/pkg/util/flowcontrol/fairqueuing/queueset"
	"k8s.io/apiserver/pkg/util/flowcontrol/metrics"
	fqrequest "k8s.io/apiserver/pkg/util/flowcontrol/request"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// System is one admission scheme in front of a pool of seats. Do asks for a
// seat for project and runs work while holding it. A scheme that refuses
// returns ok false with the wait its users are told (0: none told); a scheme
// that queues blocks until the seat is there or ctx ends (then err).
type System interface {
	Do(ctx context.Context, project string, work func()) (ok bool, retryAfter time.Duration, err error)
	// Close stops what the system runs in the background.
	Close()
}

// Scheme names a System and builds a fresh one for each run.
type Scheme struct {
	Name string
	// How says in a line how its users drive it.
	How string
	// Retry says in a line what its clients do when refused (printed
	// under the table): the hints differ between the systems, and so does
	// what a refusal costs a client.
	Retry string
	New   func(o Options, w Workload) (System, error)
}

// Schemes are the systems compared, fairshare first.
var Schemes = []Scheme{
	{Name: "fairshare", How: "the rule alone bounds the seats: pools.Pool of the seats' size (a permit is a seat), TryAcquire then scheduler.Submit/Wait",
		Retry: "refused, retries after exactly Refusal.RetryAfter, the pool's own estimate passed in-process (usually under a millisecond); a connect the kernel refuses gets no hint",
		New:   newFairshare},
	{Name: "fairshare-front", How: "the HTTP front's defaults: the requests pool 6.25 times the seats (pools.requests.size 400, front.max_in_flight 64), then scheduler.Submit/Wait with MaxInFlight = the seats",
		Retry: "as fairshare (exact Refusal.RetryAfter); waits in the scheduler's queue once admitted to the pool",
		New:   newFairshareFront},
	{Name: "fairshare-front-cost", How: "fairshare-front with front.cost_from_time: each request is charged its service time in front.cost_unit (10ms) by Ticket.Done, every project tier pro with 1 share at the scheduler's default rates (p1 10/s, p2 40/s)",
		Retry: "as fairshare-front",
		New:   newFairshareFrontCost},
	{Name: "fairshare-wait", How: "pools.Pool.Acquire (blocking, round-robin over waiting projects)",
		Retry: "never refused: blocks in Acquire",
		New:   newFairshareWait},
	{Name: "apf", How: "k8s.io/apiserver v0.37.2 queueset as Kubernetes ships the levels tenant traffic lands in (workload-low, global-default): 128 queues, hand 6, queue length 50, seats = pool",
		Retry: "waits in its queue; rejected (queue full), retries after 1s, the filter's Retry-After",
		New:   newAPFShipped},
	{Name: "apf-64x8", How: "the same queueset with the API's field defaults, what a PriorityLevelConfiguration created without queuing values gets: 64 queues, hand 8, queue length 50",
		Retry: "as apf",
		New:   newAPFFieldDefaults},
	{Name: "static", How: "a cap of pool/N per project, N fixed ahead (limit_conn per tenant)",
		Retry: "refused without a hint (nginx's 503), retries after 10ms",
		New:   newStatic},
	{Name: "fifo", How: "golang.org/x/sync/semaphore.Weighted(pool), FIFO Acquire",
		Retry: "never refused: blocks in Acquire, in arrival order",
		New:   newFIFO},
}

// SchemeByName finds a scheme in Schemes or HTTPSchemes.
func SchemeByName(name string) (Scheme, error) {
	for _, s := range append(Schemes[:len(Schemes):len(Schemes)], HTTPSchemes...) {
		if s.Name == name {
			return s, nil
		}
	}
	return Scheme{}, fmt.Errorf("unknown system %q", name)
}

// fairshare is the library as the front drives it: the requests pool's
// TryAcquire (refusal: 429 and Retry-After), then the scheduler's queue
// with MaxInFlight = the seats. Two shapes: the pool as large as the seats
// (scheme fairshare: the rule alone decides who holds a seat, and a refused
// client is told the pool's own estimate, which a connect refused in the
// kernel is not), and the pool as many times the seats as the front's
// defaults make it (fairshare-front: the rule bounds what a project may
// have admitted, the scheduler's round-robin decides who runs). The pool
// recomputes once a second, the daemon's default tick.
type fairshare struct {
	pool  *pools.Pool
	sched *scheduler.Scheduler
	// costUnit, when set, charges each request its service time in these
	// units on Ticket.Done, as the front does with front.cost_from_time
	// (Front.cost); 0 charges 1, the front's default.
	costUnit time.Duration
	cancel   context.CancelFunc
	wg       sync.WaitGroup
}

func newFairshare(o Options, _ Workload) (System, error) {
	return newFairshareSized(o.Pool, o.Pool, 0, scheduler.Policy{})
}

func newFairshareFront(o Options, _ Workload) (System, error) {
	return newFairshareSized(FrontPoolFor(o.Pool), o.Pool, 0, scheduler.Policy{})
}

// newFairshareFrontCost is the front's shape with front.cost_from_time at
// the default front.cost_unit, and every project on tier pro with one
// share: the scheduler charges a request's cost only to the bucket that
// admitted it, so under the default tier (none) the cost changes nothing.
func newFairshareFrontCost(o Options, _ Workload) (System, error) {
	return newFairshareSized(FrontPoolFor(o.Pool), o.Pool, config.Default().Front.CostUnit, scheduler.Policy{Tier: scheduler.TierPro, Shares: 1})
}

// FrontPoolFor is the requests pool the front's defaults give a service of
// seats seats: the scheduler's MaxInFlight is the seats, and the pool is
// as many times larger as pools.requests.size is than front.max_in_flight
// in config's defaults (400 and 64).
func FrontPoolFor(seats int) int {
	d := config.Default()
	return seats * d.Pools["requests"].Size / d.Front.MaxInFlight
}

// newFairshareSized is a requests pool of poolSize permits in front of a
// scheduler that dispatches at most seats at once.
func newFairshareSized(poolSize, seats int, costUnit time.Duration, policy scheduler.Policy) (System, error) {
	p, err := pools.New(pools.Config{Name: "requests", Size: poolSize}, nil)
	if err != nil {
		return nil, fmt.Errorf("fairshare pool: %w", err)
	}
	d := config.Default().Scheduler
	s, err := scheduler.New(scheduler.Config{MaxInFlight: seats, DefaultPolicy: policy,
		P1Rate: d.P1Rate, P1Burst: d.P1Burst, P2Rate: d.P2Rate, P2Burst: d.P2Burst}, nil)
	if err != nil {
		return nil, fmt.Errorf("fairshare scheduler: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &fairshare{pool: p, sched: s, costUnit: costUnit, cancel: cancel}
	f.wg.Add(2)
	go func() { defer f.wg.Done(); _ = s.Run(ctx) }()
	go func() { defer f.wg.Done(); recomputeEverySecond(ctx, p) }()
	return f, nil
}

func recomputeEverySecond(ctx context.Context, p *pools.Pool) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			p.Recompute()
		}
	}
}

func (f *fairshare) Do(ctx context.Context, project string, work func()) (bool, time.Duration, error) {
	var rf pools.Refusal
	pm, ok := f.pool.TryAcquireInto(project, &rf)
	if !ok {
		return false, rf.RetryAfter, nil
	}
	defer func() { _ = f.pool.Release(pm) }()
	t := f.sched.Submit(project)
	if _, err := t.Wait(ctx); err != nil {
		return false, 0, fmt.Errorf("scheduler: %w", err)
	}
	cost := 1.0
	began := time.Now()
	work()
	if f.costUnit > 0 {
		cost = float64(time.Since(began)) / float64(f.costUnit)
	}
	t.Done(cost)
	return true, 0, nil
}

func (f *fairshare) Close() { f.cancel(); f.wg.Wait() }

// fairshareWait is the pool's blocking Acquire: a caller that waits rather
// than retries (the permit API's blocking form).
type fairshareWait struct {
	pool   *pools.Pool
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

func newFairshareWait(o Options, _ Workload) (System, error) {
	size := o.Pool
	p, err := pools.New(pools.Config{Name: "requests", Size: size}, nil)
	if err != nil {
		return nil, fmt.Errorf("fairshare pool: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &fairshareWait{pool: p, cancel: cancel}
	f.wg.Add(1)
	go func() { defer f.wg.Done(); recomputeEverySecond(ctx, p) }()
	return f, nil
}

func (f *fairshareWait) Do(ctx context.Context, project string, work func()) (bool, time.Duration, error) {
	pm, err := f.pool.Acquire(ctx, project)
	if err != nil {
		return false, 0, err
	}
	work()
	_ = f.pool.Release(pm)
	return true, 0, nil
}

func (f *fairshareWait) Close() { f.cancel(); f.wg.Wait() }

// apf is one priority level of Kubernetes API Priority and Fairness, the
// queueset as the apiserver's filter drives it: each project a flow
// (hashed as the filter hashes flow schema and distinguisher), one seat a
// request, a rejected request answered 429 with Retry-After: 1.
type apf struct{ qs fq.QueueSet }

// APFQueuing is a priority level's queuing: queues, hand size, queue
// length limit.
type APFQueuing struct{ Queues, HandSize, QueueLength int }

var (
	// APFShipped is what Kubernetes ships for the priority levels a
	// tenant's requests land in: workload-low (flow schema
	// service-accounts, every service account) and global-default (flow
	// schema global-default, every other user), both 128 queues, hand 6,
	// queue length 50 (k8s.io/apiserver/pkg/apis/flowcontrol/bootstrap,
	// default.go, v0.37.2).
	APFShipped = APFQueuing{Queues: 128, HandSize: 6, QueueLength: 50}
	// APFFieldDefaults are the QueuingConfiguration fields' defaults
	// (k8s.io/api/flowcontrol/v1): what a level created without queuing
	// values gets. No bootstrap level a tenant lands in uses them.
	APFFieldDefaults = APFQueuing{Queues: 64, HandSize: 8, QueueLength: 50}
)

// APFRetryAfter is the Retry-After of the apiserver filter's 429
// (k8s.io/apiserver/pkg/server/filters: retryAfter = "1").
const APFRetryAfter = time.Second

var apfMu sync.Mutex // the queueset's metrics are package globals

func newAPFShipped(o Options, _ Workload) (System, error) { return newAPF(o.Pool, APFShipped) }

func newAPFFieldDefaults(o Options, _ Workload) (System, error) {
	return newAPF(o.Pool, APFFieldDefaults)
}

func newAPF(size int, q APFQueuing) (System, error) {
	apfMu.Lock()
	defer apfMu.Unlock()
	clk := eventclock.Real{}
	qsf := queueset.NewQueueSetFactory(clk)
	labels := []string{"compare"}
	qsc, err := qsf.BeginConstruction(fq.QueuingConfig{
		Name:             "compare",
		DesiredNumQueues: q.Queues,
		QueueLengthLimit: q.QueueLength,
		HandSize:         q.HandSize,
	}, metrics.RatioedGaugeVecPhasedElementPair(metrics.PriorityLevelConcurrencyGaugeVec, 1, 1, labels),
		metrics.PriorityLevelExecutionSeatsGaugeVec.NewForLabelValuesSafe(0, 1, labels),
		fq.NewNamedIntegrator(clk, "compare"))
	if err != nil {
		return nil, fmt.Errorf("apf queueset: %w", err)
	}
	return &apf{qs: qsc.Complete(fq.DispatchingConfig{ConcurrencyLimit: size, ConcurrencyDenominator: size})}, nil
}

// flowHash is the apiserver's hashFlowID (apf_controller.go): sha256 of the
// flow schema's name, a zero byte and the distinguisher.
func flowHash(fsName, distinguisher string) uint64 {
	h := sha256.New()
	h.Write([]byte(fsName))
	h.Write([]byte{0})
	h.Write([]byte(distinguisher))
	var sum [32]byte
	return binary.LittleEndian.Uint64(h.Sum(sum[:0])[:8])
}

var errAPFCanceled = errors.New("apf: request left its queue unexecuted")

func (a *apf) Do(ctx context.Context, project string, work func()) (bool, time.Duration, error) {
	req, _ := a.qs.StartRequest(ctx, &fqrequest.WorkEstimate{InitialSeats: 1}, flowHash("compare", project), project, "compare", project, nil, nil)
	if req == nil {
		return false, APFRetryAfter, nil
	}
	ran := false
	req.Finish(func() { ran = true; work() })
	if !ran {
		if ctx.Err() != nil {
			return false, 0, fmt.Errorf("%w: %w", errAPFCanceled, ctx.Err())
		}
		return false, APFRetryAfter, nil
	}
	return true, 0, nil
}

func (a *apf) Close() {}

// static caps each project at pool/N, N the number of projects the
// operator planned for (Workload.Planned), and the whole at the pool: what
// nginx limit_conn keyed by tenant beside one keyed by server, HAProxy
// maxconn per backend or nftables ct count give. A refusal carries no hint
// (nginx answers 503), so clients retry after 10ms.
type static struct {
	cap, pool int
	mu        sync.Mutex // guards the fields below
	inUse     int
	held      map[string]int // each project's seats
}

func newStatic(o Options, w Workload) (System, error) {
	size := o.Pool
	n := w.Planned
	if n < 1 {
		n = 1
	}
	c := size / n
	if c < 1 {
		c = 1
	}
	return &static{cap: c, pool: size, held: map[string]int{}}, nil
}

func (s *static) Do(_ context.Context, project string, work func()) (bool, time.Duration, error) {
	s.mu.Lock()
	// The pool is a bound too (a limit_conn on the server zone beside the
	// per-tenant one): with more projects than planned, caps add up past it.
	if s.held[project] >= s.cap || s.inUse >= s.pool {
		s.mu.Unlock()
		return false, 0, nil
	}
	s.held[project]++
	s.inUse++
	s.mu.Unlock()
	work()
	s.mu.Lock()
	s.held[project]--
	s.inUse--
	s.mu.Unlock()
	return true, 0, nil
}

func (s *static) Close() {}

// fifo is no fairness at all: one weighted semaphore, waiters in arrival
// order.
type fifo struct{ sem *semaphore.Weighted }

func newFIFO(o Options, _ Workload) (System, error) {
	size := o.Pool
	return &fifo{sem: semaphore.NewWeighted(int64(size))}, nil
}

func (f *fifo) Do(ctx context.Context, _ string, work func()) (bool, time.Duration, error) {
	if err := f.sem.Acquire(ctx, 1); err != nil {
		return false, 0, err
	}
	work()
	f.sem.Release(1)
	return true, 0, nil
}

func (f *fifo) Close() {}
