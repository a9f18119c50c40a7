// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/loader/limits"
)

// connections.reservation_ttl: the shipped default is the loader's, its
// bounds are the loader's, and a value outside them is refused naming the key.
func TestReservationTTL(t *testing.T) {
	c := Default()
	if c.Connections.ReservationTTL != limits.DefaultReservationTTL {
		t.Errorf("default reservation_ttl %s, loader's default %s", c.Connections.ReservationTTL, limits.DefaultReservationTTL)
	}
	for _, good := range []string{"0s", "100ms", "2m"} {
		c := Default()
		if err := Parse(strings.NewReader("connections: {reservation_ttl: "+good+"}\n"), &c); err != nil {
			t.Errorf("%s: %v", good, err)
		}
	}
	c = Default()
	if err := Parse(strings.NewReader("connections: {reservation_ttl: 250ms}\n"), &c); err != nil || c.Connections.ReservationTTL != 250*time.Millisecond {
		t.Errorf("250ms: %v, %s", err, c.Connections.ReservationTTL)
	}
	for _, bad := range []string{"99ms", "121s", "-1s"} {
		c := Default()
		err := Parse(strings.NewReader("connections: {reservation_ttl: "+bad+"}\n"), &c)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "connections.reservation_ttl") {
			t.Errorf("%s: %v, want ErrInvalid naming connections.reservation_ttl", bad, err)
		}
	}
}

// pools.connections.size is checked against the loader's limit when the
// file is read, not when the loader opens: a size the loader would refuse
// is refused here, naming the key.
func TestConnectionsPoolLimit(t *testing.T) {
	for _, c := range []struct {
		size int
		ok   bool
	}{{limits.MaxPoolSize, true}, {limits.MaxPoolSize + 1, false}} {
		cfg := Default()
		err := Parse(strings.NewReader(fmt.Sprintf("pools: {connections: {size: %d}}\n", c.size)), &cfg)
		if c.ok && err != nil {
			t.Errorf("size %d: %v", c.size, err)
		}
		if !c.ok && (!errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "pools.connections.size")) {
			t.Errorf("size %d: %v, want ErrInvalid naming pools.connections.size", c.size, err)
		}
	}
}

// connections.max_netns and max_netns_per_project: the shipped default is
// the loader's; 0, negative and past limits.MaxNetns are refused naming the
// key.
func TestMaxNetns(t *testing.T) {
	if c := Default(); c.Connections.MaxNetns != limits.DefaultMaxNetns {
		t.Errorf("default max_netns %d, loader's default %d", c.Connections.MaxNetns, limits.DefaultMaxNetns)
	}
	for v, ok := range map[int]bool{1: true, limits.MaxNetns: true, 0: false, -1: false, limits.MaxNetns + 1: false} {
		c := Default()
		err := Parse(strings.NewReader(fmt.Sprintf("connections: {max_netns: %d}\n", v)), &c)
		if ok && (err != nil || c.Connections.MaxNetns != v) {
			t.Errorf("%d: %v", v, err)
		}
		if !ok && (!errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "connections.max_netns")) {
			t.Errorf("%d: %v, want ErrInvalid naming connections.max_netns", v, err)
		}
	}
	for v, ok := range map[int]bool{1: true, limits.MaxNetns: true, 0: false, limits.MaxNetns + 1: false} {
		c := Default()
		err := Parse(strings.NewReader(fmt.Sprintf("connections: {max_netns_per_project: %d}\n", v)), &c)
		if ok && (err != nil || c.Connections.MaxNetnsPerProject != v) {
			t.Errorf("per project %d: %v", v, err)
		}
		if !ok && (!errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "connections.max_netns_per_project")) {
			t.Errorf("per project %d: %v, want ErrInvalid naming connections.max_netns_per_project", v, err)
		}
	}
}

// Every pool's size is bounded by what its kind can hold (MaxPoolSize and
// the others): the bound is accepted, one more is refused at load naming
// the key and the bound. Before, pools.requests.size 9223372036854775807
// was accepted (with a floor of 461168601842738790).
func TestPoolSizeBounds(t *testing.T) {
	for _, c := range []struct {
		pool string
		most int
	}{
		{PoolConnections, limits.MaxPoolSize},
		{PoolRequests, MaxRequestsPoolSize},
		{PoolFlights, MaxPoolSize},
		{PoolResidents, MaxPoolSize},
		{"uploads", MaxPoolSize},
	} {
		for _, size := range []int{c.most, c.most + 1, math.MaxInt64} {
			cfg := Default()
			err := Parse(strings.NewReader(fmt.Sprintf("pools: {%s: {size: %d}}\n", c.pool, size)), &cfg)
			key := "pools." + c.pool + ".size"
			if size == c.most {
				if err != nil {
					t.Errorf("%s %d: %v", key, size, err)
				}
				continue
			}
			if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), key) || !strings.Contains(err.Error(), fmt.Sprintf("at most %d", c.most)) {
				t.Errorf("%s %d: %v, want ErrInvalid naming %s and the bound %d", key, size, err, key, c.most)
			}
		}
	}
}
