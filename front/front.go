// SPDX-License-Identifier: Apache-2.0

package front

import (
	"context"
	"errors"
	"fmt"
	"github.com/fairshare-dev/fairshare/events"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/textproto"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"

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
	TunnelTimeout       time.Duration // an upgraded connection (a tunnel) holding its request's permit

	// UpstreamIdlePerProject bounds the idle upstream connections kept
	// for one project's requests (its exempt ones apart); all projects'
	// together are bounded by MaxInFlight and the exempt budget (see
	// IdleUpstream).
	UpstreamIdlePerProject int

	// FastPath serves plain HTTP/1.1 exchanges over TCP in the front's own
	// event loops rather than net/http's server (see "Fast path" in the
	// package documentation). Off by default.
	FastPath bool
	// PlainSends has the fast path's loops send each answer and request
	// with a send(2) of its own rather than all of a pass's with one
	// io_uring call (see "Fast path" in the package documentation). A loop
	// the kernel gives no io_uring sends so anyway.
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
	idle := IdleUpstream(cfg.MaxInFlight, cfg.ExemptMax)
	dialer := &net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}
	if u.Scheme == "http" && !cfg.UpstreamH2C && (u.Path == "" || u.Path == "/") && u.RawQuery == "" {
		host := u.Host
		if u.Port() == "" {
			host = net.JoinHostPort(u.Hostname(), "80")
		}
		f.up = &directUpstream{addr: host, dial: dialer.DialContext, maxIdle: idle, maxIdlePer: cfg.UpstreamIdlePerProject,
			idleFor: cfg.UpstreamIdleTimeout,
			maxHead: cfg.MaxUpstreamHead, max1xx: cfg.MaxInformational, headFor: cfg.UpstreamHeadTimeout, sendFor: cfg.WriteTimeout,
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

// unasked logs an upstream that sent what nobody asked for; the connection
// it came on is closed.
func (f *Front) unasked(why string) {
	f.log.Warn("upstream sent an answer nobody asked for; closing its connection", "why", why)
}

// bufferPool recycles the copy buffers of the direct path (get and put)
// and of the reverse proxy (Get and Put, httputil.BufferPool).
type bufferPool struct{ p sync.Pool }

// get returns a buffer as the pointer the pool keeps, so that putting it
// back allocates nothing (Put has to allocate one for the slice it is given).
func (b *bufferPool) get() *[]byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return v
	}
	buf := make([]byte, 32<<10)
	return &buf
}

func (b *bufferPool) put(buf *[]byte) { b.p.Put(buf) }

func (b *bufferPool) Get() []byte { return *b.get() }

func (b *bufferPool) Put(buf []byte) { b.p.Put(&buf) }

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

// IdleUpstream is how many idle upstream connections the front keeps in
// all, in each of its two pools (the direct path's and either the
// transport's or the fast path's loops' together): as many as can be in
// flight at once, MaxInFlight and the exempt budget (the exempt class's
// connections are its own, see upKey), so that every request the
// scheduler may dispatch together can find one. A front with no
// MaxInFlight keeps 64.
func IdleUpstream(maxInFlight, exemptMax int) int {
	if maxInFlight <= 0 {
		return 64
	}
	return maxInFlight + ExemptMaxFor(maxInFlight, exemptMax)
}

