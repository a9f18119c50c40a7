// SPDX-License-Identifier: Apache-2.0

package netnsscan

import (
	"fmt"
	"os"
	"testing"
)

// BenchmarkIdentity is what the scan pays per process it reads: the inode
// of its namespace file alone (a stat: "inode"), and the inode and the
// namespace's id (an open, an fstat, NS_GET_ID and a close: "inode+id",
// what it reads where the kernel gives ids).
func BenchmarkIdentity(b *testing.B) {
	path := fmt.Sprintf("/proc/%d/ns/net", os.Getpid())
	b.Run("inode", func(b *testing.B) {
		for b.Loop() {
			if _, err := nsInode(path); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("inode+id", func(b *testing.B) {
		s := &Scanner{}
		for b.Loop() {
			if _, _, err := s.identity(path); err != nil {
				b.Fatal(err)
			}
		}
	})
}
