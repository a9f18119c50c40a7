// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// pod is a "pod" of a test: a server helper in its own network namespace,
// in a container cgroup below the registered pod cgroup, listening on lo.
type pod struct {
	srv    *helper
	nsPath string
	addr   string
}

func startPod(t *testing.T, ctr string) pod {
	t.Helper()
	srv := startHelperNS(t, ctr, true)
	addr := listenAddr(t, srv.do("listen 127.0.0.1:0"))
	return pod{srv: srv, nsPath: fmt.Sprintf("/proc/%d/ns/net", srv.cmd.Process.Pid), addr: addr}
}

// Inbound admission in network namespaces the test makes, one per pod:
// before AttachNetns a pod's listener is not guarded at the SYN; after it,
// a SYN over the pool is refused with an RST (ECONNREFUSED), accepted
// connections count for the pod's project, and every way a connection ends
// gives its permit back. Reconcile looks into each namespace. A namespace
// that disappears is detached and unpinned by DetachGone.
func TestNetnsInbound(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	d := mkdirs(t, root, "kubepods/pod1", "kubepods/pod1/ctr", "kubepods/pod2", "kubepods/pod2/ctr", "clients")
	// A pool of 5: the pod's handshakes take 4 of it, a floor short.
	l := openMembers(t, root, pin, 5, []Member{{Project: "team-a", Cgroup: d[0]}, {Project: "team-b", Cgroup: d[2]}})
	a := startPod(t, d[1])
	client := startHelperAt(t, d[4], a.nsPath)

	// Not attached: the SYNs pass (the children are counted late, and the
	// ones over the pool are left unaccounted).
	if r := client.dial("tcp4", a.addr, 6); r.ok != 6 {
		t.Fatalf("before attaching: %+v", r)
	}
	client.do("close")
	waitInUse(t, l, 0, map[string]int{"team-a": 0})

	info, err := l.AttachNetns(a.nsPath)
	if err != nil {
		t.Fatal(err)
	}
	if info.Cookie == l.netns || info.Inode == 0 {
		t.Fatalf("%+v (host cookie %d)", info, l.netns)
	}
	if again, err := l.AttachNetns(a.nsPath); err != nil || again.Cookie != info.Cookie {
		t.Fatalf("attaching again: %+v %v", again, err)
	}
	linkPin := filepath.Join(pin, netnsDir, strconv.FormatUint(info.Cookie, 10))
	if _, err := os.Stat(linkPin); err != nil {
		t.Fatalf("link not pinned: %v", err)
	}
	if ns, err := l.Netns(); err != nil || len(ns) != 2 || ns[1].Cookie != info.Cookie {
		t.Fatalf("Netns: %+v %v", ns, err)
	}

	// The pool is the pod's alone: 4 in, 2 refused at the SYN.
	if r := client.dial("tcp4", a.addr, 6); r.ok != 4 || r.refused != 2 {
		t.Fatalf("attached: %+v; %+v", r, snap(t, l))
	}
	waitInUse(t, l, 4, map[string]int{"team-a": 4})
	if s := snap(t, l); s.Events.RefusedIn != 2 {
		t.Fatalf("refusals at the SYN: %+v", s.Events)
	}
	rep, err := l.Reconcile(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if rep.Netns[info.Cookie] != 4 || rep.Kernel["team-a"] != 4 || rep.Held["team-a"] != 4 || len(rep.Repaired) != 0 || len(rep.NetnsSkipped) != 0 {
		t.Fatalf("reconcile: %+v", rep)
	}

	// Release on every path: close, reset, the client killed.
	client.do("close")
	waitInUse(t, l, 0, map[string]int{"team-a": 0})
	if r := client.dial("tcp4", a.addr, 3); r.ok != 3 {
		t.Fatal(r)
	}
	waitInUse(t, l, 3, map[string]int{"team-a": 3})
	client.do("rst")
	waitInUse(t, l, 0, map[string]int{"team-a": 0})
	if r := client.dial("tcp4", a.addr, 3); r.ok != 3 {
		t.Fatal(r)
	}
	waitInUse(t, l, 3, map[string]int{"team-a": 3})
	client.kill()
	waitInUse(t, l, 0, map[string]int{"team-a": 0})

	// A second pod in a namespace of its own counts for its project.
	b := startPod(t, d[3])
	binfo, err := l.AttachNetns(b.nsPath)
	if err != nil {
		t.Fatal(err)
	}
	bclient := startHelperAt(t, d[4], b.nsPath)
	if r := bclient.dial("tcp4", b.addr, 2); r.ok != 2 {
		t.Fatal(r)
	}
	waitInUse(t, l, 2, map[string]int{"team-a": 0, "team-b": 2})

	// The second namespace disappears with its processes: its sockets are
	// gone (permits back) and its link is detached and unpinned.
	bclient.kill()
	b.srv.kill()
	waitInUse(t, l, 0, map[string]int{"team-b": 0})
	var gone []NetnsInfo
	eventually(t, "the namespace's link reports it gone", func() (bool, string) {
		var err error
		gone, err = l.DetachGone()
		if err != nil {
			t.Fatal(err)
		}
		return len(gone) == 1, fmt.Sprint(gone)
	})
	if gone[0].Cookie != binfo.Cookie {
		t.Fatalf("detached %+v, want %+v", gone, binfo)
	}
	if _, err := os.Stat(filepath.Join(pin, netnsDir, strconv.FormatUint(binfo.Cookie, 10))); !os.IsNotExist(err) {
		t.Fatalf("link of the gone namespace still pinned: %v", err)
	}
	if ns, _ := l.Netns(); len(ns) != 2 {
		t.Fatalf("Netns after the detach: %+v", ns)
	}
	if _, err := os.Stat(linkPin); err != nil {
		t.Fatalf("the live namespace's link went too: %v", err)
	}
}

// AttachNetns attaches at most Options.MaxNetns namespaces (a tenant can make
// namespaces; each costs a program instance); a namespace that goes makes
// room again.
func TestNetnsCap(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	o := rootOptions(t, root, Options{PinDir: pin, PoolSize: 10, MaxNetns: 1})
	l, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	d := mkdirs(t, root, "a", "b")
	a, b := startPod(t, d[0]), startPod(t, d[1])
	if _, err := l.AttachNetns(a.nsPath); err != nil {
		t.Fatal(err)
	}
	if _, err := l.AttachNetns(b.nsPath); !errors.Is(err, ErrNetnsFull) {
		t.Fatalf("a second namespace with MaxNetns 1: %v, want ErrNetnsFull", err)
	}
	a.srv.kill()
	eventually(t, "the first namespace detached", func() (bool, string) {
		gone, err := l.DetachGone()
		return err == nil && len(gone) == 1, fmt.Sprint(gone, err)
	})
	if _, err := l.AttachNetns(b.nsPath); err != nil {
		t.Fatalf("after the first went: %v", err)
	}
}

// A restart keeps the namespaces' links: while no limiter runs the pinned
// link keeps refusing, and the next Open takes it up (moved to its own
// program), reconciles into it once it is attached again by path, and
// detaches it when the namespace goes.
func TestNetnsRestart(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	d := mkdirs(t, root, "pod", "pod/ctr", "clients")
	ms := []Member{{Project: "team", Cgroup: d[0]}}
	l := openMembers(t, root, pin, 3, ms) // inbound, 2: a floor short of the pool
	p := startPod(t, d[1])
	info, err := l.AttachNetns(p.nsPath)
	if err != nil {
		t.Fatal(err)
	}
	client := startHelperAt(t, d[2], p.nsPath)
	l.Close()

	if r := client.dial("tcp4", p.addr, 3); r.ok != 2 || r.refused != 1 {
		t.Fatalf("no limiter running: %+v", r)
	}
	o := rootOptions(t, root, Options{PinDir: pin, PoolSize: 3, Floor: 1})
	o.MaxDepth = DefaultMaxDepth
	l2, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Close()
	if got, err := l2.Members(); err != nil || len(got) != 1 || got[0] != ms[0] {
		t.Fatalf("members read back from the pins: %+v %v", got, err)
	}
	ns, err := l2.Netns()
	if err != nil || len(ns) != 2 || ns[1].Cookie != info.Cookie || ns[1].Inode != info.Inode {
		t.Fatalf("after the restart: %+v %v", ns, err)
	}
	waitInUse(t, l2, 2, map[string]int{"team": 2})
	if r := client.dial("tcp4", p.addr, 1); r.refused != 1 {
		t.Fatalf("after the restart: %+v", r)
	}
	rep, err := l2.Reconcile(t.Context())
	if err != nil || rep.NetnsSkipped[info.Cookie] == "" {
		t.Fatalf("a namespace known only by its pin cannot be entered: %+v %v", rep, err)
	}
	if _, err := l2.AttachNetns(p.nsPath); err != nil {
		t.Fatal(err)
	}
	if rep, err = l2.Reconcile(t.Context()); err != nil || rep.Netns[info.Cookie] != 2 || len(rep.NetnsSkipped) != 0 {
		t.Fatalf("reconcile after attaching again: %+v %v", rep, err)
	}
	client.kill()
	p.srv.kill()
	eventually(t, "the namespace detached", func() (bool, string) {
		gone, err := l2.DetachGone()
		if err != nil {
			t.Fatal(err)
		}
		return len(gone) == 1, fmt.Sprint(gone)
	})
	waitInUse(t, l2, 0, map[string]int{"team": 0})
}

// BenchmarkAttachNetns is the cost of inbound admission in one more network
// namespace: loading an instance of the sk_lookup program with the
// namespace's cookie (the verifier's work; the maps are the pinned ones,
// shared) and attaching and pinning its link, per namespace, and the
// kernel memory the instance adds (its program and its .rodata, from
// fdinfo's memlock).
func BenchmarkAttachNetns(b *testing.B) {
	testutil.RequireRoot(b)
	root, pin := newRoot(b), newPinDir(b)
	o := rootOptions(b, root, Options{PinDir: pin, PoolSize: 100})
	l, err := Open(o)
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	// b.N namespaces, each held by a sleeping process until the end.
	paths := make([]string, b.N)
	for i := range paths {
		cmd := exec.Command("sleep", "infinity")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { testutil.Stop(cmd) })
		paths[i] = fmt.Sprintf("/proc/%d/ns/net", cmd.Process.Pid)
	}
	b.ResetTimer()
	for _, p := range paths {
		if _, err := l.AttachNetns(p); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	var mem int
	for _, n := range l.nets {
		mem += memlock(b, n.prog.FD())
		info, err := n.prog.Info()
		if err != nil {
			b.Fatal(err)
		}
		if ids, ok := info.MapIDs(); ok {
			for _, id := range ids {
				m, err := ebpf.NewMapFromID(id)
				if err != nil {
					b.Fatal(err)
				}
				if mi, err := m.Info(); err == nil && strings.HasSuffix(mi.Name, ".rodata") {
					mem += memlock(b, m.FD())
				}
				m.Close()
			}
		}
		break
	}
	b.ReportMetric(float64(mem)/1024, "KiB/netns")
}

// memlock is the memlock fdinfo says for the BPF object fd.
func memlock(b *testing.B, fd int) int {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/self/fdinfo/%d", fd))
	if err != nil {
		b.Fatal(err)
	}
	for _, ln := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(ln, "memlock:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	b.Fatalf("no memlock in fdinfo %d", fd)
	return 0
}

// podBehindNftSocket opens a limiter of a pool of size with project team-a
// (a pod in a network namespace of its own, serving) and a client in no
// project in that namespace, and loads an nftables table named table with
// a socket expression at input in the pod's namespace only (it goes with
// it), so that the kernel looks a SYN's socket up twice.
func podBehindNftSocket(t *testing.T, size uint32, table string) (*Limiter, pod, *helper) {
	t.Helper()
	testutil.RequireRoot(t)
	nft, err := exec.LookPath("nft")
	if err != nil {
		t.Skip("nft is not installed (Debian: apt-get install nftables)")
	}
	root, pin := newRoot(t), newPinDir(t)
	d := mkdirs(t, root, "pod", "pod/ctr", "clients")
	l := openMembers(t, root, pin, size, []Member{{Project: "team-a", Cgroup: d[0]}})
	a := startPod(t, d[1])
	client := startHelperAt(t, d[2], a.nsPath)
	if _, err := l.AttachNetns(a.nsPath); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("nsenter", "--net="+a.nsPath, nft, "-f", "-")
	cmd.Stdin = strings.NewReader("table inet " + table + " {\n chain input {\n type filter hook input priority 0; policy accept;\n" +
		" meta l4proto tcp socket transparent 0 counter\n }\n}\n")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("loading the nftables table in the pod's namespace: %v\n%s", err, out)
	}
	return l, a, client
}

// An nftables rule with a socket expression at input looks the socket of a
// SYN up before TCP does, and each lookup runs sk_lookup: a SYN the rule
// refuses is refused twice. It must be counted (and reported) once.
func TestRefusedSynLookedUpTwice(t *testing.T) {
	l, a, client := podBehindNftSocket(t, 5, "fairshare_test_twice") // inbound, 4: a floor short
	if r := client.dial("tcp4", a.addr, 6); r.ok != 4 || r.refused != 2 {
		t.Fatalf("dial: %+v; %+v", r, snap(t, l))
	}
	waitInUse(t, l, 4, map[string]int{"team-a": 4})
	if s := snap(t, l); s.Events.RefusedIn != 2 || project(s, "team-a").Refused != 2 {
		t.Fatalf("2 SYNs refused, counted %d (node) and %d (project), want 2 and 2", s.Events.RefusedIn, project(s, "team-a").Refused)
	}
	client.do("close")
	waitInUse(t, l, 0, map[string]int{"team-a": 0})
}

// The same nftables rule in front of a project with a rate: each SYN it
// admits is looked up twice, and must take one token, not two (the second
// lookup finding the bucket emptied by the first refused most SYNs: 26
// admitted in 3 s at 50/s, against 200 without the rule), and each SYN the
// rate refuses is counted once.
func TestRatedSynLookedUpTwice(t *testing.T) {
	l, a, client := podBehindNftSocket(t, 4096, "fairshare_test_rated_twice")
	if err := l.SetRate("team-a", 50); err != nil {
		t.Fatal(err)
	}
	r := client.churn("tcp4", a.addr, 3*time.Second, 0)
	checkRate(t, "rated project behind an nft socket rule", r)
	s := snap(t, l)
	if p := project(s, "team-a"); p.RateLimitedIn != uint64(r.refused) || s.Events.RateLimitedIn != uint64(r.refused) || p.Refused != 0 {
		t.Errorf("%d SYNs refused by the rate, counted %d (project) and %d (node), %d by the rule; want %d, %d, 0",
			r.refused, p.RateLimitedIn, s.Events.RateLimitedIn, p.Refused, r.refused, r.refused)
	}
	t.Logf("%v", r)
	client.do("close")
	waitInUse(t, l, 0, map[string]int{"team-a": 0})
}
