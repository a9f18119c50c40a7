// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// HangFile points this process's descriptor of path (open already, by the
// code under test) to the FIFO fifo, made here with a pipe of 4 KiB, and
// returns the FIFO's reading end, not read until the test reads it: the
// writes to path block once the pipe is full, as on a hung file system.
func HangFile(t testing.TB, path, fifo string) *os.File {
	t.Helper()
	want, err := filepath.EvalSymlinks(path)
	if err != nil {
		t.Fatal(err)
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	fd := -1
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && l == want {
			if fd, err = strconv.Atoi(e.Name()); err != nil {
				t.Fatal(err)
			}
		}
	}
	if fd < 0 {
		t.Fatalf("no descriptor of %s", want)
	}
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := os.OpenFile(fifo, os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	w, err := unix.Open(fifo, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(w)
	if _, err := unix.FcntlInt(uintptr(w), unix.F_SETPIPE_SZ, 4096); err != nil {
		t.Fatal(err)
	}
	if err := unix.Dup3(w, fd, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	return r
}
