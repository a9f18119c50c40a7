// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/loader"
	"github.com/fairshare-dev/fairshare/policy"
)

// restorePins removes, on real bpffs, exactly what a failed start added:
// in a directory that held pins, the new pins and directories (deepest
// first), keeping the old ones; a directory that did not exist goes whole.
// (The e2e TestRefusedStartWritesNothing covers the starts refused before
// anything is pinned; this covers a failure after the loader pinned.)
func TestRestorePins(t *testing.T) {
	testutil.RequireRoot(t)
	dir := filepath.Join("/sys/fs/bpf", fmt.Sprintf("fairshare-restore-%d", os.Getpid()))
	t.Cleanup(func() { os.RemoveAll(dir) })
	pin := func(path string) {
		t.Helper()
		m, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if err := m.Pin(path); err != nil {
			t.Fatal(err)
		}
	}
	entries := func() []string {
		l := listPins(dir)
		var out []string
		for p := range l.entries {
			out = append(out, p)
		}
		slices.Sort(out)
		return out
	}

	// Fresh: the directory did not exist.
	before := listPins(dir)
	if err := os.MkdirAll(filepath.Join(dir, "netns"), 0o700); err != nil {
		t.Fatal(err)
	}
	pin(filepath.Join(dir, "fs_a"))
	pin(filepath.Join(dir, "netns", "link_x"))
	if err := restorePins(dir, before); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("a fresh pin directory is still there after the restore: %v %v", err, entries())
	}

	// Used: the old pins stay, the new ones go.
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	pin(filepath.Join(dir, "fs_old"))
	before = listPins(dir)
	pin(filepath.Join(dir, "fs_new"))
	if err := os.MkdirAll(filepath.Join(dir, "netns"), 0o700); err != nil {
		t.Fatal(err)
	}
	pin(filepath.Join(dir, "netns", "link_y"))
	if err := restorePins(dir, before); err != nil {
		t.Fatal(err)
	}
	if got := entries(); !slices.Equal(got, []string{"fs_old"}) {
		t.Errorf("after the restore the used directory holds %v, want [fs_old]", got)
	}

	// A committed migration's pins stay for the next start to move in
	// place; a migration's staging pins go.
	before = listPins(dir)
	for _, d := range []string{loader.MigratedDir, "migrating"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
		pin(filepath.Join(dir, d, "fs_b"))
	}
	if err := restorePins(dir, before); err != nil {
		t.Fatal(err)
	}
	if got := entries(); !slices.Equal(got, []string{"fs_old", "migrated", "migrated/fs_b"}) {
		t.Errorf("after the restore of a failed migration the directory holds %v, want fs_old and migrated/fs_b", got)
	}
}

// TestPinsReplaced: the lock's directory (lockPins, loader.PinDirReplaced) is still the pin directory until
// it is removed, or another directory takes its name.
func TestPinsReplaced(t *testing.T) {
	for _, how := range []string{"removed", "renamed and made again"} {
		dir := filepath.Join(t.TempDir(), "pins")
		if err := os.Mkdir(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		f, err := lockPins(dir)
		if err != nil {
			t.Fatal(err)
		}
		if gone, err := loader.PinDirReplaced(f, dir); gone || err != nil {
			t.Fatalf("%s: before: gone %v, %v", how, gone, err)
		}
		if how == "removed" {
			err = os.Remove(dir)
		} else if err = os.Rename(dir, dir+".old"); err == nil {
			err = os.Mkdir(dir, 0o700)
		}
		if err != nil {
			t.Fatal(err)
		}
		if gone, err := loader.PinDirReplaced(f, dir); !gone || err != nil {
			t.Errorf("%s: gone %v, %v; want gone", how, gone, err)
		}
		f.Close()
	}
}

// TestStartsSerialisedOnAFreshNode: two daemons starting at once on a node
// with no pin directory yet. The second waits for the first's start to be
// over, whether or not the first has made the directory yet (its loader
// makes it long before the daemon locks it), then is refused if the first
// made and locked the directory (it would have written over the first's
// pins, and its rollback removed them), or goes on if the first's start
// failed and left none.
func TestStartsSerialisedOnAFreshNode(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		madeEarly, makesPins bool
	}{{"first makes its pins", false, true}, {"first made the directory before the second came", true, true},
		{"first fails", false, false}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "pins")
			pinA, startA, err := lockForStart(dir)
			if err != nil || pinA != nil || startA == nil {
				t.Fatalf("the first start: %v %v %v, want a start lock alone", pinA, startA, err)
			}
			if tc.madeEarly {
				if err := os.Mkdir(dir, 0o700); err != nil {
					t.Fatal(err)
				}
			}
			type result struct {
				pin, start *os.File
				err        error
			}
			second := make(chan result, 1)
			go func() {
				p, s, err := lockForStart(dir)
				second <- result{p, s, err}
			}()
			select {
			case r := <-second:
				t.Fatalf("the second start went on during the first's: %+v", r)
			case <-time.After(300 * time.Millisecond):
			}
			if tc.makesPins {
				if !tc.madeEarly {
					if err := os.Mkdir(dir, 0o700); err != nil {
						t.Fatal(err)
					}
				}
				if pinA, err = lockPins(dir); err != nil || pinA == nil {
					t.Fatalf("the first start's lock on its pins: %v %v", pinA, err)
				}
				defer pinA.Close()
			}
			startA.Close()
			r := <-second
			switch {
			case tc.makesPins && !errors.Is(r.err, ErrPinsInUse):
				t.Fatalf("the second start beside a running first: %+v, want ErrPinsInUse", r)
			case !tc.makesPins && (r.err != nil || r.pin != nil || r.start == nil):
				t.Fatalf("the second start after a failed first: %+v, want a start lock", r)
			}
			if r.start != nil {
				r.start.Close()
			}
			if r.pin != nil {
				r.pin.Close()
			}
		})
	}
}

