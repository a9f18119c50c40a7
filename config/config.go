// SPDX-License-Identifier: Apache-2.0

package config

import (
	"bytes"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/fairshare-dev/fairshare/internal/answerfield"
	"github.com/fairshare-dev/fairshare/internal/destination"
	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/internal/proxyclaim"
	"go.yaml.in/yaml/v3"
	"golang.org/x/net/http/httpguts"

	"github.com/fairshare-dev/fairshare/loader/limits"
)

//go:embed default.yaml
var defaultYAML []byte

// ErrInvalid is wrapped by every validation error, so callers can tell a bad
// configuration from an unreadable file.
var ErrInvalid = errors.New("invalid configuration")

// The pool names the product knows. They always exist: a file can resize them
// but not remove them.
const (
	PoolRequests    = "requests"
	PoolConnections = "connections"
	PoolResidents   = "residents"
	PoolFlights     = "flights"
)

// Config is the daemon's whole configuration. YAML keys are snake_case.
type Config struct {
	ProjectsRoot string `yaml:"projects_root"`
	PinDir       string `yaml:"pin_dir"`
	StateDir     string `yaml:"state_dir"`
	// PoliciesFile, if set, is a YAML file of policies (project -> policy)
	// that the daemon follows: it owns the projects it names.
	PoliciesFile string          `yaml:"policies_file"`
	AdminSocket  string          `yaml:"admin_socket"`
	Tick         time.Duration   `yaml:"tick"`
	Reconcile    time.Duration   `yaml:"reconcile"`
	BPF          bool            `yaml:"bpf"`
	Permits      Permits         `yaml:"permits"`
	Metrics      Metrics         `yaml:"metrics"`
	Pools        map[string]Pool `yaml:"pools"`
	Front        Front           `yaml:"front"`
	Scheduler    Scheduler       `yaml:"scheduler"`
	Connections  Connections     `yaml:"connections"`
	Listeners    Listeners       `yaml:"listeners"`
	Projects     Projects        `yaml:"projects"`
	Events       Events          `yaml:"events"`
	Kubernetes   Kubernetes      `yaml:"kubernetes"`
	Fleet        Fleet           `yaml:"fleet"`
}

// Events configures the stream of refusals and repairs (package events).
type Events struct {
	// Log, if set, is a file every event is appended to as a JSON line,
	// rotated when it would pass LogMaxBytes, keeping LogKeep old files.
	Log         string `yaml:"log"`
	LogMaxBytes int64  `yaml:"log_max_bytes"`
	LogKeep     int    `yaml:"log_keep"`
	// Recent is how many events the daemon keeps for 'fairshare events'
	// without --follow.
	Recent int `yaml:"recent"`
	// PerSec bounds the events of one project per second, in the kernel
	// (the BPF programs' refusals) and in the daemon alike; the rest are
	// counted as dropped and the stream says how many.
	PerSec int `yaml:"per_sec"`
}

// Bounds of the events keys.
const (
	MinEventsLogBytes = 4 << 10
	MaxEventsLogKeep  = 100
	MaxEventsRecent   = 100_000
	MaxEventsPerSec   = 100_000
)

