// SPDX-License-Identifier: Apache-2.0

// The front itself: its configuration and defaults (Config, New), the
// servers it serves on (Server, Serve, and the fast path's in fastpath.go),
// and the bounds it derives for the daemon (idleUpstream, MaxUpstreamConns,
// ExemptMaxFor). A request's way in is in admit.go, its way to the
// upstream and back in proxy.go.

package front

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/internal/answerfield"
	"github.com/fairshare-dev/fairshare/internal/clock"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/internal/proxyclaim"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// Defaults for the zero values of Config.
const (
	DefaultProjectHeader = "Fairshare-Project"
	DefaultCostHeader    = "Fairshare-Work-Units"
	DefaultCostUnit      = 10 * time.Millisecond
	DefaultMaxProjects   = 100
	DefaultExemptMax     = 4

	DefaultMaxUpstreamHead     = 1 << 20
	DefaultMaxInformational    = 8
	DefaultMaxRequestHead      = 64 << 10
	DefaultReadHeaderTimeout   = 10 * time.Second
	DefaultIdleTimeout         = 2 * time.Minute
	DefaultUpstreamIdleTimeout = 90 * time.Second
	DefaultBodyReadTimeout     = 30 * time.Second
	DefaultWriteTimeout        = 30 * time.Second
	DefaultUpstreamHeadTimeout = time.Minute
	DefaultUpstreamReadTimeout = time.Minute
	DefaultTunnelTimeout       = 10 * time.Minute

	// DefaultUpstreamIdlePerProject is nginx's keepalive of its upstream
	// module's examples.
	DefaultUpstreamIdlePerProject = 32
)

// Response headers the front sets.
const (
	// HeaderClass carries the class a proxied request was dispatched under.
	HeaderClass = answerfield.Class
	// HeaderQueueWait carries the seconds a proxied request waited for
	// dispatch.
	HeaderQueueWait = answerfield.QueueWait
	// HeaderRefused says why a 429 was given: rate, debt or share.
	HeaderRefused = answerfield.Refused
	// HeaderRetryAfterMs carries a 429's Retry-After to the millisecond,
	// beside the standard header's whole seconds: the spelling (and unit)
	// that HTTP client libraries already read before Retry-After, such as
	// the OpenAI and Anthropic SDKs ("retry-after-ms").
	HeaderRetryAfterMs = "Retry-After-Ms"
)

// ClassExempt is the value of HeaderClass on answers to exempt requests.
const ClassExempt = "exempt"

// ErrNoUpstream is returned by New when Config.Upstream is not an absolute
// http(s) URL.
var ErrNoUpstream = errors.New("no upstream")

// ErrUnknownRoute is returned by New when Config.Exempt.Routes names a key
// that is not in Config.Routes.
var ErrUnknownRoute = errors.New("not a configured route")

