// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"bufio"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"
)

// When this variable is set the test binary acts as a separate writer process:
// it saves one policy, says so, and waits to be killed.
const helperEnv = "FAIRSHARE_POLICY_HELPER_DIR"

func TestMain(m *testing.M) {
	if dir := os.Getenv(helperEnv); dir != "" {
		s, err := Open(dir, Options{})
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(2)
		}
		if err := s.Put("killed", Policy{Tier: TierPro, Shares: 7, RequestsPerSec: 3}); err != nil {
			fmt.Println("error:", err)
			os.Exit(2)
		}
		fmt.Println("saved")
		time.Sleep(time.Minute) // hold the lock until SIGKILL
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func ptr[T any](v T) *T { return &v }

func TestValidate(t *testing.T) {
	good := []Policy{
		{Tier: "pro", Shares: 1},
		{Tier: "lite", Shares: 10, RequestsPerSec: 100, WorkPerSec: 0.5},
		{Tier: "none", Shares: MaxShares, RequestsPerSec: MaxRate},
		{Tier: "none", Shares: 1, ConnectionsPerSec: 50},
		{Tier: "none", Shares: 1, ConnectionsPerSec: MinRate},
	}
	for _, p := range good {
		if err := p.Validate(); err != nil {
			t.Errorf("%+v: %v", p, err)
		}
	}
	bad := []struct {
		p     Policy
		field string
	}{
		{Policy{Tier: "gold", Shares: 1}, "tier"},
		{Policy{Tier: "", Shares: 1}, "tier"},
		{Policy{Tier: "Pro", Shares: 1}, "tier"},
		{Policy{Tier: "pro", Shares: 0}, "shares"},
		{Policy{Tier: "pro", Shares: -3}, "shares"},
		{Policy{Tier: "pro", Shares: MaxShares + 1}, "shares"},
		{Policy{Tier: "pro", Shares: 1, RequestsPerSec: -1}, "requests per second"},
		{Policy{Tier: "pro", Shares: 1, RequestsPerSec: math.NaN()}, "requests per second"},
		{Policy{Tier: "pro", Shares: 1, WorkPerSec: math.Inf(1)}, "work units per second"},
		{Policy{Tier: "pro", Shares: 1, WorkPerSec: 2e9}, "work units per second"},
		{Policy{Tier: "pro", Shares: 1, ConnectionsPerSec: -1}, "connections per second"},
		{Policy{Tier: "pro", Shares: 1, ConnectionsPerSec: 1e-4}, "connections per second"},
		{Policy{Tier: "pro", Shares: 1, ConnectionsPerSec: math.NaN()}, "connections per second"},
	}
	for _, tt := range bad {
		err := tt.p.Validate()
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("%+v: got %v, want an ErrInvalid naming %q", tt.p, err, tt.field)
		}
	}
}

func TestValidateProject(t *testing.T) {
	for _, name := range []string{"a", "alpha-1", "A_b.c", "9x", strings.Repeat("x", MaxProjectLen)} {
		if err := ValidateProject(name); err != nil {
			t.Errorf("%q: %v", name, err)
		}
	}
	for _, name := range []string{"", ".", "..", ".hidden", "-flag", "a/b", "a b", "é", "cgroup.procs", "x\n", "_x", strings.Repeat("x", MaxProjectLen+1)} {
		if err := ValidateProject(name); !errors.Is(err, ErrBadProject) {
			t.Errorf("%q accepted (err %v)", name, err)
		}
	}
}

