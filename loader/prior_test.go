// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// pinnedConf is the configuration the pinned programs enforce, as the
// maps in a pin directory hold it (the counts left out).
type pinnedConf struct {
	Pool, Floor, ExemptMax, Caps, Kinds uint32
	WindowNs                            uint64
	Quick                               [2]uint64
	Lens                                [2][2][4]uint8
	Events                              limiterFsEvcfg
	Exempt                              []uint64
	CapEntries                          map[uint32]uint32 // fs_caps' non-zero entries
	LivePools                           map[uint32]limiterFsDestConf
	Dests                               map[limiterFsDestKey]uint32 // in force: the trie's and the table's
	Heartbeat                           limiterFsLapse              // fs_lapses' daemon slot
}

// readPinnedConf reads pinnedConf from the maps pinned in pin.
func readPinnedConf(t *testing.T, pin string) pinnedConf {
	t.Helper()
	var l Limiter
	for name, dst := range map[string]**ebpf.Map{"fs_config": &l.objs.FsConfig, "fs_ev_config": &l.objs.FsEvConfig,
		"fs_exempt": &l.objs.FsExempt, "fs_caps": &l.objs.FsCaps, "fs_dpool_conf": &l.objs.FsDpoolConf,
		"fs_dests": &l.objs.FsDests, "fs_dnets": &l.objs.FsDnets, "fs_lapses": &l.objs.FsLapses} {
		m, err := ebpf.LoadPinnedMap(filepath.Join(pin, name), &ebpf.LoadPinOptions{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		*dst = m
	}
	var c pinnedConf
	var cfg limiterFsSettings
	if err := l.objs.FsConfig.Lookup(uint32(0), &cfg); err != nil {
		t.Fatal(err)
	}
	c.Pool, c.Floor, c.ExemptMax, c.Caps, c.Kinds = cfg.Pool, cfg.Floor, cfg.ExemptMax, cfg.Caps, cfg.DestKinds&destKindsMask
	c.WindowNs, c.Quick, c.Lens = cfg.WindowNs, cfg.DestQuick, cfg.DestLens
	if err := l.objs.FsEvConfig.Lookup(uint32(0), &c.Events); err != nil {
		t.Fatal(err)
	}
	var id uint64
	var one uint32
	for it := l.objs.FsExempt.Iterate(); it.Next(&id, &one); {
		c.Exempt = append(c.Exempt, id)
	}
	slices.Sort(c.Exempt)
	c.CapEntries = map[uint32]uint32{}
	k := uint32(0)
	if err := readArray(l.objs.FsCaps, func(v uint32) {
		if v != 0 {
			c.CapEntries[k] = v
		}
		k++
	}); err != nil {
		t.Fatal(err)
	}
	c.LivePools = map[uint32]limiterFsDestConf{}
	for id := uint32(1); id < l.objs.FsDpoolConf.MaxEntries(); id++ {
		var dc limiterFsDestConf
		if err := l.objs.FsDpoolConf.Lookup(id, &dc); err != nil {
			t.Fatal(err)
		}
		if dc.Flags&destLive != 0 {
			c.LivePools[id] = dc
		}
	}
	if err := l.objs.FsLapses.Lookup(lapseSlot, &c.Heartbeat); err != nil {
		t.Fatal(err)
	}
	trie, nets, err := l.destKeys()
	if err != nil {
		t.Fatal(err)
	}
	c.Dests = trie
	for k, v := range nets {
		c.Dests[k] = v
	}
	return c
}

// A start on reused pins that is refused once it has begun writing the
// new configuration leaves the configuration the pinned programs enforce
// as it was: the pool's size, floor and window, the destination pools, the
// exempt set, the fleet caps and the events' settings; and the heartbeat
// (a crash loop lets enforcement lapse). Refused by an
// exempt set it cannot use (checked before anything is written), and by a
// link it cannot move to its new program (after everything is).
func TestRefusedStartKeepsPinnedConfig(t *testing.T) {
	testutil.RequireRoot(t)
	for _, tc := range []struct {
		name   string
		break_ func(t *testing.T, pin string) // makes the start fail late
		exempt []string
	}{
		{name: "bad-exempt", exempt: []string{"/tmp"}},
		{name: "attach", break_: func(t *testing.T, pin string) {
			// A map pinned where the last link is: loading it as a
			// link fails once the other links run the new programs.
			path := filepath.Join(pin, "link_sk_lookup")
			if err := os.Remove(path); err != nil {
				t.Fatal(err)
			}
			testutil.PinMap(t, path)
			t.Cleanup(func() { os.Remove(path) }) // before the pin directory's Cleanup
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root, pin := newRoot(t), newPinDir(t)
			mkProject(t, root, "a")
			ex := filepath.Join(root, "exempt")
			if err := os.Mkdir(ex, 0o755); err != nil {
				t.Fatal(err)
			}
			l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: 10, Floor: 2, Window: 2 * time.Second,
				Exempt: []string{ex}, ExemptMax: 3,
				DestPools: []DestPool{destPoolOf(t, "db", 4, 1, "10.1.2.0/24:5432")}})
			if err != nil {
				t.Fatal(err)
			}
			if err := l.SetCaps("", map[string]int{"a": 2}, -1); err != nil {
				t.Fatal(err)
			}
			if err := l.SetEvents(9, false); err != nil {
				t.Fatal(err)
			}
			l.Close()
			before := readPinnedConf(t, pin)
			if before.Pool != 10 || len(before.Exempt) != 1 || len(before.CapEntries) == 0 || len(before.LivePools) != 1 || before.Events.PerSec != 9 {
				t.Fatalf("the first start's configuration is not in the pins: %+v", before)
			}
			if tc.break_ != nil {
				tc.break_(t, pin)
			}
			exempt := tc.exempt
			if exempt == nil {
				exempt = []string{filepath.Join(root, "a")}
			}
			_, err = openRoot(t, root, Options{PinDir: pin, PoolSize: 20, Floor: 5, Window: 3 * time.Second,
				Exempt: exempt, ExemptMax: 4, Events: &EventSettings{PerSec: 1, DryRun: true},
				DestPools: []DestPool{destPoolOf(t, "db", 8, 2, "10.1.3.0/24:5432"), destPoolOf(t, "web", 6, 1, "10.9.0.0/16:443")}})
			if err == nil {
				t.Fatal("the start succeeded")
			}
			if tc.break_ == nil && !errors.Is(err, ErrBadExempt) {
				t.Fatalf("the start failed with %v, want ErrBadExempt", err)
			}
			t.Logf("refused: %v", err)
			if after := readPinnedConf(t, pin); !reflect.DeepEqual(after, before) {
				t.Fatalf("the refused start changed the pinned configuration:\nbefore %+v\nafter  %+v", before, after)
			}
		})
	}
}

