// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"io"
	"net"
	"testing"
)

// Sink serves ln until the test ends (then closes it): it accepts every
// connection and holds it, reading and discarding, until the peer closes
// it. Tests whose clients only need a peer that answers the handshake and
// stays connected use it. It returns ln.
func Sink(t testing.TB, ln net.Listener) net.Listener {
	t.Helper()
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				_, _ = io.Copy(io.Discard, c)
				c.Close()
			}()
		}
	}()
	return ln
}
