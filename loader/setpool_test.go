// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// SetPool moves POOL in the running programs (a fleet allotment): real
// connects are refused past the new size at once, a pool shrunk under what
// is held refuses until releases (nothing is closed), size 0 admits nobody,
// and a Tick keeps the size set.
func TestSetPool(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 8, 0)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "alpha"))
	if err := l.SetPool(3, 0); err != nil {
		t.Fatal(err)
	}
	if r := h.dial("tcp4", ln.Addr().String(), 5); r.ok != 3 || r.refused != 2 {
		t.Fatalf("pool 3: %+v", r)
	}
	if err := l.Tick(time.Now()); err != nil {
		t.Fatal(err)
	}
	if s := snap(t, l); s.Size != 3 || s.InUse != 3 {
		t.Fatalf("after a tick: %+v", s)
	}
	// Shrunk under in_use: the three stay, the next is refused.
	if err := l.SetPool(1, 0); err != nil {
		t.Fatal(err)
	}
	if r := h.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("pool 1 with 3 held: %+v", r)
	}
	if s := snap(t, l); s.InUse != 3 {
		t.Fatalf("held permits were taken back: %+v", s)
	}
	h.do("close")
	waitInUse(t, l, 0, map[string]int{"alpha": 0})
	if err := l.SetPool(0, 0); err != nil {
		t.Fatal(err)
	}
	if r := h.dial("tcp4", ln.Addr().String(), 1); r.refused != 1 {
		t.Fatalf("pool 0: %+v", r)
	}
	if err := l.SetPool(8, 0); err != nil {
		t.Fatal(err)
	}
	if r := h.dial("tcp4", ln.Addr().String(), 8); r.ok != 8 {
		t.Fatalf("pool 8 again: %+v", r)
	}
	if err := l.SetPool(1<<30, 0); !errors.Is(err, ErrInvalidOptions) {
		t.Fatalf("a size past the permit map: %v", err)
	}
}