// MaxUpstreamConns bounds the upstream connections a front with these
// limits holds at once: one per request in flight (exempt ones included)
// and the idle ones of two pools: the direct path's, and either the
// transport's (an h2c upstream) or the fast path's loops' together (an
// HTTP/1 upstream, to which the transport keeps none). The daemon budgets
// descriptors with it.
func MaxUpstreamConns(maxInFlight, exemptMax int) int {
	return maxInFlight + ExemptMaxFor(maxInFlight, exemptMax) + 2*IdleUpstream(maxInFlight, exemptMax)
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

// exchange is the state of one proxied request, shared between ServeHTTP and
// the reverse proxy's callbacks, which all run on the request's goroutine.
type exchange struct {
	project string
	class   scheduler.Class
	waited  time.Duration
	outcome outcome
	cost    float64 // from the upstream's cost header; valid if hasCost
	hasCost bool
	exempt  bool
	w       http.ResponseWriter // the client's, for 1xx answers on the direct path
	at      time.Time           // when it was handed to the upstream

	// On the ReverseProxy path: the upstream connection (to close it after
	// an answer the front refuses) and the informational answers so far.
	upConn net.Conn
	n1xx   int
	// body is the request body with its read deadline, when there is one.
	body *timedBody
}

type exchangeKey struct{}

func exchangeOf(r *http.Request) *exchange {
	x, _ := r.Context().Value(exchangeKey{}).(*exchange)
	return x
}

// ServeHTTP admits, schedules and proxies one request.
func (f *Front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.handlers.Add(1)
	defer f.handlers.Add(-1)
	if res, dropped := takeResume(r); res != nil {
		f.serveResumed(w, r, res)
		return
	} else if dropped {
		// Its exchange was given back: it is not sent again.
		panic(http.ErrAbortHandler)
	}
	a := f.admit(w, r, peerOf(r))
	if a == nil {
		return
	}
	// One deferred exit for every path below, panics included: the reverse
	// proxy aborts a response broken mid-body with panic(http.ErrAbortHandler),
	// and the permit must still go back exactly once.
	defer func() {
		p := recover()
		f.finish(a, p != nil, p != nil && clientGone(r))
		if p != nil {
			panic(p)
		}
	}()
	if a.ticket != nil {
		class, err := a.ticket.Wait(r.Context())
		if !f.dispatched(a, class, err) {
			f.unscheduled(w, r, a.x, err)
			return
		}
	} else {
		f.dispatched(a, 0, nil)
	}
	f.forward(w, r, a.x)
}

// admission is an admitted request: what finish needs to account for it.
type admission struct {
	project    string
	start      time.Time
	permit     pools.Permit
	ticket     *scheduler.Ticket // nil without a scheduler, or once withdrawn
	dispatched time.Time
	x          *exchange
}

// admitted holds an admission and its exchange in one allocation.
type admitted struct {
	admission
	exchange
}

// admit decides about r from peer p, before any upstream work: its
// identity, the exempt budget, the rate buckets and the requests pool. A
// refusal is answered on w and admit returns nil; otherwise the request is
// admitted (its ticket submitted, not yet waited on) and must be ended with
// finish.
func (f *Front) admit(w http.ResponseWriter, r *http.Request, p *peer) *admission {
	start := f.clk.Now()
	id, status, err := f.resolvePeer(r, p)
	if err != nil {
		f.stats.badRequest(status)
		if f.deps.Events != nil {
			reason := events.ReasonNoIdent
			if status == http.StatusForbidden {
				reason = events.ReasonUntrust
			}
			f.deps.Events(events.Event{Source: events.SourceFront, Kind: events.KindRefused, Pool: poolRequests,
				Reason: reason, Remote: peerText(r), Detail: strconv.Itoa(status) + ": " + err.Error()})
		}
		http.Error(w, "fairshare: "+err.Error(), status)
		return nil
	}
	project := id.project
	if id.exempt {
		if f.exemptInFlight.Add(1) <= int64(f.cfg.ExemptMax) {
			return &admission{project: project, start: start,
				x: &exchange{project: project, outcome: outcomeCanceled, exempt: true, at: start}}
		}
		f.exemptInFlight.Add(-1)
		f.stats.overBudget()
	}
	if rates := f.deps.Rates; rates != nil {
		if ok, retry := rates.Allow(project); !ok {
			st := rates.State(project)
			reason, oc, rate := "rate", outcomeRefusedRate, st.Limits.RequestsPerSec
			msg := fmt.Sprintf("fairshare: project %s is over its requests/s rate", project)
			if st.WorkTokens < 0 {
				// Once out of debt, requests pass at the work refill rate
				// divided by their cost; one unit each is the estimate.
				reason, oc, rate = "debt", outcomeRefusedDebt, st.Limits.WorkPerSec
				msg = fmt.Sprintf("fairshare: project %s is in work-units debt", project)
			}
			if f.deps.DryRun != nil && f.deps.DryRun(project) {
				f.stats.wouldRefuse(reason)
				f.event(r, events.KindWouldRefuse, project, reason, nil)
			} else {
				f.event(r, events.KindRefused, project, reason, nil)
				f.refuse(w, project, reason, retry, rate, msg)
				f.stats.record(project, oc, 0, 0, false, start)
				return nil
			}
		}
	}
	ax := &admitted{admission: admission{project: project, start: start},
		exchange: exchange{project: project, outcome: outcomeCanceled}}
	a := &ax.admission
	a.x = &ax.exchange
	if pool := f.deps.Requests; pool != nil {
		// A flood is refused here, request after request: the refusal is
		// written into storage of this call, not allocated.
		var ref pools.Refusal
		pm, ok := pool.TryAcquireInto(project, &ref)
		if ok && ref.WouldRefuse {
			f.stats.wouldRefuse("share")
			f.event(r, events.KindWouldRefuse, project, events.ReasonShare, &ref)
		}
		if !ok {
			f.event(r, events.KindRefused, project, events.ReasonShare, &ref)
			f.refuse(w, project, "share", ref.RetryAfter, ref.ReleaseRate, fmt.Sprintf(
				"fairshare: project %s holds %d requests, its share is %d: %s", project, ref.Held, ref.Share, ref.Reason))
			f.stats.record(project, outcomeRefusedShare, 0, 0, false, start)
			return nil
		}
		a.permit = pm
	}
	if s := f.deps.Sched; s != nil {
		a.ticket = s.Submit(project)
	}
	return a
}

// unscheduled answers a request the scheduler did not dispatch (err ended
// its ticket's wait): nothing when the client went away (the wait ended
// with the request's context), 503 otherwise (the ticket was withdrawn).
func (f *Front) unscheduled(w http.ResponseWriter, r *http.Request, x *exchange, err error) {
	if r.Context().Err() != nil || errors.Is(err, context.Canceled) {
		x.outcome = outcomeCanceled
		noAnswer(w)
		return
	}
	x.outcome = outcomeError
	f.log.Warn("request not dispatched", "project", x.project, "err", err)
	http.Error(w, "fairshare: the scheduler did not dispatch the request", http.StatusServiceUnavailable)
}

// noAnswer ends a request the front cannot answer, its client gone. A
// handler that returns without writing gets an empty 200 from net/http, a
// success nobody gave, read by a client that only half-closed its
// connection: the answer is aborted instead (net/http closes the
// connection, HTTP/2 resets the stream), and a loop's captured answer
// marked so.
func noAnswer(w http.ResponseWriter) {
	if cw, ok := w.(*captured); ok {
		cw.abort = true
		return
	}
	panic(http.ErrAbortHandler)
}

// clientGone reports whether r's client went away: its context ended, or
// a read of its connection failed (which the watch hears a moment before
// net/http cancels the context).
func clientGone(r *http.Request) bool {
	if r.Context().Err() != nil {
		return true
	}
	p, ok := r.Context().Value(peerKey{}).(*peer)
	return ok && p.cc != nil && p.cc.isGone()
}

// dispatched records the end of a's wait for the scheduler (class and err
// from its ticket; none without one) and reports whether it may go
// upstream: false when its ticket was withdrawn.
func (f *Front) dispatched(a *admission, class scheduler.Class, err error) bool {
	if a.ticket != nil {
		a.x.waited = a.ticket.Waited()
		if err != nil {
			a.ticket = nil // withdrawn: nothing to complete
			return false
		}
		a.x.class = class
	}
	a.dispatched = f.clk.Now()
	a.x.at = a.dispatched
	return true
}

// finish ends an admitted request, exactly once: its ticket is completed
// and its cost charged, its permit (or exempt place) given back and its
// outcome counted. panicked: the handler is unwinding (an aborted answer);
// canceled: the client went away.
func (f *Front) finish(a *admission, panicked, canceled bool) {
	x, project := a.x, a.project
	end := f.clk.Now()
	if x.exempt {
		f.exemptInFlight.Add(-1)
		oc := x.outcome
		if oc == outcomeOK {
			oc = outcomeExempt
		}
		f.stats.record(project, oc, end.Sub(a.start), 0, true, end)
		return
	}
	if panicked {
		x.outcome = outcomeError
		if canceled {
			x.outcome = outcomeCanceled
		}
	}
	var service time.Duration
	if !a.dispatched.IsZero() {
		service = end.Sub(a.dispatched)
		cost := f.cost(x, service)
		if a.ticket != nil {
			a.ticket.Done(cost)
		}
		if f.deps.Rates != nil {
			f.deps.Rates.Charge(project, cost)
		}
	}
	if a.permit.Valid() {
		if err := f.deps.Requests.Release(a.permit); err != nil {
			f.log.Error("releasing request permit", "project", project, "err", err)
		}
	}
	f.stats.record(project, x.outcome, end.Sub(a.start), x.waited, !a.dispatched.IsZero(), end)
}

// forward proxies an admitted request: on the direct path when it can take
// it, through ReverseProxy otherwise.
func (f *Front) forward(w http.ResponseWriter, r *http.Request, x *exchange) {
	if hasBody(r) {
		// Let the upstream's answer start while the client is still
		// sending (HTTP/1 otherwise drains the request body first).
		// HTTP/2 is always full duplex and reports an error here, which
		// is fine. A body left unread is closed here, before the handler
		// returns: in full duplex the HTTP/1 server would otherwise read
		// it to its end after the handler and then panic on the next
		// request (golang/go#68560).
		_ = http.NewResponseController(w).EnableFullDuplex()
		defer r.Body.Close()
		x.body = f.timedBody(w, r)
		r.Body = x.body
	}
	if f.up != nil && f.up.takes(r) {
		f.serveDirect(w, r, x)
		return
	}
	ctx := context.WithValue(r.Context(), exchangeKey{}, x)
	if r.Header["Upgrade"] != nil {
		// A tunnel holds its request's permit while it lasts: it is
		// closed, both ends, after Config.TunnelTimeout (ReverseProxy
		// closes the upstream end when the request's context ends).
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, f.cfg.TunnelTimeout)
		defer cancel()
	}
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GotConn: func(i httptrace.GotConnInfo) { x.upConn = i.Conn },
		Got1xxResponse: func(int, textproto.MIMEHeader) error {
			// ReverseProxy has passed it on by now; the next is refused.
			if x.n1xx++; x.n1xx > f.cfg.MaxInformational {
				return fmt.Errorf("upstream sent more than %d informational answers", f.cfg.MaxInformational)
			}
			return nil
		},
	})
	f.proxy.ServeHTTP(&proxyWriter{w, f, r}, r.WithContext(ctx))
}

