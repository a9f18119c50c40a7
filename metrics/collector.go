// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"context"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/labels"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Other is the project label of the projects beyond the cardinality cap
// (package internal/labels holds the policy).
const Other = labels.Other

// Source returns the daemon's state at scrape time.
type Source func(ctx context.Context) (admin.Status, error)

// Collector is a prometheus.Collector over a Source.
type Collector struct {
	src         Source
	maxProjects int
	timeout     time.Duration
	log         *slog.Logger

	up, kernel                                *prometheus.Desc
	poolSize, poolFloor, poolInUse, poolShare *prometheus.Desc
	poolActive, poolAdmitted, poolRefused     *prometheus.Desc
	poolRateLimited, permitsRateLimited       *prometheus.Desc
	held, admitted, refused                   *prometheus.Desc
	sleeping, evictions                       *prometheus.Desc
	rateLimited, workTokens                   *prometheus.Desc
	inFlight, queue, dispatched, wait         *prometheus.Desc
	exemptMax, exemptInUse                    *prometheus.Desc
	exemptAdmitted, exemptOver                *prometheus.Desc
	recPasses, recFailures, recRepairs        *prometheus.Desc
	recLast, recSockets, recHeld              *prometheus.Desc
	recAdoptedPast, lapseAdmitted, lapsed     *prometheus.Desc
	recUnadopted                              *prometheus.Desc
	recMoved, recMovedPast, recAborted        *prometheus.Desc
	heartbeatAge, kernelEvents                *prometheus.Desc
	lnOpen, lnMax, lnAccepted, lnRefused      *prometheus.Desc
	lnErrors                                  *prometheus.Desc
	memMembers, memRefused, memSourceUp       *prometheus.Desc
	nsFound, nsAttached, nsSweeps, nsSweep    *prometheus.Desc
	nsErrors                                  *prometheus.Desc
	poolWould, poolEnforced, would            *prometheus.Desc
	evPublished, evDropped, evLost, evLogLost *prometheus.Desc
	polRefused, polRefusals, polRefusedAt     *prometheus.Desc
	polLoadedAt, polProjects                  *prometheus.Desc
	fleetSize, fleetAllot, fleetSafe          *prometheus.Desc
	fleetShare, fleetActive, fleetNodes       *prometheus.Desc
	fleetConnected, fleetWrites               *prometheus.Desc
	fleetAlloc, fleetHeld                     *prometheus.Desc

	mu   sync.Mutex             // guards the fields below
	sets map[string]*labels.Set // by group: "pool\x00<name>", "rates", "scheduler"
}

