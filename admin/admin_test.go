// SPDX-License-Identifier: Apache-2.0

package admin

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/membership"
	"github.com/fairshare-dev/fairshare/policy"
)

// With this variable set, the test binary is a client run as another user: it
// prints the HTTP status it got for GET /v1/status, or "dial: <err>".
const dialEnv = "FAIRSHARE_ADMIN_TEST_DIAL"

func TestMain(m *testing.M) {
	if path := os.Getenv(dialEnv); path != "" {
		hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}}}
		resp, err := hc.Get("http://x/v1/status")
		if err != nil {
			fmt.Println("dial:", err)
			os.Exit(0)
		}
		body, _ := io.ReadAll(resp.Body)
		fmt.Printf("%d %s", resp.StatusCode, body)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// storeBackend is a Backend over a real policy store.
type storeBackend struct {
	s *policy.Store

	mu      sync.Mutex // guards the fields below
	applied map[string]policy.Policy
}

func (b *storeBackend) Status(context.Context) (Status, error) {
	return Status{Version: "test", Pools: []Pool{{Name: "requests", Size: 8}}}, nil
}
func (b *storeBackend) Policies() ([]Entry, error) { return b.s.List() }
func (b *storeBackend) Policy(p string) (Entry, bool, error) {
	pol, found, err := b.s.Get(p)
	return Entry{Project: p, Policy: pol}, found, err
}
func (b *storeBackend) PatchPolicy(project string, pt policy.Patch) (policy.Policy, error) {
	p, err := b.s.Patch(project, pt, policy.Default())
	if err == nil {
		b.mu.Lock()
		b.applied[project] = p
		b.mu.Unlock()
	}
	return p, err
}
func (b *storeBackend) DeletePolicy(p string) (bool, error) { return b.s.Delete(p) }

// The registrations go to the store as they are: the daemon's path
// resolution and conflict checks are its own tests'.
func (b *storeBackend) Projects(context.Context) (Membership, error) {
	ms, err := b.s.Members()
	m := Membership{Members: []Member{}}
	for _, mb := range ms {
		m.Members = append(m.Members, Member{Member: mb, Source: membership.SourceRegistered})
	}
	return m, err
}
func (b *storeBackend) Register(_ context.Context, p string, cgs []string) (Registration, error) {
	if len(cgs) == 0 {
		return Registration{}, fmt.Errorf("%w: no cgroup", ErrInvalid)
	}
	var ms []membership.Member
	for _, cg := range cgs {
		ms = append(ms, membership.Member{Project: p, Cgroup: cg})
	}
	if _, err := b.s.AddMembers(ms, nil); err != nil {
		return Registration{}, err
	}
	return Registration{Project: p, Cgroups: cgs, Added: cgs}, nil
}
func (b *storeBackend) Unregister(_ context.Context, p string, cgs []string) (Registration, error) {
	rm, err := b.s.RemoveMembers(p, cgs)
	reg := Registration{Project: p}
	for _, m := range rm {
		reg.Removed = append(reg.Removed, m.Cgroup)
	}
	return reg, err
}

// brokenStatus is a backend whose status read fails (a map the kernel will
// not read, say), with or without a version of its own (Versioner).
type brokenStatus struct {
	*storeBackend
}

func (brokenStatus) Status(context.Context) (Status, error) {
	return Status{}, errors.New("reading the bpf maps: bad file descriptor")
}

type brokenStatusVersioned struct{ brokenStatus }

func (brokenStatusVersioned) Version() string { return "test" }