func TestStoreCRUD(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, found, err := s.Get("alpha"); err != nil || found {
		t.Fatalf("empty store: found=%v err=%v", found, err)
	}
	v0, _ := s.Version()
	got, err := s.Patch("alpha", Patch{Tier: ptr("pro")}, Default())
	if err != nil {
		t.Fatal(err)
	}
	if got != (Policy{Tier: "pro", Shares: 1}) {
		t.Errorf("patched from default = %+v", got)
	}
	if _, err := s.Patch("alpha", Patch{RequestsPerSec: ptr(5.0)}, Default()); err != nil {
		t.Fatal(err)
	}
	// A bad patch writes nothing and leaves the version alone.
	v1, _ := s.Version()
	if _, err := s.Patch("alpha", Patch{Shares: ptr(0)}, Default()); !errors.Is(err, ErrInvalid) {
		t.Errorf("shares 0 accepted: %v", err)
	}
	if _, err := s.Patch("../etc", Patch{Shares: ptr(2)}, Default()); !errors.Is(err, ErrBadProject) {
		t.Errorf("bad project accepted: %v", err)
	}
	if v2, _ := s.Version(); v2 != v1 || v1 != v0+2 {
		t.Errorf("versions %d %d %d: want +1 per good write and none for a bad one", v0, v1, v2)
	}
	if err := s.Put("beta", Policy{Tier: "lite", Shares: 3}); err != nil {
		t.Fatal(err)
	}
	list, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	want := []Entry{{Project: "alpha", Policy: Policy{Tier: "pro", Shares: 1, RequestsPerSec: 5}}, {Project: "beta", Policy: Policy{Tier: "lite", Shares: 3}}}
	if fmt.Sprint(list) != fmt.Sprint(want) {
		t.Errorf("list = %+v, want %+v", list, want)
	}
	if found, err := s.Delete("beta"); err != nil || !found {
		t.Errorf("delete beta: %v %v", found, err)
	}
	if found, err := s.Delete("beta"); err != nil || found {
		t.Errorf("second delete of beta: %v %v", found, err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	s, err = Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, found, err := s.Get("alpha")
	if err != nil || !found || p.RequestsPerSec != 5 {
		t.Errorf("after reopen: %+v %v %v", p, found, err)
	}
}

// Concurrent patches of different fields must all land: each is a
// read-modify-write inside one bbolt transaction.
func TestStoreConcurrentWriters(t *testing.T) {
	s, err := Open(t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	const n = 40
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var pt Patch
			if i%2 == 0 {
				pt.Shares = ptr(i + 2) // never the default 1, so a lost patch shows
			} else {
				pt.RequestsPerSec = ptr(float64(i))
			}
			if _, err := s.Patch("p", pt, Default()); err != nil {
				t.Error(err)
			}
			if _, err := s.Patch(fmt.Sprintf("q%d", i), pt, Default()); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	list, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != n+1 {
		t.Errorf("%d policies stored, want %d", len(list), n+1)
	}
	if v, _ := s.Version(); v != 2*n {
		t.Errorf("version = %d, want %d", v, 2*n)
	}
	p, _, _ := s.Get("p")
	if p.Shares == 1 || p.RequestsPerSec == 0 {
		t.Errorf("a field patch was lost: %+v", p)
	}
}

// A second process cannot open the store while one holds it, and a write the
// first reported done survives its SIGKILL.
func TestStoreLockAndSIGKILL(t *testing.T) {
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "saved" {
		t.Fatalf("helper said %q, %v", line, err)
	}
	if _, err := Open(dir, Options{Timeout: 100 * time.Millisecond}); !errors.Is(err, ErrLocked) {
		t.Fatalf("opened a store another process holds: %v", err)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatalf("reopen after SIGKILL: %v", err)
	}
	defer s.Close()
	p, found, err := s.Get("killed")
	if err != nil || !found || p != (Policy{Tier: TierPro, Shares: 7, RequestsPerSec: 3}) {
		t.Errorf("after SIGKILL: %+v found=%v err=%v", p, found, err)
	}
	if _, err := os.Stat(filepath.Join(dir, FileName)); err != nil {
		t.Error(err)
	}
}

// A policy an older version stored out of today's bounds does not make a
// patch of another field fail (the CLI writes the store itself when no
// daemon runs), and Repair writes every such policy back within bounds,
// saying what changed. Before, 'policy set --shares 3' failed on a stored
// rate of 1e-12 it did not touch.
func TestOutOfBoundsStored(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	put := func(project, raw string) {
		t.Helper()
		if err := s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketPolicies).Put([]byte(project), []byte(raw)) }); err != nil {
			t.Fatal(err)
		}
	}
	put("a", `{"tier":"pro","shares":1,"requests_per_sec":1e-12,"work_per_sec":0}`)
	put("b", `{"tier":"gold","shares":0,"requests_per_sec":5,"work_per_sec":2e10}`)
	put("c", `{"tier":"lite","shares":4,"requests_per_sec":5,"work_per_sec":0}`)
	shares := 3
	p, err := s.Patch("a", Patch{Shares: &shares}, Default())
	if err != nil || p != (Policy{Tier: "pro", Shares: 3, RequestsPerSec: MinRate}) {
		t.Fatalf("patch of shares over a stored 1e-12: %+v %v", p, err)
	}
	fixed, err := s.Repair()
	if err != nil {
		t.Fatal(err)
	}
	if len(fixed) != 1 || len(fixed["b"]) != 3 || !strings.Contains(strings.Join(fixed["b"], ";"), "work_per_sec 2e+10 -> 1e+09") {
		t.Fatalf("repaired %v", fixed)
	}
	if p, _, _ := s.Get("b"); p != (Policy{Tier: "none", Shares: 1, RequestsPerSec: 5, WorkPerSec: MaxRate}) {
		t.Fatalf("b after repair: %+v", p)
	}
	if fixed, err := s.Repair(); err != nil || len(fixed) != 0 {
		t.Fatalf("a second repair: %v %v", fixed, err)
	}
}