// New returns a collector reading src, naming at most maxProjects projects
// per pool (at least 1).
func New(src Source, maxProjects int, log *slog.Logger) *Collector {
	if maxProjects < 1 {
		maxProjects = 1
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("fairshare_"+name, help, labels, nil)
	}
	return &Collector{
		src: src, maxProjects: maxProjects, timeout: 5 * time.Second, log: log,
		sets:         map[string]*labels.Set{},
		up:           d("up", "Whether the last read of the daemon's state worked."),
		kernel:       d("kernel_enforcement", "Whether the connections pool is enforced by the BPF programs."),
		poolSize:     d("pool_size", "Permits in the pool (POOL).", "pool"),
		poolFloor:    d("pool_floor", "The pool's floor: the share no active project falls below.", "pool"),
		poolInUse:    d("pool_in_use", "Permits held now.", "pool"),
		poolShare:    d("pool_share", "The current share: max(floor, size / active projects).", "pool"),
		poolActive:   d("pool_active_projects", "Projects that held or asked for a permit within the active window.", "pool"),
		poolAdmitted: d("pool_admitted_total", "Permits granted.", "pool"),
		poolRefused:  d("pool_refused_total", "Permit requests refused by the fair-share rule.", "pool"),
		poolRateLimited: d("pool_rate_limited_total",
			"Permit requests refused by their project's rate (connections: the policy's connections_per_sec and accepts_per_sec); not in refused_total.", "pool"),
		permitsRateLimited: d("project_permits_rate_limited_total",
			"Permit requests of the project refused by its rate (connections: connections_per_sec and accepts_per_sec); not in refused_total.", "pool", "project"),
		held:        d("project_permits_held", "Permits the project holds now.", "pool", "project"),
		admitted:    d("project_admitted_total", "Permits granted to the project.", "pool", "project"),
		refused:     d("project_refused_total", "Permit requests of the project refused.", "pool", "project"),
		sleeping:    d("project_sleeping", "Resident objects of the project asleep.", "pool", "project"),
		evictions:   d("project_evictions_total", "Resident objects of the project put to sleep to make room.", "pool", "project", "reason"),
		rateLimited: d("project_rate_limited_total", "Requests of the project refused by its rate buckets or work debt.", "project"),
		workTokens:  d("project_work_tokens", "Work-unit bucket balance of the project; negative is debt.", "project"),
		inFlight:    d("scheduler_in_flight", "Requests dispatched to the upstream and not done."),
		queue:       d("scheduler_queue_length", "Requests waiting in the participant's queue.", "participant"),
		dispatched:  d("scheduler_dispatched_total", "Requests dispatched, by class.", "class"),
		wait:        d("scheduler_wait_seconds", "Time from submit to dispatch."),
		exemptMax:   d("pool_exempt_max", "The exempt budget: exempt permits held at most at a time.", "pool"),
		exemptInUse: d("pool_exempt_in_use", "Exempt permits held now; not in pool_in_use.", "pool"),
		exemptAdmitted: d("pool_exempt_admitted_total",
			"Exempt permits granted (outside the rule and the pool).", "pool"),
		exemptOver: d("pool_exempt_over_budget_total",
			"Exempt asks that found the exempt budget spent and went under the rule.", "pool"),
		recPasses:   d("reconcile_passes_total", "Reconcile passes of the kernel's counts against its socket table that completed."),
		recFailures: d("reconcile_failures_total", "Reconcile passes that failed."),
		recRepairs:  d("reconcile_repairs_total", "Corrections made by reconcile passes (adopted sockets, released orphans, uncounted listeners, in_use corrections)."),
		recLast:     d("reconcile_last_pass_timestamp_seconds", "When the last reconcile pass ended, as a Unix time."),
		recSockets:  d("reconcile_sockets", "Project sockets the kernel's table listed at the last reconcile pass."),
		recHeld:     d("reconcile_held", "Permits held in the maps at the last reconcile pass."),
		recAdoptedPast: d("reconcile_adopted_past_rule_total",
			"Sockets reconcile passes adopted although the rule or a fleet cap would have refused them, in the node's pool or a destination pool (in_use may exceed the pool by them until they end)."),
		recUnadopted: d("reconcile_unadopted_sockets",
			"Project sockets holding no permit that the last reconcile pass could not adopt, the held-permit table having no room: they count nowhere until a pass finds room."),
		recMoved: d("reconcile_moved_total",
			"Permits taken while a pod was unclassified that reconcile passes moved to the project it is classified in."),
		recAborted: d("reconcile_aborted_past_rule_total",
			"Of reconcile_moved_past_rule_total, the connections aborted for it (connections.abort_moved_past): opened before their pod was classified, with no room under its project's limit."),
		recMovedPast: d("reconcile_moved_past_rule_total",
			"Of reconcile_moved_total, the permits moved although the rule or a fleet cap would have refused the project (that pool refuses it, or in dry-run would, until it is back under its limit)."),
		lapseAdmitted: d("pool_lapsed_admitted_total",
			"Asks the kernel admitted, the rule refusing, because enforcement had lapsed (no daemon heartbeat within connections.lapse_after); in pool_admitted_total too.", "pool"),
		lapsed: d("pool_enforcement_lapsed", "1 while the kernel's enforcement has lapsed (no daemon heartbeat within connections.lapse_after).", "pool"),
		heartbeatAge: d("heartbeat_age_seconds",
			"Seconds since the heartbeat in the pins was last renewed (every tick, by a goroutine of the daemon apart from its control loop); past connections.lapse_after the kernel stops refusing.", "pool"),
		kernelEvents: d("kernel_events_total",
			"Node-wide events of the BPF programs, by event: adopted (sockets a reconcile pass found holding no permit and counted), "+
				"late (children established without a reservation, put under the rule then), unaccounted (children the rule refused "+
				"once established: up, holding no permit), expired (reservations given back past connections.reservation_ttl), "+
				"map_full (a full kernel table left a connection or a project's listener uncounted).", "event"),
		lnOpen:     d("listener_open_connections", "Connections open through the listener.", "listener"),
		lnMax:      d("listener_max_connections", "The listener's cap on open connections; 0 is none.", "listener"),
		lnAccepted: d("listener_accepted_total", "Connections accepted within the caps.", "listener"),
		lnRefused:  d("listener_refused_total", "Connections closed at once for a cap, by reason.", "listener", "reason"),
		lnErrors:   d("listener_accept_errors_total", "Accept errors waited out (out of descriptors, say).", "listener"),
		memMembers: d("membership_members", "Registered cgroups in force, by the source that registered them.", "source"),
		memRefused: d("membership_refused", "Registered cgroups not in force (a conflict, an invalid name or path, "+
			"or refused by the kernel side), and cgroups a source could not make members.", "source", "by"),
		memSourceUp: d("membership_source_up", "Whether the last read of the source of members worked.", "source"),
		nsFound:     d("netns_namespaces", "Network namespaces the members' processes are in (the host's not counted)."),
		nsAttached:  d("netns_attached", "Of those, the namespaces inbound admission is attached in."),
		nsSweeps:    d("netns_sweeps_total", "Sweeps of the network namespace scan over every member."),
		nsSweep:     d("netns_sweep_seconds", "How long the last sweep's steps took, summed."),
		nsErrors:    d("netns_scan_errors_total", "Cgroups or processes the namespace scan could not read (other than gone)."),
		poolWould: d("pool_would_refuse_total",
			"Asks admitted in dry-run (the pool's or the project's enforce: false) that the rule refused; in pool_admitted_total too.", "pool"),
		poolEnforced: d("pool_enforced", "1 while the pool enforces its rule, 0 while it is in dry-run (enforce: false) or nothing enforces it (the connections pool with bpf: false).", "pool"),
		would:        d("project_would_refuse_total", "Asks of the project admitted in dry-run that the rule refused.", "pool", "project"),
		evPublished:  d("events_published_total", "Events published (refusals, would-be refusals, evictions, repairs)."),
		evDropped: d("events_dropped_total",
			"Events dropped over the per-project bound (events.per_sec), where: kernel (in the BPF programs) or daemon.", "where"),
		evLost: d("events_stream_lost_total", "Events lost by 'fairshare events' streams that did not keep up."),
		evLogLost: d("events_log_lost_total",
			"Events events.log did not write, by reason: failed (a write failed, e.g. a full disk), dropped (its queue was full: the file did not keep up), closed (published after it closed).", "reason"),
		polRefused: d("policies_file_refused",
			"Whether the policies file's current content is refused (the policies read before stay in force)."),
		polRefusals:  d("policies_file_refusals_total", "Contents of the policies file refused (each content counted once)."),
		polRefusedAt: d("policies_file_last_refused_timestamp_seconds", "When a content of the policies file was last refused, as a Unix time."),
		polLoadedAt:  d("policies_file_loaded_timestamp_seconds", "When the policies in force were read from the policies file, as a Unix time."),
		polProjects:  d("policies_file_projects", "Projects the policies in force from the policies file name."),
		fleetSize:    d("fleet_size", "A fleet pool's size: the fleet's total, which pool_size's allotment is this node's part of.", "pool"),
		fleetAllot:   d("fleet_allotment", "This node's allotment of the fleet pool (its local POOL; decaying to the safe slice when cut off).", "pool"),
		fleetSafe:    d("fleet_safe_slice", "The allotment this node decays to when cut off from etcd.", "pool"),
		fleetShare:   d("fleet_share", "The fleet share: max(floor, fleet size / projects active on any node).", "pool"),
		fleetActive:  d("fleet_active_projects", "Projects active on any node of the fleet.", "pool"),
		fleetNodes:   d("fleet_nodes", "Live nodes (with a lease) in this node's last view of the fleet.", "pool"),
		fleetConnected: d("fleet_connected",
			"1 while the node's allotment follows the fleet through etcd, 0 while waiting for etcd or cut off from it.", "pool"),
		fleetWrites: d("fleet_writes_total", "This node's publications of the pool's demand to etcd.", "pool"),
		fleetAlloc:  d("fleet_project_allocation", "The project's allocation of the fleet pool: what it may hold fleet-wide.", "pool", "project"),
		fleetHeld:   d("fleet_project_held", "What the project holds on the whole fleet, as the nodes published it.", "pool", "project"),
	}
}

