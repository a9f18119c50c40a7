// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ringDenied reports whether err, newSendRing's, is this process being
// refused io_uring (kernel.io_uring_disabled, a seccomp filter as in some
// container runtimes' defaults): the fast path then sends without it, and
// the tests that need a ring skip.
func ringDenied(err error) bool {
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EACCES) {
		return true
	}
	b, rerr := os.ReadFile("/proc/sys/kernel/io_uring_disabled") // 6.6 and later
	return rerr == nil && strings.TrimSpace(string(b)) != "0"
}

// newTestRing returns a ring, or skips when the kernel refuses this process
// one.
func newTestRing(t *testing.T, entries uint32) *sendRing {
	t.Helper()
	r, err := newSendRing(entries)
	if err != nil {
		if ringDenied(err) {
			t.Skipf("io_uring refused here (%v)", err)
		}
		t.Fatal(err)
	}
	t.Cleanup(r.close)
	return r
}

// tcpPairs returns the descriptors of n connected loopback TCP sockets and
// their peers (tcpPair).
func tcpPairs(t *testing.T, n int) ([]int, []*net.TCPConn) {
	t.Helper()
	fds, peers := make([]int, n), make([]*net.TCPConn, n)
	for i := range n {
		fds[i], peers[i] = tcpPair(t)
	}
	return fds, peers
}

// tcpPair returns the descriptor of a connected loopback TCP socket (closed
// when the test ends) and its peer.
func tcpPair(t *testing.T) (int, *net.TCPConn) {
	t.Helper()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp4", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	p, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); p.Close() })
	f, err := c.(*net.TCPConn).File() // a descriptor of its own
	if err != nil {
		t.Fatal(err)
	}
	fd, err := unix.Dup(int(f.Fd()))
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return fd, p.(*net.TCPConn)
}

// One call sends each buffer to its own socket, whole, and answers for each
// what send(2) with MSG_DONTWAIT would: the bytes taken, part of a buffer
// when the socket has room for part, -EAGAIN when it has none, and the
// error of a socket whose peer reset it; the others are sent all the same.
func TestSendRing(t *testing.T) {
	r := newTestRing(t, 8)
	fds, peers := tcpPairs(t, 5)
	// fds[3]: a send buffer filled while its peer reads nothing.
	_ = unix.SetsockoptInt(fds[3], unix.SOL_SOCKET, unix.SO_SNDBUF, 4096)
	_ = peers[3].SetReadBuffer(4096)
	chunk := make([]byte, 4096)
	for {
		if _, err := unix.SendmsgN(fds[3], chunk, nil, nil, unix.MSG_DONTWAIT); err == unix.EAGAIN {
			break
		} else if err != nil {
			t.Fatal(err)
		}
	}
	// fds[4]: its peer reset it.
	_ = peers[4].SetLinger(0)
	peers[4].Close()
	time.Sleep(50 * time.Millisecond)

	big := bytes.Repeat([]byte("x"), 64<<20) // more than a socket holds
	bufs := [][]byte{[]byte("hello"), []byte("world, and more"), big, []byte("full"), []byte("reset")}
	res := make([]int32, len(bufs))
	if err := r.send(fds, bufs, res); err != nil {
		t.Fatal(err)
	}
	for i, want := range []string{"hello", "world, and more"} {
		if res[i] != int32(len(want)) {
			t.Errorf("send %d: %d, want %d", i, res[i], len(want))
		}
		got := make([]byte, len(want))
		_ = peers[i].SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(peers[i], got); err != nil || string(got) != want {
			t.Errorf("peer %d read %q, %v; want %q", i, got, err, want)
		}
	}
	if res[2] <= 0 || res[2] >= int32(len(big)) {
		t.Errorf("a buffer larger than the socket holds: %d taken of %d, want part of it", res[2], len(big))
	}
	if res[3] != -int32(unix.EAGAIN) {
		t.Errorf("a full socket: %d, want -EAGAIN (%d)", res[3], -int32(unix.EAGAIN))
	}
	if e := unix.Errno(-res[4]); res[4] >= 0 || (e != unix.ECONNRESET && e != unix.EPIPE) {
		t.Errorf("a reset socket: %d, want -ECONNRESET or -EPIPE", res[4])
	}

	// The ring is whole after it: a second call sends again.
	res = res[:1]
	if err := r.send(fds[:1], [][]byte{[]byte("again")}, res); err != nil || res[0] != 5 {
		t.Errorf("second call: %d, %v", res[0], err)
	}
	got := make([]byte, 5)
	if _, err := io.ReadFull(peers[0], got); err != nil || string(got) != "again" {
		t.Errorf("second call: peer read %q, %v", got, err)
	}

	// More sends than the ring has entries: refused, nothing sent.
	many := make([][]byte, 9)
	manyFds := make([]int, 9)
	for i := range many {
		many[i], manyFds[i] = []byte("x"), fds[0]
	}
	if err := r.send(manyFds, many, make([]int32, 9)); err == nil || errors.Is(err, errRingBroken) {
		t.Errorf("9 sends in a ring of 8: %v, want a refusal", err)
	}
	_ = peers[0].SetReadDeadline(time.Now().Add(100 * time.Millisecond))
	if n, _ := peers[0].Read(got); n != 0 {
		t.Errorf("the refused call sent %d bytes", n)
	}
}

