// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// newRoot creates a temporary projects root on cgroup2, removed (children
// first) when the test ends.
func newRoot(t testing.TB) string {
	t.Helper()
	return testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-test-")
}

// newPinDir returns a fresh pin directory under /sys/fs/bpf; Cleanup runs at
// the end of the test.
func newPinDir(t testing.TB) string {
	t.Helper()
	if err := ensureBPFFS("/sys/fs/bpf/fairshare-test-probe"); err != nil {
		t.Fatal(err)
	}
	os.Remove("/sys/fs/bpf/fairshare-test-probe")
	dir, err := os.MkdirTemp("/sys/fs/bpf", "fairshare-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := Cleanup(dir); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return dir
}

func openLimiter(t testing.TB, root, pin string, pool, floor uint32) *Limiter {
	t.Helper()
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool, Floor: floor, ReservationTTL: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// fakeMono is a CLOCK_MONOTONIC that a test moves on (Options.Monotonic):
// the kernel's reading plus an offset, or a reading it holds still at.
type fakeMono struct{ off, held atomic.Int64 }

func (m *fakeMono) now() time.Duration {
	if h := m.held.Load(); h != 0 {
		return time.Duration(h)
	}
	return time.Duration(monoNow()) + time.Duration(m.off.Load())
}

// hold stops the clock at its reading now, so that a stamp the programs
// make later is never older than the TTL however slow the machine; the
// next advance lets it run again.
func (m *fakeMono) hold() { m.held.Store(int64(m.now())) }

// holdAt stops the clock at t.
func (m *fakeMono) holdAt(t time.Duration) { m.held.Store(int64(t)) }

// advance moves the clock on by d, from the kernel's reading: it runs again
// if it was held.
func (m *fakeMono) advance(d time.Duration) {
	m.off.Add(int64(d))
	m.held.Store(0)
}

// openLimiterMono is openLimiter with a movable monotonic clock and the
// given reservation TTL.
func openLimiterMono(t testing.TB, root, pin string, pool, floor uint32, ttl time.Duration) (*Limiter, *fakeMono) {
	t.Helper()
	m := &fakeMono{}
	l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool, Floor: floor, ReservationTTL: ttl, Monotonic: m.now})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l, m
}