// Describe sends every descriptor.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.up, c.kernel, c.poolSize, c.poolFloor, c.poolInUse, c.poolShare,
		c.poolActive, c.poolAdmitted, c.poolRefused, c.poolRateLimited, c.permitsRateLimited, c.held, c.admitted, c.refused, c.sleeping, c.evictions,
		c.rateLimited, c.workTokens, c.inFlight, c.queue, c.dispatched, c.wait,
		c.exemptMax, c.exemptInUse, c.exemptAdmitted, c.exemptOver,
		c.recPasses, c.recFailures, c.recRepairs, c.recLast, c.recSockets, c.recHeld, c.recAdoptedPast, c.recUnadopted, c.recMoved, c.recMovedPast, c.recAborted, c.lapseAdmitted, c.lapsed, c.heartbeatAge, c.kernelEvents,
		c.lnOpen, c.lnMax, c.lnAccepted, c.lnRefused, c.lnErrors,
		c.memMembers, c.memRefused, c.memSourceUp, c.nsFound, c.nsAttached, c.nsSweeps, c.nsSweep, c.nsErrors,

		c.poolWould, c.poolEnforced, c.would, c.evPublished, c.evDropped, c.evLost, c.evLogLost,
		c.polRefused, c.polRefusals, c.polRefusedAt, c.polLoadedAt, c.polProjects,
		c.fleetSize, c.fleetAllot, c.fleetSafe, c.fleetShare, c.fleetActive, c.fleetNodes, c.fleetConnected, c.fleetWrites,
		c.fleetAlloc, c.fleetHeld} {
		ch <- d
	}
}