// Connections configures the kernel side of the connections pool beyond its
// size: the exempt class.
type Connections struct {
	// Exempt lists cgroups (relative to projects_root, or absolute below it)
	// whose connections take exempt permits instead of pool permits.
	Exempt []string `yaml:"exempt"`
	// ExemptMax bounds the exempt permits held at a time node-wide; 0 means
	// the pool's floor.
	ExemptMax int `yaml:"exempt_max"`
	// ReservationTTL bounds how long an inbound handshake whose request
	// socket is gone (reset, timed out) keeps its permit: between
	// limits.MinReservationTTL and limits.MaxReservationTTL, 0 for the
	// kernel side's default (3s). See limits.DefaultReservationTTL.
	ReservationTTL time.Duration `yaml:"reservation_ttl"`
	// MaxNetns bounds the network namespaces inbound admission is attached
	// in besides the daemon's own: 1 to limits.MaxNetns.
	MaxNetns int `yaml:"max_netns"`
	// MaxDestinationPools sizes the kernel side's destination pool tables:
	// the destination pools configured at once (a removed one still held
	// by connections included), 0 for limits.DefaultMaxDestPools when a
	// destination pool is configured and for none when none is (a pool
	// added by SIGHUP then needs a restart), at most limits.MaxDestPools.
	// Set it to add pools by SIGHUP to a node started without any. Its
	// memory is 32 bytes per pool and project id (16384 ids). Fixed when
	// the pins are made, except that tables made for none grow at a start
	// with pools.
	MaxDestinationPools int `yaml:"max_destination_pools"`
	// MaxNetnsPerProject bounds those of one project (a namespace counts
	// for each project it was attached for, until the namespace is gone
	// from the kernel, processes in it or not), so that one tenant
	// making namespaces cannot take all of MaxNetns: 1 to limits.MaxNetns
	// (past MaxNetns it bounds nothing).
	MaxNetnsPerProject int `yaml:"max_netns_per_project"`
	// LapseAfter is how long the kernel enforces without a daemon: once
	// the daemon's heartbeat (renewed every tick) is older, the programs
	// count and stop refusing (loader.Options.LapseAfter). 0 enforces
	// forever; otherwise at least MinLapseAfter(tick).
	LapseAfter time.Duration `yaml:"lapse_after"`
	// AbortMovedPast aborts the connections a pod opened before it was
	// classified whose permits a reconcile pass moves to its project past
	// the rule (loader.Options.AbortMovedPast).
	AbortMovedPast bool `yaml:"abort_moved_past"`
	// LimitHostNetworkPods limits a pod in the host's network namespace as
	// unclassified before it is classified, as any other pod
	// (loader.Options.LimitHostNetwork); off, such a pod is counted but
	// never refused until it is classified.
	LimitHostNetworkPods bool `yaml:"limit_host_network_pods"`
}

// minLapseAfter is the least connections.lapse_after besides three ticks.
const minLapseAfter = 3 * time.Second

// MinLapseAfter is the least connections.lapse_after (other than 0) with
// this tick: 3 s and three ticks. The heartbeat is renewed every tick by a
// goroutine of its own, apart from the control loop's work, so only a
// process that does not run at all misses it: three ticks let two renewals
// be late, and 3 s is far past what scheduling delays a runnable thread on
// a loaded node (Go's pauses are sub-millisecond, a throttled cgroup waits
// for its next 100 ms period). A daemon stopped outright (SIGSTOP, a
// frozen cgroup) is not a daemon running, and lapses as a dead one would.
func MinLapseAfter(tick time.Duration) time.Duration {
	return max(minLapseAfter, 3*tick)
}

// LapseRaised says, for a configuration before and after Validate, whether
// Validate raised connections.lapse_after to MinLapseAfter (a value from two
// ticks up to it, valid before the minimum rose), and a line that says so
// for the log.
func LapseRaised(before, after Config) (string, bool) {
	b, a := before.Connections.LapseAfter, after.Connections.LapseAfter
	if b == a {
		return "", false
	}
	return fmt.Sprintf("connections.lapse_after %s is under the least a running daemon cannot reach (%s and three ticks): "+
		"enforcement lapses after %s instead; write %s (or 0) in the configuration to silence this", b, minLapseAfter, a, a), true
}

// Permits configures the local permit API (package permitd) that serves the
// flights, residents and any extra pool to runtimes on the node.
type Permits struct {
	Socket string `yaml:"socket"`
	// Group may connect besides root: a group name or a numeric gid.
	Group string `yaml:"group"`
	// MaxWaiting, MaxWaitingPerUID and MaxWaitingPerSession bound the
	// permit operations waiting at once, over all sessions, per peer user
	// and per session (package permitd); 0 means its defaults.
	MaxWaiting           int `yaml:"max_waiting"`
	MaxWaitingPerUID     int `yaml:"max_waiting_per_uid"`
	MaxWaitingPerSession int `yaml:"max_waiting_per_session"`
}

// Metrics configures the Prometheus endpoint.
type Metrics struct {
	Listen      string `yaml:"listen"`
	MaxProjects int    `yaml:"max_projects"`
}

// The largest pool sizes, by kind. Each is above what a node can use and
// keeps a pool's arithmetic (size x shares, MaxShares 1e6) far from
// overflowing; a larger size is a typo, refused at load naming the key:
//
//   - connections: limits.MaxPoolSize (262144), what the kernel side's maps
//     are sized for (each permit is a socket's entry in them);
//   - requests: MaxRequestsPoolSize (1048576), requests in flight at once
//     through the front, each holding a client and an upstream socket: two
//     descriptors, and Linux's open-files ceiling (fs.nr_open) is 1048576
//     by default;
//   - flights, residents and the extra pools: MaxPoolSize (16777216),
//     permits held through the permit API, each a lease of a session the
//     daemon keeps in memory (about a kilobyte with its session): 16 GiB.
const (
	MaxRequestsPoolSize = 1 << 20
	MaxPoolSize         = 1 << 24
)