// serveDirect proxies r on the direct path.
func (f *Front) serveDirect(w http.ResponseWriter, r *http.Request, x *exchange) {
	x.w = w
	a, err := f.up.roundTrip(r, x)
	if err != nil {
		f.upstreamFailed(w, r, x, err)
		return
	}
	f.relay(w, r, x, a)
}

// relay passes the upstream's answer a to the client, ending it with
// up.done.
func (f *Front) relay(w http.ResponseWriter, r *http.Request, x *exchange, a upAnswer) {
	keep := false
	defer func() { f.up.done(a, keep, x.at) }()
	resp := a.Response
	dst := w.Header()
	if h := resp.Header; h == nil {
		// A plain head (see plainHead): its end-to-end fields are in dst.
		f.annotate(x, dst)
	} else {
		conn := h["Connection"]
		for k := range h {
			if answerfield.IsHopByHop(k) || (len(conn) > 0 && connectionListed(conn, k)) {
				delete(h, k)
			}
		}
		f.annotate(x, h)
		for k, vv := range h {
			if dst[k] == nil {
				dst[k] = vv // resp.Header is ours alone: no copy needed
				continue
			}
			dst[k] = append(dst[k], vv...)
		}
	}
	f.stripOwn(resp.Trailer)
	announced := len(resp.Trailer)
	if announced > 0 {
		keys := make([]string, 0, announced)
		for k := range resp.Trailer {
			keys = append(keys, k)
		}
		dst.Add("Trailer", strings.Join(keys, ", "))
	}
	w.WriteHeader(resp.StatusCode)
	// A response of unknown length may be a stream (server-sent events, a
	// long poll): pass each piece on as it arrives, as ReverseProxy does.
	stream := resp.ContentLength < 0
	if err := f.copyBody(w, resp.Body, stream); err != nil {
		if a.watch.clientGone(r.Context()) || errors.Is(err, errClientWrite) {
			// Nobody reads the rest: the server closes the connection.
			x.outcome = outcomeCanceled
			return
		}
		f.log.Debug("upstream answer cut short", "project", x.project, "err", err)
		// The head is out: abort the client's response so it cannot read
		// as complete (ServeHTTP's deferred exit counts it as an error).
		panic(http.ErrAbortHandler)
	}
	resp.Body.Close()
	if len(resp.Trailer) > 0 {
		// The values came with the end of the body, under any name.
		f.stripOwn(resp.Trailer)
		for k, vv := range resp.Trailer {
			if announced == 0 {
				k = http.TrailerPrefix + k
			}
			dst[k] = append(dst[k], vv...)
		}
	}
	keep = !resp.Close
}