// Collect reads the source once and sends the metrics.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), c.timeout)
	defer cancel()
	st, err := c.src(ctx)
	if err != nil {
		c.log.Warn("metrics: reading status", "err", err)
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 0)
		return
	}
	// The label sets carry state from scrape to scrape; two scrapes at once
	// take turns.
	c.mu.Lock()
	defer c.mu.Unlock()
	ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(c.kernel, prometheus.GaugeValue, b2f(st.Kernel))
	for _, p := range st.Pools {
		c.collectPool(ch, p)
	}
	c.collectRates(ch, st.Rates)
	if st.Scheduler != nil {
		c.collectScheduler(ch, st.Scheduler)
	}
	if r := st.Reconcile; r != nil {
		ch <- prometheus.MustNewConstMetric(c.recPasses, prometheus.CounterValue, float64(r.Passes))
		ch <- prometheus.MustNewConstMetric(c.recAdoptedPast, prometheus.CounterValue, float64(r.AdoptedPastTotal))
		ch <- prometheus.MustNewConstMetric(c.recMoved, prometheus.CounterValue, float64(r.MovedTotal))
		ch <- prometheus.MustNewConstMetric(c.recMovedPast, prometheus.CounterValue, float64(r.MovedPastTotal))
		ch <- prometheus.MustNewConstMetric(c.recAborted, prometheus.CounterValue, float64(r.AbortedTotal))
		ch <- prometheus.MustNewConstMetric(c.recFailures, prometheus.CounterValue, float64(r.Failures))
		ch <- prometheus.MustNewConstMetric(c.recRepairs, prometheus.CounterValue, float64(r.RepairsTotal))
		ch <- prometheus.MustNewConstMetric(c.recLast, prometheus.GaugeValue, float64(r.Time.UnixNano())/1e9)
		ch <- prometheus.MustNewConstMetric(c.recSockets, prometheus.GaugeValue, float64(r.Sockets))
		ch <- prometheus.MustNewConstMetric(c.recHeld, prometheus.GaugeValue, float64(r.Held))
		ch <- prometheus.MustNewConstMetric(c.recUnadopted, prometheus.GaugeValue, float64(r.Unadopted))
	}
	if m := st.Membership; m != nil {
		c.collectMembership(ch, m)
	}
	if e := st.Events; e != nil {
		ch <- prometheus.MustNewConstMetric(c.evPublished, prometheus.CounterValue, float64(e.Published))
		ch <- prometheus.MustNewConstMetric(c.evDropped, prometheus.CounterValue, float64(e.Dropped), "daemon")
		ch <- prometheus.MustNewConstMetric(c.evDropped, prometheus.CounterValue, float64(e.KernelDropped), "kernel")
		ch <- prometheus.MustNewConstMetric(c.evLost, prometheus.CounterValue, float64(e.StreamLost))
		if e.Log != "" {
			ch <- prometheus.MustNewConstMetric(c.evLogLost, prometheus.CounterValue, float64(e.LogFailed), "failed")
			ch <- prometheus.MustNewConstMetric(c.evLogLost, prometheus.CounterValue, float64(e.LogDropped), "dropped")
			ch <- prometheus.MustNewConstMetric(c.evLogLost, prometheus.CounterValue, float64(e.LogClosed), "closed")
		}
	}
	if f := st.PoliciesFile; f != nil {
		// Only with a policies file configured; the timestamps once there
		// is one to give.
		ch <- prometheus.MustNewConstMetric(c.polRefused, prometheus.GaugeValue, b2f(f.Error != ""))
		ch <- prometheus.MustNewConstMetric(c.polRefusals, prometheus.CounterValue, float64(f.Refusals))
		ch <- prometheus.MustNewConstMetric(c.polProjects, prometheus.GaugeValue, float64(f.Projects))
		if !f.RefusedAt.IsZero() {
			ch <- prometheus.MustNewConstMetric(c.polRefusedAt, prometheus.GaugeValue, float64(f.RefusedAt.UnixNano())/1e9)
		}
		if !f.LoadedAt.IsZero() {
			ch <- prometheus.MustNewConstMetric(c.polLoadedAt, prometheus.GaugeValue, float64(f.LoadedAt.UnixNano())/1e9)
		}
	}
	for _, l := range st.Listeners {
		ch <- prometheus.MustNewConstMetric(c.lnOpen, prometheus.GaugeValue, float64(l.Open), l.Name)
		ch <- prometheus.MustNewConstMetric(c.lnMax, prometheus.GaugeValue, float64(l.MaxConns), l.Name)
		ch <- prometheus.MustNewConstMetric(c.lnAccepted, prometheus.CounterValue, float64(l.Accepted), l.Name)
		ch <- prometheus.MustNewConstMetric(c.lnErrors, prometheus.CounterValue, float64(l.AcceptErrors), l.Name)
		for _, reason := range []string{"listener_full", "peer_full"} {
			ch <- prometheus.MustNewConstMetric(c.lnRefused, prometheus.CounterValue, float64(l.Refused[reason]), l.Name, reason)
		}
	}
}

