// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// ConfigMapDir lays out a directory as kubelet mounts a ConfigMap volume:
// each key is a symlink through ..data to a timestamped directory holding
// the files, and an update writes a new timestamped directory and swaps
// ..data to it with one rename, so a reader sees the old files or the new
// ones, never a mix.
type ConfigMapDir struct {
	t   testing.TB
	Dir string
	gen int
}

// NewConfigMapDir returns an empty ConfigMap directory below the test's
// temporary directory.
func NewConfigMapDir(t testing.TB) *ConfigMapDir {
	return &ConfigMapDir{t: t, Dir: t.TempDir()}
}

// Path is where key is seen.
func (c *ConfigMapDir) Path(key string) string { return filepath.Join(c.Dir, key) }

// Write publishes the files (key -> content) as kubelet does an update.
func (c *ConfigMapDir) Write(files map[string]string) {
	c.t.Helper()
	c.gen++
	ts := filepath.Join(c.Dir, fmt.Sprintf("..2026_12_03_10_00_00.%09d", c.gen))
	if err := os.Mkdir(ts, 0o755); err != nil {
		c.t.Fatal(err)
	}
	for k, v := range files {
		if err := os.WriteFile(filepath.Join(ts, k), []byte(v), 0o644); err != nil {
			c.t.Fatal(err)
		}
	}
	tmp := filepath.Join(c.Dir, "..data_tmp")
	if err := os.Symlink(filepath.Base(ts), tmp); err != nil {
		c.t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(c.Dir, "..data")); err != nil {
		c.t.Fatal(err)
	}
	for k := range files {
		if _, err := os.Lstat(c.Path(k)); os.IsNotExist(err) {
			if err := os.Symlink(filepath.Join("..data", k), c.Path(k)); err != nil {
				c.t.Fatal(err)
			}
		}
	}
}
