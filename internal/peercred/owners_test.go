// SPDX-License-Identifier: Apache-2.0

package peercred

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Subordinate uids fold onto their owner (by name or uid); a uid outside
// every range, or just past one, is its own; a changed file is read again
// and a missing one folds nothing.
func TestOwnersFold(t *testing.T) {
	path := filepath.Join(t.TempDir(), "subuid")
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("nobody:100000:65536\n1000:165536:65536\n# comment\n\nno-such-user-fs:300000:10\nbad line\n")
	o := NewOwners(path)
	o.every = 0
	for uid, want := range map[uint32]uint32{
		100000: 65534, 165535: 65534, 165536: 1000, 231071: 1000, 231072: 231072,
		99999: 99999, 0: 0, 300000: 300000, 65534: 65534,
	} {
		if got := o.Owner(uid); got != want {
			t.Errorf("Owner(%d) = %d, want %d", uid, got, want)
		}
	}
	if n, err := o.Ranges(); n != 2 || err == nil || !strings.Contains(err.Error(), "line 5") {
		t.Errorf("ranges %d, err %v; want 2 and the bad owner on line 5 named", n, err)
	}
	write("0:100000:10\n") // root's containers: one peer with root
	if got := o.Owner(100005); got != 0 {
		t.Errorf("after the change: Owner(100005) = %d, want 0", got)
	}
	if got := o.Owner(165536); got != 165536 {
		t.Errorf("a range gone from the file still folds: %d", got)
	}
	os.Remove(path)
	if got := o.Owner(100005); got != 100005 {
		t.Errorf("without the file: Owner(100005) = %d", got)
	}
	var none *Owners
	if none.Owner(7) != 7 {
		t.Error("a nil Owners folds")
	}
}

// Overlapping ranges do not make a uid ambiguous: the earlier start keeps
// the overlap.
func TestOwnersOverlap(t *testing.T) {
	rs, err := parseSubUID([]byte("1:100:100\n2:150:100\n3:120:10\n"))
	if err != nil {
		t.Fatal(err)
	}
	o := &Owners{ranges: rs, path: "x"}
	o.checked = o.checked.AddDate(3000, 0, 0) // never reread
	for uid, want := range map[uint32]uint32{100: 1, 125: 1, 199: 1, 200: 2, 249: 2, 250: 250} {
		if got := o.Owner(uid); got != want {
			t.Errorf("Owner(%d) = %d, want %d (ranges %+v)", uid, got, want, rs)
		}
	}
}
