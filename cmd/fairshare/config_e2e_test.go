// SPDX-License-Identifier: Apache-2.0

package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/client"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"golang.org/x/sys/unix"
)

// With permitEnv set to a socket path, the test binary is a runtime: it
// takes one flights permit and prints "ok", or "error <why>". With "PATH
// wait" it instead waits up to 300ms for a flights permit of alpha and
// spawns a resident of alpha, printing "acquire <ok|CODE> spawn <ok|CODE>".
const permitEnv = "FAIRSHARE_E2E_PERMIT"

func permitHelper(spec string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sock, mode, _ := strings.Cut(spec, " ")
	c, err := client.Dial(ctx, client.Options{Socket: sock})
	if err != nil {
		fmt.Println("error", err)
		os.Exit(0)
	}
	if mode == "wait" {
		code := func(err error) string {
			var pe *client.Error
			switch {
			case err == nil:
				return "ok"
			case errors.As(err, &pe):
				return pe.Code
			}
			return err.Error()
		}
		_, aerr := c.AcquireWait(ctx, "flights", "alpha", 300*time.Millisecond)
		_, serr := c.Spawn(ctx, "alpha", "obj")
		fmt.Println("acquire", code(aerr), "spawn", code(serr))
		os.Exit(0)
	}
	if _, err := c.Acquire(ctx, "flights", "alpha"); err != nil {
		fmt.Println("error", err)
		os.Exit(0)
	}
	fmt.Println("ok")
	os.Exit(0)
}

// runAs runs the test binary's permit helper as uid 65534 with the given
// supplementary groups.
func runAs(t *testing.T, bin, sock string, groups ...uint32) string {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(cleanEnv(), permitEnv+"="+sock, "GORACE=atexit_sleep_ms=0")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534, Groups: groups}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper: %v: %s", err, out)
	}
	return strings.TrimSpace(string(out))
}

// permits.group works end to end: a real non-root process with the group
// as a supplementary group takes a permit, the same user without the group
// is kept out by the socket's mode (0660 in the group, given here as a gid
// with no name). Three ways the socket directory comes about:
//
//   - the daemon makes it, under the usual umask 0022;
//   - the daemon makes it under UMask=0077: before, MkdirAll gave 0700 and
//     the member got EACCES (the daemon only warned);
//   - systemd makes it from the unit's RuntimeDirectory= settings, read
//     from dist/fairshare.service (RuntimeDirectoryMode, UMask), and the
//     daemon runs under the unit's umask: before, the unit said 0700.
func TestPermitsGroupMember(t *testing.T) {
	needRoot(t)
	unit := unitSettings(t)
	for _, tt := range []struct {
		name    string
		umask   string
		premake os.FileMode // 0: the daemon makes the directory
	}{
		{"daemon makes it", "0022", 0},
		{"daemon makes it under UMask=0077", "0077", 0},
		{"the unit's RuntimeDirectory", unit.umask, unit.dirMode},
	} {
		t.Run(tt.name, func(t *testing.T) {
			pub, err := os.MkdirTemp("", "fairshare-group-")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(pub) })
			os.Chmod(pub, 0o711)
			gid := 47000 + os.Getpid()%1000
			run := filepath.Join(pub, "run")
			if tt.premake != 0 {
				if err := os.Mkdir(run, 0o700); err != nil {
					t.Fatal(err)
				}
				os.Chmod(run, tt.premake)
			}
			sock := filepath.Join(run, "permits.sock")
			n := newNode(t, "")
			cfg := fmt.Sprintf("state_dir: %s\nadmin_socket: %s\npin_dir: %s\nprojects_root: %s\nbpf: false\n"+
				"permits: {socket: %s, group: '%d'}\nmetrics: {listen: ''}\n",
				n.state, filepath.Join(run, "admin.sock"), n.pin, n.root, sock, gid)
			if err := os.WriteFile(n.cfg, []byte(cfg), 0o600); err != nil {
				t.Fatal(err)
			}
			n.prefix = []string{"sh", "-c", "umask " + tt.umask + ` && exec "$0" "$@"`}
			n.start()
			var st unix.Stat_t
			if tt.premake == 0 {
				if err := unix.Stat(run, &st); err != nil || st.Mode&0o777 != uint32(listen.DirMode) {
					t.Errorf("socket directory mode %04o (%v), want %04o", st.Mode&0o777, err, listen.DirMode)
				}
			}
			if err := unix.Stat(sock, &st); err != nil || st.Mode&0o777 != 0o660 || int(st.Gid) != gid {
				t.Errorf("socket mode %04o group %d (%v), want 0660 in %d", st.Mode&0o777, st.Gid, err, gid)
			}
			bin := publicCopy(t, pub)
			if out := runAs(t, bin, sock, uint32(gid)); out != "ok" {
				t.Errorf("a member of the permit group: %s\n%s", out, n.log)
			}
			if out := runAs(t, bin, sock); !strings.Contains(out, "permission denied") {
				t.Errorf("the same user outside the group: %s", out)
			}
		})
	}
}