// maxPoolSize is the largest size of pool name (see MaxPoolSize) and why.
func maxPoolSize(name string) (int, string) {
	switch name {
	case PoolConnections:
		return limits.MaxPoolSize, "the kernel side's maps hold that many permits"
	case PoolRequests:
		return MaxRequestsPoolSize, "each permit is a request in flight holding two sockets, and the open-files ceiling is 1048576"
	}
	return MaxPoolSize, "each permit is a lease the daemon keeps in memory"
}

// Pool sizes one pool.
type Pool struct {
	Size   int           `yaml:"size"`
	Floor  int           `yaml:"floor"`
	Window time.Duration `yaml:"window"`
	// Enforce false puts the pool in dry-run: what the rule would refuse
	// is admitted and counted as would_refuse. Unset means true.
	Enforce *bool `yaml:"enforce,omitempty"`
	// Fleet makes the size the fleet's total, divided among the nodes of
	// fleet.prefix through etcd (package fleet).
	Fleet bool `yaml:"fleet,omitempty"`
	// Destinations makes the pool a destination pool: a connections pool
	// enforced in the kernel for the connects to these destinations (a
	// CIDR with an optional port, package internal/destination), on top
	// of the connections pool. Not for the four built-in pools.
	Destinations []string `yaml:"destinations,omitempty"`
}

// IsDestination reports whether the pool is a destination pool.
func (p Pool) IsDestination() bool { return len(p.Destinations) > 0 }

// Enforced reports whether the pool enforces its rule (not dry-run).
func (p Pool) Enforced() bool { return p.Enforce == nil || *p.Enforce }

// Front configures the HTTP front (reverse proxy) for the requests pool.
type Front struct {
	Listen        string            `yaml:"listen"`
	Upstream      string            `yaml:"upstream"`
	ProjectHeader string            `yaml:"project_header"`
	Routes        map[string]string `yaml:"routes"`
	MaxInFlight   int               `yaml:"max_in_flight"`
	CostHeader    string            `yaml:"cost_header"`
	CostFromTime  bool              `yaml:"cost_from_time"`
	CostUnit      time.Duration     `yaml:"cost_unit"`
	// Socket is a unix socket the front also listens on; local clients
	// reaching it are in the project of their process's cgroup.
	Socket string `yaml:"socket"`
	// TrustedPeers may set the project header: CIDRs or addresses of TCP
	// peers, and cgroups (absolute, or relative to projects_root).
	TrustedPeers []string `yaml:"trusted_peers"`
	// Exempt names the exempt class of requests.
	Exempt FrontExempt `yaml:"exempt"`
	// ExemptMax bounds exempt requests in flight; 0 means the front's
	// default (4).
	ExemptMax int `yaml:"exempt_max"`
	// Limits bound what one client or the upstream can make the front hold.
	Limits FrontLimits `yaml:"limits"`
	// FastPath serves plain HTTP/1.1 requests on the front's TCP listener
	// in the front's own event loops (front.Config.FastPath); false serves
	// every connection with Go's net/http server. The default is true.
	FastPath bool `yaml:"fast_path"`
	// IOURing has the fast path's loops send all a pass has to send
	// (answers, requests) with one io_uring call, and read the sockets a
	// pass finds readable with one (front.Config.PlainSends is its
	// opposite); false sends and reads each with a system call of its
	// own. The
	// default is true; a kernel that gives the daemon no io_uring
	// (kernel.io_uring_disabled, a seccomp filter) is met with plain
	// sends, logged once.
	IOURing bool `yaml:"io_uring"`
}

// FrontLimits are the front's bounds on heads and idle time; each is
// required (the embedded defaults set them) and checked against a range.
type FrontLimits struct {
	UpstreamHeadBytes   int64         `yaml:"upstream_head_bytes"`
	Informational       int           `yaml:"informational"`
	RequestHeadBytes    int           `yaml:"request_head_bytes"`
	ReadHeaderTimeout   time.Duration `yaml:"read_header_timeout"`
	IdleTimeout         time.Duration `yaml:"idle_timeout"`
	UpstreamIdleTimeout time.Duration `yaml:"upstream_idle_timeout"`
	BodyReadTimeout     time.Duration `yaml:"body_read_timeout"`
	BodyMinRate         int64         `yaml:"body_min_rate"`
	WriteTimeout        time.Duration `yaml:"write_timeout"`
	UpstreamHeadTimeout time.Duration `yaml:"upstream_head_timeout"`
	// UpstreamReadTimeout bounds each read of an upstream answer's body
	// (front.Config.UpstreamReadTimeout); 0: no bound.
	UpstreamReadTimeout time.Duration `yaml:"upstream_read_timeout"`
	TunnelTimeout       time.Duration `yaml:"tunnel_timeout"`
	// UpstreamIdlePerProject bounds the idle upstream connections kept for
	// one project (front.Config.UpstreamIdlePerProject).
	UpstreamIdlePerProject int `yaml:"upstream_idle_per_project"`
}

