// SPDX-License-Identifier: Apache-2.0

package config

import (
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/front"
	"github.com/fairshare-dev/fairshare/loader/limits"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

func TestDefaultIsValid(t *testing.T) {
	c := Default()
	if err := c.Validate(); err != nil {
		t.Fatalf("embedded defaults do not validate: %v", err)
	}
	if got := c.Pools[PoolConnections].Size; got != 4096 {
		t.Errorf("connections size = %d, want 4096", got)
	}
	if c.Tick != time.Second || c.Front.CostUnit != 10*time.Millisecond {
		t.Errorf("durations not decoded: tick %s cost_unit %s", c.Tick, c.Front.CostUnit)
	}
	if len(c.PoolNames()) != 4 {
		t.Errorf("pools = %v, want the four built-in ones", c.PoolNames())
	}
}

func TestParseOverlay(t *testing.T) {
	c := Default()
	in := `
pools:
  requests: {size: 8}
  uploads: {size: 10, floor: 2}
metrics: {listen: "127.0.0.1:0"}
front: {listen: "127.0.0.1:8080", upstream: "http://127.0.0.1:9000", routes: {"a.example": alpha}}
`
	if err := Parse(strings.NewReader(in), &c); err != nil {
		t.Fatal(err)
	}
	if got := c.Pools[PoolRequests]; got.Size != 8 || got.Window != time.Second {
		t.Errorf("requests = %+v, want size 8 and the default window kept", got)
	}
	if got := c.Pools[PoolConnections].Size; got != 4096 {
		t.Errorf("connections size = %d: an overlay must not drop pools it does not name", got)
	}
	if got := c.Pools["uploads"]; got.Size != 10 || got.Floor != 2 {
		t.Errorf("uploads = %+v", got)
	}
	if c.Metrics.MaxProjects != 100 {
		t.Errorf("metrics.max_projects = %d: sibling key of an overlaid one lost", c.Metrics.MaxProjects)
	}
	if c.Front.ProjectHeader != "Fairshare-Project" || c.Front.Routes["a.example"] != "alpha" {
		t.Errorf("front = %+v", c.Front)
	}
	if len(c.Front.TrustedPeers) != 0 || c.Front.ExemptMax != 0 || !c.Front.FastPath || !c.Front.IOURing {
		t.Errorf("front trusts %v, exempt_max %d, fast_path %v, io_uring %v by default; want nobody, 0, true and true",
			c.Front.TrustedPeers, c.Front.ExemptMax, c.Front.FastPath, c.Front.IOURing)
	}
	in = `
front:
  fast_path: false
  io_uring: false
  socket: /run/fairshare/front.sock
  trusted_peers: [10.0.0.0/8, "::1", system.slice/edge.service]
  routes: {"status.example": ops}
  exempt: {projects: [probe], routes: [status.example], cgroups: [ops/probes]}
  exempt_max: 2
  limits: {upstream_read_timeout: 0s}
`
	if err := Parse(strings.NewReader(in), &c); err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil {
		t.Errorf("upstream_read_timeout 0 (no bound): %v", err)
	}
	f := c.Front
	if f.Limits.UpstreamReadTimeout != 0 || f.Limits.UpstreamHeadTimeout != time.Minute {
		t.Errorf("front.limits = %+v, want upstream_read_timeout 0 and the others kept", f.Limits)
	}
	if !f.Enabled() || f.FastPath || f.IOURing || f.Socket != "/run/fairshare/front.sock" || len(f.TrustedPeers) != 3 || f.ExemptMax != 2 ||
		f.Exempt.Projects[0] != "probe" || f.Exempt.Routes[0] != "status.example" || f.Exempt.Cgroups[0] != "ops/probes" {
		t.Errorf("front = %+v", f)
	}
}

func TestParseRejects(t *testing.T) {
	tests := []struct {
		name, in, field string
	}{
		{"unknown top key", "bogus: 1", "bogus"},
		{"unknown nested key", "metrics: {lisen: x}", "lisen"},
		{"unknown pool key", "pools: {requests: {sise: 3}}", "sise"},
		{"zero size", "pools: {requests: {size: 0}}", "pools.requests.size"},
		{"negative size", "pools: {flights: {size: -1}}", "pools.flights.size"},
		{"floor over size", "pools: {requests: {size: 4, floor: 5}}", "pools.requests.floor"},
		{"negative floor", "pools: {requests: {size: 4, floor: -1}}", "pools.requests.floor"},
		{"negative window", "pools: {requests: {size: 4, window: -1s}}", "pools.requests.window"},
		{"bad pool name", "pools: {Big-Pool: {size: 4}}", "pools.Big-Pool"},
		{"bad destination", `pools: {db: {size: 4, destinations: ["10.0.0.5/24:5432"]}}`, "pools.db.destinations[0]"},
		{"v6 without brackets", `pools: {db: {size: 4, destinations: ["2001:db8::5"]}}`, "pools.db.destinations[0]"},
		{"empty destinations", `pools: {db: {size: 4, destinations: []}}`, "pools.db.destinations"},
		{"built-in destination pool", `pools: {connections: {size: 4, destinations: ["10.0.0.0/8"]}}`, "pools.connections.destinations"},
		{"overlapping destination pools", `pools: {db: {size: 4, destinations: ["10.0.0.5/32:5432"]}, other: {size: 4, destinations: ["[::ffff:10.0.0.5]/128:5432"]}}`, "pools.db and pools.other overlap"},
		{"too many destination pools", `{connections: {max_destination_pools: 1}, pools: {a: {size: 4, destinations: ["10.0.0.1"]}, b: {size: 4, destinations: ["10.0.0.2"]}}}`, "max_destination_pools"},
		{"relative pin dir", "pin_dir: fs/bpf", "pin_dir"},
		{"relative state dir", "state_dir: state", "state_dir"},
		{"relative policies file", "policies_file: policies.yaml", "policies_file"},
		{"relative projects root", "projects_root: sys/fs", "projects_root"},
		{"relative socket", "admin_socket: a.sock", "admin_socket"},
		{"relative permits socket", "permits: {socket: p.sock}", "permits.socket"},
		{"same sockets", "permits: {socket: /run/fairshare/admin.sock}", "permits.socket"},
		{"reconcile", "reconcile: 10ms", "reconcile"},
		{"tick too small", "tick: 1ms", "tick"},
		{"lapse under two ticks", "connections: {lapse_after: 1500ms}", "connections.lapse_after must be 0 (enforce forever) or at least 3s"},
		{"lapse under two ticks of 2s", "{tick: 2s, connections: {lapse_after: 3s}}", "at least 6s"},
		{"negative lapse", "connections: {lapse_after: -1s}", "connections.lapse_after"},
		{"bad duration", "tick: soon", "line 1"},
		{"metrics listen", "metrics: {listen: localhost}", "metrics.listen"},
		{"metrics cap", "metrics: {max_projects: 0}", "metrics.max_projects"},
		{"front without upstream", "front: {listen: '127.0.0.1:1'}", "front.upstream"},
		{"front bad upstream", "front: {listen: '127.0.0.1:1', upstream: 'ftp://x'}", "front.upstream"},
		{"front off, bad upstream", "front: {upstream: 'http//localhost:1'}", "front.upstream"},
		{"front in flight", "front: {listen: '127.0.0.1:1', upstream: 'http://x', max_in_flight: 0}", "front.max_in_flight"},
		// With the front off, every front key is still checked.
		{"front off, in flight", "front: {max_in_flight: -3}", "front.max_in_flight"},
		{"front off, cost unit", "front: {cost_unit: 0s}", "front.cost_unit"},
		{"front off, route", "front: {routes: {'a': '../x'}}", "front.routes"},
		{"front off, limits", "front: {limits: {informational: 0}}", "front.limits.informational"},
		{"front cost unit", "front: {listen: '127.0.0.1:1', upstream: 'http://x', cost_unit: 0s}", "front.cost_unit"},
		{"front route", "front: {listen: '127.0.0.1:1', upstream: 'http://x', routes: {'a': ''}}", "front.routes"},
		{"front socket", "front: {socket: 'f.sock', upstream: 'http://x'}", "front.socket"},
		{"front socket without upstream", "front: {socket: '/run/f.sock'}", "front.upstream"},
		{"front trusted", "front: {listen: '127.0.0.1:1', upstream: 'http://x', trusted_peers: [' ']}", "front.trusted_peers"},
		{"front exempt route", "front: {listen: '127.0.0.1:1', upstream: 'http://x', exempt: {routes: [nope]}}", "front.exempt.routes"},
		{"front exempt entry", "front: {listen: '127.0.0.1:1', upstream: 'http://x', exempt: {projects: ['']}}", "front.exempt"},
		{"front exempt max", "front: {listen: '127.0.0.1:1', upstream: 'http://x', exempt_max: -1}", "front.exempt_max"},
		{"front exempt max over room", "front: {listen: '127.0.0.1:1', upstream: 'http://x', max_in_flight: 2, exempt_max: 3}", "front.exempt_max"},
		{"front upstream head", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {upstream_head_bytes: 100}}", "front.limits.upstream_head_bytes"},
		{"front upstream head huge", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {upstream_head_bytes: 1099511627776}}", "front.limits.upstream_head_bytes"},
		{"front informational", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {informational: 0}}", "front.limits.informational"},
		{"front request head", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {request_head_bytes: -1}}", "front.limits.request_head_bytes"},
		{"front read header timeout", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {read_header_timeout: 0s}}", "front.limits.read_header_timeout"},
		{"front idle timeout", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {idle_timeout: 2h}}", "front.limits.idle_timeout"},
		{"front upstream idle", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {upstream_idle_timeout: 1ms}}", "front.limits.upstream_idle_timeout"},
		{"front upstream idle per project", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {upstream_idle_per_project: 0}}", "front.limits.upstream_idle_per_project"},
		{"front upstream idle per project huge", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {upstream_idle_per_project: 65537}}", "front.limits.upstream_idle_per_project"},
		{"front body read timeout", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {body_read_timeout: 0s}}", "front.limits.body_read_timeout"},
		{"front write timeout", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {write_timeout: 11m}}", "front.limits.write_timeout"},
		{"front upstream head timeout", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {upstream_head_timeout: 1ms}}", "front.limits.upstream_head_timeout"},
		{"front upstream read timeout short", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {upstream_read_timeout: 1ms}}", "front.limits.upstream_read_timeout"},
		{"front upstream read timeout long", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {upstream_read_timeout: 2h}}", "front.limits.upstream_read_timeout"},
		{"front upstream read timeout negative", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {upstream_read_timeout: -1s}}", "front.limits.upstream_read_timeout"},
		{"front tunnel timeout", "front: {listen: '127.0.0.1:1', upstream: 'http://x', limits: {tunnel_timeout: 25h}}", "front.limits.tunnel_timeout"},
		{"front limits key", "front: {limits: {head: 1}}", "head"},
		{"tier", "scheduler: {default_tier: gold}", "scheduler.default_tier"},
		{"shares", "scheduler: {default_shares: 0}", "scheduler.default_shares"},
		{"rate", "scheduler: {p1_rate: -1}", "scheduler.p1_rate"},
		{"zero rate", "scheduler: {p2_rate: 0}", "scheduler.p2_rate"},
		{"burst below one credit", "scheduler: {p2_burst: 0.5}", "scheduler.p2_burst"},
		{"nan burst", "scheduler: {p1_burst: .nan}", "scheduler.p1_burst"},
		// A burst of 1e308 times a project's shares made a bucket of +Inf,
		// and the daemon's status failed to encode (an empty 200).
		{"huge burst", "scheduler: {p1_burst: 1e308}", "scheduler.p1_burst"},
		{"burst past the maximum", "scheduler: {p2_burst: 1000001}", "scheduler.p2_burst"},
		{"huge rate", "scheduler: {p1_rate: 1e308}", "scheduler.p1_rate"},
		{"infinite rate", "scheduler: {p2_rate: .inf}", "scheduler.p2_rate"},
		{"shares past a policy's", "scheduler: {default_shares: 1000001}", "scheduler.default_shares"},
		{"wrong type", "pools: {requests: {size: many}}", "line 1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := Default()
			err := Parse(strings.NewReader(tt.in), &c)
			if err == nil {
				t.Fatalf("accepted %q", tt.in)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error %v does not wrap ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tt.field) {
				t.Errorf("error %q does not name %q", err, tt.field)
			}
		})
	}
}