// mkProject creates a project cgroup below root, and registers it with the
// limiters open on root.
func mkProject(t testing.TB, root, name string) string {
	t.Helper()
	dir := filepath.Join(root, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	testLimiters.Lock()
	ls := slices.Clone(testLimiters.m[root])
	testLimiters.Unlock()
	for _, l := range ls {
		syncDir(t, l, root)
	}
	return dir
}

// testLimiters are the open limiters of each test projects root, which
// mkProject keeps in step with the root's children: the directory source
// of the daemon, as these tests used to get from the loader itself.
var testLimiters = struct {
	sync.Mutex
	m map[string][]*Limiter
}{m: map[string][]*Limiter{}}

// dirMembers makes every child of root a project of its name.
func dirMembers(t testing.TB, root string) []Member {
	t.Helper()
	ents, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	var ms []Member
	for _, e := range ents {
		if e.IsDir() {
			ms = append(ms, Member{Project: e.Name(), Cgroup: filepath.Join(root, e.Name())})
		}
	}
	return ms
}

// syncDir sets l's members to root's children.
func syncDir(t testing.TB, l *Limiter, root string) {
	t.Helper()
	rep, err := l.SetMembers(dirMembers(t, root))
	if err != nil && !errors.Is(err, ErrClosed) {
		t.Fatal(err)
	}
	if len(rep.Refused) > 0 {
		t.Fatalf("members refused: %+v", rep.Refused)
	}
}

// rootOptions sets o up for projects that are the children of root: the
// programs look at the level below it only.
func rootOptions(t testing.TB, root string, o Options) Options {
	t.Helper()
	mnt, err := cgroup.FindMount()
	if err != nil {
		t.Fatal(err)
	}
	level, err := mnt.Level(root)
	if err != nil {
		t.Fatal(err)
	}
	o.BaseLevel, o.MaxDepth = level+1, 1
	return o
}

// openRoot opens a limiter whose projects are the children of root, kept in
// step by mkProject until the test ends.
func openRoot(t testing.TB, root string, o Options) (*Limiter, error) {
	t.Helper()
	l, err := Open(rootOptions(t, root, o))
	if err != nil {
		return nil, err
	}
	syncDir(t, l, root)
	// As the daemon's first tick does after its first SetMembers: adopt
	// what the members had before the programs.
	if _, err := l.Reconcile(context.Background()); err != nil {
		l.Close()
		return nil, err
	}
	testLimiters.Lock()
	testLimiters.m[root] = append(testLimiters.m[root], l)
	testLimiters.Unlock()
	t.Cleanup(func() {
		testLimiters.Lock()
		testLimiters.m[root] = slices.DeleteFunc(testLimiters.m[root], func(x *Limiter) bool { return x == l })
		testLimiters.Unlock()
	})
	return l, nil
}

// helper is a child process (this test binary re-executed) running in a
// project cgroup, driven by lines on its stdin.
type helper struct {
	t   testing.TB
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
}

// pinOneCPU keeps every thread of the helper on one CPU (threads it makes
// later inherit that from the thread that makes them): the kernel hands out
// socket cookies from a batch per CPU, so the helper's sockets, and the
// cookies burn takes, then come from one sequence, in the order it asks.
func (h *helper) pinOneCPU() {
	h.t.Helper()
	var mine, one unix.CPUSet
	if err := unix.SchedGetaffinity(0, &mine); err != nil {
		h.t.Fatal(err)
	}
	for cpu := range runtime.NumCPU() {
		if mine.IsSet(cpu) {
			one.Set(cpu)
			break
		}
	}
	// Twice: a thread made from one not pinned yet, during the first pass.
	for range 2 {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", h.cmd.Process.Pid))
		if err != nil {
			h.t.Fatal(err)
		}
		for _, task := range tasks {
			tid, err := strconv.Atoi(task.Name())
			if err != nil {
				continue
			}
			if err := unix.SchedSetaffinity(tid, &one); err != nil && !errors.Is(err, unix.ESRCH) {
				h.t.Fatalf("pinning the helper's thread %d: %v", tid, err)
			}
		}
	}
}

// startHelper starts a helper in the cgroup dir; it is killed at the end of
// the test.
func startHelper(t testing.TB, dir string) *helper {
	t.Helper()
	return startHelperNS(t, dir, false)
}

// launchHelper starts cmd, a helper process, in the cgroup dir with its
// stdin and stdout as the helper's pipes; it is killed at the end of the
// test.
func launchHelper(t testing.TB, cmd *exec.Cmd, dir string) *helper {
	t.Helper()
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	outp, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	testutil.StartInCgroup(t, cmd, dir)
	return &helper{t: t, cmd: cmd, in: in, out: bufio.NewReader(outp)}
}

// startHelperNS is startHelper, in a new network namespace (with lo up) when
// newNet is set.
func startHelperNS(t testing.TB, dir string, newNet bool) *helper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$")
	cmd.Env = append(os.Environ(), "FAIRSHARE_LOADER_HELPER=1")
	if newNet {
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWNET}
		cmd.Env = append(cmd.Env, "FAIRSHARE_LOADER_LOUP=1")
	}
	return launchHelper(t, cmd, dir)
}

func (h *helper) kill() { testutil.Stop(h.cmd) }

// do sends one command and returns its one-line reply.
func (h *helper) do(format string, args ...any) string {
	h.t.Helper()
	if _, err := fmt.Fprintf(h.in, format+"\n", args...); err != nil {
		h.t.Fatalf("helper: %v", err)
	}
	line, err := h.out.ReadString('\n')
	if err != nil {
		h.t.Fatalf("helper: reading reply to %q: %v", fmt.Sprintf(format, args...), err)
	}
	line = strings.TrimSpace(line)
	if strings.HasPrefix(line, "error") {
		h.t.Fatalf("helper: %q: %s", fmt.Sprintf(format, args...), line)
	}
	return line
}

