// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestCgroupHelperAndCleanup starts a process in a nested temporary cgroup
// and checks that it runs there, and that the test's cleanup ends it and
// removes both cgroups.
func TestCgroupHelperAndCleanup(t *testing.T) {
	RequireRoot(t)
	mnt := Cgroup2Mount(t)
	var root, child string
	var cmd *exec.Cmd
	t.Run("inner", func(t *testing.T) {
		root = TempCgroup(t, mnt, "fairshare-testutil-")
		child = MkCgroup(t, root, "child")
		cmd = exec.Command("sleep", "60")
		StartInCgroup(t, cmd, child)
		b, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/cgroup")
		if err != nil {
			t.Fatal(err)
		}
		want := "0::/" + strings.TrimPrefix(child, mnt+"/")
		if !strings.Contains(string(b), want) {
			t.Fatalf("helper's cgroup: %q, want a line %q", b, want)
		}
	})
	if cmd == nil || cmd.ProcessState == nil {
		t.Fatal("the helper was not reaped at cleanup")
	}
	for _, dir := range []string{child, root} {
		if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s left behind: %v", dir, err)
		}
	}
}

func TestFakeClock(t *testing.T) {
	c := NewFakeClock()
	t0 := c.Now()
	if t0.IsZero() || !c.Now().Equal(t0) {
		t.Fatalf("clock reads %v then %v; want a fixed non-zero instant", t0, c.Now())
	}
	c.Advance(1500 * time.Millisecond)
	if got := c.Now().Sub(t0); got != 1500*time.Millisecond {
		t.Fatalf("advanced by %v, want 1.5s", got)
	}
}