func (c *Collector) collectPool(ch chan<- prometheus.Metric, p admin.Pool) {
	gauge := func(d *prometheus.Desc, v float64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, l...)
	}
	counter := func(d *prometheus.Desc, v float64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, l...)
	}
	gauge(c.poolSize, float64(p.Size), p.Name)
	gauge(c.poolFloor, float64(p.Floor), p.Name)
	gauge(c.poolInUse, float64(p.InUse), p.Name)
	gauge(c.poolShare, float64(p.Share), p.Name)
	gauge(c.poolActive, float64(p.Active), p.Name)
	counter(c.poolAdmitted, float64(p.Admitted), p.Name)
	counter(c.poolRefused, float64(p.Refused), p.Name)
	counter(c.poolWould, float64(p.WouldRefuse), p.Name)
	// A pool nothing enforces (the connections pool with bpf off) is not
	// enforced, dry-run or not: an alert on enforced == 0 must see it.
	gauge(c.poolEnforced, b2f(!p.DryRun && p.Enforcer != "off"), p.Name)
	// Only the kernel's pool has rates per project: the family is left
	// out for the others rather than a column of zeros.
	rated := p.Enforcer == "kernel"
	if rated {
		counter(c.poolRateLimited, float64(p.RateLimited), p.Name)
	}
	if lp := p.Lapse; lp != nil {
		counter(c.lapseAdmitted, float64(lp.Admitted), p.Name)
		gauge(c.lapsed, b2f(lp.Lapsed), p.Name)
		gauge(c.heartbeatAge, lp.HeartbeatAge, p.Name)
	}
	// Node-wide, so without a pool label: only the kernel's connections
	// pool carries them.
	if e := p.KernelEvents; e != nil {
		for _, ev := range []struct {
			name string
			n    uint64
		}{{"adopted", e.Adopted}, {"late", e.Late}, {"unaccounted", e.Unaccounted}, {"expired", e.Expired}, {"map_full", e.MapFull}} {
			counter(c.kernelEvents, float64(ev.n), ev.name)
		}
	}
	if e := p.Exempt; e != nil {
		gauge(c.exemptMax, float64(e.Max), p.Name)
		gauge(c.exemptInUse, float64(e.InUse), p.Name)
		counter(c.exemptAdmitted, float64(e.Admitted), p.Name)
		counter(c.exemptOver, float64(e.OverBudget), p.Name)
	}
	residents := false
	for _, pr := range p.Projects {
		if pr.Evictions != nil || pr.Sleeping != 0 {
			residents = true
		}
	}
	ls := c.set("pool\x00" + p.Name)
	// The most permits held, then the most traffic.
	ls.Assign(labels.Busiest(p.Projects, func(p admin.Project) string { return p.Project },
		func(p admin.Project) [2]uint64 { return [2]uint64{uint64(max(p.Held, 0)), p.Admitted + p.Refused} }))
	if p.Fleet != nil {
		c.collectFleet(ch, p, ls)
	}
	type gauges struct{ held, sleeping int }
	byLabel := map[string]*gauges{}
	var order []string
	for _, pr := range p.Projects {
		l := ls.Label(pr.Project)
		g := byLabel[l]
		if g == nil {
			g = &gauges{}
			byLabel[l] = g
			order = append(order, l)
		}
		g.held += pr.Held
		g.sleeping += pr.Sleeping
		ls.Count(pr.Project, "admitted", pr.Admitted)
		ls.Count(pr.Project, "refused", pr.Refused)
		ls.Count(pr.Project, "would", pr.WouldRefuse)
		ls.Count(pr.Project, "rate_limited", pr.RateLimited)
		for r, v := range pr.Evictions {
			ls.Count(pr.Project, "evictions\x00"+r, v)
		}
	}
	// Other also carries the counts of projects gone from the pool (or from
	// their label), so it exists whenever the named series do not add up
	// to the pool's totals.
	if byLabel[Other] == nil && (ls.OtherUsed() || ls.Remainder("admitted", p.Admitted) > 0 || ls.Remainder("refused", p.Refused) > 0 ||
		ls.Remainder("would", p.WouldRefuse) > 0 || (rated && ls.Remainder("rate_limited", p.RateLimited) > 0)) {
		byLabel[Other] = &gauges{}
		order = append(order, Other)
	}
	for _, l := range order {
		g := byLabel[l]
		gauge(c.held, float64(g.held), p.Name, l)
		adm, ref, would := ls.Total(l, "admitted"), ls.Total(l, "refused"), ls.Total(l, "would")
		lim := ls.Total(l, "rate_limited")
		if l == Other {
			adm, ref, would = ls.Remainder("admitted", p.Admitted), ls.Remainder("refused", p.Refused), ls.Remainder("would", p.WouldRefuse)
			lim = ls.Remainder("rate_limited", p.RateLimited)
			ls.MarkOther()
		}
		counter(c.admitted, float64(adm), p.Name, l)
		counter(c.refused, float64(ref), p.Name, l)
		counter(c.would, float64(would), p.Name, l)
		if rated {
			counter(c.permitsRateLimited, float64(lim), p.Name, l)
		}
		if residents {
			gauge(c.sleeping, float64(g.sleeping), p.Name, l)
			var reasons []string
			for k := range ls.Counters(l) {
				if r, ok := strings.CutPrefix(k, "evictions\x00"); ok {
					reasons = append(reasons, r)
				}
			}
			sort.Strings(reasons)
			for _, r := range reasons {
				counter(c.evictions, float64(ls.Total(l, "evictions\x00"+r)), p.Name, l, r)
			}
		}
	}
}