// A policy stored before connections_per_sec existed keeps working: it reads
// as unbounded, a patch of another field keeps it so, and a patch of the new
// field keeps the old ones; an out-of-bounds stored rate is repaired as the
// others are.
func TestConnectionsPerSecStored(t *testing.T) {
	s, err := Open(t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	put := func(project, raw string) {
		t.Helper()
		if err := s.db.Update(func(tx *bolt.Tx) error { return tx.Bucket(bucketPolicies).Put([]byte(project), []byte(raw)) }); err != nil {
			t.Fatal(err)
		}
	}
	put("old", `{"tier":"pro","shares":2,"requests_per_sec":5,"work_per_sec":0}`)
	put("tiny", `{"tier":"pro","shares":1,"requests_per_sec":0,"work_per_sec":0,"connections_per_sec":1e-9}`)
	if p, found, err := s.Get("old"); err != nil || !found || p != (Policy{Tier: "pro", Shares: 2, RequestsPerSec: 5}) {
		t.Fatalf("old policy: %+v %v %v", p, found, err)
	}
	p, err := s.Patch("old", Patch{ConnectionsPerSec: ptr(50.0)}, Default())
	if err != nil || p != (Policy{Tier: "pro", Shares: 2, RequestsPerSec: 5, ConnectionsPerSec: 50}) {
		t.Fatalf("patch connections_per_sec: %+v %v", p, err)
	}
	if p, err = s.Patch("old", Patch{Shares: ptr(3)}, Default()); err != nil || p.ConnectionsPerSec != 50 {
		t.Fatalf("patch of shares lost connections_per_sec: %+v %v", p, err)
	}
	if _, err := s.Patch("old", Patch{ConnectionsPerSec: ptr(-2.0)}, Default()); !errors.Is(err, ErrInvalid) ||
		!strings.Contains(err.Error(), "connections per second") {
		t.Fatalf("negative connections_per_sec: %v", err)
	}
	fixed, err := s.Repair()
	if err != nil || !strings.Contains(strings.Join(fixed["tiny"], ";"), "connections_per_sec 1e-09 -> 0.001") {
		t.Fatalf("repair: %v %v", fixed, err)
	}
	if p, _, _ = s.Get("old"); p.ConnectionsPerSec != 50 {
		t.Fatalf("after repair: %+v", p)
	}
}