// dialResult is what a helper's dial command reports.
type dialResult struct{ ok, refused, other int }

// add counts a connect's outcome (err) and reports whether it connected.
func (r *dialResult) add(err error) bool {
	switch {
	case err == nil:
		r.ok++
		return true
	case errors.Is(err, syscall.ECONNREFUSED):
		r.refused++
	default:
		r.other++
	}
	return false
}

func (h *helper) dial(network, addr string, n int) dialResult {
	h.t.Helper()
	return h.dialTimeout(network, addr, n, 3*time.Second)
}

// dialOK dials n connections and fails the test unless all n are
// admitted; who names the dialer in the failure.
func (h *helper) dialOK(network, addr string, n int, who string) {
	h.t.Helper()
	if r := h.dial(network, addr, n); r.ok != n {
		h.t.Fatalf("%s: %d of %d admitted: %+v", who, r.ok, n, r)
	}
}

func (h *helper) dialTimeout(network, addr string, n int, timeout time.Duration) dialResult {
	h.t.Helper()
	var r dialResult
	line := h.do("dial %s %s %d %d", network, addr, n, timeout.Milliseconds())
	if _, err := fmt.Sscanf(line, "dialed %d %d %d", &r.ok, &r.refused, &r.other); err != nil {
		h.t.Fatalf("helper reply %q: %v", line, err)
	}
	return r
}

// redial has the helper open n sockets, each connect()ed k times to first
// (an address that fails at once) and then to second (redial's), and keep
// the connections: the result of the second connects, and the errno names
// of the first ones.
func (h *helper) redial(first, second string, n, k int, nonblock bool) (dialResult, string) {
	h.t.Helper()
	nb := 0
	if nonblock {
		nb = 1
	}
	var r dialResult
	var firsts string
	line := h.do("redial %s %s %d %d %d", first, second, n, k, nb)
	if _, err := fmt.Sscanf(line, "redialed %d %d %d %s", &r.ok, &r.refused, &r.other, &firsts); err != nil {
		h.t.Fatalf("helper reply %q: %v", line, err)
	}
	return r, firsts
}

// TestHelperProcess is the helper's main; it does nothing in a normal run.
func TestHelperProcess(t *testing.T) {
	if os.Getenv("FAIRSHARE_LOADER_HELPER") != "1" {
		t.Skip("helper process only")
	}
	if os.Getenv("FAIRSHARE_LOADER_LOUP") == "1" {
		if err := testutil.LoopbackUp(); err != nil {
			fmt.Fprintln(os.Stderr, "helper: lo up:", err)
			os.Exit(1)
		}
	}
	runHelper(os.Stdin, os.Stdout)
	os.Exit(0)
}