func (l *FrontLimits) validate() error {
	for _, v := range []struct {
		name     string
		val, min int64
		max      int64
	}{
		{"upstream_head_bytes", l.UpstreamHeadBytes, 4 << 10, 64 << 20},
		{"informational", int64(l.Informational), 1, 100},
		{"request_head_bytes", int64(l.RequestHeadBytes), 1 << 10, 16 << 20},
		{"body_min_rate", l.BodyMinRate, 0, 1 << 30},
		{"upstream_idle_per_project", int64(l.UpstreamIdlePerProject), 1, 1 << 16},
	} {
		if v.val < v.min || v.val > v.max {
			return fmt.Errorf("front.limits.%s must be between %d and %d, got %d", v.name, v.min, v.max, v.val)
		}
	}
	for _, v := range []struct {
		name     string
		val, min time.Duration
		max      time.Duration
	}{
		{"read_header_timeout", l.ReadHeaderTimeout, 100 * time.Millisecond, 10 * time.Minute},
		{"idle_timeout", l.IdleTimeout, time.Second, time.Hour},
		{"upstream_idle_timeout", l.UpstreamIdleTimeout, time.Second, time.Hour},
		{"body_read_timeout", l.BodyReadTimeout, 100 * time.Millisecond, 10 * time.Minute},
		{"write_timeout", l.WriteTimeout, 100 * time.Millisecond, 10 * time.Minute},
		{"upstream_head_timeout", l.UpstreamHeadTimeout, 100 * time.Millisecond, time.Hour},
		{"tunnel_timeout", l.TunnelTimeout, time.Second, 24 * time.Hour},
	} {
		if v.val < v.min || v.val > v.max {
			return fmt.Errorf("front.limits.%s must be between %s and %s, got %s", v.name, v.min, v.max, v.val)
		}
	}
	if d := l.UpstreamReadTimeout; d != 0 && (d < 100*time.Millisecond || d > time.Hour) {
		return fmt.Errorf("front.limits.upstream_read_timeout must be 0 (no bound) or between %s and %s, got %s",
			100*time.Millisecond, time.Hour, d)
	}
	return nil
}

// FrontExempt names the requests of the front's exempt class.
type FrontExempt struct {
	Projects []string `yaml:"projects"`
	Routes   []string `yaml:"routes"`
	Cgroups  []string `yaml:"cgroups"`
}

// Enabled reports whether the front listens anywhere.
func (f *Front) Enabled() bool { return f.Listen != "" || f.Socket != "" }

// Scheduler configures the request-class scheduler's buckets.
type Scheduler struct {
	P1Rate        float64       `yaml:"p1_rate"`
	P1Burst       float64       `yaml:"p1_burst"`
	P2Rate        float64       `yaml:"p2_rate"`
	P2Burst       float64       `yaml:"p2_burst"`
	Poll          time.Duration `yaml:"poll"`
	DefaultTier   string        `yaml:"default_tier"`
	DefaultShares int           `yaml:"default_shares"`
}

// Default returns the embedded defaults. It panics only if the embedded file
// is broken, which a unit test rules out.
func Default() Config {
	var c Config
	if err := decode(bytes.NewReader(defaultYAML), &c); err != nil {
		panic(fmt.Sprintf("embedded default config: %v", err))
	}
	return c
}

// DefaultYAML returns the embedded default file, comments included.
func DefaultYAML() []byte { return bytes.Clone(defaultYAML) }

