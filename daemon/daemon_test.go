// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/fairshare-dev/fairshare/pools"
)

// records is a slog handler keeping every record, at every level.
type records struct {
	mu   sync.Mutex // guards the fields below
	recs []slog.Record
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, rec)
	return nil
}
func (r *records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *records) WithGroup(string) slog.Handler      { return r }

// all is every record logged so far.
func (r *records) all() []slog.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.recs)
}

func (r *records) find(msg string) []slog.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []slog.Record
	for _, rec := range r.recs {
		if rec.Message == msg {
			out = append(out, rec)
		}
	}
	return out
}

// newTestDaemon builds a daemon with real pools, store and scheduler, BPF
// off (its no-bpf mode), no listeners, and a settable clock.
func newTestDaemon(t testing.TB, edit func(*config.Config)) (*Daemon, *testutil.FakeClock, *records) {
	t.Helper()
	dir := t.TempDir()
	cfg := config.Default()
	cfg.BPF = false
	cfg.StateDir = filepath.Join(dir, "state")
	cfg.AdminSocket = filepath.Join(dir, "admin.sock")
	cfg.Permits.Socket = ""
	cfg.Metrics.Listen = ""
	if edit != nil {
		edit(&cfg)
	}
	clk := testutil.NewFakeClock()
	logs := &records{}
	d, err := New(Options{Config: cfg, Version: "test", Log: slog.New(logs), Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d, clk, logs
}

func poolOf(t *testing.T, st admin.Status, name string) admin.Pool {
	t.Helper()
	for _, p := range st.Pools {
		if p.Name == name {
			return p
		}
	}
	t.Fatalf("no pool %q in %+v", name, st.Pools)
	return admin.Pool{}
}

func status(t *testing.T, d *Daemon) admin.Status {
	t.Helper()
	st, err := d.Status(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// Status names every pool, says the kernel is off and shows the effective
// connections floor (5% of 4096), not the configured 0.
func TestStatusAssembly(t *testing.T) {
	d, _, _ := newTestDaemon(t, nil)
	st := status(t, d)
	if st.Kernel || st.Version != "test" {
		t.Errorf("kernel %v version %q", st.Kernel, st.Version)
	}
	var names []string
	for _, p := range st.Pools {
		names = append(names, p.Name)
	}
	if got := strings.Join(names, " "); got != "connections flights requests residents" {
		t.Errorf("pools %q", got)
	}
	conn := poolOf(t, st, config.PoolConnections)
	if conn.Enforcer != "off" || conn.Floor != pools.DefaultFloor(4096) || conn.Floor == 0 {
		t.Errorf("connections %+v; want enforcer off and floor %d", conn, pools.DefaultFloor(4096))
	}
	if poolOf(t, st, config.PoolRequests).Enforcer != "daemon" {
		t.Error("requests not enforced by the daemon")
	}
	if st.DefaultPolicy.Tier != "none" || st.DefaultPolicy.Shares != 1 || st.Policies == nil || st.Rates == nil {
		t.Errorf("default policy %+v policies %v rates %v", st.DefaultPolicy, st.Policies, st.Rates)
	}
}

// The tick recomputes the user-space pools: a second project halves the
// share, and leaving the window gives it back. Share changes log at Debug.
func TestTickRecomputesPools(t *testing.T) {
	d, clk, logs := newTestDaemon(t, func(c *config.Config) {
		c.Pools[config.PoolRequests] = config.Pool{Size: 10, Floor: 1, Window: time.Second}
	})
	a, err := d.requests.TryAcquire("a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.requests.TryAcquire("b"); err != nil {
		t.Fatal(err)
	}
	d.tick(clk.Now())
	if p := poolOf(t, status(t, d), config.PoolRequests); p.Active != 2 || p.Share != 5 {
		t.Fatalf("two projects: active %d share %d, want 2 and 5", p.Active, p.Share)
	}
	if err := d.requests.Release(a); err != nil {
		t.Fatal(err)
	}
	// The daemon ticks every second; the first tick after the release vouches
	// for it, the next finds it a window old.
	for i := 0; i < 2; i++ {
		clk.Advance(time.Second)
		d.tick(clk.Now())
	}
	if p := poolOf(t, status(t, d), config.PoolRequests); p.Active != 1 || p.Share != 10 {
		t.Fatalf("a idle: active %d share %d, want 1 and 10", p.Active, p.Share)
	}
	recs := logs.find("share changed")
	if len(recs) == 0 {
		t.Fatal("no share change logged")
	}
	for _, r := range recs {
		if r.Level != slog.LevelDebug {
			t.Errorf("share change logged at %s, want DEBUG", r.Level)
		}
	}
	// A steady pool logs nothing more.
	n := len(logs.find("share changed"))
	d.tick(clk.Now())
	if m := len(logs.find("share changed")); m != n {
		t.Errorf("a steady tick logged %d share changes", m-n)
	}
}

// H3: pool totals never go down when the pool forgets an idle project.
func TestStatusPoolTotalsSurviveForgetting(t *testing.T) {
	d, clk, _ := newTestDaemon(t, func(c *config.Config) {
		c.Pools[config.PoolFlights] = config.Pool{Size: 1, Floor: 1, Window: time.Second}
	})
	fl := d.others[config.PoolFlights]
	pm, err := fl.TryAcquire("a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fl.TryAcquire("b"); err == nil {
		t.Fatal("full pool admitted")
	}
	if err := fl.Release(pm); err != nil {
		t.Fatal(err)
	}
	before := poolOf(t, status(t, d), config.PoolFlights)
	if before.Admitted != 1 || before.Refused != 1 {
		t.Fatalf("before: %+v", before)
	}
	// The daemon ticks every second; the first tick after the release vouches
	// for it, the next finds it a window old.
	for i := 0; i < 2; i++ {
		clk.Advance(time.Second)
		d.tick(clk.Now())
	}
	clk.Advance(2 * pools.DefaultForget)
	d.tick(clk.Now())
	after := poolOf(t, status(t, d), config.PoolFlights)
	if len(after.Projects) != 0 {
		t.Fatalf("idle projects not forgotten: %+v", after.Projects)
	}
	if after.Admitted != 1 || after.Refused != 1 {
		t.Fatalf("totals went from %d/%d to %d/%d when idle projects were forgotten",
			before.Admitted, before.Refused, after.Admitted, after.Refused)
	}
}

// apply: a stored policy reaches the scheduler and the rate buckets; a
// deleted one puts the project back on the default, in both.
func TestPolicyAppliedAndDeleted(t *testing.T) {
	d, _, _ := newTestDaemon(t, nil)
	pro, three, rps := policy.TierPro, 3, 2.0
	if _, err := d.PatchPolicy("alpha", policy.Patch{Tier: &pro, Shares: &three, RequestsPerSec: &rps}); err != nil {
		t.Fatal(err)
	}
	d.sched.Submit("alpha") // make it a live participant
	participant := func() admin.Participant {
		for _, p := range status(t, d).Scheduler.Participants {
			if p.Participant == "alpha" {
				return p
			}
		}
		t.Fatal("alpha is not a participant")
		return admin.Participant{}
	}
	if p := participant(); p.Tier != "pro" || p.Shares != 3 || p.P1 == 0 {
		t.Fatalf("after set: %+v", p)
	}
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 2 {
		t.Fatalf("rate limits %+v", l)
	}
	// Spend the bucket (burst 2) so a refusal is counted.
	for range 3 {
		d.rates.Allow("alpha")
	}
	found, err := d.DeletePolicy("alpha")
	if err != nil || !found {
		t.Fatalf("delete: %v %v", found, err)
	}
	if p := participant(); p.Tier != "none" || p.Shares != 1 {
		t.Fatalf("after delete: %+v, want the default none x1", p)
	}
	if ok, _ := d.rates.Allow("alpha"); !ok {
		t.Fatal("still rate limited after its policy was deleted")
	}
	// L1: nothing of the deleted policy stays in the scheduler.
	d.sched.DeletePolicy("alpha") // idempotent
	if st := status(t, d); len(st.Policies) != 0 {
		t.Fatalf("policies after delete: %+v", st.Policies)
	}
}

// Rate refusals stay counted when a policy drops its limits (the bucket is
// deleted) and keep adding up when limits return.
func TestRateLimitedNeverGoesDown(t *testing.T) {
	d, _, _ := newTestDaemon(t, nil)
	limited := func() uint64 {
		for _, r := range status(t, d).Rates {
			if r.Project == "alpha" {
				return r.Limited
			}
		}
		return 0
	}
	one, zero := 1.0, 0.0
	if _, err := d.PatchPolicy("alpha", policy.Patch{RequestsPerSec: &one}); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		d.rates.Allow("alpha") // burst 1: one passes, two refused
	}
	if n := limited(); n != 2 {
		t.Fatalf("limited %d, want 2", n)
	}
	if _, err := d.PatchPolicy("alpha", policy.Patch{RequestsPerSec: &zero}); err != nil {
		t.Fatal(err)
	}
	if n := limited(); n != 2 {
		t.Fatalf("limited %d after the limits were dropped, want 2 still", n)
	}
	if _, err := d.PatchPolicy("alpha", policy.Patch{RequestsPerSec: &one}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		d.rates.Allow("alpha")
	}
	if n := limited(); n != 3 {
		t.Fatalf("limited %d, want 3", n)
	}
	if _, err := d.DeletePolicy("alpha"); err != nil {
		t.Fatal(err)
	}
	if n := limited(); n != 3 {
		t.Fatalf("limited %d after delete, want 3", n)
	}
}

// H4: a project with a stored policy that sent nothing lately (or ever)
// still shows its policy in the status; the scheduler's live view is not
// the source.
func TestStatusListsStoredPoliciesOfIdleProjects(t *testing.T) {
	d, clk, _ := newTestDaemon(t, nil)
	lite, two := policy.TierLite, 2
	if _, err := d.PatchPolicy("quiet", policy.Patch{Tier: &lite, Shares: &two}); err != nil {
		t.Fatal(err)
	}
	d.sched.Submit("busy") // a live participant beside the idle one
	st := status(t, d)
	if len(st.Policies) != 1 || st.Policies[0].Project != "quiet" || st.Policies[0].Tier != "lite" || st.Policies[0].Shares != 2 {
		t.Fatalf("policies %+v", st.Policies)
	}
	for _, p := range st.Scheduler.Participants {
		if p.Participant == "quiet" {
			t.Fatalf("quiet is live: %+v", p)
		}
	}
	clk.Advance(time.Minute)
	if st := status(t, d); len(st.Policies) != 1 {
		t.Fatalf("policies %+v after idling", st.Policies)
	}
}

// The loader's "pins changed layout while loading" errors become one
// sentence naming the directory and the remedy (a start again, not cleanup), told apart with
// ErrStalePins; other load errors keep their full text.
func TestLoadError(t *testing.T) {
	for _, sentinel := range []error{loader.ErrPinnedMismatch} {
		err := loadError("/sys/fs/bpf/fs", fmt.Errorf("maps pinned differ: %w", sentinel))
		if !errors.Is(err, ErrStalePins) || !errors.Is(err, sentinel) {
			t.Errorf("%v: not ErrStalePins and %v", err, sentinel)
		}
		if !strings.HasPrefix(err.Error(), "the maps pinned in /sys/fs/bpf/fs changed layout while the daemon loaded the programs "+
			"against them (another process at work on the pin directory); start it again once that is done") {
			t.Errorf("message %q", err)
		}
	}
	// A real verifier refusal: its log must reach the message.
	prog, verr := ebpf.NewProgram(&ebpf.ProgramSpec{Type: ebpf.SocketFilter, License: "GPL",
		Instructions: asm.Instructions{asm.Mov.Reg(asm.R0, asm.R2), asm.Return()}})
	if verr == nil {
		prog.Close()
		t.Fatal("the kernel accepted a read of an uninitialised register")
	}
	var ve *ebpf.VerifierError
	if !errors.As(verr, &ve) {
		t.Skipf("no verifier error to test with (unprivileged?): %v", verr)
	}
	err := loadError("/x", fmt.Errorf("loading objects: program fs_connect: %w", verr))
	if errors.Is(err, ErrStalePins) || !errors.As(err, &ve) {
		t.Errorf("%v: wrong classification", err)
	}
	if !strings.Contains(err.Error(), "R2 !read_ok") {
		t.Errorf("the verifier log is lost: %q", err)
	}
}

// frontConfig passes every front key on: with each key of the daemon's
// front section set, no field of front.Config is left at its zero value
// but the two the daemon does not offer, and PlainSends follows io_uring.
func TestFrontConfigCopiesEveryKey(t *testing.T) {
	cfg := config.Default()
	fill(t, reflect.ValueOf(&cfg.Front).Elem())
	cfg.Metrics.MaxProjects = 7
	fc := reflect.ValueOf(frontConfig(cfg, "/sys/fs/cgroup/fairshare"))
	for i := range fc.NumField() {
		name := fc.Type().Field(i).Name
		if name == "ForwardProject" || name == "UpstreamH2C" {
			continue
		}
		if name == "PlainSends" {
			continue // front.io_uring's opposite: below
		}
		if fc.Field(i).IsZero() {
			t.Errorf("front.Config.%s is not set from the configuration", name)
		}
	}
	if frontConfig(cfg, "").PlainSends {
		t.Error("front.io_uring true: the fast path sends without its io_uring")
	}
	cfg.Front.IOURing = false
	if !frontConfig(cfg, "").PlainSends {
		t.Error("front.io_uring false: the fast path sends with its io_uring")
	}
	// 0 is no bound, which the front spells below 0 (its 0 is the default).
	cfg.Front.Limits.UpstreamReadTimeout = 0
	if d := frontConfig(cfg, "").UpstreamReadTimeout; d >= 0 {
		t.Errorf("front.limits.upstream_read_timeout 0: the front's is %v, want below 0 (no bound)", d)
	}
}

// fill sets every field of v, recursively, to a value that is not zero.
func fill(t *testing.T, v reflect.Value) {
	t.Helper()
	switch v.Kind() {
	case reflect.Struct:
		for i := range v.NumField() {
			fill(t, v.Field(i))
		}
	case reflect.String:
		v.SetString("x")
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int64:
		v.SetInt(7)
	case reflect.Slice:
		v.Set(reflect.MakeSlice(v.Type(), 1, 1))
		fill(t, v.Index(0))
	case reflect.Map:
		v.Set(reflect.MakeMap(v.Type()))
		v.SetMapIndex(reflect.ValueOf("k").Convert(v.Type().Key()), reflect.ValueOf("x").Convert(v.Type().Elem()))
	default:
		t.Fatalf("fill: %s", v.Kind())
	}
}

// An upstream given with the front off is said to go unused, once: the
// operator who passed --front-upstream without --front-listen learns why no
// request reaches it. With the front on, nothing is said.
func TestUpstreamWithFrontOffWarns(t *testing.T) {
	const msg = "front.upstream is set but the front is off (no front.listen or front.socket): no request reaches it through fairshare"
	_, _, logs := newTestDaemon(t, func(c *config.Config) { c.Front.Upstream = "http://127.0.0.1:1" })
	if got := logs.find(msg); len(got) != 1 || got[0].Level != slog.LevelWarn {
		t.Errorf("front off with an upstream: %d warnings %q, want 1", len(got), msg)
	}
	_, _, logs = newTestDaemon(t, func(c *config.Config) {
		c.Front.Upstream, c.Front.Socket = "http://127.0.0.1:1", filepath.Join(t.TempDir(), "front.sock")
	})
	if got := logs.find(msg); len(got) != 0 {
		t.Errorf("front on: warned %q", msg)
	}
}

// TestReloadNamesWhatNeedsARestart: a reload applies the destination pools
// only; a change to any other setting is named in one warning, so that the
// operator does not believe it applied. An unchanged configuration, read
// again, warns of nothing. Before, only pools were compared, and a changed
// policies_file or events.per_sec was left without a word.
func TestReloadNamesWhatNeedsARestart(t *testing.T) {
	var start config.Config
	d, _, logs := newTestDaemon(t, func(c *config.Config) { start = *c })
	const msg = "reload: a change to these settings needs a restart; they are not applied"
	if err := d.Reload(start); err != nil {
		t.Fatal(err)
	}
	if got := logs.find(msg); len(got) != 0 {
		t.Fatalf("an unchanged configuration warned: %v", got[0])
	}
	next := start
	next.PoliciesFile = filepath.Join(t.TempDir(), "policies.yaml")
	next.Events.PerSec = start.Events.PerSec + 1
	next.Tick = 2 * start.Tick
	if err := d.Reload(next); err != nil {
		t.Fatal(err)
	}
	got := logs.find(msg)
	if len(got) != 1 {
		t.Fatalf("%d warnings, want one naming the settings", len(got))
	}
	var keys string
	got[0].Attrs(func(a slog.Attr) bool {
		if a.Key == "keys" {
			keys = a.Value.String()
		}
		return true
	})
	if keys != "[events.per_sec policies_file tick]" {
		t.Errorf("the warning names %s, want [events.per_sec policies_file tick]", keys)
	}
}
