// SPDX-License-Identifier: Apache-2.0

package main

import (
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
	"golang.org/x/sys/unix"
)

// A start that is refused writes nothing: for each way a start fails while
// the daemon builds its parts (a socket path where a regular file is, an
// exempt cgroup outside the cgroup2 mount, a busy front or metrics port, a state
// directory it cannot write), the pin directory, the state directory, the
// socket directory and the projects root are as they were, both on a fresh
// node and on one a killed daemon left enforcing: there the pins are the
// same objects (same link, program and map ids), and a project is still
// refused as before. Before the fix, each case exited only after making
// state_dir/policies.db and pinning every link.
func TestRefusedStartWritesNothing(t *testing.T) {
	for _, left := range []bool{false, true} {
		name := "fresh"
		if left {
			name = "left-by-a-killed-daemon"
		}
		t.Run(name, func(t *testing.T) { refusedStarts(t, left) })
	}
}

func refusedStarts(t *testing.T, left bool) {
	n := newNode(t, "pools: {connections: {size: 2}}\n")
	if err := os.MkdirAll(n.state, 0o700); err != nil {
		t.Fatal(err)
	}
	addr := sink(t)
	if left {
		n.start()
		a := n.connectFrom("alpha", addr, 3)
		t.Cleanup(a.close)
		if a.connected != 2 || a.refused != 1 {
			t.Fatalf("alpha connected %d, refused %d; want 2 and 1 with a pool of 2", a.connected, a.refused)
		}
		n.mkProject("beta")
		n.stop(syscall.SIGKILL)
	}
	// What each case uses, made before the listing.
	cfgDir := t.TempDir()
	frontFile := filepath.Join(n.dir, "run", "front.sock")
	if err := os.MkdirAll(filepath.Dir(frontFile), 0o711); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(frontFile, []byte("not a socket\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	busy, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()

	base := fmt.Sprintf("state_dir: %s\nadmin_socket: %s\npin_dir: %s\nprojects_root: %s\npermits: {socket: %s}\npools: {connections: {size: 2}}\n",
		n.state, n.sock, n.pin, n.root, filepath.Join(n.dir, "run", "permits.sock"))
	upstream := "upstream: 'http://" + addr + "'"
	cases := []struct {
		name, yaml string
		code       int
		readOnly   bool // the state directory is mounted read-only
		says       string
	}{
		{"front socket is a regular file", "metrics: {listen: '127.0.0.1:0'}\nfront: {socket: " + frontFile + ", " + upstream + "}\n", 78, false, "not a socket"},
		{"exempt cgroup outside the cgroup2 mount", "metrics: {listen: '127.0.0.1:0'}\nconnections: {exempt: [" + cfgDir + "]}\n", 78, false, "connections.exempt"},
		{"busy front port", "metrics: {listen: '127.0.0.1:0'}\nfront: {listen: '" + busy.Addr().String() + "', " + upstream + "}\n", 1, false, "address already in use"},
		{"busy metrics port", "metrics: {listen: '" + busy.Addr().String() + "'}\n", 1, false, "address already in use"},
		{"unwritable state dir", "metrics: {listen: '127.0.0.1:0'}\n", 78, true, "state_dir"},
	}
	before := nodeListing(t, n)
	if !left && (before.pins != "" || before.root != "") {
		t.Fatalf("a fresh node has pins or a projects root:\n%s\n%s", before.pins, before.root)
	}
	for i, c := range cases {
		cfg := filepath.Join(cfgDir, fmt.Sprintf("%d.yaml", i))
		if err := os.WriteFile(cfg, []byte(base+c.yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		if c.readOnly {
			readOnlyBind(t, n.state)
		}
		_, errOut, code := runCLI(t, "run", "--config", cfg)
		if c.readOnly {
			if err := unix.Unmount(n.state, 0); err != nil {
				t.Fatalf("unmounting %s: %v", n.state, err)
			}
		}
		if code != c.code || !strings.Contains(errOut, c.says) {
			t.Errorf("%s: exit %d, want %d saying %q:\n%s", c.name, code, c.code, c.says, errOut)
		}
		after := nodeListing(t, n)
		if after != before {
			t.Errorf("%s: the start changed the node:\nbefore:\n%s\nafter:\n%s", c.name, before, after)
		}
	}
	if left {
		// The killed daemon's programs still enforce its pool of 2, which
		// alpha fills.
		b := n.connectFrom("beta", addr, 1)
		b.close()
		if b.connected != 0 || b.refused != 1 {
			t.Errorf("after the refused starts beta connected %d, refused %d; want refused", b.connected, b.refused)
		}
	}
}

// readOnlyBind mounts dir read-only over itself until the test ends (or
// the caller unmounts it).
func readOnlyBind(t *testing.T, dir string) {
	t.Helper()
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		t.Skipf("bind mount of %s: %v", dir, err)
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	if err := unix.Mount("", dir, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
		t.Fatalf("remounting %s read-only: %v", dir, err)
	}
}

// listing is what a refused start must leave as it was.
type listing struct{ files, pins, root string }

func (l listing) String() string {
	return "files:\n" + l.files + "pins:\n" + l.pins + "projects root:\n" + l.root
}

// nodeListing lists the node's directory (state and sockets: every entry
// with its type, and size and modification time for a regular file), its
// pins (each with the id of its object, and for a link its program's) and
// the cgroups below its projects root.
func nodeListing(t *testing.T, n *node) listing {
	t.Helper()
	var l listing
	var lines []string
	filepath.WalkDir(n.dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil || p == n.dir {
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return nil
		}
		line := fmt.Sprintf("%s %v", strings.TrimPrefix(p, n.dir), fi.Mode())
		if fi.Mode().IsRegular() {
			line += fmt.Sprintf(" %d %d", fi.Size(), fi.ModTime().UnixNano())
		}
		lines = append(lines, line)
		return nil
	})
	sort.Strings(lines)
	l.files = strings.Join(lines, "\n") + "\n"
	lines = nil
	filepath.WalkDir(n.pin, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		rel := strings.TrimPrefix(p, n.pin)
		switch {
		case e.IsDir():
			lines = append(lines, rel+"/")
		case strings.HasPrefix(e.Name(), "link_"):
			lk, err := link.LoadPinnedLink(p, nil)
			if err != nil {
				t.Fatalf("loading %s: %v", p, err)
			}
			info, err := lk.Info()
			lk.Close()
			if err != nil {
				t.Fatal(err)
			}
			lines = append(lines, fmt.Sprintf("%s link %d program %d", rel, info.ID, info.Program))
		default:
			m, err := ebpf.LoadPinnedMap(p, nil)
			if err != nil {
				lines = append(lines, rel+" ?")
				return nil
			}
			info, _ := m.Info()
			id, _ := info.ID()
			m.Close()
			lines = append(lines, fmt.Sprintf("%s map %d", rel, id))
		}
		return nil
	})
	sort.Strings(lines)
	l.pins = strings.Join(lines, "\n")
	lines = nil
	filepath.WalkDir(n.root, func(p string, e fs.DirEntry, err error) error {
		if err == nil && e.IsDir() {
			lines = append(lines, p)
		}
		return nil
	})
	l.root = strings.Join(lines, "\n")
	return l
}

// TestSecondDaemonOnSamePinsRefused: a daemon started on the pin directory a
// running daemon uses, with sockets, state and port of its own, is refused
// before it changes anything: the first daemon's pins keep their objects
// (before the lock, the second took them over, wrote its own pool size into
// them, and with --detach-on-exit unpinned them as it exited), and the
// first still refuses past its pool.
func TestSecondDaemonOnSamePinsRefused(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 2, floor: 1}}\n")
	n.start()
	addr := sink(t)
	a := n.connectFrom("alpha", addr, 2)
	defer a.close()
	before := nodeListing(t, n).pins
	other := t.TempDir()
	_, errOut, code := runCLI(t, "run", "--config", n.cfg, "--state-dir", filepath.Join(other, "state"),
		"--admin-socket", filepath.Join(other, "admin.sock"), "--permits-socket", "",
		"--pool", "connections=100", "--detach-on-exit")
	if code == 0 || !strings.Contains(errOut, "another fairshare daemon runs on this pin directory") {
		t.Fatalf("a second daemon on the same pins: exit %d: %s", code, errOut)
	}
	if want := fmt.Sprintf("locked by pid %d", n.cmd.Process.Pid); !strings.Contains(errOut, want) {
		t.Errorf("the refusal does not name the running daemon (%q): %s", want, errOut)
	}
	if after := nodeListing(t, n).pins; after != before {
		t.Errorf("the second daemon changed the pins:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if c := pool(n.status(), "connections"); c.Size != 2 {
		t.Errorf("the first daemon's pool is %d, want 2", c.Size)
	}
	b := n.connectFrom("alpha", addr, 1)
	defer b.close()
	if b.refused != 1 {
		t.Errorf("past the pool after the second start: %d connected, %d refused", b.connected, b.refused)
	}
}

// TestCleanupRefusedWhileDaemonRuns: 'fairshare cleanup' on the pin
// directory of a running daemon exits 1 naming the daemon's pid and changes
// nothing (before, it unpinned everything under the daemon: status could no
// longer read the pins, and enforcement ended with the daemon's next exit,
// its counts lost); with --force it unpins, the daemon stops by itself
// (TestCleanupForceStopsDaemon), and then nothing is left. Cleanup after the
// daemon stopped, the uninstall path, is TestEndToEnd's.
func TestCleanupRefusedWhileDaemonRuns(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 2}}\n")
	n.start()
	addr := sink(t)
	a := n.connectFrom("alpha", addr, 2)
	defer a.close()
	before := nodeListing(t, n).pins
	_, errOut, code := runCLI(t, "cleanup", "--pin-dir", n.pin)
	if code != 1 || !strings.Contains(errOut, fmt.Sprintf("locked by pid %d", n.cmd.Process.Pid)) || !strings.Contains(errOut, "--force") {
		t.Fatalf("cleanup under a running daemon: exit %d: %s", code, errOut)
	}
	if after := nodeListing(t, n).pins; after != before {
		t.Errorf("the refused cleanup changed the pins:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if b := n.connectFrom("alpha", addr, 1); b.refused != 1 {
		t.Errorf("past the pool after the refused cleanup: %d connected, %d refused", b.connected, b.refused)
	} else {
		b.close()
	}
	out, errOut, code := runCLI(t, "cleanup", "--force", "--pin-dir", n.pin)
	if code != 0 || !strings.Contains(errOut, "--force") {
		t.Fatalf("cleanup --force: exit %d: %s %s", code, out, errOut)
	}
	if _, err := os.Stat(n.pin); !os.IsNotExist(err) {
		t.Errorf("pins still there after cleanup --force: %v", err)
	}
	if code := n.waitExit(); code != 1 {
		t.Fatalf("daemon exit %d after cleanup --force, want 1:\n%s", code, n.log)
	}
	if b := n.connectFrom("alpha", addr, 2); b.connected != 2 {
		t.Errorf("after cleanup --force and the daemon's exit alpha connected %d of 2: programs left attached", b.connected)
	} else {
		b.close()
	}
}

