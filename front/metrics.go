// SPDX-License-Identifier: Apache-2.0

package front

import (
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/labels"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/prometheus/client_golang/prometheus"
)

// outcome is how a request ended, as counted in metrics.
type outcome int

const (
	outcomeOK outcome = iota
	outcomeRefusedRate
	outcomeRefusedDebt
	outcomeRefusedShare
	outcomeError
	outcomeCanceled
	outcomeExempt
	numOutcomes
)

var outcomeNames = [numOutcomes]string{"ok", "refused_rate", "refused_debt", "refused_share", "error", "canceled", "exempt"}

// latencyBounds are the histogram bucket upper bounds, in seconds.
var latencyBounds = [...]float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}

// histogram counts observations per bucket (not cumulative); the last count
// is the +Inf bucket. The sum is in whole microseconds, a count like the
// others, with the nanoseconds not yet a microsecond kept aside. In
// nanoseconds it wrapped after 585 years of summed time, days for a series
// with thousands of requests always in flight or queued (Other sums many
// projects), and the exported sum went backwards; microseconds last a
// thousand times longer.
type histogram struct {
	counts [len(latencyBounds) + 1]uint64
	sumUs  uint64
	restNs uint64 // below 1000
}

func (h *histogram) observe(d time.Duration) {
	i := sort.SearchFloat64s(latencyBounds[:], d.Seconds())
	h.counts[i]++
	ns := uint64(max(d, 0)) + h.restNs
	h.sumUs += ns / 1000
	h.restNs = ns % 1000
}

// count hands the histogram's counts to the label set as counters named
// after keys.
func (h *histogram) count(ls *labels.Set, project string, keys *histogramKeys) {
	for i, n := range h.counts {
		ls.Count(project, keys.buckets[i], n)
	}
	ls.Count(project, keys.sum, h.sumUs)
}

// histogramKeys name a histogram's counts in a label set.
type histogramKeys struct {
	buckets [len(latencyBounds) + 1]string
	sum     string
}

func newHistogramKeys(name string) *histogramKeys {
	k := &histogramKeys{sum: name + "\x00sum"}
	for i := range k.buckets {
		k.buckets[i] = name + "\x00" + strconv.Itoa(i)
	}
	return k
}

var durationKeys, waitKeys = newHistogramKeys("duration"), newHistogramKeys("wait")

// constHistogram is label's histogram series from the label set's totals.
func constHistogram(d *prometheus.Desc, ls *labels.Set, label string, keys *histogramKeys) prometheus.Metric {
	cum := make(map[float64]uint64, len(latencyBounds))
	var n uint64
	for i, b := range latencyBounds {
		n += ls.Total(label, keys.buckets[i])
		cum[b] = n
	}
	n += ls.Total(label, keys.buckets[len(latencyBounds)])
	return prometheus.MustNewConstHistogram(d, n, float64(ls.Total(label, keys.sum))/1e6, cum, label)
}

type projectStats struct {
	outcomes [numOutcomes]uint64
	duration histogram // arrival to completion, dispatched requests only
	wait     histogram // time waiting for dispatch
	last     time.Time // when a request of the project last ended
}

// total is the project's requests, for the order of the labels.
func (ps *projectStats) total() (n uint64) {
	for _, v := range ps.outcomes {
		n += v
	}
	return n
}

// forgetAfter is how long the front keeps the counts of a project with no
// request, as the pools keep an idle project's (pools.DefaultForget): its
// metric label frees then (package internal/labels).
const forgetAfter = pools.DefaultForget

// stats are the front's counters, read by the collector at scrape time.
type stats struct {
	mu               sync.Mutex // guards the fields below
	projects         map[string]*projectStats
	swept            time.Time   // when idle projects were last forgotten
	labels           *labels.Set // the projects' label values (at most Config.MaxProjects)
	badRequests      uint64
	untrusted        uint64
	exemptOverBudget uint64
	// would counts the refusals dry-run admitted, by reason (share, rate,
	// debt).
	would map[string]uint64
}

func newStats(maxProjects int) *stats {
	return &stats{projects: map[string]*projectStats{}, labels: labels.NewSet(maxProjects)}
}

// badRequest counts a request answered with status before it had a project:
// 403 for a project header from an untrusted peer, 400 otherwise.
func (s *stats) badRequest(status int) {
	s.mu.Lock()
	if status == http.StatusForbidden {
		s.untrusted++
	} else {
		s.badRequests++
	}
	s.mu.Unlock()
}

func (s *stats) wouldRefuse(reason string) {
	s.mu.Lock()
	if s.would == nil {
		s.would = map[string]uint64{}
	}
	s.would[reason]++
	s.mu.Unlock()
}

func (s *stats) overBudget() {
	s.mu.Lock()
	s.exemptOverBudget++
	s.mu.Unlock()
}