func TestLoad(t *testing.T) {
	if _, err := Load(filepath.Join(t.TempDir(), "missing.yaml")); err == nil {
		t.Error("a missing file loaded")
	}
	p := filepath.Join(t.TempDir(), "c.yaml")
	if err := os.WriteFile(p, []byte("state_dir: /tmp/x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(p)
	if err != nil {
		t.Fatal(err)
	}
	if c.StateDir != "/tmp/x" {
		t.Errorf("state_dir = %q", c.StateDir)
	}
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(p); err != nil {
		t.Errorf("an empty file should mean the defaults: %v", err)
	}
}

func TestMarshalRoundTrip(t *testing.T) {
	c := Default()
	c.Pools["extra"] = Pool{Size: 3, Window: 2 * time.Second}
	c.Pools["db"] = Pool{Size: 8, Window: time.Second, Destinations: []string{"10.0.0.5/32:5432", "[2001:db8::]/32"}}
	out, err := c.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	back := Default()
	if err := Parse(strings.NewReader(string(out)), &back); err != nil {
		t.Fatalf("printed config does not parse back: %v\n%s", err, out)
	}
	if !reflect.DeepEqual(back.Pools["extra"], c.Pools["extra"]) || !reflect.DeepEqual(back.Pools["db"], c.Pools["db"]) || back.Tick != c.Tick {
		t.Errorf("round trip changed the config:\n%s", out)
	}
}

func TestConnectionsExempt(t *testing.T) {
	c := Default()
	if len(c.Connections.Exempt) != 0 || c.Connections.ExemptMax != 0 {
		t.Fatalf("defaults: %+v", c.Connections)
	}
	good := "connections:\n  exempt: [ops, app/probes]\n  exempt_max: 7\n"
	if err := Parse(strings.NewReader(good), &c); err != nil {
		t.Fatal(err)
	}
	if len(c.Connections.Exempt) != 2 || c.Connections.ExemptMax != 7 {
		t.Fatalf("parsed: %+v", c.Connections)
	}
	for _, bad := range []string{
		"connections: {exempt_max: -1}\n",
		"connections: {exempt_max: 5000}\n", // above the pool's 4096
		"connections: {exempt: [\"\"]}\n",
		"connections: {exempt: [" + strings.Repeat("a,", limits.ExemptCap) + "a]}\n",
	} {
		c := Default()
		if err := Parse(strings.NewReader(bad), &c); !errors.Is(err, ErrInvalid) {
			t.Errorf("%q: %v, want ErrInvalid", bad, err)
		}
	}
}

// The embedded defaults are the packages' defaults: one source of truth, so
// the scheduler's capacity arithmetic (scheduler/doc.go) holds for a node
// running the shipped configuration.
func TestDefaultsAgreeWithPackages(t *testing.T) {
	c := Default()
	s := c.Scheduler
	for _, v := range []struct {
		name      string
		got, want float64
	}{
		{"p1_rate", s.P1Rate, scheduler.DefaultP1Rate}, {"p1_burst", s.P1Burst, scheduler.DefaultP1Burst},
		{"p2_rate", s.P2Rate, scheduler.DefaultP2Rate}, {"p2_burst", s.P2Burst, scheduler.DefaultP2Burst},
	} {
		if v.got != v.want {
			t.Errorf("scheduler.%s = %g in default.yaml, the scheduler package's default is %g", v.name, v.got, v.want)
		}
	}
	if s.Poll != scheduler.DefaultPoll {
		t.Errorf("scheduler.poll = %s, package default %s", s.Poll, scheduler.DefaultPoll)
	}
	for _, name := range c.PoolNames() {
		if w := c.Pools[name].Window; w != pools.DefaultWindow {
			t.Errorf("pools.%s.window = %s, package default %s", name, w, pools.DefaultWindow)
		}
	}
	if c.Front.ProjectHeader != front.DefaultProjectHeader || c.Front.CostHeader != front.DefaultCostHeader ||
		c.Front.CostUnit != front.DefaultCostUnit {
		t.Errorf("front defaults %q %q %s disagree with package front", c.Front.ProjectHeader, c.Front.CostHeader, c.Front.CostUnit)
	}
	if l := c.Front.Limits; l.UpstreamHeadBytes != front.DefaultMaxUpstreamHead || l.Informational != front.DefaultMaxInformational ||
		l.RequestHeadBytes != front.DefaultMaxRequestHead || l.ReadHeaderTimeout != front.DefaultReadHeaderTimeout ||
		l.IdleTimeout != front.DefaultIdleTimeout || l.UpstreamIdleTimeout != front.DefaultUpstreamIdleTimeout ||
		l.UpstreamIdlePerProject != front.DefaultUpstreamIdlePerProject || l.UpstreamReadTimeout != front.DefaultUpstreamReadTimeout {
		t.Errorf("front.limits %+v disagree with package front's defaults", l)
	}
	if c.Metrics.MaxProjects != front.DefaultMaxProjects {
		t.Errorf("metrics.max_projects = %d, front's default %d", c.Metrics.MaxProjects, front.DefaultMaxProjects)
	}
}

// Every scheduler value the configuration accepts, scheduler.New accepts,
// and the other way round for the values a file can state (zero is the
// package's "use the default" and is refused here, see validate).
func TestSchedulerBoundsAgreeWithScheduler(t *testing.T) {
	values := []float64{math.Inf(-1), -1, 0, 1e-9, 0.5, 0.999, 1, 1.5, 40, 1e6, 1e6 + 1, 1e308, math.Inf(1), math.NaN()}
	for _, field := range []string{"p1_rate", "p1_burst", "p2_rate", "p2_burst"} {
		for _, v := range values {
			c := Default()
			sc := scheduler.Config{P1Rate: c.Scheduler.P1Rate, P1Burst: c.Scheduler.P1Burst,
				P2Rate: c.Scheduler.P2Rate, P2Burst: c.Scheduler.P2Burst}
			switch field {
			case "p1_rate":
				c.Scheduler.P1Rate, sc.P1Rate = v, v
			case "p1_burst":
				c.Scheduler.P1Burst, sc.P1Burst = v, v
			case "p2_rate":
				c.Scheduler.P2Rate, sc.P2Rate = v, v
			case "p2_burst":
				c.Scheduler.P2Burst, sc.P2Burst = v, v
			}
			cfgErr := c.Validate()
			_, schedErr := scheduler.New(sc, nil)
			if v == 0 {
				if cfgErr == nil {
					t.Errorf("%s: 0 accepted; the scheduler would silently use its default", field)
				}
				continue
			}
			if (cfgErr == nil) != (schedErr == nil) {
				t.Errorf("%s = %g: config says %v, scheduler.New says %v", field, v, cfgErr, schedErr)
			}
			if cfgErr != nil && !strings.Contains(cfgErr.Error(), "scheduler."+field) {
				t.Errorf("%s = %g: error %q does not name the field", field, v, cfgErr)
			}
		}
	}
}

// The largest rates and bursts the configuration accepts, times the most
// shares a policy may have (or the scheduler takes), keep every balance
// finite: the daemon's status, which shows them, then encodes. A burst of
// 1e308 made a bucket of +Inf and the status an empty answer.
func TestSchedulerBoundsKeepBalancesFinite(t *testing.T) {
	c := Default()
	c.Scheduler.P1Rate, c.Scheduler.P1Burst = MaxSchedulerRate, MaxBurst
	c.Scheduler.P2Rate, c.Scheduler.P2Burst = MaxSchedulerRate, MaxBurst
	if MaxShares != policy.MaxShares {
		t.Fatalf("config.MaxShares %d, policy.MaxShares %d: a default the policies refuse", MaxShares, policy.MaxShares)
	}
	c.Scheduler.DefaultShares = MaxShares
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	s, err := scheduler.New(scheduler.Config{P1Rate: c.Scheduler.P1Rate, P1Burst: c.Scheduler.P1Burst,
		P2Rate: c.Scheduler.P2Rate, P2Burst: c.Scheduler.P2Burst}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s.SetPolicy("policy", scheduler.Policy{Tier: scheduler.TierPro, Shares: policy.MaxShares})
	s.SetPolicy("most", scheduler.Policy{Tier: scheduler.TierPro, Shares: math.MaxInt})
	for _, p := range []string{"policy", "most"} {
		s.Submit(p).Done(1)
	}
	snap := s.Snapshot()
	if len(snap.Participants) != 2 {
		t.Fatalf("participants %+v", snap.Participants)
	}
	for _, p := range snap.Participants {
		if math.IsInf(p.P1, 0) || math.IsInf(p.P2, 0) || p.P1 < MaxBurst {
			t.Errorf("%s: balances %v and %v", p.Participant, p.P1, p.P2)
		}
	}
	if _, err := json.Marshal(snap); err != nil {
		t.Errorf("status does not encode: %v", err)
	}
}

// A project header the front would strip from every request as a client's
// proxy claim is refused when the configuration is read, before the
// daemon writes anything.
func TestProjectHeaderNotAProxyClaim(t *testing.T) {
	headerKeyRefused(t, "project_header", map[string]bool{"X-Real-Ip": false, "x_forwarded_project": false, "Forwarded": false, "X-Tenant": true})
}

// So is a cost header naming a field the relay or the client needs, or one
// of the front's own: the front takes the cost header out of every answer.
func TestCostHeaderNotReserved(t *testing.T) {
	headerKeyRefused(t, "cost_header", map[string]bool{"Content-Length": false, "content-type": false, "Keep-Alive": false, "Date": false,
		"Fairshare-Class": false, "X-Cost": true, "Fairshare-Work-Units": true})
}

// A header name that no field can match (a space, a quote, a colon) is
// refused for either key: it would leave every answer uncharged, or every
// client unnamed.
func TestHeaderKeysAreNames(t *testing.T) {
	for _, key := range []string{"project_header", "cost_header"} {
		headerKeyRefused(t, key, map[string]bool{"'x cost'": false, "'X-Cost:'": false, "'\"X\"'": false, "X-Cost_2": true})
	}
}

// headerKeyRefused sets front.<key> to each header name and checks that
// the configuration is refused, naming the key, exactly when the name's
// value in ok is false.
func headerKeyRefused(t *testing.T, key string, ok map[string]bool) {
	t.Helper()
	for h, fine := range ok {
		c := Default()
		y := "front:\n  listen: 127.0.0.1:1\n  upstream: http://127.0.0.1:2\n  " + key + ": " + h + "\n"
		err := Parse(strings.NewReader(y), &c)
		if fine && err != nil {
			t.Errorf("%s %s: %v", key, h, err)
		}
		if !fine && (!errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), key)) {
			t.Errorf("%s %s: %v, want ErrInvalid naming front.%s", key, h, err, key)
		}
	}
}

// A lapse_after of two ticks or more but under MinLapseAfter was valid
// before the minimum rose: Validate raises it, where refusing it stopped an
// upgraded daemon from starting while the pins it had left lapsed and
// every tenant went unlimited (review).
func TestLapseAfterRaisedNotRefused(t *testing.T) {
	for _, tc := range []struct {
		tick, lapse, want time.Duration
	}{
		{time.Second, 2 * time.Second, 3 * time.Second},
		{time.Second, 2500 * time.Millisecond, 3 * time.Second},
		{2 * time.Second, 4 * time.Second, 6 * time.Second},
		{time.Second, 3 * time.Second, 3 * time.Second},
		{time.Second, 0, 0},
	} {
		c := Default()
		c.Tick, c.Connections.LapseAfter = tc.tick, tc.lapse
		before := c
		if err := c.Validate(); err != nil {
			t.Fatalf("tick %s, lapse_after %s: %v", tc.tick, tc.lapse, err)
		}
		if got := c.Connections.LapseAfter; got != tc.want {
			t.Errorf("tick %s, lapse_after %s: %s after Validate, want %s", tc.tick, tc.lapse, got, tc.want)
		}
		msg, raised := LapseRaised(before, c)
		if raised != (tc.lapse != tc.want) || raised && !strings.Contains(msg, tc.want.String()) {
			t.Errorf("tick %s, lapse_after %s: LapseRaised %v %q", tc.tick, tc.lapse, raised, msg)
		}
	}
}