// Config configures a Front. The zero value of each field means its default.
type Config struct {
	Listen        string            // e.g. "127.0.0.1:8080"; "" = front disabled (the daemon decides)
	Upstream      string            // upstream base URL
	ProjectHeader string            // default "Fairshare-Project"
	Routes        map[string]string // Host (or host/path-prefix) -> project
	MaxInFlight   int               // upstream concurrency (the daemon feeds it to scheduler.Config.MaxInFlight)
	CostHeader    string            // upstream response header carrying work units; default "Fairshare-Work-Units"
	CostFromTime  bool              // no header: cost = service time in units of CostUnit
	CostUnit      time.Duration     // default 10ms per work unit

	// ForwardProject sets the project header on the upstream request to the
	// resolved project. Off by default: the upstream then never sees the
	// client's claim.
	ForwardProject bool
	// UpstreamH2C talks HTTP/2 over cleartext (prior knowledge) to the
	// upstream instead of HTTP/1.1.
	UpstreamH2C bool
	// MaxProjects caps the project label values of the front's metrics,
	// "(other)" included, by the policy of package internal/labels (the
	// daemon's metrics.max_projects). Default 100.
	MaxProjects int

	// ProjectsRoot is the cgroup2 directory whose children are the
	// projects. With it, a local client (unix socket, or TCP from a loopback
	// address) is in the project of its cgroup. "" turns that off.
	ProjectsRoot string
	// TrustedPeers may name the project in the header: CIDRs or single
	// addresses of TCP peers, and cgroups (absolute, or relative to
	// ProjectsRoot) of local peers, with every cgroup below them. Empty (the
	// default) trusts nobody.
	TrustedPeers []string
	// Exempt is the exempt class: requests that take no permit and are never
	// refused or queued, within ExemptMax.
	Exempt Exempt
	// ExemptMax bounds the exempt requests in flight at once; past it an
	// exempt request is treated like any request of its project. Default
	// DefaultExemptMax, or MaxInFlight if smaller (ExemptMaxFor).
	ExemptMax int

	// Limits on what a client or the upstream can make the front hold (see
	// "Limits" in the package documentation); zero means the default.
	MaxUpstreamHead     int64         // bytes of the upstream's answer heads, 1xx included: past it 502
	MaxInformational    int           // 1xx answers per request: past it 502
	MaxRequestHead      int           // bytes of a client's request head: past it 431
	ReadHeaderTimeout   time.Duration // to read a client's request head: past it the connection is closed
	IdleTimeout         time.Duration // a client's keep-alive connection between requests
	UpstreamIdleTimeout time.Duration // an upstream connection kept for reuse
	BodyReadTimeout     time.Duration // each read of a client's request body: past it 408
	BodyMinRate         int64         // bytes/s a request body must average after BodyReadTimeout: slower 408; 0 off
	WriteTimeout        time.Duration // each write to a client: past it the connection is closed; and each piece of a request body the upstream does not take: past it the exchange is aborted
	UpstreamHeadTimeout time.Duration // the upstream's answer head, from when the request is all out: past it 504
	UpstreamReadTimeout time.Duration // each read of the upstream's answer body: past it the answer is cut off; less than 0: no bound
	TunnelTimeout       time.Duration // an upgraded connection (a tunnel) holding its request's permit

	// UpstreamIdlePerProject bounds the idle upstream connections kept
	// for one project's requests (its exempt ones apart); all projects'
	// together are bounded by MaxInFlight plus the exempt budget, or 64
	// without MaxInFlight, on every path together.
	UpstreamIdlePerProject int

	// FastPath serves plain HTTP/1.1 exchanges over TCP in the front's own
	// event loops rather than net/http's server (see "Fast path" in the
	// package documentation). Off by default.
	FastPath bool
	// PlainSends has the fast path's loops send each answer and request
	// with a send(2) of its own rather than all of a pass's with one
	// io_uring call, and read each socket with a read(2) of its own rather
	// than the first reads of a pass with one (see "Fast path" in the
	// package documentation). A loop the kernel gives no io_uring sends
	// and reads so anyway.
	PlainSends bool
}

// Exempt names the requests of the exempt class.
type Exempt struct {
	Projects []string // projects, however they were named
	Routes   []string // keys of Config.Routes
	Cgroups  []string // cgroups of local peers (absolute, or relative to ProjectsRoot), with those below
}

// Deps are the shared parts the front works with. Requests, Rates and Sched
// may each be nil, which skips that step (tests and benchmarks use this).
type Deps struct {
	Requests *pools.Pool
	Rates    *pools.Rates
	Sched    *scheduler.Scheduler
	Log      *slog.Logger
	Clock    clock.Clock // nil means the system clock
	// Seed seeds the Retry-After jitter; 0 picks a random seed.
	Seed uint64
	// ProjectOf, when set, names the project of a client's cgroup id from
	// the daemon's membership (a registered cgroup at any depth, a systemd
	// slice, a pod): "" for a cgroup in no project, an error when the
	// cgroup could not be placed (gone, unreadable), which the front
	// treats as an unknown local peer. Nil: the children of
	// Config.ProjectsRoot are the projects.
	ProjectOf func(cgroupID uint64) (string, error)
	// Events, if set, receives the front's refusals (share, rate, debt,
	// identity) and would-be refusals; it must not block.
	Events func(events.Event)
	// DryRun, if set, reports a project in dry-run: its rate and debt
	// refusals are admitted and published as would_refuse (the requests
	// pool handles the share itself, pools.Pool.SetDryRun).
	DryRun func(project string) bool
}

