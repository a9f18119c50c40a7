// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/internal/proxyclaim"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/pools"
)

// The test binary doubles as a client process that the tests start inside a
// cgroup (TestMain dispatches on clientRoleEnv).
const (
	clientRoleEnv   = "FAIRSHARE_FRONT_TEST_CLIENT" // "tcp:<addr>" or "unix:<path>"
	clientHeaderEnv = "FAIRSHARE_FRONT_TEST_HEADER" // project header to send, if any
	clientRawEnv    = "FAIRSHARE_FRONT_TEST_RAW"    // a raw request to send instead
)

// runRawClient sends each raw request (separated by RS, 0x1e) on its own connection
// and prints a line "<status> <class>|<body>" for each.
func runRawClient(target, raws string) int {
	network, addr, _ := strings.Cut(target, ":")
	for raw := range strings.SplitSeq(raws, "\x1e") {
		fmt.Println(rawExchange(network, addr, raw))
	}
	return 0
}

func rawExchange(network, addr, raw string) string {
	c, err := net.DialTimeout(network, addr, 10*time.Second)
	if err != nil {
		return "0 error " + err.Error()
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, raw); err != nil {
		return "0 error " + err.Error()
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return "0 error " + err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return fmt.Sprintf("%d %s|%s", resp.StatusCode, resp.Header.Get(HeaderClass), strings.ReplaceAll(strings.TrimSpace(string(b)), "\n", " "))
}

// runTestClient sends one GET to the front and prints "<status> <body>".
func runTestClient(target, header string) int {
	network, addr, _ := strings.Cut(target, ":")
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
	req, _ := http.NewRequest("GET", "http://front.test/", nil)
	if header != "" {
		req.Header.Set(DefaultProjectHeader, header)
	}
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	fmt.Printf("%d %s", resp.StatusCode, strings.TrimSpace(string(b)))
	return 0
}

// clientIn runs the client process in cgroup dir (placed there by clone3,
// so it never runs outside it) and returns its status and body.
func clientIn(t *testing.T, dir, target, header string) (int, string) {
	t.Helper()
	return clientInEnv(t, dir, target, clientHeaderEnv+"="+header)
}

// rawClientIn sends raw requests from a client in cgroup dir, each on its
// own connection, and returns a line "<status> <Fairshare-Class>|<body>"
// for each.
func rawClientIn(t *testing.T, dir, target string, raws ...string) []string {
	t.Helper()
	out := clientOutput(t, dir, target, clientRawEnv+"="+strings.Join(raws, "\x1e"))
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	if len(lines) != len(raws) {
		t.Fatalf("client in %s: %d answers to %d requests: %q", dir, len(lines), len(raws), out)
	}
	return lines
}

func clientInEnv(t *testing.T, dir, target, env string) (int, string) {
	t.Helper()
	out := clientOutput(t, dir, target, env)
	var status int
	if _, err := fmt.Sscanf(out, "%d", &status); err != nil {
		t.Fatalf("client output %q", out)
	}
	_, body, _ := strings.Cut(out, " ")
	return status, body
}

// clientOutput runs the client process in cgroup dir with env and returns
// what it printed.
func clientOutput(t *testing.T, dir, target, env string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), clientRoleEnv+"="+target, env)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	testutil.InCgroup(t, cmd, dir)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("client in %s: %v (%s)", dir, err, out)
	}
	return string(out)
}

// targets serves the rig's front on a unix socket too and returns both
// targets of the test client: "unix:<path>" and "tcp:<addr>".
func (r *rig) targets(t *testing.T) (unixTarget, tcpTarget string) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "front.sock")
	ul, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := r.front.Server()
	go func() { _ = srv.Serve(ul) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "unix:" + sock, "tcp:" + strings.TrimPrefix(r.url, "http://")
}

// cgroupMount returns the cgroup2 mount, skipping the test without one or
// without the right to create cgroups.
func cgroupMount(t *testing.T) string {
	t.Helper()
	testutil.RequireRoot(t)
	return testutil.Cgroup2Mount(t)
}