// runHelper serves commands:
//
//	dial <tcp|tcp4|tcp6|mapped|mptcp> <addr> <n> [timeout ms]
//	                                        open n connections and keep them
//	listen <addr>                           listen; accepted connections are
//	                                        held until the peer closes
//	listen-noaccept <addr>                  listen, never accept
//	listen-backlog <addr> <n> [v6only] [reuseport] [accept]
//	                                        listen(n) on a plain TCP socket; never accept,
//	                                        or accept and keep the connections
//	dialfrom <network> <local> <addr>       one connection from a given local address, kept
//	listen-reuseport <addr>                 listen with SO_REUSEPORT, accept as listen
//	unlisten-first                          close the oldest SO_REUSEPORT listener
//	churn <network> <addr> <ms> <pace us>   connect and reset in a loop for ms (rate_test.go)
//	reconnect <addr>                        connect() twice on one non-blocking socket
//	redial <first> <second> <n> <k> <nonblock 0|1>
//	                                        n sockets, each connect()ed k times to first
//	                                        (an address that fails at once), then to
//	                                        second; the connections kept
//	leftovers <first> <n>                   n sockets, each connect()ed once to first (an
//	                                        address that fails at once), kept unconnected
//	connect-leftovers <addr> [keep]         connect those sockets to addr; the connections kept
//	                                        (keep: the refused sockets too, until close)
//	held                                    connections accepted and open
//	close                                   close every dialed connection
//	rst                                     close them with an RST (SO_LINGER 0)
//	unlisten                                close the listeners
//	burn <n>                                make the kernel hand out n socket cookies
//	exit
func runHelper(in io.Reader, out io.Writer) {
	var (
		conns []net.Conn
		ln    net.Listener
		lns   []net.Listener // SO_REUSEPORT listeners, oldest first
		mu    sync.Mutex     // guards held
		held  int
		// listen-backlog sockets, closed by unlisten
		rawLns   []int
		rawConns []int // accepted by listen-backlog ... accept, kept open
		// sockets of leftovers, not connected yet; and those of them
		// refused, kept open by connect-leftovers ... keep until close
		leftovers, refusedFds []int
	)
	sc := bufio.NewScanner(in)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "dial":
			n, _ := strconv.Atoi(f[3])
			timeout := 3 * time.Second
			if len(f) > 4 {
				ms, _ := strconv.Atoi(f[4])
				timeout = time.Duration(ms) * time.Millisecond
			}
			var r dialResult
			for range n {
				if c, err := helperDial(f[1], f[2], timeout); r.add(err) {
					conns = append(conns, c)
				}
			}
			fmt.Fprintf(out, "dialed %d %d %d\n", r.ok, r.refused, r.other)
		case "flood":
			// flood <ip4:port> <ms>: refused connects as fast as one
			// thread makes them (raw syscalls), for ms.
			ap, err := netip.ParseAddrPort(f[1])
			if err != nil {
				fmt.Fprintf(out, "error %v\n", err)
				continue
			}
			ms, _ := strconv.Atoi(f[2])
			sa := &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
			var refused, other int
			for end := time.Now().Add(time.Duration(ms) * time.Millisecond); time.Now().Before(end); {
				fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					other++
					continue
				}
				if err := unix.Connect(fd, sa); errors.Is(err, unix.ECONNREFUSED) {
					refused++
				} else {
					other++
				}
				unix.Close(fd)
			}
			fmt.Fprintf(out, "flooded %d %d\n", refused, other)
		case "listen", "listen-reuseport":
			var err error
			if f[0] == "listen" {
				ln, err = net.Listen("tcp", f[1])
			} else {
				lc := net.ListenConfig{Control: sockOpt(unix.SO_REUSEPORT)}
				if ln, err = lc.Listen(context.Background(), "tcp", f[1]); err == nil {
					lns = append(lns, ln)
				}
			}
			if err != nil {
				fmt.Fprintf(out, "error %v\n", err)
				continue
			}
			go func(ln net.Listener) {
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					mu.Lock()
					held++
					mu.Unlock()
					go func() {
						_, _ = io.Copy(io.Discard, c)
						c.Close()
						mu.Lock()
						held--
						mu.Unlock()
					}()
				}
			}(ln)
			fmt.Fprintf(out, "listening %s\n", ln.Addr())
		case "listen-noaccept":
			// Completed handshakes stay queued for accept().
			var err error
			ln, err = net.Listen("tcp", f[1])
			if err != nil {
				fmt.Fprintf(out, "error %v\n", err)
				continue
			}
			fmt.Fprintf(out, "listening %s\n", ln.Addr())
		case "listen-backlog":
			n, _ := strconv.Atoi(f[2])
			fd, a, err := listenBacklog(f[1], n, slices.Contains(f[3:], "v6only"), slices.Contains(f[3:], "reuseport"))
			if err != nil {
				fmt.Fprintf(out, "error %v\n", err)
				continue
			}
			rawLns = append(rawLns, fd)
			if slices.Contains(f[3:], "accept") {
				go func() {
					for {
						nfd, _, err := unix.Accept(fd)
						if err != nil {
							return
						}
						mu.Lock()
						held++
						rawConns = append(rawConns, nfd)
						mu.Unlock()
					}
				}()
			}
			fmt.Fprintf(out, "listening %s\n", a)
		case "churn":
			ms, _ := strconv.Atoi(f[3])
			us, _ := strconv.Atoi(f[4])
			fmt.Fprintln(out, churnLine(f[1], f[2], time.Duration(ms)*time.Millisecond, time.Duration(us)*time.Microsecond))
		case "dialfrom":
			// dialfrom <network> <local addr:port> <addr>: one connection
			// from a given local address, kept.
			d := net.Dialer{Timeout: 3 * time.Second, LocalAddr: net.TCPAddrFromAddrPort(netip.MustParseAddrPort(f[2])),
				Control: sockOpt(unix.SO_REUSEADDR)}
			c, err := d.Dial(f[1], f[3])
			if err != nil {
				fmt.Fprintf(out, "dialed %v\n", err)
				continue
			}
			conns = append(conns, c)
			fmt.Fprintf(out, "dialed ok\n")
		case "reconnect":
			// Non-blocking connect, then connect() again while the first is
			// in progress: reports the second call's errno.
			fmt.Fprintf(out, "reconnect %s\n", reconnect(f[1]))
		case "leftovers":
			n, _ := strconv.Atoi(f[2])
			sa, fam, err := sockaddrOf(f[1])
			if err != nil {
				fmt.Fprintf(out, "error %v\n", err)
				continue
			}
			for range n {
				fd, err := unix.Socket(fam, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					break
				}
				_ = unix.Connect(fd, sa)
				leftovers = append(leftovers, fd)
			}
			fmt.Fprintf(out, "left %d\n", len(leftovers))
		case "connect-leftovers":
			sa, _, err := sockaddrOf(f[1])
			if err != nil {
				fmt.Fprintf(out, "error %v\n", err)
				continue
			}
			var r dialResult
			for _, fd := range leftovers {
				if r.add(unix.Connect(fd, sa)) {
					file := os.NewFile(uintptr(fd), "leftover")
					if c, err := net.FileConn(file); err == nil {
						conns = append(conns, c)
					}
					file.Close()
				} else if len(f) > 2 && f[2] == "keep" {
					refusedFds = append(refusedFds, fd)
				} else {
					unix.Close(fd)
				}
			}
			leftovers = nil
			fmt.Fprintf(out, "dialed %d %d %d\n", r.ok, r.refused, r.other)
		case "redial":
			n, _ := strconv.Atoi(f[3])
			k, _ := strconv.Atoi(f[4])
			var r dialResult
			firsts := map[string]bool{}
			for range n {
				c, first, err := redial(f[1], f[2], k, f[5] == "1")
				firsts[first] = true
				if r.add(err) {
					conns = append(conns, c)
				}
			}
			fmt.Fprintf(out, "redialed %d %d %d %s\n", r.ok, r.refused, r.other, strings.Join(slices.Sorted(maps.Keys(firsts)), ","))
		case "held":
			mu.Lock()
			fmt.Fprintf(out, "held %d\n", held)
			mu.Unlock()
		case "close", "rst":
			for _, c := range conns {
				if f[0] == "rst" {
					if tc, ok := c.(*net.TCPConn); ok {
						_ = tc.SetLinger(0)
					}
				}
				c.Close()
			}
			conns = nil
			for _, fd := range refusedFds {
				unix.Close(fd)
			}
			refusedFds = nil
			fmt.Fprintln(out, "closed")
		case "burn":
			n, _ := strconv.Atoi(f[1])
			if err := burnCookies(n); err != nil {
				fmt.Fprintf(out, "error %v\n", err)
				continue
			}
			fmt.Fprintln(out, "burnt")
		case "unlisten":
			if ln != nil {
				ln.Close()
			}
			for _, l := range lns {
				l.Close()
			}
			lns = nil
			for _, fd := range rawLns {
				unix.Close(fd)
			}
			rawLns = nil
			fmt.Fprintln(out, "unlistened")
		case "unlisten-first":
			if len(lns) > 0 {
				lns[0].Close()
				lns = lns[1:]
			}
			fmt.Fprintln(out, "unlistened")
		case "exit":
			return
		default:
			fmt.Fprintf(out, "error unknown command %q\n", f[0])
		}
	}
}

