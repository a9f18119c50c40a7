// SPDX-License-Identifier: Apache-2.0

package front

import (
	"net/http"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// OtherProject is the metric label for projects past Config.MaxProjects. It
// is the daemon's one overflow label (metrics.Other), and it cannot be a
// project's name (policy.ValidateProject refuses parentheses), so a real
// project called "other" is never summed with the overflow.
const OtherProject = "(other)"

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
var latencyBounds = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10}

// histogram counts observations per bucket (not cumulative); the last count
// is the +Inf bucket.
type histogram struct {
	counts [15]uint64
	sum    float64
}

func (h *histogram) observe(v float64) {
	i := sort.SearchFloat64s(latencyBounds, v)
	h.counts[i]++
	h.sum += v
}

func (h *histogram) constHistogram(d *prometheus.Desc, labels ...string) prometheus.Metric {
	cum := make(map[float64]uint64, len(latencyBounds))
	var n uint64
	for i, b := range latencyBounds {
		n += h.counts[i]
		cum[b] = n
	}
	n += h.counts[len(latencyBounds)]
	return prometheus.MustNewConstHistogram(d, n, h.sum, cum, labels...)
}

type projectStats struct {
	outcomes [numOutcomes]uint64
	duration histogram // arrival to completion, dispatched requests only
	wait     histogram // time waiting for dispatch
}

// stats are the front's counters, read by the collector at scrape time.
type stats struct {
	maxProjects int

	mu               sync.Mutex // guards the fields below
	projects         map[string]*projectStats
	badRequests      uint64
	untrusted        uint64
	exemptOverBudget uint64
}

func newStats(maxProjects int) *stats {
	return &stats{maxProjects: maxProjects, projects: map[string]*projectStats{}}
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

func (s *stats) overBudget() {
	s.mu.Lock()
	s.exemptOverBudget++
	s.mu.Unlock()
}

func (s *stats) record(project string, oc outcome, total, waited time.Duration, dispatched bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ps := s.projectLocked(project)
	ps.outcomes[oc]++
	if dispatched {
		ps.duration.observe(total.Seconds())
	}
	if waited > 0 || dispatched {
		ps.wait.observe(waited.Seconds())
	}
}

// projectLocked returns the stats of project, folding it into OtherProject
// once maxProjects label values exist.
func (s *stats) projectLocked(project string) *projectStats {
	if ps, ok := s.projects[project]; ok {
		return ps
	}
	if len(s.projects) >= s.maxProjects {
		project = OtherProject
		if ps, ok := s.projects[project]; ok {
			return ps
		}
	}
	ps := &projectStats{}
	s.projects[project] = ps
	return ps
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
	for project, ps := range s.projects {
		for oc, n := range ps.outcomes {
			ch <- prometheus.MustNewConstMetric(descRequests, prometheus.CounterValue, float64(n), project, outcomeNames[oc])
		}
		ch <- ps.duration.constHistogram(descDuration, project)
		ch <- ps.wait.constHistogram(descWait, project)
	}
}