// TestHealthWithoutStatus: the health check of a backend that knows its
// version reads no status, so a failing status read (answered 500 on
// /v1/status) does not take the daemon for one that does not answer: the
// CLI's policy commands, which ask the health check first, still reach it.
// A backend without a version is checked by its status, as before.
func TestHealthWithoutStatus(t *testing.T) {
	sock, b := startServer(t)
	ctx := context.Background()
	for _, tc := range []struct {
		b      Backend
		health bool
	}{{brokenStatusVersioned{brokenStatus{b}}, true}, {brokenStatus{b}, false}} {
		ln, err := Listen(sock + "2")
		if err != nil {
			t.Fatal(err)
		}
		sctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		go func() { done <- NewServer(tc.b, nil).Serve(sctx, ln) }()
		c := NewClient(sock + "2")
		err = c.Health(ctx)
		if (err == nil) != tc.health {
			t.Errorf("%T: health %v, want ok %v", tc.b, err, tc.health)
		}
		if _, err := c.Status(ctx); err == nil {
			t.Errorf("%T: the status read did not fail", tc.b)
		}
		if _, err := c.PatchPolicy(ctx, "alpha", policy.Patch{Shares: ptr(2)}); err != nil {
			t.Errorf("%T: a policy write: %v", tc.b, err)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

func startServer(t *testing.T) (string, *storeBackend) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the admin api accepts only root; run the tests as root")
	}
	dir := t.TempDir()
	st, err := policy.Open(filepath.Join(dir, "state"), policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	b := &storeBackend{s: st, applied: map[string]policy.Policy{}}
	sock := filepath.Join(dir, "run", "admin.sock")
	ln, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- NewServer(b, nil).Serve(ctx, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
	return sock, b
}

func ptr[T any](v T) *T { return &v }

func TestAPI(t *testing.T) {
	sock, b := startServer(t)
	ctx := context.Background()
	c := NewClient(sock)
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Errorf("socket mode = %v, want a 0600 socket", fi.Mode())
	}
	if err := c.Health(ctx); err != nil {
		t.Fatal(err)
	}
	if st, err := c.Status(ctx); err != nil || st.Version != "test" || st.Pools[0].Size != 8 {
		t.Fatalf("status = %+v, %v", st, err)
	}
	if _, err := c.Policy(ctx, "alpha"); !errors.Is(err, ErrNotFound) {
		t.Errorf("missing policy: %v", err)
	}
	p, err := c.PatchPolicy(ctx, "alpha", policy.Patch{Tier: ptr("pro"), Shares: ptr(3)})
	if err != nil || p != (policy.Policy{Tier: "pro", Shares: 3}) {
		t.Fatalf("patch = %+v, %v", p, err)
	}
	if b.applied["alpha"] != p {
		t.Errorf("backend applied %+v", b.applied["alpha"])
	}
	var apiErr *APIError
	for _, bad := range []policy.Patch{{Shares: ptr(0)}, {Tier: ptr("gold")}, {WorkPerSec: ptr(-1.0)}} {
		if _, err := c.PatchPolicy(ctx, "alpha", bad); !errors.As(err, &apiErr) || apiErr.Code != 400 {
			t.Errorf("bad patch %+v: %v", bad, err)
		}
	}
	if _, err := c.PatchPolicy(ctx, ".hidden", policy.Patch{Shares: ptr(2)}); !errors.As(err, &apiErr) || apiErr.Code != 400 || !strings.Contains(err.Error(), "project name") {
		t.Errorf("bad project: %v", err)
	}
	if got, _ := c.Policy(ctx, "alpha"); got.Policy != p {
		t.Errorf("bad patches changed the policy to %+v", got)
	}
	list, err := c.Policies(ctx)
	if err != nil || len(list) != 1 || list[0].Project != "alpha" {
		t.Errorf("list = %+v, %v", list, err)
	}
	if err := c.DeletePolicy(ctx, "alpha"); err != nil {
		t.Error(err)
	}
	if err := c.DeletePolicy(ctx, "alpha"); !errors.Is(err, ErrNotFound) {
		t.Errorf("second delete: %v", err)
	}
	// Registrations: stored, listed, a conflict is 409 and bad input 400,
	// removal by cgroup (a repeated query parameter) and a missing one 404.
	if reg, err := c.Register(ctx, "web", []string{"/cg/a", "/cg/b c"}); err != nil || len(reg.Added) != 2 {
		t.Fatalf("register = %+v, %v", reg, err)
	}
	if _, err := c.Register(ctx, "db", []string{"/cg/a"}); !errors.As(err, &apiErr) || apiErr.Code != 409 {
		t.Errorf("a cgroup of another project: %v", err)
	}
	if _, err := c.Register(ctx, "db", nil); !errors.As(err, &apiErr) || apiErr.Code != 400 {
		t.Errorf("no cgroup: %v", err)
	}
	if _, err := c.Register(ctx, "bad name", []string{"/cg/x"}); !errors.As(err, &apiErr) || apiErr.Code != 400 {
		t.Errorf("a bad project: %v", err)
	}
	if m, err := c.Projects(ctx); err != nil || len(m.Members) != 2 || m.Members[1].Cgroup != "/cg/b c" {
		t.Errorf("projects = %+v, %v", m, err)
	}
	if reg, err := c.Unregister(ctx, "web", []string{"/cg/b c", "/cg/a"}); err != nil || len(reg.Removed) != 2 {
		t.Errorf("unregister = %+v, %v", reg, err)
	}
	if _, err := c.Unregister(ctx, "web", []string{"/cg/a"}); !errors.Is(err, ErrNotFound) {
		t.Errorf("unregister again: %v", err)
	}
	// A second daemon must not steal the socket.
	if _, err := Listen(sock); !errors.Is(err, ErrInUse) {
		t.Errorf("listen on a live socket: %v", err)
	}
}

// TestPatchBodiesRefused: the admin API refuses, with 400 and nothing
// stored, what the CLI never sends: an empty patch ({} or null, which
// stored a copy of the default that no longer followed
// scheduler.default_tier), anything after the JSON value (ignored before),
// and a body past 64 KiB (a bare "unexpected EOF" before, now named).
func TestPatchBodiesRefused(t *testing.T) {
	sock, b := startServer(t)
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	patch := func(body string) (int, string) {
		req, _ := http.NewRequest(http.MethodPatch, "http://fairshare/v1/policies/alpha", strings.NewReader(body))
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		msg, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(msg)
	}
	for body, why := range map[string]string{
		"{}":                          "sets nothing",
		"null":                        "sets nothing",
		`{"tier":"pro"} garbage{`:     "more after",
		`{"tier":"pro"}{}`:            "more after",
		`{"tier":"pro"} {"shares":9}`: "more after",
		`{"tier":"pro","x":"` + strings.Repeat("a", 70<<10) + `"}`: "longer than 65536 bytes",
	} {
		if code, msg := patch(body); code != http.StatusBadRequest || !strings.Contains(msg, why) {
			t.Errorf("PATCH %.40q: %d %q, want 400 saying %q", body, code, msg, why)
		}
	}
	if _, ok := b.applied["alpha"]; ok {
		t.Fatalf("a refused patch was applied: %+v", b.applied["alpha"])
	}
	if code, msg := patch("{\"tier\":\"pro\"}\n"); code != http.StatusOK {
		t.Fatalf("a good patch: %d %q", code, msg)
	}
}

func TestNoDaemon(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	if err := NewClient(sock).Health(context.Background()); !errors.Is(err, ErrNoDaemon) {
		t.Errorf("missing socket: %v", err)
	}
	// A stale socket file: Listen replaces it, clients get ErrNoDaemon.
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	if err := NewClient(sock).Health(context.Background()); !errors.Is(err, ErrNoDaemon) {
		t.Errorf("stale socket: %v", err)
	}
	ln, err = Listen(sock)
	if err != nil {
		t.Fatalf("stale socket not replaced: %v", err)
	}
	ln.Close()
}

// runAsNobody runs this test binary as uid/gid 65534 dialling sock.
func runAsNobody(t *testing.T, sock string) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// The go test binary lives in a 0700 build dir; copy it where nobody can run it.
	bin := filepath.Join(t.TempDir(), "admin.test")
	if err := os.Chmod(filepath.Dir(bin), 0o755); err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, src, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-test.run=^$")
	cmd.Env = []string{dialEnv + "=" + sock}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper as nobody: %v: %s", err, out)
	}
	return string(out)
}

func TestRefusesNonRootPeer(t *testing.T) {
	sock, _ := startServer(t)
	// Open the path to others so the connection reaches the server (the
	// directories from t.TempDir are 0700).
	for d := filepath.Dir(sock); d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// With the default 0600 mode the kernel refuses the connect itself.
	if out := runAsNobody(t, sock); !strings.Contains(out, "permission denied") {
		t.Errorf("nobody on a 0600 socket got %q, want permission denied", out)
	}
	// With the mode loosened, SO_PEERCRED still refuses.
	if err := os.Chmod(sock, 0o666); err != nil {
		t.Fatal(err)
	}
	out := runAsNobody(t, sock)
	if !strings.HasPrefix(out, "403 ") || !strings.Contains(out, "only root") {
		t.Errorf("nobody on a 0666 socket got %q, want 403", out)
	}
	// And root still gets in.
	if err := NewClient(sock).Health(context.Background()); err != nil {
		t.Errorf("root after the refusals: %v", err)
	}
}
