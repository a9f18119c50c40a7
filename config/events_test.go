// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fairshare-dev/fairshare/events"
)

// TestEventsAndEnforce: the events keys are checked at load, each error
// naming its key; a pool's enforce defaults to true, also when a file gives
// the pool without it, and residents cannot be put in dry-run.
func TestEventsAndEnforce(t *testing.T) {
	c := Default()
	if c.Events.Log != "" || c.Events.LogMaxBytes != events.DefaultLogMaxBytes || c.Events.LogKeep != events.DefaultLogKeep {
		t.Fatalf("defaults disagree with package events: %+v", c.Events)
	}
	for _, name := range c.PoolNames() {
		if !c.Pools[name].Enforced() {
			t.Fatalf("pools.%s not enforced by default", name)
		}
	}
	if err := Parse(strings.NewReader("pools:\n  requests: {size: 10}\n  flights: {size: 5, enforce: false}\n"), &c); err != nil {
		t.Fatal(err)
	}
	if !c.Pools[PoolRequests].Enforced() || c.Pools[PoolFlights].Enforced() {
		t.Fatalf("enforce: requests %v flights %v", c.Pools[PoolRequests].Enforce, c.Pools[PoolFlights].Enforce)
	}
	dir := t.TempDir()
	if err := os.Mkdir(filepath.Join(dir, "d"), 0o700); err != nil {
		t.Fatal(err)
	}
	for bad, key := range map[string]string{
		"events: {log: relative.log}\n":                    "events.log",
		"events: {log: " + filepath.Join(dir, "d") + "}\n": "events.log",
		"events: {log_max_bytes: 100}\n":                   "events.log_max_bytes",
		"events: {log_keep: 0}\n":                          "events.log_keep",
		"events: {recent: 0}\n":                            "events.recent",
		"events: {per_sec: 0}\n":                           "events.per_sec",
		"pools: {residents: {size: 4, enforce: false}}\n":  "pools.residents.enforce",
	} {
		c := Default()
		err := Parse(strings.NewReader(bad), &c)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), key) {
			t.Errorf("%q: %v, want ErrInvalid naming %s", bad, err, key)
		}
	}
	c = Default()
	good := "events: {log: " + filepath.Join(dir, "events.log") + ", log_keep: 5}\n"
	if err := Parse(strings.NewReader(good), &c); err != nil {
		t.Fatal(err)
	}
}
