// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/cgroup"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// cgroupID returns the id of a cgroup: the inode number of its directory.
func cgroupID(t testing.TB, dir string) uint64 {
	t.Helper()
	id, err := cgroup.ID(dir)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// helperSocket is what the helper process reports about one of its sockets.
type helperSocket struct {
	Name     string
	Cookie   uint64 // getsockopt SO_COOKIE on the process's fd
	Protocol int    // getsockopt SO_PROTOCOL: IPPROTO_TCP or IPPROTO_MPTCP
	Local    netip.AddrPort
	Remote   netip.AddrPort // zero for listeners
}

const helperEnv = "SOCKDIAG_TEST_HELPER"

// startHelper re-executes the test binary as TestHelperProcess inside the
// cgroup dir and returns the sockets it opened. The helper holds them until
// Cleanup, which kills it and waits for it.
func startHelper(t testing.TB, cgroupDir string) []helperSocket {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.v=false")
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	cmd.Stderr = os.Stderr
	stdin, stdout := testutil.Pipes(t, cmd)
	testutil.StartInCgroup(t, cmd, cgroupDir)
	// Registered last, so it runs first: the helper holds its sockets until
	// stdin closes (and the cleanup keeps the pipe reachable until then).
	t.Cleanup(func() { stdin.Close() })

	var socks []helperSocket
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		line := sc.Bytes()
		if bytes.Equal(line, []byte("ready")) {
			return socks
		}
		var s helperSocket
		if err := json.Unmarshal(line, &s); err != nil {
			t.Fatalf("helper said %q: %v", line, err)
		}
		socks = append(socks, s)
	}
	t.Fatalf("helper exited before it was ready: %v", sc.Err())
	return nil
}

// TestHelperProcess is not a test: startHelper runs the test binary with
// helperEnv set, and then this opens sockets, describes them on stdout and
// holds them until stdin closes.
func TestHelperProcess(t *testing.T) {
	if os.Getenv(helperEnv) != "1" {
		t.Skip("helper process only")
	}
	if err := runHelper(os.Stdout, os.Stdin); err != nil {
		os.Stderr.WriteString("helper: " + err.Error() + "\n")
		os.Exit(2)
	}
	os.Exit(0)
}

func runHelper(out io.Writer, in io.Reader) error {
	enc := json.NewEncoder(out)
	var keep []any // keep every socket open (and reachable) until we exit
	report := func(name string, c syscall.Conn, local, remote net.Addr) error {
		raw, err := c.SyscallConn()
		if err != nil {
			return err
		}
		s := helperSocket{Name: name}
		var serr error
		err = raw.Control(func(fd uintptr) {
			s.Cookie, serr = unix.GetsockoptUint64(int(fd), unix.SOL_SOCKET, unix.SO_COOKIE)
			if serr == nil {
				s.Protocol, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PROTOCOL)
			}
		})
		if err = errors.Join(err, serr); err != nil {
			return err
		}
		s.Local = local.(*net.TCPAddr).AddrPort()
		if remote != nil {
			s.Remote = remote.(*net.TCPAddr).AddrPort()
		}
		keep = append(keep, c)
		return enc.Encode(s)
	}
	// pair opens a listener, one connection to it and its accepted end.
	pair := func(prefix, addr string, listenMPTCP, dialMPTCP bool) error {
		var lc net.ListenConfig
		lc.SetMultipathTCP(listenMPTCP)
		ln, err := lc.Listen(context.Background(), "tcp", addr)
		if err != nil {
			return err
		}
		tl := ln.(*net.TCPListener)
		if err := report(prefix+"listener", tl, tl.Addr(), nil); err != nil {
			return err
		}
		var d net.Dialer
		d.SetMultipathTCP(dialMPTCP)
		c, err := d.Dial("tcp", tl.Addr().String())
		if err != nil {
			return err
		}
		tc := c.(*net.TCPConn)
		if err := report(prefix+"client", tc, tc.LocalAddr(), tc.RemoteAddr()); err != nil {
			return err
		}
		a, err := tl.AcceptTCP()
		if err != nil {
			return err
		}
		return report(prefix+"accepted", a, a.LocalAddr(), a.RemoteAddr())
	}
	if err := pair("v4-", "127.0.0.1:0", false, false); err != nil {
		return err
	}
	if err := pair("v6-", "[::1]:0", false, false); err != nil {
		return err
	}
	if err := pair("mptcp-", "127.0.0.1:0", true, false); err != nil {
		return err
	}
	if err := pair("mptcp2-", "127.0.0.1:0", true, true); err != nil {
		return err
	}
	if _, err := io.WriteString(out, "ready\n"); err != nil {
		return err
	}
	_, err := io.Copy(io.Discard, in) // hold everything until the test closes stdin
	_ = keep
	return err
}