// record counts a request of project that ended now.
func (s *stats) record(project string, oc outcome, total, waited time.Duration, dispatched bool, now time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ps := s.projects[project]
	if ps == nil {
		ps = &projectStats{}
		s.projects[project] = ps
	}
	ps.last = now
	ps.outcomes[oc]++
	if dispatched {
		ps.duration.observe(total)
	}
	if waited > 0 || dispatched {
		ps.wait.observe(waited)
	}
	if now.Sub(s.swept) >= forgetAfter {
		s.forgetLocked(now)
	}
}

// forgetLocked drops the projects with no request for forgetAfter.
func (s *stats) forgetLocked(now time.Time) {
	for p, ps := range s.projects {
		if now.Sub(ps.last) >= forgetAfter {
			delete(s.projects, p)
		}
	}
	s.swept = now
}

var (
	descRequests = prometheus.NewDesc("fairshare_front_requests_total",
		"Requests that named a valid project, by how they ended.", []string{"project", "outcome"}, nil)
	descDuration = prometheus.NewDesc("fairshare_front_request_duration_seconds",
		"Time from arrival to completion of requests dispatched to the upstream.", []string{"project"}, nil)
	descWait = prometheus.NewDesc("fairshare_front_queue_wait_seconds",
		"Time admitted requests waited for the scheduler to dispatch them.", []string{"project"}, nil)
	descBad = prometheus.NewDesc("fairshare_front_bad_requests_total",
		"Requests answered 400 because they named no valid project.", nil, nil)
	descUntrusted = prometheus.NewDesc("fairshare_front_untrusted_requests_total",
		"Requests answered 403 because a peer not trusted to name the project sent the project header.", nil, nil)
	descExemptInFlight = prometheus.NewDesc("fairshare_front_exempt_requests_in_flight",
		"Exempt requests being served (outside the requests pool and the scheduler).", nil, nil)
	descExemptMax = prometheus.NewDesc("fairshare_front_exempt_max",
		"The most exempt requests served at once; more are treated like their project's requests.", nil, nil)
	descExemptOver = prometheus.NewDesc("fairshare_front_exempt_over_budget_total",
		"Exempt requests that found the exempt budget full and were treated like their project's requests.", nil, nil)
	descWould = prometheus.NewDesc("fairshare_front_would_refuse_total",
		"Requests of projects in dry-run that would have been refused, by reason (share, rate, debt), and were admitted.", []string{"reason"}, nil)
)

type collector struct{ f *Front }

// Collector returns a Prometheus collector over the front's counters.
func (f *Front) Collector() prometheus.Collector { return collector{f} }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descRequests
	ch <- descDuration
	ch <- descWait
	ch <- descBad
	ch <- descUntrusted
	ch <- descExemptInFlight
	ch <- descExemptMax
	ch <- descExemptOver
	ch <- descWould
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(descExemptInFlight, prometheus.GaugeValue, float64(c.f.ExemptInFlight()))
	ch <- prometheus.MustNewConstMetric(descExemptMax, prometheus.GaugeValue, float64(c.f.cfg.ExemptMax))
	s := c.f.stats
	s.mu.Lock()
	defer s.mu.Unlock()
	ch <- prometheus.MustNewConstMetric(descBad, prometheus.CounterValue, float64(s.badRequests))
	ch <- prometheus.MustNewConstMetric(descUntrusted, prometheus.CounterValue, float64(s.untrusted))
	ch <- prometheus.MustNewConstMetric(descExemptOver, prometheus.CounterValue, float64(s.exemptOverBudget))
	for _, reason := range []string{"share", "rate", "debt"} {
		ch <- prometheus.MustNewConstMetric(descWould, prometheus.CounterValue, float64(s.would[reason]), reason)
	}
	s.forgetLocked(c.f.clk.Now())
	names := make([]string, 0, len(s.projects))
	for p := range s.projects {
		names = append(names, p)
	}
	// The most requests first, for the labels that free up.
	names = labels.Busiest(names, func(p string) string { return p },
		func(p string) [2]uint64 { return [2]uint64{s.projects[p].total()} })
	ls := s.labels
	ls.Assign(names)
	var emit []string
	for _, p := range names {
		ps := s.projects[p]
		for oc, n := range ps.outcomes {
			ls.Count(p, outcomeNames[oc], n)
		}
		ps.duration.count(ls, p, durationKeys)
		ps.wait.count(ls, p, waitKeys)
		if ls.Label(p) == p {
			emit = append(emit, p)
		}
	}
	if ls.OtherUsed() {
		emit = append(emit, labels.Other)
	}
	for _, l := range emit {
		for oc := range numOutcomes {
			ch <- prometheus.MustNewConstMetric(descRequests, prometheus.CounterValue, float64(ls.Total(l, outcomeNames[oc])), l, outcomeNames[oc])
		}
		ch <- constHistogram(descDuration, ls, l, durationKeys)
		ch <- constHistogram(descWait, ls, l, waitKeys)
	}
}
