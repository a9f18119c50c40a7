// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/front"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/internal/logrl"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/metrics"
	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/sync/errgroup"
)

// Options configure New.
type Options struct {
	Config  config.Config
	Version string
	Log     *slog.Logger
	// ReadyFile, if set, is written once every listener is up, with the
	// addresses actually bound (see Ready). Tests use it.
	ReadyFile string
	// DetachOnExit unpins and detaches the BPF programs on shutdown instead
	// of leaving them enforcing.
	DetachOnExit bool
	// ConfigDir is the directory of the configuration file ("": none). A
	// policies file outside it that fails at its first line is refused as
	// "not a policies file", with nothing of its content in the log.
	ConfigDir string
	// Clock drives the user-space pools, rate buckets and scheduler; nil
	// means the system clock. Tests move it to reach idle and forget periods.
	Clock clock.Clock
}

// Ready is the JSON written to Options.ReadyFile.
type Ready struct {
	PID         int    `json:"pid"`
	AdminSocket string `json:"admin_socket"`
	Metrics     string `json:"metrics,omitempty"`
	Front       string `json:"front,omitempty"`
	FrontSocket string `json:"front_socket,omitempty"`
	Permits     string `json:"permits,omitempty"`
	Kernel      bool   `json:"kernel"`
}

// Daemon is the running node daemon.
type Daemon struct {
	opts Options
	cfg  config.Config
	// pinLock holds the pin directory's lock (lockPins) for the daemon's
	// life; nil without BPF.
	pinLock *os.File
	// storeClosed: closeParts closed the store (it keeps d.store).
	storeClosed bool
	// kernelClosed and fleetClosed: closeParts closed them. It keeps
	// d.kernel and d.fleet named: an admin call or a scrape still
	// finishing past the shutdown's grace (which http.Server.Close does
	// not wait for) reads them without a lock, and gets the limiter's
	// ErrClosed rather than a nil pointer. kernelClosed is guarded by
	// destMu, which a reload holds while it uses the kernel side.
	kernelClosed, fleetClosed bool
	// pinsGone is set once the pin directory is found removed or replaced
	// (watchPins): nothing of it is the daemon's to unpin as it exits.
	pinsGone  atomic.Bool
	log       *slog.Logger
	defPolicy policy.Policy

	store     *policy.Store
	projects  *projects   // the membership: which cgroups are in which project
	kernel    *kernelSide // the connections pool in the kernel; nil without BPF
	fleet     *fleetSide  // the fleet pools' etcd side; nil without fleet pools
	pools     []pool      // every pool, by name, for the control loop and Status
	requests  *pools.Pool
	others    map[string]*pools.Pool // flights and extra pools, served by permitd
	residents *pools.Residents
	rates     *pools.Rates
	sched     *scheduler.Scheduler
	front     *front.Front // nil when disabled
	permits   *permitd.Server
	logrl     *logrl.Handler
	caps      Caps
	owners    *peercred.Owners // subordinate uids, for the per-peer caps
	events    *eventSink       // every part's refusals, evictions and repairs

	// polMu serializes changes of the policies in force (the admin API's
	// and the policies file's), so that a check of who owns a project and
	// the change it allows are one step.
	polMu sync.Mutex

	mu   sync.Mutex        // guards the fields below
	seen map[string][2]int // pool -> last logged {active, share}
	// limitedGone keeps the rate refusals of buckets deleted when a policy
	// dropped its limits, so the project's count never goes down. It holds
	// one number per project that ever had limits.
	limitedGone map[string]uint64
	// dryProjects are the projects in dry-run by their policy.
	dryProjects map[string]bool
	// destCfg are the destination pools in force (the configuration's,
	// then the last Reload's).
	destCfg map[string]config.Pool

	// destMu serializes the sizes of the fleet destination pools: a
	// Member's SetSize and a Reload's SetDestPools, which would otherwise
	// write the configured (fleet) size over the allotment.
	destMu sync.Mutex
	// fleetSizes is the local size last given to each fleet destination
	// pool (its allotment), by name, and the size the kernel's connections
	// pool opens at when it is a fleet pool (its safe slice); guarded by
	// destMu.
	fleetSizes map[string]int
	// listeners are the listeners serving, for status and metrics.
	listeners []*listen.Listener

	// The sockets New made, which Run serves (nil: not configured).
	adminLn, metricsLn, frontLn, frontSock net.Listener
	// connectionsAt is the connections pool's index in pools, where the
	// kernel side goes once it is open.
	connectionsAt int

	// file follows the policies file (nil: none configured).
	file *policyFile
	// health is the control loop's last tick, for /healthz.
	health health
}