// helperDial dials; "mapped" dials an IPv4 address from an AF_INET6 socket
// (::ffff:a.b.c.d), which Go's dialer would turn into an AF_INET one.
func helperDial(network, addr string, timeout time.Duration) (net.Conn, error) {
	if network == "mptcp" {
		d := net.Dialer{Timeout: timeout}
		d.SetMultipathTCP(true)
		return d.Dial("tcp", addr)
	}
	if network != "mapped" {
		return net.DialTimeout(network, addr, timeout)
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, err
	}
	fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	sa := &unix.SockaddrInet6{Port: int(ap.Port()), Addr: netip.AddrFrom16(ap.Addr().As16()).As16()}
	if err := unix.Connect(fd, sa); err != nil {
		unix.Close(fd)
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "mapped")
	defer f.Close()
	return net.FileConn(f)
}

// eventually polls cond until it is true or 10 s have passed: releases
// happen in the kernel asynchronously to the close() that caused them.
func eventually(t testing.TB, what string, cond func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ok, msg := cond()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: %s", what, msg)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func snap(t testing.TB, l *Limiter) Snapshot {
	t.Helper()
	s, err := l.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func project(s Snapshot, name string) ProjectCounters {
	for _, p := range s.Projects {
		if p.Project == name {
			return p
		}
	}
	return ProjectCounters{Project: name}
}

// inUse waits until the node and the named project hold the given counts.
func waitInUse(t testing.TB, l *Limiter, node int, proj map[string]int) {
	t.Helper()
	eventually(t, "in_use", func() (bool, string) {
		s := snap(t, l)
		ok := s.InUse == node
		for name, n := range proj {
			ok = ok && project(s, name).InUse == n
		}
		var resv []string
		err := l.readResv(func(k limiterFsResvKey, v limiterFsResv) {
			resv = append(resv, fmt.Sprintf("%d:%d", k.Cookie, v.Project))
		})
		if err != nil {
			t.Fatal(err)
		}
		return ok, fmt.Sprintf("want node %d projects %v, have %+v; reservations %v", node, proj, s, resv)
	})
}

// sockOpt is a dialer's or listener's Control that turns the SOL_SOCKET
// option opt on.
func sockOpt(opt int) func(_, _ string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, opt, 1)
		}); err != nil {
			return err
		}
		return serr
	}
}

