// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"bytes"
	"sync"
)

// Buffer is a bytes.Buffer that a test may read while another goroutine
// (a logger, a child's output pipe) writes to it.
type Buffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String is what was written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
