// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"errors"
	"net"
	"net/netip"
	"runtime"
	"testing"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// TestHandleAt reads the socket table of a network namespace the caller is
// not in: a listener made in a fresh namespace is listed (with its cookie
// and cgroup) through a Handle opened there, and not by List in the
// caller's own; a closed Handle refuses instead of falling back to the
// caller's namespace.
func TestHandleAt(t *testing.T) {
	testutil.RequireRoot(t)
	ns, fd, port := listenInNewNetns(t)
	want, err := unix.GetsockoptUint64(fd, unix.SOL_SOCKET, unix.SO_COOKIE)
	if err != nil {
		t.Fatal(err)
	}

	h, err := NewHandleAt(ns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	var found []Socket
	for range 2 { // the handle's socket serves more than one request
		socks, err := h.List(Options{Families: []uint8{unix.AF_INET}, States: StateListen.Mask()})
		if err != nil {
			t.Fatal(err)
		}
		found = byCookie(socks, want)
		if len(found) != 1 || found[0].Src.Port() != port || found[0].CgroupID == 0 {
			t.Fatalf("listener (cookie %d, port %d) in the namespace: %+v", want, port, found)
		}
	}
	host, err := List(Options{Families: []uint8{unix.AF_INET}, States: StateListen.Mask()})
	if err != nil {
		t.Fatal(err)
	}
	if got := byCookie(host, want); len(got) != 0 {
		t.Errorf("the caller's namespace lists the other namespace's listener: %+v", got)
	}
	h.Close()
	if _, err := h.List(Options{}); !errors.Is(err, ErrClosed) {
		t.Errorf("List on a closed handle: %v, want ErrClosed", err)
	}
}

// listenInNewNetns makes a network namespace and an IPv4 listener in it
// (on any address: lo is down there) and returns both; the test's end
// closes them, and with them the namespace.
func listenInNewNetns(t *testing.T) (netns.NsHandle, int, uint16) {
	t.Helper()
	type res struct {
		ns   netns.NsHandle
		fd   int
		port uint16
		err  error
	}
	ch := make(chan res)
	go func() {
		// The thread that enters the namespace is never returned to the
		// pool: it dies with this goroutine.
		runtime.LockOSThread()
		var r res
		defer func() { ch <- r }()
		if r.ns, r.err = netns.New(); r.err != nil {
			return
		}
		r.fd, r.err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		if r.err != nil {
			return
		}
		if r.err = unix.Bind(r.fd, &unix.SockaddrInet4{}); r.err != nil {
			return
		}
		if r.err = unix.Listen(r.fd, 8); r.err != nil {
			return
		}
		sa, err := unix.Getsockname(r.fd)
		r.err = err
		if sa, ok := sa.(*unix.SockaddrInet4); ok {
			r.port = uint16(sa.Port)
		}
	}()
	r := <-ch
	t.Cleanup(func() {
		if r.fd > 0 {
			unix.Close(r.fd)
		}
		r.ns.Close()
	})
	if r.err != nil {
		t.Fatalf("listener in a new network namespace: %v", r.err)
	}
	return r.ns, r.fd, r.port
}

// TestLookupFollowsThreadNetns: Lookup keeps a socket for the namespace it
// is used from most, but a thread in another namespace is answered from its
// own: a connection made there is found there and not from the host.
func TestLookupFollowsThreadNetns(t *testing.T) {
	testutil.RequireRoot(t)
	// The kept socket is made in the host namespace first.
	if _, err := Lookup(netip.MustParseAddrPort("127.0.0.1:1"), netip.MustParseAddrPort("127.0.0.1:2")); !errors.Is(err, ErrNotFound) {
		t.Fatalf("lookup of nothing: %v", err)
	}
	type res struct {
		src, dst netip.AddrPort
		err      error
	}
	ch := make(chan res)
	done := make(chan struct{})
	defer close(done)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread dies with the goroutine
		var r res
		ns, err := netns.New()
		if err != nil {
			ch <- res{err: err}
			return
		}
		defer ns.Close()
		if err := testutil.LoopbackUp(); err != nil {
			ch <- res{err: err}
			return
		}
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			ch <- res{err: err}
			return
		}
		defer ln.Close()
		c, err := net.Dial("tcp4", ln.Addr().String())
		if err != nil {
			ch <- res{err: err}
			return
		}
		defer c.Close()
		r.src = c.LocalAddr().(*net.TCPAddr).AddrPort()
		r.dst = c.RemoteAddr().(*net.TCPAddr).AddrPort()
		_, r.err = Lookup(r.src, r.dst)
		ch <- r
		<-done
	}()
	r := <-ch
	if r.err != nil {
		t.Fatalf("lookup from a thread in the connection's namespace: %v", r.err)
	}
	if s, err := Lookup(r.src, r.dst); !errors.Is(err, ErrNotFound) {
		t.Errorf("the host found another namespace's connection: %+v, %v", s, err)
	}
}