// upstreamClient is the front's own HTTP/1.1 client to the upstream
// (directUpstream), as far as the front uses it: which requests it takes,
// one exchange, and the end of it.
type upstreamClient interface {
	// takes reports whether r can go this way; the others go through
	// ReverseProxy.
	takes(r *http.Request) bool
	// roundTrip sends r upstream and reads the answer's head, passing
	// informational answers on to x.w, and watches the client meanwhile.
	roundTrip(r *http.Request, x *exchange) (upAnswer, error)
	// done ends an answer: its connection is kept for the next request
	// when keep is true (its body was read to its end) and the client
	// did not go away.
	done(a upAnswer, keep bool, now time.Time)
	closeIdle()
}

// Front is the request front: an http.Handler that admits, schedules and
// proxies requests to the upstream.
type Front struct {
	cfg      Config
	deps     Deps
	clk      clock.Clock
	log      *slog.Logger
	upstream *url.URL
	routes   routeTable
	proxy    *httputil.ReverseProxy
	tr       *http.Transport
	// keyed is the fallback's transports by project (for an h2c
	// upstream; nil otherwise), made from tr.
	keyed *keyedTransport
	up    upstreamClient // nil: every request goes through proxy
	bufs  *bufferPool
	// projectKey is Config.ProjectHeader in canonical form, as keys of a
	// parsed request's header map are.
	projectKey string
	// claimProject is Config.ProjectHeader as proxyclaim.Fold folds it.
	claimProject string
	// costKey is Config.CostHeader in canonical form.
	costKey string
	stats   *stats
	id      *identity
	retry   *retryPacer

	fast     atomic.Pointer[fastServer] // the fast path's, while Serve runs it
	handlers atomic.Int64               // ServeHTTP calls running (waitHandlers)
	// fastLoops is the fast path's number of loops; 0: GOMAXPROCS-1, at
	// least one (benchmarks set it).
	fastLoops int
	// fastHotEvents is the events per hotWindow that make a loop hot (see
	// loopHeat); 0: the default, fastHotEvents (tests set it).
	fastHotEvents int
	// fastRecvArena is the bytes a loop's pass reads into with its ring
	// (see recvAll); 0: the default, fastRecvArena (tests make it small).
	fastRecvArena int
	// drainFor is how long Serve lets the exchanges in flight finish
	// once told to stop (shorter in tests).
	drainFor time.Duration

	exemptProjects map[string]bool
	exemptRoutes   map[string]bool
	exemptInFlight atomic.Int64
}

