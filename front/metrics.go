// SPDX-License-Identifier: Apache-2.0

package front

import (
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// OtherProject is the metric label for projects past Config.MaxProjects.
const OtherProject = "other"

// outcome is how a request ended, as counted in metrics.
type outcome int

const (
	outcomeOK outcome = iota
	outcomeRefusedRate
	outcomeRefusedDebt
	outcomeRefusedShare
	outcomeError
	outcomeCanceled
	numOutcomes
)

var outcomeNames = [numOutcomes]string{"ok", "refused_rate", "refused_debt", "refused_share", "error", "canceled"}

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

	mu          sync.Mutex // guards the fields below
	projects    map[string]*projectStats
	badRequests uint64
}

func newStats(maxProjects int) *stats {
	return &stats{maxProjects: maxProjects, projects: map[string]*projectStats{}}
}

func (s *stats) badRequest() {
	s.mu.Lock()
	s.badRequests++
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
)

type collector struct{ s *stats }

// Collector returns a Prometheus collector over the front's counters.
func (f *Front) Collector() prometheus.Collector { return collector{f.stats} }

func (c collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descRequests
	ch <- descDuration
	ch <- descWait
	ch <- descBad
}

func (c collector) Collect(ch chan<- prometheus.Metric) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	ch <- prometheus.MustNewConstMetric(descBad, prometheus.CounterValue, float64(c.s.badRequests))
	for project, ps := range c.s.projects {
		for oc, n := range ps.outcomes {
			ch <- prometheus.MustNewConstMetric(descRequests, prometheus.CounterValue, float64(n), project, outcomeNames[oc])
		}
		ch <- ps.duration.constHistogram(descDuration, project)
		ch <- ps.wait.constHistogram(descWait, project)
	}
}