// errClientWrite: a write of the answer to the client failed (it went away,
// or did not read within Config.WriteTimeout).
var errClientWrite = errors.New("writing to the client")

// copyBody copies the upstream body to the client with a pooled buffer,
// flushing after every read when stream is set.
func (f *Front) copyBody(w http.ResponseWriter, body io.Reader, stream bool) error {
	bp := f.bufs.get()
	defer f.bufs.put(bp)
	buf := *bp
	var fl http.Flusher
	if stream {
		fl, _ = w.(http.Flusher)
	}
	for {
		n, rerr := body.Read(buf)
		if n > 0 {
			if _, err := w.Write(buf[:n]); err != nil {
				return fmt.Errorf("%w: %w", errClientWrite, err)
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return fmt.Errorf("reading the upstream answer: %w", rerr)
		}
	}
}

// cost is what a finished request is charged, in work units.
func (f *Front) cost(x *exchange, service time.Duration) float64 {
	switch {
	case x.hasCost:
		return x.cost
	case f.cfg.CostFromTime:
		return float64(service) / float64(f.cfg.CostUnit)
	default:
		return 1
	}
}

// refuse answers 429 with a Retry-After for this project: the estimate,
// spread over whole seconds at the rate the project can be admitted again
// (see retryPacer).
func (f *Front) refuse(w http.ResponseWriter, project, reason string, est time.Duration, rate float64, msg string) {
	h := w.Header()
	h.Set("Retry-After", strconv.Itoa(f.hint(project, est, rate)))
	h.Set(HeaderRefused, reason)
	http.Error(w, msg, http.StatusTooManyRequests)
}

// poolRequests is the name of the front's pool (config.PoolRequests).
const poolRequests = "requests"

// event publishes a decision about r of project (rf: the rule's numbers,
// for a share refusal).
func (f *Front) event(r *http.Request, kind, project, reason string, rf *pools.Refusal) {
	if f.deps.Events == nil {
		return
	}
	e := events.Event{Source: events.SourceFront, Kind: kind, Pool: poolRequests, Project: project, Reason: reason, Remote: peerText(r)}
	if rf != nil {
		if rf.Reason == pools.ReasonFull {
			e.Reason = events.ReasonPoolFull
		}
		e.Held, e.InUse, e.Share, e.PoolSize = rf.Held, rf.InUse, rf.Share, rf.Size
	}
	f.deps.Events(e)
}

// peerText is the client as an event names it: its address, or "unix" on
// the front's socket.
func peerText(r *http.Request) string {
	if r.RemoteAddr == "" || r.RemoteAddr == "@" {
		return "unix"
	}
	return r.RemoteAddr
}

// hint is the Retry-After, in seconds, of a refusal of project now: the
// refusal's estimate est and the rate at which the project can be admitted
// again.
func (f *Front) hint(project string, est time.Duration, rate float64) int {
	return f.retry.seconds(project, f.clk.Now(), est, rate)
}

// ExemptInFlight returns the exempt requests being served.
func (f *Front) ExemptInFlight() int { return int(f.exemptInFlight.Load()) }

func (f *Front) rewrite(pr *httputil.ProxyRequest) {
	pr.SetURL(f.upstream)
	pr.Out.Host = pr.In.Host
	pr.Out.Header.Del(f.cfg.ProjectHeader)
	for k := range pr.Out.Header {
		if f.isClaim(k) {
			delete(pr.Out.Header, k)
		}
	}
	for k := range pr.Out.Trailer { // as the direct path's trailers
		if f.isClaim(k) {
			delete(pr.Out.Trailer, k)
		}
	}
	// As the direct path (see isClaim), once the client's claims are
	// gone (Rewrite has dropped its Forwarded and X-Forwarded-{For,Host,
	// Proto}, the loop above the others).
	if ip, _, err := net.SplitHostPort(pr.In.RemoteAddr); err == nil {
		pr.Out.Header.Set("X-Forwarded-For", ip)
	}
	if pr.In.TLS != nil {
		pr.Out.Header.Set("X-Forwarded-Proto", "https")
	}
	if f.cfg.ForwardProject {
		if x := exchangeOf(pr.In); x != nil {
			pr.Out.Header.Set(f.cfg.ProjectHeader, x.project)
		}
	}
}

func (f *Front) modifyResponse(resp *http.Response) error {
	x := exchangeOf(resp.Request)
	if resp.StatusCode < 100 || resp.StatusCode > 599 {
		// net/http reads any three digits; the client is answered 502 and
		// the connection that spoke them is not used again.
		if x != nil && x.upConn != nil {
			x.upConn.Close()
		}
		return fmt.Errorf("upstream status %d outside 100-599", resp.StatusCode)
	}
	if x != nil {
		f.annotate(x, resp.Header)
	}
	if len(resp.Trailer) > 0 {
		f.stripOwn(resp.Trailer) // not announced
		resp.Body = &ownTrailer{resp.Body, f, resp}
	}
	return nil
}

// annotate records the upstream's answer in x (it came, its cost) and sets
// the front's headers on it.
func (f *Front) annotate(x *exchange, h http.Header) {
	f.answered(x, h.Get(f.cfg.CostHeader))
	delete(h, f.costKey)
	delete(h, HeaderRefused)
	// The values are shared, read-only slices (net/http copies a header's
	// values when it writes them; len == cap, so an append copies too): three
	// fewer allocations per request than Set and formatting each time.
	if class := classOf(x); class != nil {
		h[HeaderClass] = class
	} else {
		// No scheduler: no class, and none from the upstream either.
		delete(h, HeaderClass)
	}
	h[HeaderQueueWait] = queueWaitOf(x)
}

// answered records in x that the upstream answered, at the cost its cost
// header says (v; "" when it sent none).
func (f *Front) answered(x *exchange, v string) {
	x.outcome = outcomeOK
	if v == "" {
		return
	}
	c, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err == nil && c >= 0 && !math.IsInf(c, 0) {
		x.cost, x.hasCost = c, true
	} else {
		f.log.Warn("ignoring bad cost header", "project", x.project, "value", v)
	}
}

// classOf is the value of HeaderClass on x's answer; nil when x went
// through no scheduler.
func classOf(x *exchange) []string {
	switch {
	case x.exempt:
		return classExempt
	case x.class >= scheduler.P1 && x.class <= scheduler.P3:
		return classValues[x.class]
	case x.class != 0:
		return []string{x.class.String()}
	}
	return nil
}

// queueWaitOf is the value of HeaderQueueWait on x's answer.
func queueWaitOf(x *exchange) []string {
	if x.waited == 0 {
		return noWait
	}
	return []string{strconv.FormatFloat(x.waited.Seconds(), 'f', 6, 64)}
}

// The values of HeaderClass and of HeaderQueueWait for a request that did
// not wait, set by annotate. HeaderClass and HeaderQueueWait are already in
// canonical form, as keys set directly in a header map must be.
var (
	classExempt = []string{ClassExempt}
	classValues = [...][]string{
		scheduler.P1: {scheduler.P1.String()},
		scheduler.P2: {scheduler.P2.String()},
		scheduler.P3: {scheduler.P3.String()},
	}
	noWait = []string{strconv.FormatFloat(0, 'f', 6, 64)}
)

// stripOwn deletes from h, an upstream's informational head or trailer,
// the fields the front sets itself or consumes (its class, queue wait and
// refusal, the cost header): the upstream does not speak for the front.
func (f *Front) stripOwn(h http.Header) {
	if len(h) == 0 {
		return
	}
	for k := range h {
		if f.own(k) {
			delete(h, k)
		}
	}
}

// own reports whether canonical key k is a field the front sets itself or
// consumes: its class, queue wait and refusal, and the cost header.
func (f *Front) own(k string) bool {
	return k == HeaderClass || k == HeaderQueueWait || k == HeaderRefused || k == f.costKey
}

// may1xx reports whether an informational answer may be passed to
// the client of r: not to an HTTP/1.0 client, which does not know them
// (RFC 9110 15.2).
func may1xx(r *http.Request) bool { return r.ProtoAtLeast(1, 1) }

// proxyWriter is the client's ResponseWriter as ReverseProxy sees it: an
// informational answer reaches only a client that may have one, and without
// the front's own fields.
type proxyWriter struct {
	http.ResponseWriter
	f *Front
	r *http.Request
}

func (w *proxyWriter) WriteHeader(code int) {
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		if !may1xx(w.r) {
			clear(w.Header()) // ReverseProxy copied the answer's fields in
			return
		}
		w.f.stripOwn(w.Header())
	}
	w.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController (ReverseProxy's flushes, hijacks
// and deadlines) reach the server's writer.
func (w *proxyWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// ownTrailer removes the front's own fields from an answer's trailer when
// its body ends: the values only come then, and would be passed on by
// ReverseProxy under whatever names the upstream chose.
type ownTrailer struct {
	io.ReadCloser
	f    *Front
	resp *http.Response
}

func (b *ownTrailer) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.f.stripOwn(b.resp.Trailer)
	}
	return n, err
}

func (f *Front) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	f.upstreamFailed(w, r, exchangeOf(r), err)
}