// New checks cfg, fills in defaults and builds the front.
func New(cfg Config, deps Deps) (*Front, error) {
	if cfg.ProjectHeader == "" {
		cfg.ProjectHeader = DefaultProjectHeader
	}
	if proxyclaim.Is(cfg.ProjectHeader) {
		// It would be stripped as the client's claim, and the front's
		// own X-Forwarded-For would collide with it.
		return nil, fmt.Errorf("project header %q: the front strips it from every request as a proxy's claim on the client's address or scheme; choose another name", cfg.ProjectHeader)
	}
	if cfg.CostHeader == "" {
		cfg.CostHeader = DefaultCostHeader
	}
	for _, name := range []string{cfg.ProjectHeader, cfg.CostHeader} {
		if !httpguts.ValidHeaderFieldName(name) {
			return nil, fmt.Errorf("header %q: not a header name, it would match no field", name)
		}
	}
	if why := answerfield.Reserved(cfg.CostHeader); why != "" {
		// The front takes it out of every answer.
		return nil, fmt.Errorf("cost header %q is %s: choose another name", cfg.CostHeader, why)
	}
	if cfg.CostUnit <= 0 {
		cfg.CostUnit = DefaultCostUnit
	}
	if cfg.MaxProjects <= 0 {
		cfg.MaxProjects = DefaultMaxProjects
	}
	cfg.ExemptMax = ExemptMaxFor(cfg.MaxInFlight, cfg.ExemptMax)
	cfg.FastPath = cfg.FastPath || fastPathAlways
	cfg.PlainSends = cfg.PlainSends || plainSendsAlways
	setDefault(&cfg.MaxUpstreamHead, DefaultMaxUpstreamHead)
	setDefault(&cfg.MaxInformational, DefaultMaxInformational)
	setDefault(&cfg.MaxRequestHead, DefaultMaxRequestHead)
	setDefault(&cfg.ReadHeaderTimeout, DefaultReadHeaderTimeout)
	setDefault(&cfg.IdleTimeout, DefaultIdleTimeout)
	setDefault(&cfg.UpstreamIdleTimeout, DefaultUpstreamIdleTimeout)
	setDefault(&cfg.UpstreamIdlePerProject, DefaultUpstreamIdlePerProject)
	setDefault(&cfg.BodyReadTimeout, DefaultBodyReadTimeout)
	setDefault(&cfg.WriteTimeout, DefaultWriteTimeout)
	setDefault(&cfg.UpstreamHeadTimeout, DefaultUpstreamHeadTimeout)
	if cfg.UpstreamReadTimeout == 0 {
		cfg.UpstreamReadTimeout = DefaultUpstreamReadTimeout
	}
	setDefault(&cfg.TunnelTimeout, DefaultTunnelTimeout)
	u, err := url.Parse(cfg.Upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("upstream %q: %w", cfg.Upstream, ErrNoUpstream)
	}
	routes, err := newRouteTable(cfg.Routes)
	if err != nil {
		return nil, fmt.Errorf("routes: %w", err)
	}
	f := &Front{cfg: cfg, deps: deps, clk: clock.Or(deps.Clock), log: deps.Log, upstream: u, routes: routes, drainFor: 5 * time.Second,
		exemptProjects: map[string]bool{}, exemptRoutes: map[string]bool{}, bufs: &bufferPool{},
		projectKey: http.CanonicalHeaderKey(cfg.ProjectHeader), claimProject: proxyclaim.Fold(cfg.ProjectHeader),
		costKey: http.CanonicalHeaderKey(cfg.CostHeader)}
	for _, p := range cfg.Exempt.Projects {
		if err := ValidateProject(p); err != nil {
			return nil, fmt.Errorf("exempt project: %w", err)
		}
		f.exemptProjects[p] = true
	}
	for _, k := range cfg.Exempt.Routes {
		if _, ok := cfg.Routes[k]; !ok {
			return nil, fmt.Errorf("exempt route %q: %w", k, ErrUnknownRoute)
		}
		f.exemptRoutes[k] = true
	}
	if f.id, err = newIdentity(cfg, f.clk, deps.ProjectOf != nil); err != nil {
		return nil, fmt.Errorf("peer identity: %w", err)
	}
	seed := deps.Seed
	if seed == 0 {
		seed = rand.Uint64()
	}
	f.retry = newRetryPacer(seed)
	if f.log == nil {
		f.log = slog.New(slog.DiscardHandler)
	}
	f.stats = newStats(cfg.MaxProjects)
	idle := idleUpstream(cfg.MaxInFlight, cfg.ExemptMax)
	dialer := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
	if u.Scheme == "http" && !cfg.UpstreamH2C && (u.Path == "" || u.Path == "/") && u.RawQuery == "" {
		host := u.Host
		if u.Port() == "" {
			host = net.JoinHostPort(u.Hostname(), "80")
		}
		f.up = &directUpstream{addr: host, dial: dialer.DialContext, maxIdle: idle, maxIdlePer: cfg.UpstreamIdlePerProject,
			idleFor: cfg.UpstreamIdleTimeout,
			maxHead: cfg.MaxUpstreamHead, max1xx: cfg.MaxInformational, headFor: cfg.UpstreamHeadTimeout, sendFor: cfg.WriteTimeout,
			readFor: cfg.readFor(),
			unasked: f.unasked, stripOwn: f.stripOwn, bufs: f.bufs,
			host: u.Host, projectKey: f.projectKey, forwardProject: cfg.ForwardProject, isClaim: f.isClaim}
	}
	f.tr = &http.Transport{
		DialContext:            dialer.DialContext,
		MaxIdleConns:           idle,
		MaxIdleConnsPerHost:    idle,
		IdleConnTimeout:        cfg.UpstreamIdleTimeout,
		ExpectContinueTimeout:  time.Second,
		MaxResponseHeaderBytes: cfg.MaxUpstreamHead,
		ResponseHeaderTimeout:  cfg.UpstreamHeadTimeout,
	}
	if cfg.UpstreamH2C {
		f.tr.Protocols = new(http.Protocols)
		f.tr.Protocols.SetUnencryptedHTTP2(true)
		if cfg.WriteTimeout > 0 {
			// A frame whose write to the connection waits this long
			// (an upstream that stopped reading its socket) closes the
			// connection: the bound on every send (sendBody) cannot
			// otherwise reach a write that holds the connection's writer.
			f.tr.HTTP2 = &http.HTTP2Config{WriteByteTimeout: cfg.WriteTimeout}
		}
	} else {
		// http.Transport looks for bytes the upstream sent unasked in a
		// background read that races the next request on the connection:
		// under concurrency it handed one client's (or a forged) answer to
		// another (TestHostileConcurrent). Over HTTP/1 the fallback
		// therefore uses each connection for one request; HTTP/2 frames
		// its answers by stream and keeps its connection.
		f.tr.DisableKeepAlives = true
	}
	var tr http.RoundTripper = f.tr
	if cfg.UpstreamH2C {
		// A transport of each project's (the cloned template's fields
		// read when a project's is made: tests change the template).
		f.keyed = &keyedTransport{mk: f.tr.Clone, max: idle}
		tr = f.keyed
	}
	f.proxy = &httputil.ReverseProxy{
		Rewrite:        f.rewrite,
		Transport:      tr,
		ModifyResponse: f.modifyResponse,
		ErrorHandler:   f.proxyError,
		ErrorLog:       slog.NewLogLogger(f.log.Handler(), slog.LevelDebug),
		// Without a pool the proxy allocates (and the GC clears and the
		// scavenger returns) a 32 KiB copy buffer per request: a quarter of
		// the front's CPU in the benchmark.
		BufferPool: f.bufs,
	}
	return f, nil
}