// unitDirs are the unit's settings for its runtime directory.
type unitDirs struct {
	dirMode os.FileMode
	umask   string
}

// unitSettings reads RuntimeDirectoryMode and UMask (systemd's default
// 0022 when absent) from dist/fairshare.service.
func unitSettings(t *testing.T) unitDirs {
	t.Helper()
	b, err := os.ReadFile("../../dist/fairshare.service")
	if err != nil {
		t.Fatal(err)
	}
	u := unitDirs{umask: "0022"}
	for line := range strings.Lines(string(b)) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), "=")
		if !ok {
			continue
		}
		switch k {
		case "RuntimeDirectoryMode":
			m, err := strconv.ParseUint(v, 8, 32)
			if err != nil {
				t.Fatalf("RuntimeDirectoryMode=%s", v)
			}
			u.dirMode = os.FileMode(m)
		case "UMask":
			u.umask = v
		}
	}
	if u.dirMode == 0 {
		t.Fatal("dist/fairshare.service sets no RuntimeDirectoryMode")
	}
	return u
}

// runFor runs the binary for at most d and returns its stderr and exit code
// (-1 when it was still running).
func runFor(t *testing.T, d time.Duration, args ...string) (string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = cleanEnv()
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(out), ee.ExitCode()
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(out), 0
}

// A socket path that holds anything but a socket is never removed: the
// daemon refuses to start, naming the file, with exit status 78 (a restart
// cannot fix it). Before, --admin-socket pointed at a regular file deleted
// the file.
func TestSocketPathKeepsOtherFiles(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	for _, flag := range []string{"--admin-socket", "--permits-socket", "--front-socket"} {
		file := filepath.Join(dir, strings.TrimPrefix(flag, "--")+".conf")
		if err := os.WriteFile(file, []byte("precious"), 0o644); err != nil {
			t.Fatal(err)
		}
		args := []string{"run", "--no-bpf", "--state-dir", filepath.Join(dir, "state"), "--metrics-listen", "",
			"--admin-socket", filepath.Join(dir, "admin.sock"), "--permits-socket", filepath.Join(dir, "permits.sock"),
			flag, file}
		if flag == "--front-socket" {
			args = append(args, "--front-upstream", "http://127.0.0.1:1")
		}
		out, code := runFor(t, 10*time.Second, args...)
		if code != 78 || !strings.Contains(out, file) || !strings.Contains(out, "not a socket") {
			t.Errorf("%s at a regular file: exit %d: %s", flag, code, out)
		}
		if b, err := os.ReadFile(file); err != nil || string(b) != "precious" {
			t.Errorf("%s: the file at the socket path was touched: %q %v", flag, b, err)
		}
	}
}

