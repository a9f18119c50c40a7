// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/front"
	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/internal/logrl"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/metrics"
	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
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
	// Clock drives the user-space pools, rate buckets and scheduler; nil
	// means the system clock. Tests move it to reach idle and forget periods.
	Clock clock.Clock
}

// ErrStalePins means the pin directory holds BPF objects loaded for another
// configuration (another map layout, or a pool larger than the pinned maps
// hold). Only 'fairshare cleanup' (which drops enforcement and every count)
// resolves it, so the daemon does not try on its own.
var ErrStalePins = errors.New("pinned bpf objects are from another configuration")

// stalePinsError names the pin directory and the remedy in one sentence and
// keeps the loader's error for errors.Is.
type stalePinsError struct {
	dir string
	err error
}

func (e *stalePinsError) Error() string {
	return fmt.Sprintf("pins in %s are from another configuration; run 'fairshare cleanup' (%v)", e.dir, e.err)
}

func (e *stalePinsError) Unwrap() []error { return []error{ErrStalePins, e.err} }

// verbose adds the verifier's log to an error's message: cilium/ebpf's
// VerifierError prints the log only with %+v, which does not reach through
// the wrapping around it, and an operator needs that log to see why a
// program was refused. Callers still reach the error with errors.Is/As.
type verbose struct{ err error }

func (v verbose) Error() string {
	var ve *ebpf.VerifierError
	if errors.As(v.err, &ve) {
		return fmt.Sprintf("%v\n%+v", v.err, ve)
	}
	return v.err.Error()
}

func (v verbose) Unwrap() error { return v.err }

// loadError turns loader.Open's error into the daemon's.
func loadError(pinDir string, err error) error {
	if errors.Is(err, loader.ErrPinnedMismatch) || errors.Is(err, loader.ErrPoolTooLarge) {
		return &stalePinsError{dir: pinDir, err: err}
	}
	if errors.Is(err, loader.ErrBadExempt) {
		return fmt.Errorf("%w: connections.exempt: %w", config.ErrInvalid, err)
	}
	return fmt.Errorf("loading the bpf programs: %w", verbose{err})
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
	opts      Options
	cfg       config.Config
	log       *slog.Logger
	defPolicy policy.Policy

	store     *policy.Store
	lim       *loader.Limiter // nil without BPF
	root      string          // projects root in use
	requests  *pools.Pool
	others    map[string]*pools.Pool // flights and extra pools, served by permitd
	residents *pools.Residents
	rates     *pools.Rates
	sched     *scheduler.Scheduler
	front     *front.Front // nil when disabled
	permits   *permitd.Server
	logrl     *logrl.Handler
	caps      Caps

	mu   sync.Mutex        // guards the fields below
	seen map[string][2]int // pool -> last logged {active, share}
	// limitedGone keeps the rate refusals of buckets deleted when a policy
	// dropped its limits, so the project's count never goes down. It holds
	// one number per project that ever had limits.
	limitedGone map[string]uint64
	// kernel is what the kernel's project entries were last seen holding,
	// and what the entries the loader forgot had counted.
	kernel kernelBook
	// rec is the reconcile passes' record.
	rec admin.Reconcile
	// listeners are the listeners serving, for status and metrics.
	listeners []*listen.Listener
}

