// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"testing"

	"github.com/cilium/ebpf"
)

// PinMap pins a new small map at path (on bpffs): a pin that is nobody's,
// or one that stands where a test wants a pin of another kind.
func PinMap(t testing.TB, path string) {
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

// Tree lists what is under dir, relative and sorted, directories ending in
// "/" (and a line saying so if it cannot be listed: the caller compares,
// and goes on to its other cases).
func Tree(t testing.TB, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if d.IsDir() {
			rel += "/"
		}
		out = append(out, rel)
		return nil
	})
	if err != nil {
		out = append(out, fmt.Sprintf("(listing failed: %v)", err))
	}
	slices.Sort(out)
	return out
}