// readFor is how long one read of an upstream answer's body may wait
// (Config.UpstreamReadTimeout); 0: no bound.
func (cfg *Config) readFor() time.Duration { return max(cfg.UpstreamReadTimeout, 0) }

// fastPathAlways turns Config.FastPath on in every front (the tests run
// their suites on both paths with it).
var fastPathAlways bool

// plainSendsAlways turns Config.PlainSends on in every front (the tests run
// the fast path both ways, see FAIRSHARE_FRONT_PLAIN_SENDS in TestMain).
var plainSendsAlways bool

// setDefault sets *v to def when it is zero or less.
func setDefault[T int | int64 | time.Duration](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}

// Server returns an HTTP server for Config.Listen that serves f over
// HTTP/1.1 and cleartext HTTP/2 (h2c with prior knowledge).
func (f *Front) Server() *http.Server {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	return &http.Server{
		Addr:              f.cfg.Listen,
		Handler:           f,
		Protocols:         p,
		ConnContext:       f.connContext,
		ReadHeaderTimeout: f.cfg.ReadHeaderTimeout,
		IdleTimeout:       f.cfg.IdleTimeout,
		MaxHeaderBytes:    f.cfg.MaxRequestHead,
		ErrorLog:          slog.NewLogLogger(f.log.Handler(), slog.LevelDebug),
	}
}