// New opens the store, loads and attaches the BPF programs (unless
// cfg.BPF is false), builds the pools and applies the stored policies.
func New(opts Options) (*Daemon, error) {
	cfg := opts.Config
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg, _ = Effective(cfg)
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// Every part logs through one limiter of repeated lines: an outage or a
	// flood repeats one line per request or connection.
	rl := logrl.New(log.Handler(), logrl.Options{})
	log = slog.New(rl)
	nofile, err := listen.RaiseFileLimit()
	if err != nil {
		log.Warn("could not raise the open-files limit", "err", err)
		nofile, _ = hardFileLimit()
	}
	d := &Daemon{
		opts: opts, cfg: cfg, log: log, logrl: rl, caps: BudgetCaps(cfg, nofile),
		defPolicy: policy.Policy{Tier: cfg.Scheduler.DefaultTier, Shares: cfg.Scheduler.DefaultShares},
		others:    map[string]*pools.Pool{},
		rates:     pools.NewRates(opts.Clock),
		seen:      map[string][2]int{},

		limitedGone: map[string]uint64{},
		kernel:      kernelBook{last: map[uint64]kernelCounts{}},
	}
	ok := false
	defer func() {
		if !ok {
			d.closeParts()
		}
	}()

	d.store, err = policy.Open(cfg.StateDir, policy.Options{Timeout: 2 * time.Second})
	if err != nil {
		return nil, fmt.Errorf("opening policy store: %w", err)
	}

	if cfg.BPF {
		d.root, err = ProjectsRoot(cfg)
		if err != nil {
			return nil, err
		}
		conn := cfg.Pools[config.PoolConnections]
		d.lim, err = loader.Open(loader.Options{
			ProjectsRoot: d.root, PinDir: cfg.PinDir,
			PoolSize: uint32(conn.Size), Floor: uint32(conn.Floor), Window: conn.Window,
			Logger: log,
			Exempt: cfg.Connections.Exempt, ExemptMax: uint32(cfg.Connections.ExemptMax),
			ReservationTTL: cfg.Connections.ReservationTTL,
		})
		if err != nil {
			return nil, loadError(cfg.PinDir, err)
		}
		// The floor in force, as the maps say.
		floor := pools.EffectiveFloor(conn.Size, conn.Floor)
		if s, err := d.lim.Snapshot(); err == nil {
			floor = s.Floor
			// Before the first Tick may forget an entry, so its counts
			// are kept (see kernelBook).
			d.noteKernel(s)
		}
		log.Info("connections enforced in the kernel", "projects_root", d.root, "pin_dir", cfg.PinDir,
			"size", conn.Size, "floor", floor)
	} else {
		log.Warn("bpf disabled by configuration: connections are NOT enforced on this node")
	}

	for _, name := range cfg.PoolNames() {
		pc := cfg.Pools[name]
		pcfg := pools.Config{Name: name, Size: pc.Size, Floor: pc.Floor, Window: pc.Window}
		switch name {
		case config.PoolConnections:
			continue // the kernel's
		case config.PoolResidents:
			d.residents, err = pools.NewResidents(pcfg, opts.Clock)
		default:
			var p *pools.Pool
			p, err = pools.New(pcfg, opts.Clock)
			if name == config.PoolRequests {
				d.requests = p
			} else {
				d.others[name] = p
			}
		}
		if err != nil {
			return nil, fmt.Errorf("pool %s: %w", name, err)
		}
	}

	tier, err := scheduler.ParseTier(cfg.Scheduler.DefaultTier)
	if err != nil {
		return nil, fmt.Errorf("scheduler.default_tier: %w", err)
	}
	d.sched, err = scheduler.New(scheduler.Config{
		P1Rate: cfg.Scheduler.P1Rate, P1Burst: cfg.Scheduler.P1Burst,
		P2Rate: cfg.Scheduler.P2Rate, P2Burst: cfg.Scheduler.P2Burst,
		MaxInFlight:   cfg.Front.MaxInFlight,
		Poll:          cfg.Scheduler.Poll,
		DefaultPolicy: scheduler.Policy{Tier: tier, Shares: cfg.Scheduler.DefaultShares},
	}, opts.Clock)
	if err != nil {
		return nil, fmt.Errorf("scheduler: %w", err)
	}

	if cfg.Front.Enabled() {
		// Local clients are in the project of their cgroup. Without a
		// cgroup2 hierarchy there is no such identity; routes and trusted
		// peers still work.
		root := d.root
		if root == "" {
			if root, err = ProjectsRoot(cfg); err != nil {
				log.Warn("front: no projects root, local clients get no project from their cgroup", "err", err)
				root = ""
			}
		}
		d.front, err = front.New(front.Config{
			Listen: cfg.Front.Listen, Upstream: cfg.Front.Upstream,
			ProjectHeader: cfg.Front.ProjectHeader, Routes: cfg.Front.Routes,
			MaxInFlight: cfg.Front.MaxInFlight, CostHeader: cfg.Front.CostHeader,
			CostFromTime: cfg.Front.CostFromTime, CostUnit: cfg.Front.CostUnit,
			MaxProjects:  cfg.Metrics.MaxProjects,
			ProjectsRoot: root, TrustedPeers: cfg.Front.TrustedPeers,
			Exempt: front.Exempt{
				Projects: cfg.Front.Exempt.Projects, Routes: cfg.Front.Exempt.Routes, Cgroups: cfg.Front.Exempt.Cgroups,
			},
			ExemptMax:           cfg.Front.ExemptMax,
			MaxUpstreamHead:     cfg.Front.Limits.UpstreamHeadBytes,
			MaxInformational:    cfg.Front.Limits.Informational,
			MaxRequestHead:      cfg.Front.Limits.RequestHeadBytes,
			ReadHeaderTimeout:   cfg.Front.Limits.ReadHeaderTimeout,
			IdleTimeout:         cfg.Front.Limits.IdleTimeout,
			UpstreamIdleTimeout: cfg.Front.Limits.UpstreamIdleTimeout,
		}, front.Deps{Requests: d.requests, Rates: d.rates, Sched: d.sched, Log: log.With("part", "front")})
		if err != nil {
			// Everything front.New checks comes from the front's keys.
			return nil, fmt.Errorf("%w: front: %w", config.ErrInvalid, err)
		}
	}

	if cfg.Permits.Socket != "" {
		if cfg.Permits.Group != "" {
			if _, err := permitd.LookupGroup(cfg.Permits.Group); err != nil {
				return nil, fmt.Errorf("%w: permits.group: %w", config.ErrInvalid, err)
			}
		}
		d.permits, err = permitd.New(permitsConfig(cfg, d.caps), d.others, d.residents, log.With("part", "permits"))
		if err != nil {
			return nil, fmt.Errorf("permit api: %w", err)
		}
	}

	list, err := d.store.List()
	if err != nil {
		return nil, err
	}
	for _, e := range list {
		d.apply(e.Project, e.Policy)
	}
	if len(list) > 0 {
		log.Info("policies applied", "count", len(list))
	}
	ok = true
	return d, nil
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

// ProjectsRoot returns cfg.ProjectsRoot, or <cgroup2 mount>/fairshare.
func ProjectsRoot(cfg config.Config) (string, error) {
	if cfg.ProjectsRoot != "" {
		return cfg.ProjectsRoot, nil
	}
	mnt, err := cgroup.FindMount()
	if err != nil {
		return "", fmt.Errorf("finding the projects root: %w", err)
	}
	return filepath.Join(mnt.Point, "fairshare"), nil
}

// apply hands a stored policy to the scheduler and the rate buckets.
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
}