// Load reads path on top of the defaults and validates the result. An empty
// path returns the validated defaults.
func Load(path string) (Config, error) {
	c := Default()
	if path == "" {
		return c, c.Validate()
	}
	f, err := os.Open(path)
	if err != nil {
		return Config{}, fmt.Errorf("reading config: %w", err)
	}
	defer f.Close()
	if err := Parse(f, &c); err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// Parse decodes YAML from r on top of c (keys absent from r keep c's values)
// and validates the result.
func Parse(r io.Reader, c *Config) error {
	if err := decode(r, c); err != nil {
		return err
	}
	return c.Validate()
}

func decode(r io.Reader, c *Config) error {
	// Pools merge key by key: decoding into a fresh map and then copying lets a
	// file change pools.requests.size without restating the other pools.
	base := c.Pools
	c.Pools = nil
	dec := yaml.NewDecoder(r)
	dec.KnownFields(true)
	err := dec.Decode(c)
	if errors.Is(err, io.EOF) {
		err = nil // an empty file changes nothing
	}
	if err != nil {
		c.Pools = base
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	merged := make(map[string]Pool, len(base)+len(c.Pools))
	for k, v := range base {
		merged[k] = v
	}
	for k, v := range c.Pools {
		if old, ok := merged[k]; ok && v.Window == 0 {
			// A file that resizes a pool need not restate its window.
			v.Window = old.Window
		}
		merged[k] = v
	}
	c.Pools = merged
	return nil
}

// MaxSocketPath is the longest unix socket path (listen.MaxPathLen: 108
// bytes of sun_path with the terminating NUL).
const MaxSocketPath = 107

// checkHostPort accepts host:port with a port from 0 to 65535 (0: any free
// port), a host that is empty (every address), an IP address or a name.
func checkHostPort(hp string) error {
	host, port, err := net.SplitHostPort(hp)
	if err != nil {
		return fmt.Errorf("%q is not host:port: %v", hp, err)
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return fmt.Errorf("%q: the port must be a number from 0 to 65535, got %q", hp, port)
	}
	if strings.ContainsAny(host, " \t\r\n/") {
		return fmt.Errorf("%q: %q is not a host", hp, host)
	}
	return nil
}

func (e Events) validate() error {
	if e.Log != "" {
		if !filepath.IsAbs(e.Log) {
			return fmt.Errorf("events.log must be an absolute path or empty, got %q", e.Log)
		}
		if st, err := os.Stat(e.Log); err == nil && !st.Mode().IsRegular() {
			return fmt.Errorf("events.log: %s exists and is not a regular file", e.Log)
		}
	}
	if e.LogMaxBytes < MinEventsLogBytes {
		return fmt.Errorf("events.log_max_bytes must be at least %d, got %d", MinEventsLogBytes, e.LogMaxBytes)
	}
	if e.LogKeep < 1 || e.LogKeep > MaxEventsLogKeep {
		return fmt.Errorf("events.log_keep must be from 1 to %d, got %d", MaxEventsLogKeep, e.LogKeep)
	}
	if e.Recent < 1 || e.Recent > MaxEventsRecent {
		return fmt.Errorf("events.recent must be from 1 to %d, got %d", MaxEventsRecent, e.Recent)
	}
	if e.PerSec < 1 || e.PerSec > MaxEventsPerSec {
		return fmt.Errorf("events.per_sec must be from 1 to %d, got %d", MaxEventsPerSec, e.PerSec)
	}
	return nil
}

// poolName is the charset of pool names: they become label values and keys.
var poolName = regexp.MustCompile(`^[a-z][a-z0-9_]{0,31}$`)

// Validate checks every field and returns the first problem, naming its field.
func (c *Config) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
	}
	if c.ProjectsRoot != "" && !filepath.IsAbs(c.ProjectsRoot) {
		return bad("projects_root must be an absolute path, got %q", c.ProjectsRoot)
	}
	if !filepath.IsAbs(c.PinDir) {
		return bad("pin_dir must be an absolute path, got %q", c.PinDir)
	}
	if c.PoliciesFile != "" && !filepath.IsAbs(c.PoliciesFile) {
		return bad("policies_file must be an absolute path or empty, got %q", c.PoliciesFile)
	}
	if !filepath.IsAbs(c.StateDir) {
		return bad("state_dir must be an absolute path, got %q", c.StateDir)
	}
	if !filepath.IsAbs(c.AdminSocket) {
		return bad("admin_socket must be an absolute path, got %q", c.AdminSocket)
	}
	if len(c.AdminSocket) > MaxSocketPath {
		return bad("admin_socket is %d bytes, longer than a unix socket path may be (%d)", len(c.AdminSocket), MaxSocketPath)
	}
	if c.Tick < 10*time.Millisecond || c.Tick > time.Minute {
		return bad("tick must be between 10ms and 1m, got %s", c.Tick)
	}
	if c.Reconcile != 0 && c.Reconcile < time.Second {
		return bad("reconcile must be 0 (off) or at least 1s, got %s", c.Reconcile)
	}
	if c.Permits.Socket != "" && !filepath.IsAbs(c.Permits.Socket) {
		return bad("permits.socket must be an absolute path or empty, got %q", c.Permits.Socket)
	}
	if len(c.Permits.Socket) > MaxSocketPath {
		return bad("permits.socket is %d bytes, longer than a unix socket path may be (%d)", len(c.Permits.Socket), MaxSocketPath)
	}
	if c.Permits.Socket != "" && c.Permits.Socket == c.AdminSocket {
		return bad("permits.socket must differ from admin_socket")
	}
	if c.Metrics.Listen != "" {
		if err := checkHostPort(c.Metrics.Listen); err != nil {
			return bad("metrics.listen: %v", err)
		}
	}
	if c.Metrics.MaxProjects < 1 {
		return bad("metrics.max_projects must be >= 1, got %d", c.Metrics.MaxProjects)
	}
	for _, name := range []string{PoolRequests, PoolConnections, PoolResidents, PoolFlights} {
		if _, ok := c.Pools[name]; !ok {
			return bad("pools.%s is missing; the four built-in pools cannot be removed", name)
		}
	}
	for _, name := range c.PoolNames() {
		p := c.Pools[name]
		if !poolName.MatchString(name) {
			return bad("pools.%s: a pool name is lowercase letters, digits and _, starting with a letter, at most 32 bytes", name)
		}
		if p.Size <= 0 {
			return bad("pools.%s.size must be > 0, got %d", name, p.Size)
		}
		if most, why := maxPoolSize(name); p.Size > most {
			return bad("pools.%s.size must be at most %d (%s), got %d", name, most, why, p.Size)
		}
		if p.Floor < 0 || p.Floor > p.Size {
			return bad("pools.%s.floor must be between 0 and size (%d), got %d", name, p.Size, p.Floor)
		}
		if p.Window < 0 {
			return bad("pools.%s.window must not be negative, got %s", name, p.Window)
		}
		if name == PoolResidents && !p.Enforced() {
			return bad("pools.residents.enforce: false is not supported: a full residents pool evicts rather than refuses, so there is nothing to dry-run")
		}
	}
	if err := c.checkDestinations(); err != nil {
		return bad("%v", err)
	}
	if err := c.Events.validate(); err != nil {
		return bad("%v", err)
	}
	// The kernel side's bounds (package limits), checked here so that a
	// file the loader would refuse fails now, naming its key.
	if n := len(c.Connections.Exempt); n > limits.ExemptCap {
		return bad("connections.exempt names %d cgroups, at most %d", n, limits.ExemptCap)
	}
	for _, e := range c.Connections.Exempt {
		if strings.TrimSpace(e) == "" {
			return bad("connections.exempt has an empty path")
		}
	}
	if m := c.Connections.ExemptMax; m < 0 || m > c.Pools[PoolConnections].Size {
		return bad("connections.exempt_max must be between 0 and pools.connections.size (%d), got %d",
			c.Pools[PoolConnections].Size, m)
	}
	if err := c.checkFleet(); err != nil {
		return bad("%v", err)
	}
	if err := c.checkValues(); err != nil {
		return bad("%v", err)
	}
	if n := c.Connections.MaxNetns; n < 1 || n > limits.MaxNetns {
		return bad("connections.max_netns must be between 1 and %d, got %d", limits.MaxNetns, n)
	}
	if n := c.Connections.MaxNetnsPerProject; n < 1 || n > limits.MaxNetns {
		return bad("connections.max_netns_per_project must be between 1 and %d, got %d", limits.MaxNetns, n)
	}
	if la, least := c.Connections.LapseAfter, MinLapseAfter(c.Tick); la < 0 || la != 0 && la < 2*c.Tick {
		return bad("connections.lapse_after must be 0 (enforce forever) or at least %s (%s and three ticks), got %s",
			least, minLapseAfter, la)
	} else if la != 0 && la < least {
		// Two ticks was the least before: a node upgraded with such a
		// value starts with it raised (the caller warns, see
		// LapseRaised) instead of refusing to start while the pins its
		// last daemon left lapse.
		c.Connections.LapseAfter = least
	}
	if ttl := c.Connections.ReservationTTL; ttl != 0 && (ttl < limits.MinReservationTTL || ttl > limits.MaxReservationTTL) {
		return bad("connections.reservation_ttl must be 0 (the kernel side's default, 3s) or between %s and %s, got %s",
			limits.MinReservationTTL, limits.MaxReservationTTL, ttl)
	}
	if err := c.Front.validate(); err != nil {
		return bad("%v", err)
	}
	if err := c.Scheduler.validate(); err != nil {
		return bad("%v", err)
	}
	if err := c.Projects.validate(); err != nil {
		return bad("%v", err)
	}
	if err := c.Kubernetes.validate(c.Projects.Has(membership.SourceKubernetes)); err != nil {
		return bad("%v", err)
	}
	return nil
}