// Open writes the events' settings and the pool's dry-run (Options.Events)
// before its programs run and before its heartbeat: a pool in dry-run is
// never refused by them, and nothing the daemon's start could still fail on
// (and renew the heartbeat at each try) comes after Open. Without them,
// Open leaves what the pins hold.
func TestOpenWritesEvents(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	addr := sink(t, "tcp4", "127.0.0.1:0").Addr().String()
	dir := mkProject(t, root, "a")
	holder, prober := startHelper(t, dir), startHelper(t, dir)
	const pool = 2
	for i, tc := range []struct {
		events *EventSettings
		admit  bool
	}{
		{&EventSettings{PerSec: 3, DryRun: true}, true},
		{nil, true}, // as the pins hold them
		{&EventSettings{PerSec: 3}, false},
	} {
		l, err := openRoot(t, root, Options{PinDir: pin, PoolSize: pool, Events: tc.events})
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			if r := holder.dial("tcp4", addr, pool); r.ok != pool {
				t.Fatal(r)
			}
		}
		r := prober.dial("tcp4", addr, 1)
		prober.do("close")
		if tc.admit && r.ok != 1 || !tc.admit && r.refused != 1 {
			t.Fatalf("start %d (events %+v) with the pool full: %+v, want admitted %v", i, tc.events, r, tc.admit)
		}
		var c limiterFsEvcfg
		if err := l.objs.FsEvConfig.Lookup(uint32(0), &c); err != nil || c.PerSec != 3 {
			t.Fatalf("start %d: fs_ev_config %+v, %v; want 3 events a second", i, c, err)
		}
		l.Close()
	}
	holder.do("close")
}