// unapply puts a project whose policy was deleted back on the default:
// default tier and shares, unbounded rates.
func (d *Daemon) unapply(project string) {
	d.sched.DeletePolicy(project)
	d.setLimits(project, pools.Limits{})
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
	ready := Ready{PID: os.Getpid(), AdminSocket: d.cfg.AdminSocket, Kernel: d.lim != nil}
	d.log.Info("connection caps", "open_files", d.caps.NoFile, "per_listener", d.caps.PerListener,
		"per_uid", d.caps.PerUID, "admin", d.caps.Admin, "admin_root_reserve", adminReserve, "metrics", d.caps.Metrics)
	if d.caps.Over {
		d.log.Warn("listeners.max_conns promises more connections than the open-files limit holds beside the daemon's own: "+
			"a flood of connections can exhaust the descriptors the admin socket needs; lower it or raise LimitNOFILE",
			"per_listener", d.caps.PerListener, "open_files", d.caps.NoFile)
	}

	adminLn, err := admin.Listen(d.cfg.AdminSocket)
	if err != nil {
		return pathError("admin_socket", err)
	}
	adminLn = d.wrap(adminLn, listen.Options{Name: "admin", MaxConns: d.caps.Admin, Reserve: adminReserve,
		MaxPerUID: adminPerUID, Privileged: func(uid uint32) bool { return uid == 0 }, Refuse: refuseHTTP})
	var metricsLn, frontLn, frontSock net.Listener
	closeAll := func() {
		for _, ln := range []net.Listener{adminLn, metricsLn, frontLn, frontSock} {
			if ln != nil {
				ln.Close()
			}
		}
	}
	if d.cfg.Metrics.Listen != "" {
		if metricsLn, err = net.Listen("tcp", d.cfg.Metrics.Listen); err != nil {
			closeAll()
			return fmt.Errorf("metrics listener: %w", err)
		}
		metricsLn = d.wrap(metricsLn, listen.Options{Name: "metrics", MaxConns: d.caps.Metrics, Refuse: refuseHTTP})
		ready.Metrics = metricsLn.Addr().String()
	}
	if d.front != nil && d.cfg.Front.Listen != "" {
		if frontLn, err = net.Listen("tcp", d.cfg.Front.Listen); err != nil {
			closeAll()
			return fmt.Errorf("front listener: %w", err)
		}
		frontLn = d.wrap(frontLn, listen.Options{Name: "front", MaxConns: d.caps.PerListener, Refuse: refuseHTTP})
		ready.Front = frontLn.Addr().String()
	}
	if d.front != nil && d.cfg.Front.Socket != "" {
		if frontSock, err = d.listenUnixFront(d.cfg.Front.Socket); err != nil {
			closeAll()
			return pathError("front.socket", err)
		}
		frontSock = d.wrap(frontSock, listen.Options{Name: "front_socket", MaxConns: d.caps.PerListener,
			MaxPerUID: d.caps.PerUID, Refuse: refuseHTTP})
		ready.FrontSocket = d.cfg.Front.Socket
	}
	if d.permits != nil {
		if err := d.permits.Listen(); err != nil {
			closeAll()
			return pathError("permits.socket", fmt.Errorf("permit api: %w", err))
		}
		ready.Permits = d.permits.Socket()
	}

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return admin.NewServer(d, d.log.With("part", "admin")).Serve(gctx, adminLn) })
	if metricsLn != nil {
		reg := metrics.NewRegistry(metrics.New(d.Status, d.cfg.Metrics.MaxProjects, d.log))
		if d.front != nil {
			reg.MustRegister(d.front.Collector())
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(d.log.Handler(), slog.LevelWarn)}))
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