// New checks what it can before it creates anything (preflight), then
// builds the parts in order: the TCP listeners, the events log, the store,
// the membership, the user-space pools and the scheduler, the front, the
// unix sockets, the permit API, and last the kernel's connections pool
// (unless cfg.BPF is false); then it applies the stored policies. A start
// that fails removes again what it created (see start.go), so a refused
// start leaves the state, socket and pin directories as they were.
func New(opts Options) (*Daemon, error) {
	cfg := opts.Config
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	lapseNote, lapseRaised := config.LapseRaised(opts.Config, cfg)
	cfg, _ = Effective(cfg)
	if err := preflight(cfg); err != nil {
		return nil, err
	}
	var pinLock *os.File
	if cfg.BPF {
		// Before anything is made: a second daemon on these pins is
		// refused here, leaving the first's untouched (and one that
		// starts beside another on a node with no pins yet waits for
		// that one's start to be over: see lockForStart).
		var startLock *os.File
		var err error
		if pinLock, startLock, err = lockForStart(cfg.PinDir); err != nil {
			return nil, err
		}
		if startLock != nil {
			// Released as New returns: after the kernel side locked
			// the directory it made, or after the rollback below
			// (deferred later, so run first) removed it.
			defer startLock.Close()
		}
	}
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// Every part logs through one limiter of repeated lines: an outage or a
	// flood repeats one line per request or connection.
	rl := logrl.New(log.Handler(), logrl.Options{})
	log = slog.New(rl)
	if lapseRaised {
		log.Warn(lapseNote)
	}
	nofile, err := listen.RaiseFileLimit()
	if err != nil {
		log.Warn("could not raise the open-files limit", "err", err)
		nofile, _ = hardFileLimit()
	}
	d := &Daemon{
		opts: opts, cfg: cfg, log: log, logrl: rl, caps: BudgetCaps(cfg, nofile), owners: newOwners(cfg),
		defPolicy: policy.Policy{Tier: cfg.Scheduler.DefaultTier, Shares: cfg.Scheduler.DefaultShares},
		others:    map[string]*pools.Pool{},
		rates:     pools.NewRates(opts.Clock),
		seen:      map[string][2]int{},

		limitedGone: map[string]uint64{},
		dryProjects: map[string]bool{},

		connectionsAt: -1,
		destCfg:       destOnly(cfg),
		fleetSizes:    map[string]int{},
		pinLock:       pinLock,
	}
	var undo rollback
	ok := false
	defer func() {
		if !ok {
			d.closeParts()
			undo.run()
		}
	}()

	// The TCP listeners first: a busy port is the likeliest failure, and
	// binding one creates no file.
	if cfg.Metrics.Listen != "" {
		if d.metricsLn, err = net.Listen("tcp", cfg.Metrics.Listen); err != nil {
			return nil, fmt.Errorf("metrics listener: %w", err)
		}
	}
	if cfg.Front.Enabled() && cfg.Front.Listen != "" {
		if d.frontLn, err = net.Listen("tcp", cfg.Front.Listen); err != nil {
			return nil, fmt.Errorf("front listener: %w", err)
		}
	}

	if cfg.Events.Log != "" {
		made := missing(cfg.Events.Log)
		undo.add(func() { removeMade(made) })
	}
	if d.events, err = newEventSink(cfg.Events, log.With("part", "events")); err != nil {
		return nil, err
	}
	made := missing(filepath.Join(cfg.StateDir, policy.FileName))
	undo.add(func() { removeMade(made) })
	d.store, err = policy.Open(cfg.StateDir, policy.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("opening policy store: %w", err)
	}
	if root, err := ProjectsRoot(cfg); err == nil {
		made := missing(root)
		undo.add(func() { removeMade(made) })
	}
	if d.projects, err = newProjects(cfg, d.store, cfg.BPF, log); err != nil {
		return nil, err
	}
	if err := d.buildPools(); err != nil {
		return nil, err
	}
	if err := d.buildScheduler(); err != nil {
		return nil, err
	}
	if cfg.Front.Enabled() {
		if err := d.buildFront(); err != nil {
			return nil, err
		}
	}
	if cfg.Permits.Socket != "" {
		if err := d.buildPermits(); err != nil {
			return nil, err
		}
	}
	if err := d.buildFleet(); err != nil {
		return nil, err
	}
	if d.fleet != nil {
		undo.add(func() { d.fleet.close() })
	}

	list, err := d.storedPolicies()
	if err != nil {
		return nil, err
	}
	if err := d.listenUnix(&undo); err != nil {
		return nil, err
	}

	// The kernel side last: nothing after it can fail, so a pin directory
	// a running configuration left is changed only by a start that goes on
	// (the loader checks what the pins may refuse, a change of destination
	// pools, before it writes the pool's settings; only the kernel refusing
	// a map write or an attach midway leaves part of this configuration
	// written).
	if cfg.BPF {
		pins := listPins(cfg.PinDir)
		undo.add(func() {
			if err := restorePins(cfg.PinDir, pins); err != nil {
				log.Error("removing the pins of the failed start", "pin_dir", cfg.PinDir, "err", err)
			}
		})
		if d.kernel, err = openKernel(cfg, log, d.events, d.fleetSizes, d.pinLock); err != nil {
			return nil, err
		}
		if d.pinLock == nil {
			if d.pinLock, err = lockPins(cfg.PinDir); err != nil {
				return nil, err
			}
			// Gone since the kernel side made it: nothing to lock, and
			// no start without the lock (the undo above runs).
			if d.pinLock == nil {
				return nil, fmt.Errorf("%w: %s, while the daemon started", ErrPinsRemoved, cfg.PinDir)
			}
		}
		d.projects.kernel = d.kernel.members()
		if d.connectionsAt >= 0 {
			d.pools[d.connectionsAt] = d.kernel
		}
	} else {
		log.Warn("bpf disabled by configuration: connections are NOT enforced on this node")
	}
	d.projects.apply(context.Background(), time.Now(), false)
	for _, name := range cfg.PoolNames() {
		if !cfg.Pools[name].Enforced() {
			log.Warn("pool in dry-run (enforce: false): what the rule would refuse is admitted and counted as would_refuse",
				"pool", name)
		}
	}
	if lapsing := cfg.LapsingFleetPools(); len(lapsing) > 0 {
		log.Warn("fleet pools enforced in the kernel lapse with the rest: past connections.lapse_after without a daemon, "+
			"this node admits everything in them whatever the fleet's size; lapse_after: 0 holds them (docs/fleet.md)",
			"pools", lapsing, "lapse_after", cfg.Connections.LapseAfter)
	}
	if !cfg.Front.Enabled() && cfg.Front.Upstream != "" {
		// --front-upstream without --front-listen or --front-socket.
		log.Warn("front.upstream is set but the front is off (no front.listen or front.socket): no request reaches it through fairshare",
			"upstream", cfg.Front.Upstream)
	}
	for _, e := range list {
		d.apply(e.Project, e.Policy)
	}
	if len(list) > 0 {
		log.Info("policies applied", "count", len(list))
	}
	if cfg.PoliciesFile != "" {
		d.file = newPolicyFile(cfg.PoliciesFile, d.defPolicy, opts.ConfigDir)
		d.followPolicies()
	} else if err := d.store.ClearAccepted(); err != nil {
		// Without a policies file none of its policies is in force: the
		// content an earlier run kept must not come back, stale, at a
		// later start that names the file again and finds it refused.
		log.Warn("the policies file's content an earlier run kept could not be cleared from the policy store; "+
			"a later start with policies_file set and the file refused would put it in force again", "err", err)
	}
	ok = true
	return d, nil
}