func (f *Front) validate() error {
	// Every key is checked with the front off too: a mistyped value given
	// without --front-listen was otherwise dropped without a word, or
	// refused only when the daemon built its parts (the scheduler takes
	// max_in_flight whether or not the front runs), after --print-config
	// had shown it as valid.
	if f.Upstream != "" {
		if u, err := url.Parse(f.Upstream); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("front.upstream must be an http(s) URL, got %q", f.Upstream)
		}
	}
	if f.Listen != "" {
		if err := checkHostPort(f.Listen); err != nil {
			return fmt.Errorf("front.listen: %v", err)
		}
	}
	if f.Socket != "" && (!filepath.IsAbs(f.Socket) || len(f.Socket) > MaxSocketPath) {
		return fmt.Errorf("front.socket must be an absolute path of at most %d bytes, got %q", MaxSocketPath, f.Socket)
	}
	if f.Enabled() && f.Upstream == "" {
		return errors.New("front.upstream is required when front.listen or front.socket is set")
	}
	for _, p := range f.TrustedPeers {
		if strings.TrimSpace(p) == "" {
			return errors.New("front.trusted_peers has an empty entry")
		}
	}
	for _, k := range f.Exempt.Routes {
		if _, ok := f.Routes[k]; !ok {
			return fmt.Errorf("front.exempt.routes: %q is not a key of front.routes", k)
		}
	}
	for _, list := range [][]string{f.Exempt.Projects, f.Exempt.Cgroups} {
		for _, e := range list {
			if strings.TrimSpace(e) == "" {
				return errors.New("front.exempt has an empty entry")
			}
		}
	}
	if f.ExemptMax < 0 || f.ExemptMax > f.MaxInFlight {
		return fmt.Errorf("front.exempt_max must be between 0 and front.max_in_flight (%d), got %d", f.MaxInFlight, f.ExemptMax)
	}
	if f.ProjectHeader == "" {
		return errors.New("front.project_header must not be empty")
	}
	for key, name := range map[string]string{"project_header": f.ProjectHeader, "cost_header": f.CostHeader} {
		if name != "" && !httpguts.ValidHeaderFieldName(name) {
			// It would match no field a client or an upstream sends.
			return fmt.Errorf("front.%s %q is not a header name (letters, digits and !#$%%&'*+-.^_`|~ only)", key, name)
		}
	}
	if proxyclaim.Is(f.ProjectHeader) {
		return fmt.Errorf("front.project_header %q is a header the front strips from every request (a proxy's claim on the client's address or scheme, such as X-Forwarded-* or X-Real-Ip): choose another name", f.ProjectHeader)
	}
	if why := answerfield.Reserved(f.CostHeader); why != "" {
		return fmt.Errorf("front.cost_header %q is %s; the front takes the cost header out of every answer: choose another name", f.CostHeader, why)
	}
	for host, project := range f.Routes {
		if host == "" || strings.TrimSpace(project) == "" {
			return fmt.Errorf("front.routes: %q -> %q needs both a host and a project", host, project)
		}
	}
	if f.MaxInFlight < 1 {
		return fmt.Errorf("front.max_in_flight must be >= 1, got %d", f.MaxInFlight)
	}
	if f.CostUnit <= 0 {
		return fmt.Errorf("front.cost_unit must be > 0, got %s", f.CostUnit)
	}
	return f.Limits.validate()
}

