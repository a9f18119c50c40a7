// SPDX-License-Identifier: Apache-2.0

package pools

import (
	"errors"
	"testing"
)

func TestDefaultFloor(t *testing.T) {
	for _, tc := range []struct{ size, want int }{
		{1, 1}, {19, 1}, {20, 1}, {39, 1}, {40, 2}, {100, 5}, {1000, 50},
	} {
		if got := DefaultFloor(tc.size); got != tc.want {
			t.Errorf("DefaultFloor(%d) = %d, want %d", tc.size, got, tc.want)
		}
	}
}

func TestEffectiveFloor(t *testing.T) {
	for _, tt := range []struct{ size, floor, want int }{{4096, 0, 204}, {10, 0, 1}, {8, 3, 3}, {1, 0, 1}} {
		if got := EffectiveFloor(tt.size, tt.floor); got != tt.want {
			t.Errorf("size %d floor %d: %d, want %d", tt.size, tt.floor, got, tt.want)
		}
	}
}

func TestShare(t *testing.T) {
	for _, tc := range []struct{ size, floor, active, want int }{
		{100, 5, 0, 100},
		{100, 5, -1, 100},
		{100, 5, 1, 100},
		{100, 5, 3, 33}, // integer division rounds down
		{100, 5, 20, 5},
		{100, 5, 21, 5}, // floor wins over 100/21 = 4
		{100, 5, 1000, 5},
		{8, 1, 2, 4},
	} {
		if got := Share(tc.size, tc.floor, tc.active); got != tc.want {
			t.Errorf("Share(%d, %d, %d) = %d, want %d", tc.size, tc.floor, tc.active, got, tc.want)
		}
	}
}

func TestAdmits(t *testing.T) {
	const size, floor, share = 10, 2, 5
	for _, tc := range []struct {
		inUse, held int
		want        bool
	}{
		{0, 0, true},
		{9, 4, true},   // under share: up to the last permit
		{10, 4, false}, // under share, pool full
		{7, 5, true},   // at share: below size - floor
		{8, 5, false},  // at share: the floor stays free
		{8, 9, false},
		{0, 9, true},
	} {
		if got := Admits(tc.inUse, tc.held, size, floor, share); got != tc.want {
			t.Errorf("Admits(inUse=%d, held=%d) = %v, want %v", tc.inUse, tc.held, got, tc.want)
		}
	}
}

func TestConfigValidation(t *testing.T) {
	for _, cfg := range []Config{
		{Size: 0}, {Size: -1}, {Size: 10, Floor: -1}, {Size: 10, Floor: 11}, {Size: 10, Window: -1},
	} {
		if _, err := New(cfg, nil); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("New(%+v) = %v, want ErrInvalidConfig", cfg, err)
		}
		if _, err := NewResidents(cfg, nil); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("NewResidents(%+v) = %v, want ErrInvalidConfig", cfg, err)
		}
	}
	p, err := New(Config{Name: "x", Size: 100}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s := p.Snapshot(); s.Floor != 5 || s.Size != 100 || s.Share != 100 || s.Name != "x" {
		t.Fatalf("defaults: %+v", s)
	}
	// Resize(0, 0) is valid (admits nobody: TestResizeZero); below 0, or
	// 0 with a floor, is not.
	for _, c := range [][2]int{{-1, 0}, {0, 1}, {3, 4}} {
		if err := p.Resize(c[0], c[1]); !errors.Is(err, ErrInvalidConfig) {
			t.Fatalf("Resize(%d, %d): %v", c[0], c[1], err)
		}
	}
}