// listenUnix makes the unix sockets: the admin socket, the front's, the
// permit API's. Each is added to undo with the directories it made.
func (d *Daemon) listenUnix(undo *rollback) error {
	made := missing(d.cfg.AdminSocket)
	undo.add(func() { removeMade(made) })
	ln, err := admin.Listen(d.cfg.AdminSocket)
	if err != nil {
		return pathError("admin_socket", err)
	}
	d.adminLn = ln
	undo.add(func() { ln.Close() })
	if d.front != nil && d.cfg.Front.Socket != "" {
		made := missing(d.cfg.Front.Socket)
		undo.add(func() { removeMade(made) })
		ln, err := d.listenUnixFront(d.cfg.Front.Socket)
		if err != nil {
			return pathError("front.socket", err)
		}
		d.frontSock = ln
		undo.add(func() { ln.Close() })
	}
	if d.permits != nil {
		made := missing(d.permits.Socket())
		undo.add(func() { removeMade(made) })
		if err := d.permits.Listen(); err != nil {
			return pathError("permits.socket", fmt.Errorf("permit api: %w", err))
		}
		undo.add(func() { d.permits.Close() })
	}
	return nil
}

func (d *Daemon) buildScheduler() error {
	sc := d.cfg.Scheduler
	tier, err := scheduler.ParseTier(sc.DefaultTier)
	if err != nil {
		return fmt.Errorf("scheduler.default_tier: %w", err)
	}
	d.sched, err = scheduler.New(scheduler.Config{
		P1Rate: sc.P1Rate, P1Burst: sc.P1Burst,
		P2Rate: sc.P2Rate, P2Burst: sc.P2Burst,
		MaxInFlight: d.cfg.Front.MaxInFlight,
		// The places are divided as the requests pool is: among the
		// projects seen within its window.
		Window:        d.cfg.Pools[config.PoolRequests].Window,
		Poll:          sc.Poll,
		DefaultPolicy: scheduler.Policy{Tier: tier, Shares: sc.DefaultShares},
	}, d.opts.Clock)
	if err != nil {
		return fmt.Errorf("scheduler: %w", err)
	}
	return nil
}