// echoProject answers with the project the front forwarded.
func echoProject(w http.ResponseWriter, req *http.Request) {
	_, _ = io.WriteString(w, "project="+req.Header.Get(DefaultProjectHeader))
}

// TestHeaderTrust: by default nobody may name the project in the header; a
// spoofed header from an untrusted peer is refused with 403 and never reaches
// the upstream, while routes still work; a trusted address may name it.
func TestHeaderTrust(t *testing.T) {
	r := newRig(t, rigOpts{untrusted: true, cfg: Config{ForwardProject: true,
		Routes: map[string]string{"routed.example": "routed"}}}, echoProject)
	resp := r.get(t, "alpha", "/")
	body := readAll(t, resp)
	if resp.StatusCode != http.StatusForbidden || !strings.Contains(body, "not accepted from this peer") {
		t.Errorf("spoofed header from an untrusted peer: %d %q, want 403", resp.StatusCode, body)
	}
	req, _ := http.NewRequest("GET", r.url, nil)
	req.Host = "routed.example"
	req.Header.Set(DefaultProjectHeader, "alpha")
	resp, err := r.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != 200 || body != "project=routed" {
		t.Errorf("routed host with a spoofed header: %d %q, want the route's project", resp.StatusCode, body)
	}
	if got := r.hits.Load(); got != 1 {
		t.Errorf("upstream hits %d, want 1: the refused request reached it", got)
	}
	if n := metricValue(t, r.front, "fairshare_front_untrusted_requests_total"); n != 1 {
		t.Errorf("untrusted requests counted %v, want 1", n)
	}

	trusted := newRig(t, rigOpts{cfg: Config{ForwardProject: true, TrustedPeers: []string{"127.0.0.1/32"}}}, echoProject)
	if body := readAll(t, trusted.get(t, "alpha", "/")); body != "project=alpha" {
		t.Errorf("trusted peer: %q, want project=alpha", body)
	}
	// The front as a handler of a plain http.Server (no connection of
	// its own to look at): a trusted address is trusted all the same.
	plain := httptest.NewServer(trusted.front)
	t.Cleanup(plain.Close)
	req, _ = http.NewRequest("GET", plain.URL, nil)
	req.Header.Set(DefaultProjectHeader, "alpha")
	if resp, err := http.DefaultClient.Do(req); err != nil {
		t.Errorf("trusted peer, the front as a handler: %v", err)
	} else if body := readAll(t, resp); body != "project=alpha" {
		t.Errorf("trusted peer, the front as a handler: %q, want project=alpha", body)
	}
	other := newRig(t, rigOpts{cfg: Config{TrustedPeers: []string{"10.0.0.0/8"}}}, echoProject)
	if resp := other.get(t, "alpha", "/"); resp.StatusCode != http.StatusForbidden {
		t.Errorf("peer outside the trusted CIDR: %d, want 403", resp.StatusCode)
	}
}