// TestExemptCgroupMadeAfterStart: an exempt cgroup that does not exist yet
// (after a boot, a project's cgroups come after the daemon) used to refuse
// the start with exit status 2, which systemd does not restart: the node
// ran with no enforcement at all. Now the daemon starts, says which are
// missing (log, status), and puts each in force within a tick of its
// making; one removed goes out of force, and in again when it is made
// again (a new cgroup id).
func TestExemptCgroupMadeAfterStart(t *testing.T) {
	n := newNode(t, "pools: {connections: {size: 2}}\nconnections: {exempt: [alpha/probes]}\n")
	probes := filepath.Join(n.root, "alpha", "probes")
	t.Cleanup(func() { os.Remove(probes) })
	n.start()
	missing := func() []string {
		for _, p := range n.status().Pools {
			if p.Name == "connections" && p.Exempt != nil {
				return p.Exempt.Missing
			}
		}
		return nil
	}
	if m := missing(); len(m) != 1 || m[0] != probes {
		t.Fatalf("missing exempt cgroups %v, want [%s]", m, probes)
	}
	if out, _, _ := n.cli("status"); !strings.Contains(out, "exempt cgroups not made yet (exempt once they are): "+probes) {
		t.Errorf("status does not name the missing exempt cgroup:\n%s", out)
	}
	addr := sink(t)
	a := n.connectFrom("alpha", addr, 3)
	t.Cleanup(a.close)
	if a.connected != 2 || a.refused != 1 {
		t.Fatalf("alpha connected %d, refused %d; want 2 and 1 with a pool of 2", a.connected, a.refused)
	}
	for round := range 2 {
		if err := os.Mkdir(probes, 0o755); err != nil {
			t.Fatal(err)
		}
		eventually(t, func() error {
			if m := missing(); len(m) != 0 {
				return fmt.Errorf("round %d: still missing %v", round, m)
			}
			return nil
		})
		p := n.connectFrom("alpha/probes", addr, 1)
		p.close()
		if p.connected != 1 {
			t.Fatalf("round %d: a probe on a full pool: connected %d, refused %d; want exempt", round, p.connected, p.refused)
		}
		if err := os.Remove(probes); err != nil {
			t.Fatal(err)
		}
		eventually(t, func() error {
			if m := missing(); len(m) != 1 {
				return fmt.Errorf("round %d: a removed exempt cgroup is not missing: %v", round, m)
			}
			return nil
		})
	}
}