// buildFront builds the HTTP front over the requests pool, the rate buckets
// and the scheduler.
func (d *Daemon) buildFront() error {
	// Local clients are in the project of their cgroup. Without a cgroup2
	// hierarchy there is no such identity; routes and trusted peers still
	// work.
	root := ""
	if d.kernel != nil {
		root = d.kernel.root
	} else if r, err := ProjectsRoot(d.cfg); err == nil {
		root = r
	} else {
		d.log.Warn("front: no projects root, local clients get no project from their cgroup", "err", err)
	}
	var err error
	d.front, err = front.New(frontConfig(d.cfg, root),
		front.Deps{Requests: d.requests, Rates: d.rates, Sched: d.sched, Log: d.log.With("part", "front"),
			ProjectOf: d.projects.projectOf, Events: d.events.publish, DryRun: d.dryRun})
	if err != nil {
		// Everything front.New checks comes from the front's keys.
		return fmt.Errorf("%w: front: %w", config.ErrInvalid, err)
	}
	return nil
}

// frontConfig is the front's configuration from the daemon's.
func frontConfig(cfg config.Config, projectsRoot string) front.Config {
	fc, lim := cfg.Front, cfg.Front.Limits
	return front.Config{
		Listen: fc.Listen, Upstream: fc.Upstream,
		ProjectHeader: fc.ProjectHeader, Routes: fc.Routes,
		MaxInFlight: fc.MaxInFlight, CostHeader: fc.CostHeader,
		CostFromTime: fc.CostFromTime, CostUnit: fc.CostUnit,
		MaxProjects:  cfg.Metrics.MaxProjects,
		ProjectsRoot: projectsRoot, TrustedPeers: fc.TrustedPeers,
		Exempt:    front.Exempt(fc.Exempt),
		ExemptMax: fc.ExemptMax,

		MaxUpstreamHead: lim.UpstreamHeadBytes, MaxInformational: lim.Informational,
		MaxRequestHead: lim.RequestHeadBytes, ReadHeaderTimeout: lim.ReadHeaderTimeout,
		IdleTimeout: lim.IdleTimeout, UpstreamIdleTimeout: lim.UpstreamIdleTimeout,
		BodyReadTimeout: lim.BodyReadTimeout, BodyMinRate: lim.BodyMinRate, WriteTimeout: lim.WriteTimeout,
		UpstreamHeadTimeout: lim.UpstreamHeadTimeout, UpstreamReadTimeout: upstreamReadTimeout(lim.UpstreamReadTimeout),
		TunnelTimeout:          lim.TunnelTimeout,
		UpstreamIdlePerProject: lim.UpstreamIdlePerProject,
		FastPath:               fc.FastPath, PlainSends: !fc.IOURing,
	}
}

// upstreamReadTimeout is front.limits.upstream_read_timeout as the front
// takes it: 0 turns the bound off, which the front spells below 0 (its 0
// is the default).
func upstreamReadTimeout(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}