// TestCallsPastCloseFindItClosed: an admin call or a scrape still running
// when the daemon closes (http.Server.Close does not wait for handlers past
// the shutdown's grace) reads the kernel side and the store while they
// close, in every order: each gets an error or an answer, never a nil
// pointer, and a reload after the close applies nothing.
func TestCallsPastCloseFindItClosed(t *testing.T) {
	testutil.RequireRoot(t)
	for round := range 5 {
		root := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-pastclose-")
		pin := filepath.Join("/sys/fs/bpf", filepath.Base(root))
		t.Cleanup(func() { loader.Cleanup(pin) })
		var cfg config.Config
		d, _, _ := newTestDaemon(t, func(c *config.Config) {
			c.BPF, c.PinDir, c.ProjectsRoot, c.Tick = true, pin, root, time.Minute
			c.Projects.Sources = []string{"directory"}
			c.Pools["db"] = config.Pool{Size: 4, Destinations: []string{"127.0.0.1/32:15432"}}
			cfg = *c
		})
		var wg sync.WaitGroup
		stop := make(chan struct{})
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					d.Status(t.Context())
					d.apply("alpha", policy.Policy{Shares: 1, RequestsPerSec: 10})
					select {
					case <-stop:
						return
					default:
					}
				}
			}()
		}
		time.Sleep(time.Duration(round) * time.Millisecond)
		if err := d.Close(); err != nil {
			t.Fatalf("round %d: close: %v", round, err)
		}
		close(stop)
		wg.Wait()
		if _, err := d.Status(t.Context()); err == nil {
			t.Errorf("round %d: status of a closed daemon answered", round)
		}
		if err := d.Reload(cfg); !errors.Is(err, errStopping) {
			t.Errorf("round %d: reload after close: %v, want %v", round, err, errStopping)
		}
	}
}

// TestDryRunSetsNeverGoBack: policies changing a project's dry-run from
// several goroutines at once (admin calls, the control loop's tick) leave
// the kernel's dry-run set equal to the last one asked for, in every
// order: a write of an older copy of the set after a newer one put a
// project back as it was.
func TestDryRunSetsNeverGoBack(t *testing.T) {
	testutil.RequireRoot(t)
	root := testutil.TempCgroup(t, testutil.Cgroup2Mount(t), "fairshare-dryrun-")
	pin := filepath.Join("/sys/fs/bpf", filepath.Base(root))
	t.Cleanup(func() { loader.Cleanup(pin) })
	projects := []string{"p0", "p1", "p2", "p3", "p4", "p5"}
	for _, p := range projects {
		if err := os.Mkdir(filepath.Join(root, p), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	d, _, _ := newTestDaemon(t, func(c *config.Config) {
		c.BPF, c.PinDir, c.ProjectsRoot, c.Tick = true, pin, root, time.Minute
		c.Projects.Sources = []string{"directory"}
	})
	m, err := ebpf.LoadPinnedMap(filepath.Join(pin, "fs_dryrun"), &ebpf.LoadPinOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for round := range 200 {
		var wg sync.WaitGroup
		for i, p := range projects {
			wg.Add(2)
			go func() {
				defer wg.Done()
				d.kernel.setDryRun(p, (round+i)%2 == 0)
			}()
			go func() {
				defer wg.Done()
				d.kernel.syncDryRun() // the tick's
			}()
		}
		wg.Wait()
		var id uint64
		var v uint32
		in := map[uint64]bool{}
		for it := m.Iterate(); it.Next(&id, &v); {
			in[id] = true
		}
		snap, err := d.kernel.lim.Snapshot()
		if err != nil {
			t.Fatal(err)
		}
		ids := map[string]uint64{}
		for _, p := range snap.Projects {
			ids[p.Project] = uint64(p.ID)
		}
		want := map[uint64]bool{}
		for p := range d.kernel.dry {
			if ids[p] == 0 {
				t.Fatalf("no id for project %s in %+v", p, snap.Projects)
			}
			want[ids[p]] = true
		}
		if !maps.Equal(in, want) {
			t.Fatalf("round %d: the kernel's dry-run set %v, asked for %v (%v)", round, in, want, d.kernel.dry)
		}
	}
}