// upstreamFailed answers a request the upstream did not answer: 408 when
// the client's body stalled past Config.BodyReadTimeout, 400 when it broke
// off, 504 when the upstream did not answer in time (a connection within
// the dialer's 5 seconds, a head within Config.UpstreamHeadTimeout), 502
// otherwise, or nothing (see noAnswer)
// when the client went away.
func (f *Front) upstreamFailed(w http.ResponseWriter, r *http.Request, x *exchange, err error) {
	if x != nil && x.body != nil && x.body.timedOut.Load() {
		// The client's own stall; its connection cannot be trusted to be
		// in step, and the server's read of it failed.
		x.outcome = outcomeCanceled
		w.Header().Set("Connection", "close")
		http.Error(w, "fairshare: the request body stalled", http.StatusRequestTimeout)
		return
	}
	if r.Context().Err() != nil || errors.Is(err, errClientGone) {
		// The client went away; there is nobody to answer.
		if x != nil {
			x.outcome = outcomeCanceled
		}
		noAnswer(w)
		return
	}
	if errors.Is(err, errClientBody) {
		if x != nil {
			x.outcome = outcomeCanceled
		}
		w.Header().Set("Connection", "close")
		http.Error(w, "fairshare: bad request body", http.StatusBadRequest)
		return
	}
	status, msg := http.StatusBadGateway, "fairshare: upstream unavailable"
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		status, msg = http.StatusGatewayTimeout, "fairshare: the upstream did not answer in time"
	}
	if x != nil {
		x.outcome = outcomeError
		f.log.Warn("upstream error", "project", x.project, "status", status, "err", err)
	}
	http.Error(w, msg, status)
}