// collectFleet sends a fleet pool's fleet view; its projects go by the
// pool's labels (the busiest named, the rest in Other).
func (c *Collector) collectFleet(ch chan<- prometheus.Metric, p admin.Pool, ls *labels.Set) {
	f := p.Fleet
	gauge := func(d *prometheus.Desc, v float64, l ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, l...)
	}
	gauge(c.fleetSize, float64(f.Size), p.Name)
	gauge(c.fleetAllot, float64(f.Allotment), p.Name)
	gauge(c.fleetSafe, float64(f.Safe), p.Name)
	gauge(c.fleetShare, float64(f.Share), p.Name)
	gauge(c.fleetActive, float64(f.Active), p.Name)
	gauge(c.fleetNodes, float64(f.Nodes), p.Name)
	gauge(c.fleetConnected, b2f(f.State == "connected"), p.Name)
	ch <- prometheus.MustNewConstMetric(c.fleetWrites, prometheus.CounterValue, float64(f.Writes), p.Name)
	type sums struct{ alloc, held int }
	by := map[string]*sums{}
	var order []string
	for _, pr := range f.Projects {
		l := ls.Label(pr.Project)
		if by[l] == nil {
			by[l] = &sums{}
			order = append(order, l)
		}
		by[l].alloc += pr.Alloc
		by[l].held += pr.FleetHeld
	}
	for _, l := range order {
		gauge(c.fleetAlloc, float64(by[l].alloc), p.Name, l)
		gauge(c.fleetHeld, float64(by[l].held), p.Name, l)
	}
}