// loop is the control loop.
func (d *Daemon) loop(ctx context.Context) error {
	t := time.NewTicker(d.cfg.Tick)
	defer t.Stop()
	var lastReconcile, lastKernel time.Time
	for {
		select {
		case <-ctx.Done():
			return nil
		case now := <-t.C:
			d.tick(now)
			// Open reconciled; the first pass of the loop runs at its first
			// tick anyway, so status shows a pass from the start.
			if d.lim != nil && (lastReconcile.IsZero() || d.cfg.Reconcile > 0 && now.Sub(lastReconcile) >= d.cfg.Reconcile) {
				d.reconcile(ctx)
				lastReconcile = now
			}
			// The loader forgets a removed project's entry after a minute
			// idle; reading them more often than that keeps their final
			// counts (kernelBook).
			if d.lim != nil && now.Sub(lastKernel) >= kernelReadEvery {
				if s, err := d.lim.Snapshot(); err == nil {
					d.noteKernel(s)
				}
				lastKernel = now
			}
		}
	}
}

func (d *Daemon) tick(now time.Time) {
	if d.lim != nil {
		if err := d.lim.Tick(now); err != nil {
			d.log.Error("bpf tick failed: connection shares not updated; the last share stays in force until a tick succeeds",
				"pin_dir", d.cfg.PinDir, "err", err)
		} else if d.log.Enabled(context.Background(), slog.LevelDebug) {
			// loader.Tick does not return what it computed; reading the
			// maps again every tick is paid only when the change log
			// below is read.
			if s, err := d.lim.Snapshot(); err == nil {
				d.note(config.PoolConnections, s.Active, s.Share)
			}
		}
	}
	if d.requests != nil {
		d.requests.Recompute()
		s := d.requests.Snapshot()
		d.note(s.Name, s.Active, s.Share)
	}
	for _, p := range d.others {
		p.Recompute()
		s := p.Snapshot()
		d.note(s.Name, s.Active, s.Share)
	}
	if d.residents != nil {
		d.residents.Recompute()
		s := d.residents.Snapshot()
		d.note(s.Name, s.Active, s.Share)
	}
}