// buildPermits builds the permit API over the flights, residents and extra
// pools.
func (d *Daemon) buildPermits() error {
	if g := d.cfg.Permits.Group; g != "" {
		if _, err := permitd.LookupGroup(g); err != nil {
			return fmt.Errorf("%w: permits.group: %w", config.ErrInvalid, err)
		}
	}
	var err error
	pc := permitsConfig(d.cfg, d.caps, d.owners)
	pc.Events = d.events.publish
	d.permits, err = permitd.New(pc, d.others, d.residents, d.log.With("part", "permits"))
	if err != nil {
		return fmt.Errorf("permit api: %w", err)
	}
	return nil
}

// listenUnixFront listens on the front's unix socket. Anyone on the node may
// connect: what a client gets is decided by its cgroup, not by the socket's
// mode. A file at the path that is not a socket is left alone and refused.
func (d *Daemon) listenUnixFront(path string) (net.Listener, error) {
	ln, warn, err := listen.Unix(path, 0o666, -1)
	if err != nil {
		return nil, fmt.Errorf("front socket: %w", err)
	}
	if warn != "" {
		d.log.Warn("local clients may not reach the front socket", "socket", path, "problem", warn)
	}
	return ln, nil
}

// ProjectsRoot returns cfg.ProjectsRoot, or <cgroup2 mount>/fairshare
// (fairshare.slice with the systemd source).
func ProjectsRoot(cfg config.Config) (string, error) {
	if cfg.ProjectsRoot != "" {
		return cfg.ProjectsRoot, nil
	}
	mnt, err := cgroup.FindMount()
	if err != nil {
		return "", fmt.Errorf("finding the projects root: %w", err)
	}
	if cfg.Projects.Has(membership.SourceSystemd) {
		return filepath.Join(mnt.Point, "fairshare.slice"), nil
	}
	return filepath.Join(mnt.Point, "fairshare"), nil
}

// apply hands a stored policy to the scheduler, the rate buckets and the
// kernel's connection rates.
func (d *Daemon) apply(project string, p policy.Policy) {
	tier, err := scheduler.ParseTier(p.Tier)
	if err != nil {
		// The store validates tiers; a bad one here is a store from a newer
		// version. Keep the project on the default rather than fail.
		d.log.Warn("unknown tier in stored policy", "project", project, "tier", p.Tier)
		tier, _ = scheduler.ParseTier(d.defPolicy.Tier)
	}
	d.sched.SetPolicy(project, scheduler.Policy{Tier: tier, Shares: p.Shares})
	d.setLimits(project, pools.Limits{RequestsPerSec: p.RequestsPerSec, WorkPerSec: p.WorkPerSec})
	if d.kernel != nil {
		d.kernel.setRates(project, loader.Rates{Out: p.ConnectionsPerSec, In: p.AcceptsPerSec})
	}
	d.setDryRun(project, !p.Enforced())
}

// setDryRun puts a project in dry-run in every pool that refuses (not
// residents, which evict), and in the front's rate checks (dryRun).
func (d *Daemon) setDryRun(project string, on bool) {
	if d.requests != nil {
		d.requests.SetDryRun(project, on)
	}
	for _, p := range d.others {
		p.SetDryRun(project, on)
	}
	if d.kernel != nil {
		d.kernel.setDryRun(project, on)
	}
	d.mu.Lock()
	if on {
		d.dryProjects[project] = true
	} else {
		delete(d.dryProjects, project)
	}
	d.mu.Unlock()
}

// dryRun reports whether project is in dry-run by its policy.
func (d *Daemon) dryRun(project string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dryProjects[project]
}

// unapply puts a project whose policy was deleted back on the default:
// default tier and shares, unbounded rates (in the kernel too, at once).
func (d *Daemon) unapply(project string) {
	d.sched.DeletePolicy(project)
	d.setLimits(project, pools.Limits{})
	if d.kernel != nil {
		d.kernel.setRates(project, loader.Rates{})
	}
	d.setDryRun(project, false)
}

// setLimits sets a project's rate limits, keeping the refusals of a bucket
// that unbounded limits delete. Status reads the buckets under the same
// lock, so no reader sees the count between the delete and the carry.
func (d *Daemon) setLimits(project string, l pools.Limits) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if l.RequestsPerSec <= 0 && l.WorkPerSec <= 0 {
		if n := d.rates.State(project).Limited; n > 0 {
			d.limitedGone[project] += n
		}
	}
	d.rates.SetLimits(project, l)
}