// TestCgroupIdentity runs clients in a project's cgroup below a projects
// root and talks to the front over a unix socket and over TCP loopback: the
// project comes from the client's cgroup, a header naming another project is
// refused, and a trusted cgroup outside the root may name any project.
func TestCgroupIdentity(t *testing.T) {
	mount := cgroupMount(t)
	root := testutil.MkCgroup(t, mount, fmt.Sprintf("fairshare-front-test-%d", os.Getpid()))
	web := testutil.MkCgroup(t, root, "web")
	workers := testutil.MkCgroup(t, web, "workers")
	edge := testutil.MkCgroup(t, mount, fmt.Sprintf("fairshare-front-edge-%d", os.Getpid()))
	outside := testutil.MkCgroup(t, mount, fmt.Sprintf("fairshare-front-outside-%d", os.Getpid()))

	r := newRig(t, rigOpts{untrusted: true, cfg: Config{ForwardProject: true, ProjectsRoot: root,
		TrustedPeers: []string{edge}}}, echoProject)
	sock, tcp := r.targets(t)

	for _, tc := range []identityCase{
		{"project cgroup", web, "", 200, "project=web"},
		{"nested cgroup", workers, "", 200, "project=web"},
		{"own name in header", web, "web", 200, "project=web"},
		{"spoofed header", web, "billing", 403, "belongs to project web"},
		{"outside the root", outside, "", 400, "no project"},
		{"outside the root, spoofed", outside, "web", 403, "only trusted peers"},
		{"trusted cgroup", edge, "billing", 200, "project=billing"},
	} {
		for _, target := range []string{sock, tcp} {
			t.Run(tc.name+"/"+target[:strings.Index(target, ":")], func(t *testing.T) {
				status, body := clientIn(t, tc.cgroup, target, tc.header)
				if status != tc.status || !strings.Contains(body, tc.body) {
					t.Errorf("got %d %q, want %d %q", status, body, tc.status, tc.body)
				}
			})
		}
	}
	// Trusted by address (a local edge proxy's loopback): a process of
	// the node outside every project at that address may name any
	// project; one in a project's cgroup is its project's all the same.
	byAddr := newRig(t, rigOpts{untrusted: true, cfg: Config{ForwardProject: true, ProjectsRoot: root,
		TrustedPeers: []string{"127.0.0.1/32"}}}, echoProject)
	_, byAddrTCP := byAddr.targets(t)
	for _, tc := range []identityCase{
		{"host process at a trusted address", outside, "billing", 200, "project=billing"},
		{"project cgroup at a trusted address", web, "", 200, "project=web"},
		{"project cgroup at a trusted address, spoofed", workers, "billing", 403, "belongs to project web"},
	} {
		if status, body := clientIn(t, tc.cgroup, byAddrTCP, tc.header); status != tc.status || !strings.Contains(body, tc.body) {
			t.Errorf("%s: got %d %q, want %d %q", tc.name, status, body, tc.status, tc.body)
		}
	}
	// The same through the daemon's listener (internal/listen), which
	// finds a loopback client's cgroup itself and hands it over: on both
	// paths the client is still a process of this node, its project's,
	// and the listener's class of it is not trusted.
	for _, fast := range []bool{false, true} {
		wr := newRig(t, rigOpts{untrusted: true, cfg: Config{ForwardProject: true, ProjectsRoot: root, FastPath: fast,
			TrustedPeers: []string{"127.0.0.1/32"}}}, echoProject)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		type class struct {
			project string
			trusted bool
		}
		classes := make(chan class, 8)
		wl := listen.Wrap(ln, listen.Options{Name: "front", Classify: func(c net.Conn, p *listen.Peer) {
			project, trusted := wr.front.PeerClass(c, p.Cgroup)
			classes <- class{project, trusted}
		}})
		ctx, cancel := context.WithCancel(context.Background())
		served := make(chan struct{})
		go func() { defer close(served); _ = wr.front.Serve(ctx, wl) }()
		t.Cleanup(func() { cancel(); _ = wl.Close(); <-served })
		for _, tc := range []identityCase{
			{"host process at a trusted address", outside, "billing", 200, "project=billing"},
			{"project cgroup at a trusted address", web, "", 200, "project=web"},
			{"project cgroup at a trusted address, spoofed", workers, "billing", 403, "belongs to project web"},
		} {
			status, body := clientIn(t, tc.cgroup, "tcp:"+ln.Addr().String(), tc.header)
			if status != tc.status || !strings.Contains(body, tc.body) {
				t.Errorf("fast path %v, the daemon's listener, %s: got %d %q, want %d %q", fast, tc.name, status, body, tc.status, tc.body)
			}
			want := class{"web", false}
			if tc.cgroup == outside {
				want = class{"", true}
			}
			if got := <-classes; got != want {
				t.Errorf("fast path %v, %s: the listener's class %+v, want %+v", fast, tc.name, got, want)
			}
		}
	}

	// A project, or a sub-cgroup of one, created just after the index was
	// built (the connections above rebuilt it) is found at its first
	// connection: a miss walks the tree at once.
	late := testutil.MkCgroup(t, root, "late")
	if status, body := clientIn(t, late, tcp, ""); status != 200 || body != "project=late" {
		t.Errorf("new project cgroup: %d %q", status, body)
	}
	for _, target := range []string{sock, tcp} {
		sub := testutil.MkCgroup(t, web, fmt.Sprintf("sub-%d", len(target)))
		if status, body := clientIn(t, sub, target, ""); status != 200 || body != "project=web" {
			t.Errorf("new sub-cgroup of web via %s: %d %q", target, status, body)
		}
	}
}

