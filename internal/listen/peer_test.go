// SPDX-License-Identifier: Apache-2.0

package listen

import (
	"bufio"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/fairshare-dev/fairshare/internal/peercred"
)

func refuseLine(c net.Conn, reason string) { io.WriteString(c, "refused "+reason+"\n") }

// A user with a subordinate uid range (newuidmap lets it run processes as
// any of 65,536 host uids) is one peer: nobody and three of its subordinate
// uids share nobody's three places, while a uid outside every range has its
// own. Before, each uid was a peer of its own, and one user could take a
// whole listener.
func TestSubordinateUIDsAreOnePeer(t *testing.T) {
	needRoot(t)
	subuid := filepath.Join(t.TempDir(), "subuid")
	if err := os.WriteFile(subuid, []byte("nobody:200000:65536\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(publicDir(t), "s.sock")
	ul, _, err := Unix(path, 0o666, -1)
	if err != nil {
		t.Fatal(err)
	}
	l := Wrap(ul, Options{Name: "test", MaxConns: 100, MaxPerPeer: 3, Owners: peercred.NewOwners(subuid), Refuse: refuseLine})
	defer l.Close()
	serve(l)
	open := 0
	for _, uid := range []uint32{200000, 200001, 265535, 65534} {
		h := dialAs(t, path, 2, uid)
		open += h.count("open")
		if h.count("open")+h.count("refused peer_full") != 2 {
			t.Fatalf("uid %d: %q", uid, h.lines)
		}
	}
	if open != 3 {
		t.Errorf("nobody and its subordinate uids hold %d connections, want 3 (one peer)", open)
	}
	if h := dialAs(t, path, 2, 265536); h.count("open") != 2 {
		t.Errorf("a uid just past the range: %q, want both open", h.lines)
	}
	if st := l.Stats(); st.Peers != 2 || st.Open != 5 {
		t.Errorf("stats %+v; want 5 open by 2 peers", st)
	}
}

// Over TCP on loopback the kernel's socket table names the client's user:
// nobody is held to its per-peer cap, another user has its own, and root
// alone gets the reserve. Before, TCP peers had no per-peer cap at all, so
// one local user could hold every place of /metrics or the front's port.
func TestLoopbackTCPPeers(t *testing.T) {
	needRoot(t)
	tl, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	checkLocalTCPPeers(t, tl)
}

// localPeers are the peers checkLocalTCPPeers's listener accepted.
type localPeers struct {
	mu  sync.Mutex
	got []Peer
}

// checkLocalTCPPeers wraps tl with caps of 6 places, 2 of them root's, 2 a
// peer, and checks that local
// users connecting to it are told apart by sock_diag: nobody is held to its
// per-peer cap, another user has its own, and root alone gets the reserve.
// It returns the peers recorded, emptied, for more checks.
func checkLocalTCPPeers(t *testing.T, tl net.Listener) *localPeers {
	t.Helper()
	lp := &localPeers{}
	l := Wrap(tl, Options{Name: "tcp", MaxConns: 6, Reserve: 2, MaxPerPeer: 2,
		Privileged: func(uid uint32) bool { return uid == 0 }, Refuse: refuseLine,
		Classify: func(c net.Conn, p *Peer) { lp.mu.Lock(); lp.got = append(lp.got, *p); lp.mu.Unlock() }})
	t.Cleanup(func() { l.Close() })
	serve(l)
	addr := tl.Addr().String()
	if h := dialNetAs(t, "tcp4", addr, 4, 65534); h.count("open") != 2 || h.count("refused peer_full") != 2 {
		t.Fatalf("nobody: %q; want 2 open, 2 refused peer_full", h.lines)
	}
	if h := dialNetAs(t, "tcp4", addr, 3, 65533); h.count("open") != 2 || h.count("refused listener_full") != 1 {
		t.Fatalf("uid 65533: %q; want 2 open, then the listener full but for root", h.lines)
	}
	if h := dialNetAs(t, "tcp4", addr, 3, 0); h.count("open") != 2 || h.count("refused listener_full") != 1 {
		t.Fatalf("root: %q; want the 2 reserved places", h.lines)
	}
	lp.mu.Lock()
	defer lp.mu.Unlock()
	for _, p := range lp.got {
		if !p.HasUID || p.Key != "uid:"+itoa(p.UID) || p.Cgroup == 0 || p.Privileged != (p.UID == 0) {
			t.Errorf("peer %+v: want its uid and cgroup from sock_diag", p)
		}
	}
	lp.got = nil
	return lp
}

func itoa(u uint32) string { return strconv.FormatUint(uint64(u), 10) }

func TestRemoteKey(t *testing.T) {
	for in, want := range map[string]string{
		"192.0.2.7":            "192.0.2.7",
		"2001:db8:1:2:3:4:5:6": "2001:db8:1:2::/64",
		"2001:db8:1:2:ffff::1": "2001:db8:1:2::/64",
		"::ffff:192.0.2.7":     "192.0.2.7",
		"2001:db8:1:3:3:4:5:6": "2001:db8:1:3::/64",
	} {
		if got := remoteKey(netip.MustParseAddr(in)); got != want {
			t.Errorf("remoteKey(%s) = %s, want %s", in, got, want)
		}
	}
}

// hostAddrEnv runs TestHostAddressTCPPeers's body: the test binary re-run
// in a network namespace of its own.
const hostAddrEnv = "LISTEN_TEST_HOST_ADDR"

// A client of this host that connects to the host's own address (not
// loopback: kubelet probing a host-network pod at the node's address) is
// named by sock_diag as on loopback: root gets the reserve, a local user its
// per-peer cap. Before, it was a remote address, and root's probes shared
// the places with every pod that reaches the node's address; a tenant
// holding them failed the daemon's probes and had it restarted. A client
// from another address of the same host is still an address. In a network
// namespace of the test's own.
func TestHostAddressTCPPeers(t *testing.T) {
	needRoot(t)
	if os.Getenv(hostAddrEnv) == "" {
		cmd := exec.Command(os.Args[0], "-test.run=^TestHostAddressTCPPeers$", "-test.count=1")
		cmd.Env = append(os.Environ(), hostAddrEnv+"=1")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET}
		if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "PASS") {
			t.Fatalf("in a network namespace of its own: %v\n%s", err, out)
		}
		return
	}
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
	// Two addresses of the host that are not loopback ones (on lo: no
	// interface to make, which a kernel without the dummy driver refuses).
	for _, a := range []string{"10.200.0.1/32", "10.200.0.2/32"} {
		addr, _ := netlink.ParseAddr(a)
		if err := netlink.AddrAdd(lo, addr); err != nil {
			t.Fatal(err)
		}
	}
	tl, err := net.Listen("tcp4", "10.200.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	lp := checkLocalTCPPeers(t, tl)
	// From the host's other address: an address, as a remote peer.
	c, err := (&net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("10.200.0.2")}}).Dial("tcp4", tl.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = bufio.NewReader(c).ReadString('\n')
	lp.mu.Lock()
	defer lp.mu.Unlock()
	if len(lp.got) != 1 || lp.got[0].HasUID || lp.got[0].Key != "net:10.200.0.2" {
		t.Errorf("a client from another address: %+v, want the address's peer", lp.got)
	}
}