// Run serves until ctx is done, then shuts down. It closes the daemon.
func (d *Daemon) Run(ctx context.Context) (err error) {
	defer func() {
		if cerr := d.Close(); err == nil {
			err = cerr
		}
	}()
	ready := Ready{PID: os.Getpid(), AdminSocket: d.cfg.AdminSocket, Kernel: d.kernel != nil}
	d.logCaps()
	if d.caps.Over {
		d.log.Warn("listeners.max_conns promises more connections than the open-files limit holds beside the daemon's own: "+
			"a flood of connections can exhaust the descriptors the admin socket needs; lower it or raise LimitNOFILE",
			"per_listener", d.caps.PerListener, "open_files", d.caps.NoFile)
	}

	// New made the listeners; from here their serve loops close them.
	adminLn := d.wrap(d.adminLn, d.listenOptions("admin"))
	var metricsLn, frontLn, frontSock net.Listener
	if d.metricsLn != nil {
		metricsLn = d.wrap(d.metricsLn, d.listenOptions("metrics"))
		ready.Metrics = metricsLn.Addr().String()
	}
	if d.frontLn != nil {
		frontLn = d.wrap(d.frontLn, d.listenOptions("front"))
		ready.Front = frontLn.Addr().String()
	}
	if d.frontSock != nil {
		frontSock = d.wrap(d.frontSock, d.listenOptions("front_socket"))
		ready.FrontSocket = d.cfg.Front.Socket
	}
	if d.permits != nil {
		ready.Permits = d.permits.Socket()
	}

	// Alive from the start: the first tick is a period away.
	d.health.beat(time.Now())
	g, gctx := errgroup.WithContext(ctx)
	// No apply comes once the loop stops: a registration waiting for one
	// returns then (stored, pending) rather than hold the admin API's
	// shutdown past its grace.
	d.projects.applies = gctx.Done()
	g.Go(func() error { return admin.NewServer(d, d.log.With("part", "admin")).Serve(gctx, adminLn) })
	if metricsLn != nil {
		reg := metrics.NewRegistry(metrics.New(d.Status, d.cfg.Metrics.MaxProjects, d.log))
		if d.front != nil {
			reg.MustRegister(d.front.Collector())
		}
		mux := http.NewServeMux()
		mux.Handle("/healthz", d.health.handler(d.cfg.Tick))
		mux.Handle("/metrics", metricsHandler(reg, d.log))
		g.Go(func() error { return serveMetrics(gctx, metricsLn, mux) })
	}
	if frontLn != nil {
		g.Go(func() error { return d.front.Serve(gctx, frontLn) })
	}
	if frontSock != nil {
		g.Go(func() error { return d.front.Serve(gctx, frontSock) })
	}
	if d.permits != nil {
		g.Go(func() error { return d.permits.Serve(gctx) })
	}
	g.Go(func() error {
		if err := d.sched.Run(gctx); err != nil && !errors.Is(err, context.Canceled) {
			return fmt.Errorf("scheduler: %w", err)
		}
		return nil
	})
	g.Go(func() error { return d.loop(gctx) })
	if d.fleet != nil {
		g.Go(func() error { return d.fleet.run(gctx) })
	}
	if d.kernel != nil {
		g.Go(func() error { return d.kernel.readRefusals(gctx, d.events) })
		g.Go(func() error { return d.kernel.beat(gctx, d.cfg.Tick) })
		g.Go(func() error { return d.watchPins(gctx, d.cfg.Tick) })
	}

	d.log.Info("serving", "admin", ready.AdminSocket, "metrics", ready.Metrics, "front", ready.Front,
		"permits", ready.Permits, "kernel", ready.Kernel)
	if d.opts.ReadyFile != "" {
		buf, _ := json.Marshal(ready)
		if err := writeFileAtomic(d.opts.ReadyFile, buf); err != nil {
			d.log.Error("writing ready file", "err", err)
		}
	}
	err = g.Wait()
	d.log.Info("stopped", "err", err)
	d.logrl.Flush()
	return err
}