// MinBurst is the smallest bucket a scheduler class may have: one credit pays
// for one dispatch, so a smaller bucket could never admit anything. The
// scheduler package applies the same bound.
const MinBurst = 1

// MaxSchedulerRate and MaxBurst bound a scheduler class's rate and burst
// (per share), as the scheduler package does (scheduler.MaxRate and
// MaxBurst): far above what a node dispatches. A burst of 1e308 times a
// project's shares made a bucket of +Inf, and the daemon's status could not
// be encoded.
const (
	MaxSchedulerRate = 1e6
	MaxBurst         = 1e6
)

// MaxShares bounds scheduler.default_shares as package policy bounds a
// policy's shares (policy.MaxShares; a test keeps them equal): a policy set
// without --shares takes the default, which must validate.
const MaxShares = 1_000_000

func (s *Scheduler) validate() error {
	// The same bounds as scheduler.New, so a file that validates here also
	// starts the daemon: a rate is > 0, a burst >= MinBurst, both at most
	// their maximum. Zero is refused too: scheduler.New would read it as
	// "use the default", which a file that names the key did not ask for.
	for _, v := range []struct {
		name          string
		val, min, max float64
	}{{"p1_rate", s.P1Rate, 0, MaxSchedulerRate}, {"p1_burst", s.P1Burst, MinBurst, MaxBurst},
		{"p2_rate", s.P2Rate, 0, MaxSchedulerRate}, {"p2_burst", s.P2Burst, MinBurst, MaxBurst}} {
		if math.IsNaN(v.val) || v.val < v.min || (v.min == 0 && v.val <= 0) || v.val > v.max {
			if v.min == 0 {
				return fmt.Errorf("scheduler.%s must be a number > 0 and at most %g, got %g", v.name, v.max, v.val)
			}
			return fmt.Errorf("scheduler.%s must be a number from %g to %g, got %g", v.name, v.min, v.max, v.val)
		}
	}
	if s.Poll < 0 {
		return fmt.Errorf("scheduler.poll must not be negative, got %s", s.Poll)
	}
	switch s.DefaultTier {
	case "pro", "lite", "none":
	default:
		return fmt.Errorf("scheduler.default_tier must be pro, lite or none, got %q", s.DefaultTier)
	}
	if s.DefaultShares < 1 || s.DefaultShares > MaxShares {
		// A policy's bound: the default is where a policy set without
		// shares starts, which the store would refuse above it.
		return fmt.Errorf("scheduler.default_shares must be a whole number from 1 to %d, got %d", MaxShares, s.DefaultShares)
	}
	return nil
}