// --print-config prints what the daemon runs on, defaults resolved, after
// validating; pool sizes and other common settings come from flags and
// FAIRSHARE_* variables too.
func TestPrintConfigIsEffective(t *testing.T) {
	out, errOut, code := runCLI(t, "run", "--print-config")
	if code != 0 {
		t.Fatalf("print-config: %d %s", code, errOut)
	}
	for _, want := range []string{"floor: 204", "exempt_max: 204", "exempt_max: 4", "max_waiting: 4096", "max_waiting_per_uid: 512",
		"subuid: /etc/subuid", "max_conns: 0\n", "# not resolved: listeners: 0 is derived when the daemon starts"} {
		if !strings.Contains(out, want) {
			t.Errorf("print-config lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "floor: 0") {
		t.Errorf("print-config shows unresolved values:\n%s", out)
	}
	if strings.Contains(out, `projects_root: ""`) && !strings.Contains(out, "# not resolved: projects_root") {
		t.Errorf("projects root neither resolved nor explained:\n%s", out)
	}
	// Flags and the environment, pool sizes included (a flag given beats
	// its variable).
	for _, tt := range []struct {
		args, env, want []string
	}{
		{[]string{"--pool", "connections=1000/7", "--pool", "requests=40", "--front-max-in-flight", "8",
			"--front-listen", "127.0.0.1:8080", "--front-upstream", "http://127.0.0.1:9000"},
			[]string{"FAIRSHARE_PERMITS_GROUP=4242", "FAIRSHARE_RECONCILE=30s"},
			[]string{"size: 1000\n    floor: 7", "size: 40\n    floor: 2", "max_in_flight: 8", "group: \"4242\"", "reconcile: 30s",
				"exempt_max: 7"}},
		{nil, []string{"FAIRSHARE_POOL=requests=40,uploads=10/3", "FAIRSHARE_MAX_CONNS=77"},
			[]string{"size: 40\n    floor: 2", "uploads:\n    size: 10\n    floor: 3", "max_conns: 77\n  max_conns_per_peer: 0"}},
	} {
		cmd := exec.Command(binary, append([]string{"run", "--print-config"}, tt.args...)...)
		cmd.Env = append(cleanEnv(), tt.env...)
		b, err := cmd.Output()
		if err != nil {
			t.Fatalf("print-config %v %v: %v", tt.args, tt.env, err)
		}
		for _, want := range tt.want {
			if !strings.Contains(string(b), want) {
				t.Errorf("print-config %v %v lacks %q:\n%s", tt.args, tt.env, want, b)
			}
		}
	}
	// Invalid values exit 78 naming the key or flag; a value that does not
	// parse as its flag's type is a command line that does not parse, 2.
	for _, tt := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--pool", "connections=many"}, 78, "--pool connections=many"},
		{[]string{"--pool", "requests=0"}, 78, "pools.requests.size"},
		{[]string{"--front-listen", "127.0.0.1:1", "--front-upstream", "http://x", "--front-max-in-flight", "-1"}, 78, "front.max_in_flight must be >= 1"},
		{[]string{"--max-conns", "-3"}, 78, "listeners.max_conns"},
		// Values that do not parse, and values found bad only when bound,
		// exited 1 before (and systemd restarted the daemon in a loop).
		{[]string{"--max-conns", "abc"}, 2, `invalid value "abc" for flag -max-conns`},
		{[]string{"--reconcile", "soon"}, 2, "-reconcile"},
		{[]string{"--metrics-listen", "127.0.0.1:99999"}, 78, "metrics.listen"},
		{[]string{"--permits-socket", "/run/" + strings.Repeat("p", 110)}, 78, "permits.socket is 115 bytes"},
		// What run refuses when it builds its parts, print-config refuses.
		{[]string{"--permits-group", "no-such-group-fs14"}, 78, "permits.group"},
	} {
		_, errOut, code := runCLI(t, append([]string{"run", "--print-config"}, tt.args...)...)
		if code != tt.code || !strings.Contains(errOut, tt.want) {
			t.Errorf("%v: exit %d %q, want %d naming %q", tt.args, code, errOut, tt.code, tt.want)
		}
	}
	cmd := exec.Command(binary, "run", "--print-config")
	cmd.Env = append(cleanEnv(), "FAIRSHARE_MAX_CONNS=abc")
	if out, err := cmd.CombinedOutput(); cmd.ProcessState.ExitCode() != 2 || !strings.Contains(string(out), "FAIRSHARE_MAX_CONNS") {
		t.Errorf("FAIRSHARE_MAX_CONNS=abc: exit %d (%v): %s", cmd.ProcessState.ExitCode(), err, out)
	}
	cmd = exec.Command(binary, "run", "--print-config")
	cmd.Env = append(cleanEnv(), "FAIRSHARE_POOL=requests=0")
	if out, err := cmd.CombinedOutput(); cmd.ProcessState.ExitCode() != 78 || !strings.Contains(string(out), "pools.requests.size") {
		t.Errorf("FAIRSHARE_POOL=requests=0: exit %d (%v): %s", cmd.ProcessState.ExitCode(), err, out)
	}
	// What it prints is true: fed back as the file, it runs the same (with
	// --front-max-in-flight 2 it printed exempt_max 4, which the file then
	// refused).
	out, errOut, code = runCLI(t, "run", "--print-config", "--front-max-in-flight", "2", "--front-listen", "127.0.0.1:1",
		"--front-upstream", "http://127.0.0.1:2")
	if code != 0 || !strings.Contains(out, "exempt_max: 2\n") {
		t.Fatalf("print-config with max_in_flight 2: exit %d %s\n%s", code, errOut, out)
	}
	file := filepath.Join(t.TempDir(), "printed.yaml")
	if err := os.WriteFile(file, []byte(out), 0o600); err != nil {
		t.Fatal(err)
	}
	again, errOut, code := runCLI(t, "run", "--print-config", "--config", file)
	if code != 0 || again != out {
		t.Errorf("the printed configuration fed back: exit %d %s\n%s\nwas\n%s", code, errOut, again, out)
	}
}