// note logs a pool's active count or share when it changes.
func (d *Daemon) note(pool string, active, share int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.noteLocked(pool, active, share)
}

func (d *Daemon) noteLocked(pool string, active, share int) {
	if old, ok := d.seen[pool]; ok && old == [2]int{active, share} {
		return
	}
	d.seen[pool] = [2]int{active, share}
	// Debug: on a busy node the share moves every few ticks, and Info would
	// drown everything else. fairshare_pool_share has the history.
	d.log.Debug("share changed", "pool", pool, "active", active, "share", share)
}

func (d *Daemon) reconcile(ctx context.Context) {
	start := time.Now()
	rep, err := d.lim.Reconcile(ctx)
	d.mu.Lock()
	d.rec.Time = time.Now()
	if err != nil {
		d.rec.Failures++
		d.rec.Error = err.Error()
		d.mu.Unlock()
		d.log.Error("reconcile failed: the connection counts were not checked against the kernel's socket table", "err", err)
		return
	}
	sum := func(m map[string]int) (n int) {
		for _, v := range m {
			n += v
		}
		return n
	}
	repairs := rep.Adopted + rep.Orphans + rep.StaleListeners + abs(rep.ExemptRepaired)
	for _, v := range rep.Repaired {
		repairs += abs(v)
	}
	d.rec.Passes++
	d.rec.RepairsTotal += uint64(repairs)
	d.rec.Error = ""
	d.rec.Sockets, d.rec.Held, d.rec.Repairs = sum(rep.Kernel), sum(rep.Held), repairs
	d.rec.Adopted, d.rec.Orphans, d.rec.StaleListeners = rep.Adopted, rep.Orphans, rep.StaleListeners
	d.mu.Unlock()
	d.log.Debug("reconcile pass", "sockets", sum(rep.Kernel), "held", sum(rep.Held), "reservations", sum(rep.Reservations),
		"repairs", repairs, "took", time.Since(start).Round(time.Microsecond))
	if repairs > 0 {
		d.log.Warn("reconcile repaired the connection counts", "adopted", rep.Adopted, "repaired", rep.Repaired,
			"orphans", rep.Orphans, "stale_listeners", rep.StaleListeners, "exempt_repaired", rep.ExemptRepaired)
	}
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// Close closes everything the daemon holds. Pinned BPF objects stay unless
// DetachOnExit was set.
func (d *Daemon) Close() error {
	return d.closeParts()
}

func (d *Daemon) closeParts() error {
	var errs []error
	if d.front != nil {
		d.front.CloseIdle()
	}
	if d.lim != nil {
		errs = append(errs, d.lim.Close())
		d.lim = nil
		if d.opts.DetachOnExit {
			errs = append(errs, loader.Cleanup(d.cfg.PinDir))
			d.log.Info("bpf programs detached and unpinned", "pin_dir", d.cfg.PinDir)
		} else {
			d.log.Info("bpf programs left pinned and enforcing", "pin_dir", d.cfg.PinDir)
		}
	}
	if d.store != nil {
		errs = append(errs, d.store.Close())
		d.store = nil
	}
	return errors.Join(errs...)
}

func serveMetrics(ctx context.Context, ln net.Listener, h http.Handler) error {
	hs := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
		WriteTimeout: 30 * time.Second, IdleTimeout: time.Minute}
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