// A send the kernel refuses as it takes it (here a buffer address outside
// user memory: EFAULT) stops the call there: the sends before it went out
// and say so, it says why, and the ones after it are unsent (-EAGAIN, for
// send(2) to try), taken back from the queue so that the next call does
// not send them behind the caller's back.
func TestSendRingStopsAtARefusedSend(t *testing.T) {
	if !kernelAtLeast(t, 6, 10) {
		t.Skip("before Linux 6.10 a send's buffer is checked when it is sent, not when it is taken: no refusal to test with")
	}
	r := newTestRing(t, 8)
	fds, peers := tcpPairs(t, 3)
	kernel := uintptr(0xffff_8000_0000_0000) // the kernel's half of the address space
	bad := unsafe.Slice((*byte)(unsafe.Add(unsafe.Pointer(nil), kernel)), 5)
	res := make([]int32, 3)
	if err := r.send(fds, [][]byte{[]byte("hello"), bad, []byte("world")}, res); err != nil {
		t.Fatal(err)
	}
	if res[0] != 5 || res[1] >= 0 || res[1] == sendUnknown || res[2] != -int32(unix.EAGAIN) {
		t.Errorf("results %v, want [5 -errno -EAGAIN]", res)
	}
	got := make([]byte, 5)
	_ = peers[0].SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(peers[0], got); err != nil || string(got) != "hello" {
		t.Errorf("peer 0 read %q, %v", got, err)
	}
	// The next call sends what it is given, and nothing left from before.
	res = res[:1]
	if err := r.send(fds[1:2], [][]byte{[]byte("later")}, res); err != nil || res[0] != 5 {
		t.Fatalf("next call: %v, %v", res, err)
	}
	_ = peers[1].SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(peers[1], got); err != nil || string(got) != "later" {
		t.Errorf("peer 1 read %q, %v", got, err)
	}
	_ = peers[2].SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if n, _ := peers[2].Read(got); n != 0 {
		t.Errorf("the unsent send went out later: peer 2 read %q", got[:n])
	}
}

// kernelAtLeast reports whether the running kernel is major.minor or later.
func kernelAtLeast(t *testing.T, major, minor int) bool {
	t.Helper()
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	var ma, mi int
	if _, err := fmt.Sscanf(unix.ByteSliceToString(u.Release[:]), "%d.%d", &ma, &mi); err != nil {
		t.Fatalf("kernel release %q: %v", unix.ByteSliceToString(u.Release[:]), err)
	}
	return ma > major || ma == major && mi >= minor
}