// watchPins checks every period that the pin directory is still the one
// the daemon locked. One removed under it (fairshare cleanup --force) or
// replaced leaves its programs pinned nowhere: status cannot read them, and
// a daemon started meanwhile pins a second set that enforces beside them
// (its lock is on the new directory). It then stops with ErrPinsRemoved;
// as it closes it unpins what is left of its own pins through the directory
// it holds open and nothing at the path (a directory there is another's),
// and its programs detach as it exits; a supervisor that restarts it starts
// afresh.
func (d *Daemon) watchPins(ctx context.Context, period time.Duration) error {
	if d.pinLock == nil {
		return nil
	}
	failing := false
	return eachTick(ctx, period, func() (bool, error) {
		gone, err := loader.PinDirReplaced(d.pinLock, d.cfg.PinDir)
		switch {
		case err != nil && !failing:
			d.log.Warn("checking the pin directory", "pin_dir", d.cfg.PinDir, "err", err)
			failing = true
		case err == nil:
			failing = false
		}
		if gone {
			d.pinsGone.Store(true)
			d.log.Error("the pin directory was removed or replaced under the daemon (fairshare cleanup --force?): "+
				"its programs are pinned nowhere; stopping, and they detach as it exits", "pin_dir", d.cfg.PinDir)
			return true, fmt.Errorf("%w: %s", ErrPinsRemoved, d.cfg.PinDir)
		}
		return false, nil
	})
}

// pathError marks a socket path holding something other than a socket as
// a configuration error (a restart cannot fix it), naming the key.
func pathError(key string, err error) error {
	if errors.Is(err, listen.ErrNotSocket) {
		return fmt.Errorf("%w: %s: %w", config.ErrInvalid, key, err)
	}
	return err
}

// wrap puts ln behind the accept backoff and caps of package listen and
// keeps it for status and metrics.
func (d *Daemon) wrap(ln net.Listener, o listen.Options) net.Listener {
	o.Log = d.log.With("part", "listen")
	l := listen.Wrap(ln, o)
	d.mu.Lock()
	d.listeners = append(d.listeners, l)
	d.mu.Unlock()
	return l
}

// wakeGap is the least time between two applies of the membership outside
// the tick.
const wakeGap = 20 * time.Millisecond

// loop is the control loop.
func (d *Daemon) loop(ctx context.Context) error {
	t := time.NewTicker(d.cfg.Tick)
	defer t.Stop()
	d.projects.watch(ctx)
	// A source changed, or a registration waits: members now (the
	// namespaces at the tick), but at most one such apply per wakeGap, so
	// a storm of mkdir in the projects root coalesces.
	var wakeC <-chan time.Time
	var lastWake time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-d.projects.wake:
			if wakeC == nil {
				wakeC = time.After(max(0, wakeGap-time.Since(lastWake)))
			}
		case <-wakeC:
			wakeC, lastWake = nil, time.Now()
			d.projects.apply(ctx, lastWake, false)
		case now := <-t.C:
			d.projects.apply(ctx, now, true)
			d.tick(now)
			d.followPolicies()
			if d.kernel != nil {
				d.kernel.maintain(ctx, now)
			}
			d.events.flush()
			// After the tick's work: a tick that hangs in any of it
			// shows as a stalled loop.
			d.health.beat(time.Now())
		}
	}
}

// tick settles every pool's share. A pool whose share could not be updated
// keeps the last one; for the kernel's, the programs keep enforcing it.
func (d *Daemon) tick(now time.Time) {
	// Reading a pool back costs a snapshot (for the kernel's, the maps):
	// paid only when the change log below is read.
	debug := d.log.Enabled(context.Background(), slog.LevelDebug)
	for _, p := range d.pools {
		if err := p.recompute(now); err != nil {
			d.log.Error("share not updated: the last share stays in force until a recompute succeeds",
				"pool", p.name(), "err", err)
			continue
		}
		if debug {
			if s, err := p.status(); err == nil {
				d.note(s.Name, s.Active, s.Share)
			}
		}
	}
}

// note logs a pool's active count or share when it changes.
func (d *Daemon) note(pool string, active, share int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if old, ok := d.seen[pool]; ok && old == [2]int{active, share} {
		return
	}
	d.seen[pool] = [2]int{active, share}
	// Debug: on a busy node the share moves every few ticks, and Info would
	// drown everything else. fairshare_pool_share has the history.
	d.log.Debug("share changed", "pool", pool, "active", active, "share", share)
}

// Close closes everything the daemon holds. Pinned BPF objects stay unless
// DetachOnExit was set.
func (d *Daemon) Close() error {
	return d.closeParts()
}

