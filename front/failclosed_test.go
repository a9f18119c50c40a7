// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/pools"
)

// peerRoleEnv makes the test binary a hostile local client (see
// runPeerRole): "passfd|<socket>" connects to the front's unix socket, hands
// the connection to fd 3 with SCM_RIGHTS and exits; "rst|<addr>|<request>"
// sends a request over TCP and resets the connection at once (SO_LINGER 0).
const peerRoleEnv = "FAIRSHARE_FRONT_TEST_PEER_ROLE"

func init() {
	if role := os.Getenv(peerRoleEnv); role != "" {
		os.Exit(runPeerRole(role))
	}
}

func runPeerRole(role string) int {
	kind, arg, _ := strings.Cut(role, "|")
	switch kind {
	case "passfd":
		c, err := net.Dial("unix", arg)
		if err != nil {
			fmt.Println(err)
			return 1
		}
		f, err := c.(*net.UnixConn).File()
		if err == nil {
			err = unix.Sendmsg(3, []byte{1}, unix.UnixRights(int(f.Fd())), nil, 0)
		}
		if err != nil {
			fmt.Println(err)
			return 1
		}
		return 0
	case "rst":
		addr, raw, _ := strings.Cut(arg, "|")
		c, err := net.Dial("tcp", addr)
		if err != nil {
			fmt.Println(err)
			return 1
		}
		_, _ = io.WriteString(c, raw)
		_ = c.(*net.TCPConn).SetLinger(0)
		_ = c.Close()
		return 0
	}
	fmt.Println("unknown role", kind)
	return 1
}

// runPeer runs the test binary as a hostile client in cgroup dir and waits
// for it (and so for its exit).
func runPeer(t *testing.T, dir, role string, extra *os.File) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), peerRoleEnv+"="+role)
	if extra != nil {
		cmd.ExtraFiles = []*os.File{extra}
	}
	testutil.InCgroup(t, cmd, dir)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("hostile client: %v %s", err, out)
	}
}

// failClosedRig is a front with projects alpha and beta under a projects
// root, routed.example routed to alpha (whose bucket holds one request) and
// exempt.example an exempt route; nothing is trusted. It serves a unix
// socket as well as TCP.
func failClosedRig(t *testing.T) (r *rig, sock, tcp, alpha, beta string) {
	mount := cgroupMount(t)
	root := testutil.MkCgroup(t, mount, fmt.Sprintf("fairshare-failclosed-%d", os.Getpid()))
	alpha = testutil.MkCgroup(t, root, "alpha")
	beta = testutil.MkCgroup(t, root, "beta")
	r = newRig(t, rigOpts{untrusted: true, cfg: Config{ProjectsRoot: root,
		Routes: map[string]string{"routed.example": "alpha", "exempt.example": "ops"},
		Exempt: Exempt{Routes: []string{"exempt.example"}, Projects: []string{"ops"}},
	}}, func(w http.ResponseWriter, req *http.Request) { _, _ = io.WriteString(w, "ok") })
	r.rates.SetLimits("alpha", pools.Limits{RequestsPerSec: 0.001})
	sock = filepath.Join(t.TempDir(), "front.sock")
	ul, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := r.front.Server()
	go func() { _ = srv.Serve(clientListener{ul}) }()
	t.Cleanup(func() { _ = srv.Close() })
	return r, sock, strings.TrimPrefix(r.url, "http://"), alpha, beta
}

