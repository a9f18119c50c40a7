// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Sink serves ln until the test ends (then closes it): it accepts every
// connection and holds it, reading and discarding, until the peer closes
// it. Tests whose clients only need a peer that answers the handshake and
// stays connected use it. It returns ln.
func Sink(t testing.TB, ln net.Listener) net.Listener {
	t.Helper()
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				_, _ = io.Copy(io.Discard, c)
				c.Close()
			}()
		}
	}()
	return ln
}

// DialAll dials addr n times from the test's own process, each within
// timeout, and keeps the connections made until the test ends. It returns
// how many connected and how many were refused (ECONNREFUSED: an RST, as
// the limiter answers a refused SYN); any other error fails the test.
func DialAll(t testing.TB, addr string, n int, timeout time.Duration) (ok, refused int) {
	t.Helper()
	ok, refused, err := TryDialAll(t, addr, n, timeout)
	if err != nil {
		t.Fatal(err)
	}
	return ok, refused
}

// TryDialAll is DialAll that stops at an error other than a refusal and
// returns it, so that the caller can say what it saw.
func TryDialAll(t testing.TB, addr string, n int, timeout time.Duration) (ok, refused int, err error) {
	for range n {
		c, err := net.DialTimeout("tcp4", addr, timeout)
		if errors.Is(err, syscall.ECONNREFUSED) {
			refused++
			continue
		}
		if err != nil {
			return ok, refused, err
		}
		t.Cleanup(func() { c.Close() })
		ok++
	}
	return ok, refused, nil
}

// LoopbackUp brings lo up in the calling thread's network namespace (a new
// namespace starts with it down).
func LoopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}