// DestPools parses the destinations of the destination pools, by pool name.
func (c *Config) DestPools() (map[string][]destination.Destination, error) {
	out := map[string][]destination.Destination{}
	for _, name := range c.PoolNames() {
		p := c.Pools[name]
		if !p.IsDestination() {
			continue
		}
		ds, err := destination.ParseAll(p.Destinations)
		if err != nil {
			return nil, fmt.Errorf("pools.%s.destinations%w", name, err)
		}
		out[name] = ds
	}
	return out, nil
}

// checkDestinations checks the destination pools: not a built-in pool,
// every destination parsed, none in two pools, within the kernel side's
// bounds.
func (c *Config) checkDestinations() error {
	n, total := 0, 0
	for _, name := range c.PoolNames() {
		p := c.Pools[name]
		if p.Destinations != nil && len(p.Destinations) == 0 {
			return fmt.Errorf("pools.%s.destinations is empty: give at least one, or leave the key out", name)
		}
		if !p.IsDestination() {
			continue
		}
		switch name {
		case PoolRequests, PoolConnections, PoolResidents, PoolFlights:
			return fmt.Errorf("pools.%s.destinations: a built-in pool cannot be a destination pool; name a pool of its own", name)
		}
		if p.Size > limits.MaxPoolSize {
			return fmt.Errorf("pools.%s.size must be at most %d for a destination pool, got %d", name, limits.MaxPoolSize, p.Size)
		}
		n++
		total += len(p.Destinations)
	}
	dests, err := c.DestPools()
	if err != nil {
		return err
	}
	if err := destination.Check(dests); err != nil {
		return err
	}
	if total > limits.MaxDestinations {
		return fmt.Errorf("the destination pools list %d destinations, at most %d", total, limits.MaxDestinations)
	}
	max := c.Connections.MaxDestinationPools
	if max < 0 || max > limits.MaxDestPools {
		return fmt.Errorf("connections.max_destination_pools must be between 0 and %d, got %d", limits.MaxDestPools, max)
	}
	if max == 0 {
		max = limits.DefaultMaxDestPools
	}
	if n > max {
		return fmt.Errorf("%d destination pools, connections.max_destination_pools is %d", n, max)
	}
	return nil
}

// PoolNames returns the configured pool names, sorted.
func (c *Config) PoolNames() []string {
	names := make([]string, 0, len(c.Pools))
	for n := range c.Pools {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Marshal renders c as YAML, for --print-config.
func (c *Config) Marshal() ([]byte, error) {
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(c); err != nil {
		return nil, fmt.Errorf("encoding config: %w", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("encoding config: %w", err)
	}
	return buf.Bytes(), nil
}