// nodeSpilled is the node's count of entries in the spill tables.
func nodeSpilled(t testing.TB, l *Limiter) int64 {
	t.Helper()
	var n limiterFsPool
	if err := l.objs.FsNode.Lookup(uint32(0), &n); err != nil {
		t.Fatal(err)
	}
	return n.Spilled
}

// sink is a listener outside every project that accepts and holds
// connections until the peer closes them.
func sink(t testing.TB, network, addr string) net.Listener {
	t.Helper()
	var lc net.ListenConfig
	lc.SetMultipathTCP(false)
	ln, err := lc.Listen(t.Context(), network, addr)
	if err != nil {
		t.Fatal(err)
	}
	return testutil.Sink(t, ln)
}

func dialOutside(addr string) (net.Conn, error) {
	return net.DialTimeout("tcp4", addr, 3*time.Second)
}

func reconnect(addr string) string {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return err.Error()
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err.Error()
	}
	// Left open: it keeps its permit until the helper exits.
	sa := &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	first := unix.Connect(fd, sa)
	second := unix.Connect(fd, sa)
	name := func(err error) string {
		if err == nil {
			return "ok"
		}
		if e, ok := err.(unix.Errno); ok {
			return unix.ErrnoName(e)
		}
		return err.Error()
	}
	return name(first) + " " + name(second)
}

// sockaddrOf is addr (ip:port) as a socket address, and its family.
func sockaddrOf(addr string) (unix.Sockaddr, int, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, 0, err
	}
	if ap.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}, unix.AF_INET, nil
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}, unix.AF_INET6, nil
}