func (d *Daemon) closeParts() error {
	var errs []error
	// Listeners Run never served (a failed start, or New without Run);
	// closing a served one again does nothing.
	for _, ln := range []net.Listener{d.adminLn, d.metricsLn, d.frontLn, d.frontSock} {
		if ln != nil {
			ln.Close()
		}
	}
	if d.permits != nil {
		d.permits.Close()
	}
	if d.front != nil {
		d.front.CloseIdle()
	}
	if d.fleet != nil && !d.fleetClosed {
		errs = append(errs, d.fleet.close())
		d.fleetClosed = true
	}
	if d.kernel != nil && !d.kernelClosed {
		// Checked again here: a stop that came before the watcher's next
		// tick must not clean a directory another daemon made since.
		var gone *os.File
		if d.pinLock != nil {
			if replaced, err := loader.PinDirReplaced(d.pinLock, d.cfg.PinDir); d.pinsGone.Load() || err == nil && replaced {
				gone = d.pinLock
			}
		}
		// Under destMu: a reload (SIGHUP) under way uses the kernel side
		// until it is done, and one after finds it closed.
		d.destMu.Lock()
		d.kernelClosed = true
		errs = append(errs, d.kernel.close(d.opts.DetachOnExit, gone))
		d.destMu.Unlock()
	}
	if d.projects != nil {
		errs = append(errs, d.projects.close())
	}
	if d.store != nil && !d.storeClosed {
		// The store stays named: an admin call still finishing past the
		// shutdown's grace gets the store's "closed" error, not a nil
		// store.
		errs = append(errs, d.store.Close())
		d.storeClosed = true
	}
	if d.events != nil {
		// Left in place: a part still finishing may publish; the log then
		// refuses the write and says so. events.log is for diagnosis: a
		// file that could not take the last events (a full disk, a hung
		// file system) loses them, said here, and the stop is still a
		// clean one (exit 0: systemd marks the unit failed otherwise).
		if err := d.events.close(); err != nil {
			d.log.Warn("events.log: the last events were not all written at stop", "err", err)
		}
	}
	if d.pinLock != nil {
		d.pinLock.Close()
		d.pinLock = nil
	}
	return errors.Join(errs...)
}

// maxScrapes bounds the scrapes of /metrics served at once; past it a
// scrape is answered 503. Each reads the whole node (the kernel's maps,
// under the lock the control loop and the heartbeat take): a Prometheus
// scrapes one at a time, an HA pair two, and any local user may connect.
const maxScrapes = 4

// metricsHandler serves reg's metrics, maxScrapes at a time. A scrape
// holds its place while it reads the node and encodes the answer into
// memory, not while the answer is written: a client that asks and never
// reads would otherwise hold a place for the server's write timeout, and
// four of them every place.
func metricsHandler(reg prometheus.Gatherer, log *slog.Logger) http.Handler {
	h := promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)})
	places := make(chan struct{}, maxScrapes)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case places <- struct{}{}:
		default:
			http.Error(w, "fairshare: too many scrapes of /metrics at once", http.StatusServiceUnavailable)
			return
		}
		rec := &bufferedAnswer{header: http.Header{}, code: http.StatusOK}
		h.ServeHTTP(rec, r)
		<-places
		maps.Copy(w.Header(), rec.header)
		w.WriteHeader(rec.code)
		_, _ = w.Write(rec.body.Bytes())
	})
}

// bufferedAnswer is an http.ResponseWriter that keeps the answer in memory
// (metricsHandler).
type bufferedAnswer struct {
	header http.Header
	code   int
	body   bytes.Buffer
}

func (b *bufferedAnswer) Header() http.Header         { return b.header }
func (b *bufferedAnswer) WriteHeader(code int)        { b.code = code }
func (b *bufferedAnswer) Write(p []byte) (int, error) { return b.body.Write(p) }

func serveMetrics(ctx context.Context, ln net.Listener, h http.Handler) error {
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 2 * time.Second, ReadTimeout: 10 * time.Second,
		WriteTimeout: 30 * time.Second, IdleTimeout: metricsIdle}
	if err := listen.ServeHTTP(ctx, hs, ln, 2*time.Second); err != nil {
		return fmt.Errorf("metrics server: %w", err)
	}
	return nil
}

func writeFileAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