// set returns the label set of one group, creating it on first use. Groups
// are the configured pools, the rates and the scheduler, so few.
func (c *Collector) set(group string) *labels.Set {
	ls := c.sets[group]
	if ls == nil {
		ls = labels.NewSet(c.maxProjects)
		c.sets[group] = ls
	}
	return ls
}

func (c *Collector) collectRates(ch chan<- prometheus.Metric, rates []admin.Rate) {
	ls := c.set("rates")
	ls.Assign(labels.Busiest(rates, func(r admin.Rate) string { return r.Project },
		func(r admin.Rate) [2]uint64 { return [2]uint64{r.Limited} }))
	tokens := map[string]float64{}
	var order []string
	for _, r := range rates {
		l := ls.Label(r.Project)
		if _, ok := tokens[l]; !ok {
			order = append(order, l)
		}
		tokens[l] += r.WorkTokens
		ls.Count(r.Project, "limited", r.Limited)
	}
	if _, ok := tokens[Other]; !ok && ls.OtherUsed() {
		tokens[Other] = 0
		order = append(order, Other)
	}
	for _, l := range order {
		ch <- prometheus.MustNewConstMetric(c.rateLimited, prometheus.CounterValue, float64(ls.Total(l, "limited")), l)
		ch <- prometheus.MustNewConstMetric(c.workTokens, prometheus.GaugeValue, tokens[l], l)
	}
}

