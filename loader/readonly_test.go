// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"errors"
	"testing"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// With the daemon's limiter closed (as after a stop or a SIGKILL), the
// pinned maps still count; OpenReadOnly reads the same numbers and cannot
// write.
func TestReadOnlyWhileNoDaemon(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	l := openLimiter(t, root, pin, 8, 1)
	ln := sink(t, "tcp4", "127.0.0.1:0")
	h := startHelper(t, mkProject(t, root, "alpha"))
	if r := h.dial("tcp4", ln.Addr().String(), 3); r.ok != 3 {
		t.Fatalf("dial: %+v", r)
	}
	want := snap(t, l)
	l.Close()

	if _, err := OpenReadOnly(t.TempDir()); !errors.Is(err, ErrNotPinned) {
		t.Fatalf("an empty directory: %v", err)
	}
	ro, err := OpenReadOnly(pin)
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	got, err := ro.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if got.InUse != 3 || got.Size != 8 || project(got, "alpha").InUse != 3 || got.Admitted != want.Admitted {
		t.Fatalf("read-only snapshot %+v, daemon's %+v", got, want)
	}
	if a, err := ro.KernelActive(); err != nil || a != 1 {
		t.Fatalf("kernel active %d %v", a, err)
	}
	if err := ro.l.objs.FsNode.Put(uint32(0), make([]byte, ro.l.objs.FsNode.ValueSize())); err == nil {
		t.Fatal("a write through the read-only maps succeeded")
	}
}