// redial makes one socket of second's family, connect()s it k times to
// first, which must fail before the socket leaves TCP_CLOSE (a multicast
// address: ENETUNREACH, no packet sent), then to second, blocking or not,
// and returns the connection, the errno names of the first connects, and
// the second's error.
func redial(first, second string, k int, nonblock bool) (net.Conn, string, error) {
	sa1, _, err := sockaddrOf(first)
	if err != nil {
		return nil, "", err
	}
	sa2, fam, err := sockaddrOf(second)
	if err != nil {
		return nil, "", err
	}
	flags := unix.SOCK_STREAM | unix.SOCK_CLOEXEC
	if nonblock {
		flags |= unix.SOCK_NONBLOCK
	}
	fd, err := unix.Socket(fam, flags, 0)
	if err != nil {
		return nil, "", err
	}
	var names []string
	for range k {
		err := unix.Connect(fd, sa1)
		name := "ok"
		if e, ok := err.(unix.Errno); ok {
			name = unix.ErrnoName(e)
		} else if err != nil {
			name = err.Error()
		}
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	err = unix.Connect(fd, sa2)
	if errors.Is(err, unix.EINPROGRESS) {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		if _, err = unix.Poll(pfd, 3000); err == nil {
			var v int
			if v, err = unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR); err == nil && v != 0 {
				err = unix.Errno(v)
			}
		}
	}
	if err != nil {
		unix.Close(fd)
		return nil, strings.Join(names, "+"), err
	}
	f := os.NewFile(uintptr(fd), "redial")
	c, err := net.FileConn(f)
	f.Close()
	return c, strings.Join(names, "+"), err
}

// burnCookies makes the kernel generate n socket cookies (SO_COOKIE on fresh
// UDP sockets), moving this CPU's cookie sequence on.
func burnCookies(n int) error {
	for range n {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return err
		}
		_, err = unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
		unix.Close(fd)
		if err != nil {
			return err
		}
	}
	return nil
}

// detachLinks detaches every link of l, as if the programs were not there:
// the maps and their counts stay.
func detachLinks(tb testing.TB, l *Limiter) {
	tb.Helper()
	for _, lk := range l.links {
		if err := lk.Unpin(); err != nil {
			tb.Fatal(err)
		}
		lk.Close()
	}
	l.links = nil
}

// attachLinks attaches the programs of objs where l attaches its own (not
// pinned: detachLinks or l.Close undoes it).
func attachLinks(tb testing.TB, l *Limiter, objs *limiterObjects) {
	tb.Helper()
	for _, a := range l.attachments(l.root, objs) {
		lk, err := a.attach()
		if err != nil {
			tb.Fatalf("attaching %s: %v", a.name, err)
		}
		l.links = append(l.links, lk)
	}
}

// listenBacklog listens on addr with a plain TCP socket (not MPTCP, as Go's
// listeners are) and the given backlog, optionally IPV6_V6ONLY, and returns
// the socket and the address it got.
func listenBacklog(addr string, backlog int, v6only, reuseport bool) (int, string, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return -1, "", err
	}
	family := unix.AF_INET6
	var sa unix.Sockaddr = &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
	if ap.Addr().Is4() {
		family = unix.AF_INET
		sa = &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, "", err
	}
	ok := false
	defer func() {
		if !ok {
			unix.Close(fd)
		}
	}()
	if family == unix.AF_INET6 {
		v := 0
		if v6only {
			v = 1
		}
		if err := unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, v); err != nil {
			return -1, "", err
		}
	}
	if reuseport {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEPORT, 1); err != nil {
			return -1, "", err
		}
	}
	if err := unix.Bind(fd, sa); err != nil {
		return -1, "", err
	}
	if err := unix.Listen(fd, backlog); err != nil {
		return -1, "", err
	}
	got, err := unix.Getsockname(fd)
	if err != nil {
		return -1, "", err
	}
	ok = true
	switch g := got.(type) {
	case *unix.SockaddrInet4:
		return fd, netip.AddrPortFrom(netip.AddrFrom4(g.Addr), uint16(g.Port)).String(), nil
	case *unix.SockaddrInet6:
		return fd, netip.AddrPortFrom(netip.AddrFrom16(g.Addr), uint16(g.Port)).String(), nil
	}
	return fd, addr, nil
}

