// SPDX-License-Identifier: Apache-2.0

package peercred

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
)

type wrapped struct{ net.Conn }

func (w wrapped) NetConn() net.Conn { return w.Conn }

func TestOfSeesThroughWrappers(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := net.Dial("unix", path)
		if err == nil {
			defer c.Close()
			var b [1]byte
			c.Read(b[:])
		}
	}()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cr, err := Of(wrapped{wrapped{c}})
	if err != nil {
		t.Fatal(err)
	}
	if int(cr.UID) != os.Geteuid() || int(cr.PID) != os.Getpid() {
		t.Errorf("cred %+v, want uid %d pid %d", cr, os.Geteuid(), os.Getpid())
	}
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if _, err := Of(a); !errors.Is(err, ErrNotUnix) {
		t.Errorf("a pipe: %v", err)
	}
}
