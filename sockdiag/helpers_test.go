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
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// requireRoot skips tests that create cgroups and move processes into them.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create cgroups")
	}
}

// cgroup2Mount returns the mount point of the cgroup v2 hierarchy from
// /proc/self/mountinfo.
func cgroup2Mount(t testing.TB) string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		if f := strings.Fields(post); len(f) > 0 && f[0] == "cgroup2" {
			if pf := strings.Fields(pre); len(pf) >= 5 {
				return pf[4]
			}
		}
	}
	t.Skip("no cgroup2 mount in /proc/self/mountinfo")
	return ""
}

// tempCgroup creates a cgroup directory below parent, removed in Cleanup
// (after every process in it has gone, which the caller's cleanups ensure by
// being registered later and so running first).
func tempCgroup(t testing.TB, parent, pattern string) string {
	t.Helper()
	dir, err := os.MkdirTemp(parent, pattern)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { removeCgroup(t, dir) })
	return dir
}

// mkCgroup creates a named cgroup below parent, removed in Cleanup.
func mkCgroup(t testing.TB, parent, name string) string {
	t.Helper()
	dir := filepath.Join(parent, name)
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { removeCgroup(t, dir) })
	return dir
}

// removeCgroup removes a cgroup directory, retrying while its last processes
// are still being reaped by the kernel (rmdir says EBUSY until then).
func removeCgroup(t testing.TB, dir string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		err := unix.Rmdir(dir)
		if err == nil || errors.Is(err, unix.ENOENT) {
			return
		}
		if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
			t.Errorf("removing cgroup %s: %v", dir, err)
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// cgroupID returns the id of a cgroup: the inode number of its directory.
func cgroupID(t testing.TB, dir string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
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
	cgfd, err := unix.Open(cgroupDir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(cgfd)

	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.v=false")
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: cgfd}
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting helper in %s: %v", cgroupDir, err)
	}
	t.Cleanup(func() {
		stdin.Close()
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})

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