func (c *Collector) collectScheduler(ch chan<- prometheus.Metric, s *admin.Scheduler) {
	ch <- prometheus.MustNewConstMetric(c.inFlight, prometheus.GaugeValue, float64(s.InFlight))
	ls := c.set("scheduler")
	ls.Assign(labels.Busiest(s.Participants, func(p admin.Participant) string { return p.Participant },
		func(p admin.Participant) [2]uint64 { return [2]uint64{uint64(max(p.Queue, 0))} }))
	queues := map[string]int{}
	var order []string
	for _, p := range s.Participants {
		l := ls.Label(p.Participant)
		if _, ok := queues[l]; !ok {
			order = append(order, l)
		}
		queues[l] += p.Queue
	}
	for _, l := range order {
		ch <- prometheus.MustNewConstMetric(c.queue, prometheus.GaugeValue, float64(queues[l]), l)
	}
	for _, class := range []string{"P1", "P2", "P3"} {
		ch <- prometheus.MustNewConstMetric(c.dispatched, prometheus.CounterValue, float64(s.Dispatched[class]), class)
	}
	// Prometheus buckets are cumulative; the status histogram is not.
	buckets := make(map[float64]uint64, len(s.Wait.Bounds))
	var cum uint64
	for i, b := range s.Wait.Bounds {
		if i < len(s.Wait.Counts) {
			cum += s.Wait.Counts[i]
		}
		buckets[b] = cum
	}
	ch <- prometheus.MustNewConstHistogram(c.wait, s.Wait.Count, s.Wait.Sum, buckets)
}

// collectMembership sends the members and refusals by source, and the
// namespace scan's findings.
func (c *Collector) collectMembership(ch chan<- prometheus.Metric, m *admin.Membership) {
	type key struct{ source, by string }
	refused := map[key]int{}
	for _, s := range m.Sources {
		ch <- prometheus.MustNewConstMetric(c.memMembers, prometheus.GaugeValue, float64(s.Members), s.Name)
		ch <- prometheus.MustNewConstMetric(c.memSourceUp, prometheus.GaugeValue, b2f(s.Error == ""), s.Name)
		refused[key{s.Name, "sources"}] += 0
	}
	for _, r := range m.Refused {
		refused[key{r.Source, r.By}]++
	}
	for k, n := range refused {
		ch <- prometheus.MustNewConstMetric(c.memRefused, prometheus.GaugeValue, float64(n), k.source, k.by)
	}
	if ns := m.Netns; ns != nil {
		attached := 0
		for _, n := range ns.Namespaces {
			if n.Attached {
				attached++
			}
		}
		ch <- prometheus.MustNewConstMetric(c.nsFound, prometheus.GaugeValue, float64(len(ns.Namespaces)))
		ch <- prometheus.MustNewConstMetric(c.nsAttached, prometheus.GaugeValue, float64(attached))
		ch <- prometheus.MustNewConstMetric(c.nsSweeps, prometheus.CounterValue, float64(ns.Scan.Sweeps))
		ch <- prometheus.MustNewConstMetric(c.nsSweep, prometheus.GaugeValue, ns.Scan.SweepTime.Seconds())
		ch <- prometheus.MustNewConstMetric(c.nsErrors, prometheus.CounterValue, float64(ns.Scan.Errors))
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// NewRegistry returns a registry holding c plus the Go runtime and process
// collectors, for the daemon's /metrics.
func NewRegistry(c *Collector) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(c, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}
