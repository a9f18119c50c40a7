// SPDX-License-Identifier: Apache-2.0

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// With floodEnv set to "NETWORK ADDR N", the test binary opens up to N
// connections to ADDR (a unix socket path or a TCP address), prints
// "flooded <open>" and holds them until its stdin closes. The flood test
// runs it as nobody.
const floodEnv = "FAIRSHARE_E2E_FLOOD"

func floodHelper(spec string) {
	f := strings.Fields(spec)
	n, _ := strconv.Atoi(f[2])
	var conns []net.Conn
	for i := 0; i < n; i++ {
		c, err := net.DialTimeout(f[0], f[1], time.Second)
		if err != nil {
			time.Sleep(time.Millisecond) // a full backlog: the daemon is closing what it refused
			continue
		}
		conns = append(conns, c)
	}
	fmt.Printf("flooded %d\n", len(conns))
	io.Copy(io.Discard, os.Stdin)
	os.Exit(0)
}

// publicCopy copies the test binary where another user may run it.
func publicCopy(t *testing.T, dir string) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "flood")
	if err := os.WriteFile(p, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

// flood starts a flooder as nobody and waits until it holds its connections.
func flood(t *testing.T, bin, network, addr string, n int) (open int, stop func()) {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(cleanEnv(), floodEnv+"="+network+" "+addr+" "+strconv.Itoa(n), "GORACE=atexit_sleep_ms=0")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	in, out := testutil.Pipes(t, cmd)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stop = func() { in.Close(); cmd.Wait() }
	t.Cleanup(stop)
	line, err := bufio.NewReader(out).ReadString('\n')
	if _, serr := fmt.Sscanf(line, "flooded %d", &open); err != nil || serr != nil {
		t.Fatalf("flooder said %q (%v)", line, err)
	}
	return open, stop
}

func countFDs(pid int) int {
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(ents)
}

// An unprivileged user floods the daemon's world-reachable listeners (the
// front's unix socket, mode 0666, and its TCP port) with thousands of
// connections, against a daemon whose open-files limit is 1024. The daemon
// keeps serving: the operator's CLI answers through the flood, a runtime
// takes a permit, and the listeners report what they refused. Before, the
// flood ran the daemon out of descriptors: the admin CLI timed out and the
// permit API's accept error stopped the daemon, dropping every lease.
func TestFDFloodByUnprivilegedUser(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	t.Cleanup(up.Close)
	pub, err := os.MkdirTemp("", "fairshare-flood-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(pub) })
	os.Chmod(pub, 0o711)
	sock := filepath.Join(pub, "front.sock")
	n := newNode(t, fmt.Sprintf("front: {listen: '127.0.0.1:0', socket: %q, upstream: %q}\n", sock, up.URL))
	const nofile = 1024
	n.prefix = []string{"prlimit", "--nofile=" + strconv.Itoa(nofile)}
	n.start()
	bin := publicCopy(t, pub)

	const perListener = 3000
	sockOpen, _ := flood(t, bin, "unix", sock, perListener)
	tcpOpen, _ := flood(t, bin, "tcp4", n.r.Front, perListener)
	fds := countFDs(n.r.PID)
	t.Logf("nobody holds %d connections to the front socket and %d to the front's TCP port; the daemon holds %d descriptors (limit %d)",
		sockOpen, tcpOpen, fds, nofile)
	if sockOpen+tcpOpen < nofile {
		t.Fatalf("the flood opened only %d connections; not a flood for a limit of %d", sockOpen+tcpOpen, nofile)
	}

	// The operator's CLI answers during the flood.
	start := time.Now()
	out, errOut, code := runCLI(t, "status", "--config", n.cfg, "--json")
	if code != 0 {
		t.Fatalf("status during the flood: exit %d after %v: %s", code, time.Since(start), errOut)
	}
	t.Logf("admin CLI answered in %v during the flood", time.Since(start).Round(time.Millisecond))
	var st admin.Status
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatal(err)
	}
	refused := map[string]uint64{}
	for _, l := range st.Listeners {
		for _, v := range l.Refused {
			refused[l.Name] += v
		}
		if l.MaxConns > 0 && l.Open > l.MaxConns {
			t.Errorf("listener %s holds %d connections, cap %d", l.Name, l.Open, l.MaxConns)
		}
	}
	if refused["front"] == 0 || refused["front_socket"] == 0 {
		t.Errorf("listeners refused nothing: %+v", st.Listeners)
	}
	t.Logf("listeners: %+v", st.Listeners)

	// A runtime (root) takes a permit during the flood.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, client.Options{Socket: filepath.Join(n.dir, "run", "permits.sock")})
	if err != nil {
		t.Fatalf("permit API during the flood: %v\n%s", err, n.log)
	}
	defer c.Close()
	if _, err := c.Acquire(ctx, "flights", "alpha"); err != nil {
		t.Fatalf("acquire during the flood: %v", err)
	}
	select {
	case err := <-n.done:
		n.cmd = nil
		t.Fatalf("the daemon exited during the flood: %v\n%s", err, n.log)
	default:
	}
	// The refusals are in the log, but not one line each.
	if lines := strings.Count(n.log.String(), "connection refused: too many open connections"); lines > 20 {
		t.Errorf("%d log lines for refused connections", lines)
	}
}