// TestIdentityFailsClosed: a local client whose cgroup the front cannot
// learn is refused, not served as a peer outside every project (whom Host
// routes and exempt routes would serve). Each case is a client in beta that
// asks for a route: (a) the process that connected the unix socket passed
// it on and exited; (b) a TCP client resets its connection right after its
// request (alpha's one-request bucket must stay unspent: alpha's own client
// is served); (c) a sub-cgroup of beta created just after an index walk;
// (d) a TCP client that reaches the front at the node's own non-loopback
// address.
func TestIdentityFailsClosed(t *testing.T) {
	r, sock, tcp, alpha, beta := failClosedRig(t)

	t.Run("unix peer exited", func(t *testing.T) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		mine, theirs := os.NewFile(uintptr(fds[0]), "mine"), os.NewFile(uintptr(fds[1]), "theirs")
		defer mine.Close()
		runPeer(t, beta, "passfd|"+sock, theirs)
		theirs.Close()
		buf, oob := make([]byte, 1), make([]byte, 64)
		_, oobn, _, _, err := unix.Recvmsg(fds[0], buf, oob, 0)
		if err != nil {
			t.Fatal(err)
		}
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil || len(msgs) != 1 {
			t.Fatalf("control message: %v %d", err, len(msgs))
		}
		got, err := unix.ParseUnixRights(&msgs[0])
		if err != nil || len(got) != 1 {
			t.Fatalf("rights: %v %v", got, err)
		}
		f := os.NewFile(uintptr(got[0]), "front")
		c, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.WriteString(c, "GET / HTTP/1.1\r\nHost: exempt.example\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusForbidden || !strings.Contains(string(b), "cannot tell which cgroup") {
			t.Errorf("exited connector, Host exempt.example: got %d %v %q, want 403 naming the unknown cgroup", resp.StatusCode, resp.Header, b)
		}
	})

	t.Run("tcp reset", func(t *testing.T) {
		for range 5 {
			runPeer(t, beta, "rst|"+tcp+"|GET / HTTP/1.1\r\nHost: routed.example\r\n\r\n", nil)
		}
		// The front answers (or fails to) each reset request on its own
		// goroutine; give it the time it takes to have spent a token.
		time.Sleep(200 * time.Millisecond)
		got := rawClientIn(t, alpha, "tcp:"+tcp, "GET / HTTP/1.1\r\nHost: front.test\r\n\r\n")[0]
		if !strings.HasPrefix(got, "200") {
			t.Errorf("alpha's own client after beta's reset requests to alpha's route: %q, want 200", got)
		}
	})

	t.Run("new sub-cgroup", func(t *testing.T) {
		for i, target := range []string{"unix:" + sock, "tcp:" + tcp} {
			// Any request walks the index; the sub-cgroup comes right after.
			_ = rawClientIn(t, beta, target, "GET / HTTP/1.1\r\nHost: front.test\r\n\r\n")
			sub := testutil.MkCgroup(t, beta, fmt.Sprintf("sub%d", i))
			got := rawClientIn(t, sub, target, "GET / HTTP/1.1\r\nHost: exempt.example\r\n\r\n")[0]
			if !strings.HasPrefix(got, "200") || strings.Contains(got, "exempt") {
				t.Errorf("new sub-cgroup of beta via %s, Host exempt.example: %q, want 200 as beta", target, got)
			}
		}
	})

	t.Run("own non-loopback address", func(t *testing.T) {
		ext := nonLoopbackAddr(t)
		l, err := net.Listen("tcp", net.JoinHostPort(ext.String(), "0"))
		if err != nil {
			t.Fatal(err)
		}
		srv := r.front.Server()
		go func() { _ = srv.Serve(clientListener{l}) }()
		t.Cleanup(func() { _ = srv.Close() })
		got := rawClientIn(t, beta, "tcp:"+l.Addr().String(), "GET / HTTP/1.1\r\nHost: exempt.example\r\n\r\n")[0]
		if !strings.HasPrefix(got, "200") || strings.Contains(got, "exempt") {
			t.Errorf("beta via %s, Host exempt.example: %q, want 200 as beta", l.Addr(), got)
		}
	})
}

// nonLoopbackAddr returns an IPv4 address of one of the node's interfaces
// that is not loopback (no traffic leaves the node: a connection to it stays
// local).
func nonLoopbackAddr(t *testing.T) netip.Addr {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap().Is4() && !ip.IsLoopback() {
				return ip.Unmap()
			}
		}
	}
	t.Skip("no non-loopback IPv4 address on this node")
	return netip.Addr{}
}