// Serve serves f on l until ctx is done, then shuts down gracefully (in-flight
// requests get up to five seconds).
func (f *Front) Serve(ctx context.Context, l net.Listener) error {
	if f.fastOK(l) {
		return f.serveFast(ctx, l)
	}
	err := listen.ServeHTTP(ctx, f.Server(), clientListener{l}, f.drainFor)
	f.waitHandlers()
	f.CloseIdle()
	if err != nil {
		return fmt.Errorf("front: %w", err)
	}
	return nil
}

// waitHandlers waits a little for the requests net/http's server still
// runs once it is shut down and its connections closed: their contexts have
// ended, and they give their permits back as they return. One that does
// not (an upgraded connection's tunnel, which the server does not close)
// is logged.
func (f *Front) waitHandlers() {
	deadline := time.Now().Add(handlersGrace)
	for f.handlers.Load() > 0 {
		if time.Now().After(deadline) {
			f.log.Warn("requests still in flight after the front stopped; each gives its permit back when it ends",
				"requests", f.handlers.Load())
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// handlersGrace is how long waitHandlers waits.
const handlersGrace = time.Second

// CloseIdle closes idle upstream connections.
func (f *Front) CloseIdle() {
	f.tr.CloseIdleConnections()
	if f.keyed != nil {
		f.keyed.CloseIdleConnections()
	}
	if f.up != nil {
		f.up.closeIdle()
	}
}

// idleUpstream is how many idle upstream connections the front keeps in
// all, the direct path's pool and the fast path's loops' together (they
// share one idleBudget), or the h2c transports' (keyedTransport): as many
// as can be in
// flight at once, MaxInFlight and the exempt budget (the exempt class's
// connections are its own, see upKey), so that every request the
// scheduler may dispatch together can find one. A front with no
// MaxInFlight keeps 64.
func idleUpstream(maxInFlight, exemptMax int) int {
	if maxInFlight <= 0 {
		return 64
	}
	return maxInFlight + ExemptMaxFor(maxInFlight, exemptMax)
}

// MaxUpstreamConns bounds the upstream connections a front with these
// limits holds at once: one per request in flight (exempt ones included),
// the idle ones (idleUpstream), and as many again for those on their way
// in or out beside them (a replay's new connection while the stale one
// closes, an evicted one being closed, a connection being dialed for a
// request the client already left). The daemon budgets descriptors with
// it.
func MaxUpstreamConns(maxInFlight, exemptMax int) int {
	return maxInFlight + ExemptMaxFor(maxInFlight, exemptMax) + 2*idleUpstream(maxInFlight, exemptMax)
}

// ExemptMaxFor is the exempt budget in force: exemptMax when set, else
// DefaultExemptMax but no more than maxInFlight (the configuration bounds
// the budget by it, so a front of max_in_flight 2 has 2).
func ExemptMaxFor(maxInFlight, exemptMax int) int {
	switch {
	case exemptMax > 0:
		return exemptMax
	case maxInFlight > 0:
		return min(DefaultExemptMax, maxInFlight)
	}
	return DefaultExemptMax
}

// Config returns the configuration in use, defaults filled in.
func (f *Front) Config() Config { return f.cfg }

// ExemptInFlight returns the exempt requests being served.
func (f *Front) ExemptInFlight() int { return int(f.exemptInFlight.Load()) }