// silence makes the clients on 127.0.0.1 ports lo..hi vanish without a word,
// as a client host that went away does: the resets the kernel sends from
// those ports (in answer to a SYN-ACK for a bare SYN sent with sendSYN) are
// dropped, so the server keeps the request sockets and retransmits. Needs
// nft; the table goes when the test ends. The ports are below the kernel's
// ephemeral range: a listener or a client of the test given one of them
// would have its own resets dropped (a refused SYN then timed out, where
// a reset was due).
func silence(t testing.TB, lo, hi uint16) {
	t.Helper()
	if lo < 1024 || hi >= 32768 {
		t.Fatalf("silence(%d, %d): use ports in 1024..32767, below the ephemeral range", lo, hi)
	}
	testutil.NftTable(t, fmt.Sprintf(`chain out {
	type filter hook output priority 0; policy accept;
	ip saddr 127.0.0.1 tcp sport %d-%d tcp flags & rst == rst meta mark != %d drop
}`, lo, hi, rawMark))
}

// rawMark marks the segments sendSeg sends, which silence lets through.
const rawMark = 0x7a11

// selftest runs one step of fs_selftest (bpf/limiter.c).
func (l *Limiter) selftest(a limiterFsSelftestArgs) (int64, error) {
	buf, err := binary.Append(nil, binary.NativeEndian, &a)
	if err != nil {
		return 0, err
	}
	out := make([]byte, len(buf))
	if _, err := l.objs.FsSelftest.Run(&ebpf.RunOptions{Context: buf, ContextOut: out}); err != nil {
		return 0, err
	}
	var res limiterFsSelftestArgs
	if _, err := binary.Decode(out, binary.NativeEndian, &res); err != nil {
		return 0, err
	}
	return res.Result, nil
}

// Steps of fs_selftest (enum selftest_op in bpf/lib/types.h).
const (
	stPortChange = 2
	stTake       = 3
)

// Places and outcomes of take_permit (bpf/lib/rule.h).
const (
	atSyn   = 2
	atChild = 3

	refused  = 0
	taken    = 1
	notTaken = 2
)

// freePort returns a TCP port that 0.0.0.0 and [::] can both be bound to now,
// below the ephemeral range (32768 and up by default), so that no connect()
// on the host takes it as its local port before a test listens on it.
func freePort(t testing.TB) uint16 {
	t.Helper()
	for p := 24000 + os.Getpid()%4000; ; p++ {
		if p >= 32000 {
			p = 24000
		}
		ok := true
		for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
			fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			var sa unix.Sockaddr = &unix.SockaddrInet4{Port: p}
			if family == unix.AF_INET6 {
				_ = unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0)
				sa = &unix.SockaddrInet6{Port: p}
			}
			err = unix.Bind(fd, sa)
			unix.Close(fd)
			if err != nil {
				ok = false
				break
			}
		}
		if ok {
			return uint16(p)
		}
	}
}

// memberIndex maps every cgroup at or below a member of l to its project.
func memberIndex(t testing.TB, l *Limiter) map[uint64]string {
	t.Helper()
	ms, err := l.Members()
	if err != nil {
		t.Fatal(err)
	}
	index := map[uint64]string{}
	for _, m := range ms {
		if err := cgroup.Walk(m.Cgroup, func(_ string, id uint64) { index[id] = m.Project }); err != nil {
			t.Fatal(err)
		}
	}
	return index
}

// startHelperAt is startHelper in the existing network namespace nsPath
// (entered by nsenter before the helper starts).
func startHelperAt(t testing.TB, dir, nsPath string) *helper {
	t.Helper()
	cmd := exec.Command("nsenter", "--net="+nsPath, "--", os.Args[0], "-test.run=^TestHelperProcess$")
	cmd.Env = append(os.Environ(), "FAIRSHARE_LOADER_HELPER=1")
	return launchHelper(t, cmd, dir)
}