// timedBody is a client's request body each read of which must return
// within Config.BodyReadTimeout: a client that stops sending does not hold
// its request, and its permit, for longer.
type timedBody struct {
	io.ReadCloser
	d time.Duration
	// minRate (bytes/s, 0 none) bounds the whole body: by start + d +
	// read/minRate the client must have sent read bytes and more.
	minRate int64
	start   time.Time
	read    int64
	conn    net.Conn                 // the client's connection, HTTP/1 under Front.Serve
	rc      *http.ResponseController // otherwise
	// timedOut: a read failed on the deadline.
	timedOut atomic.Bool
}

func (f *Front) timedBody(w http.ResponseWriter, r *http.Request) *timedBody {
	b := &timedBody{ReadCloser: r.Body, d: f.cfg.BodyReadTimeout, minRate: f.cfg.BodyMinRate, start: time.Now()}
	if cc := peerOf(r).cc; cc != nil && r.ProtoMajor == 1 {
		b.conn = cc.Conn
	} else {
		b.rc = http.NewResponseController(w)
	}
	return b
}

func (b *timedBody) setDeadline(t time.Time) {
	if b.conn != nil {
		_ = b.conn.SetReadDeadline(t)
	} else {
		_ = b.rc.SetReadDeadline(t)
	}
}

// Read reads within the deadline, and lifts it after: at the end of an
// HTTP/1 body net/http starts reading the connection for the next request,
// which must not fail on it.
func (b *timedBody) Read(p []byte) (int, error) {
	start := time.Now()
	deadline := start.Add(b.d)
	if b.minRate > 0 {
		// The whole body's bound: a client trickling a byte before each
		// read's deadline still has to keep the average rate.
		deadline = minTime(deadline, b.start.Add(b.d+time.Duration(float64(b.read+1)/float64(b.minRate)*float64(time.Second))))
	}
	b.setDeadline(deadline)
	n, err := b.ReadCloser.Read(p)
	b.read += int64(n)
	if err != nil && err != io.EOF && (errors.Is(err, os.ErrDeadlineExceeded) || !time.Now().Before(deadline)) {
		// The deadline stays in the past: the server's own read of the
		// rest of the body, when the handler closes it, fails at once
		// too rather than wait for a client that stopped.
		b.timedOut.Store(true)
		b.setDeadline(time.Unix(1, 0))
		return n, err
	}
	b.setDeadline(time.Time{})
	return n, err
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}
