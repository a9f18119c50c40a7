// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/loader"
)

// connections.reservation_ttl: the shipped default is the loader's, its
// bounds are the loader's, and a value outside them is refused naming the key.
func TestReservationTTL(t *testing.T) {
	c := Default()
	if c.Connections.ReservationTTL != loader.DefaultReservationTTL {
		t.Errorf("default reservation_ttl %s, loader's default %s", c.Connections.ReservationTTL, loader.DefaultReservationTTL)
	}
	if MinReservationTTL != loader.MinReservationTTL || MaxReservationTTL != loader.MaxReservationTTL {
		t.Errorf("bounds %s..%s, loader's %s..%s", MinReservationTTL, MaxReservationTTL, loader.MinReservationTTL, loader.MaxReservationTTL)
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