// TestMembershipIdentity: with the daemon's membership (Deps.ProjectOf) the
// project of a client is the member its cgroup is in at any depth (a pod's
// container, not a child of the projects root), a cgroup in no member has
// none, and one the membership cannot place is an unknown local peer (403),
// never one outside every project whom routes would serve.
func TestMembershipIdentity(t *testing.T) {
	mount := cgroupMount(t)
	top := testutil.MkCgroup(t, mount, fmt.Sprintf("fairshare-front-members-%d", os.Getpid()))
	root := testutil.MkCgroup(t, top, "projects")
	testutil.MkCgroup(t, root, "web")
	pod := testutil.MkCgroup(t, testutil.MkCgroup(t, testutil.MkCgroup(t, top, "kubepods"), "burstable"), "pod1")
	ctr := testutil.MkCgroup(t, pod, "ctr")
	broken := testutil.MkCgroup(t, top, "broken")
	outside := testutil.MkCgroup(t, top, "outside")
	id := func(dir string) uint64 {
		v, err := cgroup.ID(dir)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	members := map[uint64]string{id(pod): "team-a", id(ctr): "team-a"}
	brokenID := id(broken)
	projectOf := func(cg uint64) (string, error) {
		if cg == brokenID {
			return "", errors.New("cgroup gone")
		}
		return members[cg], nil
	}
	r := newRig(t, rigOpts{untrusted: true, cfg: Config{ForwardProject: true, ProjectsRoot: root,
		Routes: map[string]string{"routed.example": "web"}},
		tweak: func(f *Front) { f.deps.ProjectOf = projectOf }}, echoProject)
	sock, tcp := r.targets(t)
	routed := "GET / HTTP/1.1\r\nHost: routed.example\r\nConnection: close\r\n\r\n"
	plain := "GET / HTTP/1.1\r\nHost: front.test\r\nConnection: close\r\n\r\n"
	for _, tc := range []struct {
		name, cgroup, raw, want string
	}{
		{"pod container", ctr, plain, "200|project=team-a"},
		{"pod container, routed host", ctr, routed, "200|project=team-a"},
		{"not placed", broken, routed, "403|"},
		{"outside every member", outside, plain, "400|"},
		{"outside every member, routed host", outside, routed, "200|project=web"},
	} {
		for _, target := range []string{sock, tcp} {
			t.Run(tc.name+"/"+target[:strings.Index(target, ":")], func(t *testing.T) {
				// "<status> <class>|<body>": the status and the body's start.
				got := rawClientIn(t, tc.cgroup, target, tc.raw)[0]
				status, _, _ := strings.Cut(got, " ")
				_, body, _ := strings.Cut(got, "|")
				if !strings.HasPrefix(status+"|"+body, tc.want) {
					t.Errorf("got %q, want %q...", got, tc.want)
				}
			})
		}
	}
}

// TestIdentityUnclaimable: a client in project beta's cgroup sends every
// way a request can name a host, a project or a forwarder: Host (any case,
// with a port), the absolute-form URI, Forwarded, X-Forwarded-*, the
// project header in other cases and with underscores. None makes it count
// as another project or as exempt: each request is beta's (or refused 403
// when it names another project in the header), project alpha's rate bucket
// (one request) is untouched, and the upstream sees no spelling of the
// project header but the front's own.
func TestIdentityUnclaimable(t *testing.T) {
	mount := cgroupMount(t)
	root := testutil.MkCgroup(t, mount, fmt.Sprintf("fairshare-front-claim-%d", os.Getpid()))
	alpha := testutil.MkCgroup(t, root, "alpha")
	beta := testutil.MkCgroup(t, root, "beta")

	r := newRig(t, rigOpts{untrusted: true, cfg: Config{ForwardProject: true, ProjectsRoot: root,
		Routes: map[string]string{"routed.example": "alpha", "exempt.example": "ops"},
		Exempt: Exempt{Routes: []string{"exempt.example"}, Projects: []string{"ops"}},
	}}, func(w http.ResponseWriter, req *http.Request) {
		// Every spelling of the project header that reached the upstream.
		var seen []string
		for k, vv := range req.Header {
			if proxyclaim.Fold(k) == "fairshare-project" {
				seen = append(seen, k+"="+strings.Join(vv, ","))
			}
		}
		_, _ = io.WriteString(w, strings.Join(seen, ";"))
	})
	r.rates.SetLimits("alpha", pools.Limits{RequestsPerSec: 1})
	sock := filepath.Join(t.TempDir(), "front.sock")
	ul, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := r.front.Server()
	go func() { _ = srv.Serve(clientListener{ul}) }()
	t.Cleanup(func() { _ = srv.Close() })
	tcp := "tcp:" + strings.TrimPrefix(r.url, "http://")

	const own = "200 beta" // any class but exempt; the upstream saw only the front's header
	cases := []struct{ name, raw, want string }{
		{"routed Host", "GET / HTTP/1.1\r\nHost: routed.example\r\n\r\n", own},
		{"routed Host, other case and port", "GET / HTTP/1.1\r\nHost: ROUTED.Example:80\r\n\r\n", own},
		{"exempt Host", "GET / HTTP/1.1\r\nHost: exempt.example\r\n\r\n", own},
		{"absolute-form URI", "GET http://exempt.example/ HTTP/1.1\r\nHost: front.test\r\n\r\n", own},
		{"absolute-form URI, routed", "GET http://routed.example/x HTTP/1.1\r\nHost: routed.example\r\n\r\n", own},
		{"Forwarded", "GET / HTTP/1.1\r\nHost: front.test\r\nForwarded: for=10.0.0.1;host=exempt.example\r\n\r\n", own},
		{"X-Forwarded-*", "GET / HTTP/1.1\r\nHost: front.test\r\nX-Forwarded-Host: routed.example\r\nX-Forwarded-For: 10.0.0.1\r\nX-Forwarded-Proto: https\r\n\r\n", own},
		{"header, lower case", "GET / HTTP/1.1\r\nHost: front.test\r\nfairshare-project: alpha\r\n\r\n", "403 |"},
		{"header, upper case, exempt project", "GET / HTTP/1.1\r\nHost: front.test\r\nFAIRSHARE-PROJECT: ops\r\n\r\n", "403 |"},
		{"header with underscores", "GET / HTTP/1.1\r\nHost: front.test\r\nFairshare_Project: alpha\r\n\r\n", own},
		{"underscores and a routed Host", "GET / HTTP/1.1\r\nHost: exempt.example\r\nfairshare_project: ops\r\n\r\n", own},
		{"own name, routed Host", "GET / HTTP/1.1\r\nHost: routed.example\r\nFairshare-Project: beta\r\n\r\n", own},
	}
	var raws []string
	for _, tc := range cases {
		raws = append(raws, tc.raw)
	}
	// One client process per transport sends every case, each on its own
	// connection (a process per case took 25s under the race detector).
	for _, target := range []string{tcp, "unix:" + sock} {
		got := rawClientIn(t, beta, target, raws...)
		for i, tc := range cases {
			var status int
			_, _ = fmt.Sscanf(got[i], "%d", &status)
			_, body, _ := strings.Cut(got[i], " ")
			class, echo, _ := strings.Cut(body, "|")
			where := tc.name + "/" + target[:strings.Index(target, ":")]
			if tc.want == own {
				if status != 200 || class == ClassExempt || echo != "Fairshare-Project=beta" {
					t.Errorf("%s: got %q, want 200 as beta, not exempt, the upstream seeing only the front's header", where, got[i])
				}
			} else if !strings.HasPrefix(got[i], tc.want) {
				t.Errorf("%s: got %q, want %q", where, got[i], tc.want)
			}
		}
	}
	// alpha's bucket was not spent by any of that: its own client passes.
	if got := rawClientIn(t, alpha, tcp, "GET / HTTP/1.1\r\nHost: front.test\r\n\r\n")[0]; !strings.HasPrefix(got, "200 ") ||
		!strings.HasSuffix(got, "|Fairshare-Project=alpha") {
		t.Errorf("alpha's own client: %q, want 200 as alpha", got)
	}
}

// metricValue reads an unlabelled counter or gauge of the front.
func metricValue(t *testing.T, f *Front, name string) float64 {
	t.Helper()
	ms := series(t, f, name)
	if len(ms) != 1 {
		t.Fatalf("metric %s: %d series, want 1", name, len(ms))
	}
	if c := ms[0].GetCounter(); c != nil {
		return c.GetValue()
	}
	return ms[0].GetGauge().GetValue()
}

// BenchmarkPeerIdentity is the per-connection cost of naming a local
// client's project from its cgroup (paid once per connection, not per
// request): sock_diag lookup for TCP loopback, SO_PEERCRED + /proc + stat for
// a unix socket, then the index.
func BenchmarkPeerIdentity(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("needs root to create cgroups")
	}
	root := filepath.Join(testutil.Cgroup2Mount(b), fmt.Sprintf("fairshare-front-bench-%d", os.Getpid()))
	if err := os.Mkdir(root, 0o755); err != nil {
		b.Fatal(err)
	}
	defer unix.Rmdir(root)
	f, err := New(Config{Upstream: "http://x", ProjectsRoot: root}, Deps{})
	if err != nil {
		b.Fatal(err)
	}
	for _, network := range []string{"tcp", "unix"} {
		b.Run(network, func(b *testing.B) {
			addr := "127.0.0.1:0"
			if network == "unix" {
				addr = filepath.Join(b.TempDir(), "s")
			}
			ln, err := net.Listen(network, addr)
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			c, err := net.Dial(network, ln.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close()
			s, err := ln.Accept()
			if err != nil {
				b.Fatal(err)
			}
			defer s.Close()
			ctx := f.connContext(context.Background(), s)
			b.ReportAllocs()
			for b.Loop() {
				p := &peer{conn: s, addr: ctx.Value(peerKey{}).(*peer).addr}
				if f.cgroupOf(p) == 0 {
					b.Fatal("no cgroup")
				}
				_ = f.id.projects.lookup(p.cgroup)
			}
		})
	}
}

// The node's addresses are read at most once a second for the remote
// clients' checks (a netlink dump each read), and each of them is found.
func TestNodeAddrsKept(t *testing.T) {
	addrs, err := net.InterfaceAddrs()
	if err != nil || len(addrs) == 0 {
		t.Fatalf("the node's addresses: %v, %v", addrs, err)
	}
	var c addrCache
	for _, ia := range addrs {
		n, ok := ia.(*net.IPNet)
		if !ok {
			continue
		}
		a, _ := netip.AddrFromSlice(n.IP)
		if local, ok := c.has(a.Unmap()); !local || !ok {
			t.Errorf("%s: local %v, read %v", a, local, ok)
		}
	}
	read := c.at
	if local, _ := c.has(netip.MustParseAddr("192.0.2.1")); local {
		t.Error("192.0.2.1 (TEST-NET-1) taken for the node's")
	}
	if c.at != read {
		t.Error("read again within the second")
	}
	c.at = c.at.Add(-time.Second)
	c.has(netip.MustParseAddr("192.0.2.1"))
	if !c.at.After(read) {
		t.Error("not read again after the second")
	}
}

// identityCase is a request from a process in cgroup, sending header as
// its project, and the answer expected: status, and a part of its body.
type identityCase struct {
	name, cgroup, header string
	status               int
	body                 string
}
