// SPDX-License-Identifier: Apache-2.0

package events

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
)

// Defaults of a Log.
const (
	DefaultLogMaxBytes = 64 << 20
	DefaultLogKeep     = 3
)

// Log writes events as JSON lines to a file, rotated by size: when the file
// would grow past MaxBytes it is renamed path.1 (path.1 to path.2, and so on,
// keeping Keep old files) and a new one is started. Safe for concurrent use.
type Log struct {
	path     string
	maxBytes int64
	keep     int

	mu   sync.Mutex // guards the fields below
	f    *os.File
	w    *bufio.Writer
	size int64
}

// OpenLog opens (appending) the log at path. maxBytes <= 0 and keep <= 0
// take the defaults. The file is created 0640.
func OpenLog(path string, maxBytes int64, keep int) (*Log, error) {
	if path == "" {
		return nil, errors.New("events log: no path")
	}
	if maxBytes <= 0 {
		maxBytes = DefaultLogMaxBytes
	}
	if keep <= 0 {
		keep = DefaultLogKeep
	}
	l := &Log{path: path, maxBytes: maxBytes, keep: keep}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("events log: %w", err)
	}
	if err := l.openLocked(); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *Log) openLocked() error {
	f, err := os.OpenFile(l.path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o640)
	if err != nil {
		return fmt.Errorf("events log: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("events log: %w", err)
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return fmt.Errorf("events log: %s is not a regular file", l.path)
	}
	l.f, l.w, l.size = f, bufio.NewWriterSize(f, 32<<10), st.Size()
	return nil
}

// Write appends e as one line, rotating first if the line would take the
// file past its size.
func (l *Log) Write(e Event) error {
	b, err := json.Marshal(e)
	if err != nil {
		return err
	}
	b = append(b, '\n')
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return errors.New("events log: closed")
	}
	if l.size > 0 && l.size+int64(len(b)) > l.maxBytes {
		if err := l.rotateLocked(); err != nil {
			return err
		}
	}
	n, err := l.w.Write(b)
	l.size += int64(n)
	return err
}

// Flush writes buffered lines to the file.
func (l *Log) Flush() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.w == nil {
		return nil
	}
	return l.w.Flush()
}

func (l *Log) rotateLocked() error {
	if err := l.w.Flush(); err != nil {
		return fmt.Errorf("events log: %w", err)
	}
	if err := l.f.Close(); err != nil {
		return fmt.Errorf("events log: %w", err)
	}
	l.f = nil
	for i := l.keep - 1; i >= 1; i-- {
		_ = os.Rename(l.path+"."+strconv.Itoa(i), l.path+"."+strconv.Itoa(i+1))
	}
	if err := os.Rename(l.path, l.path+".1"); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("events log: %w", err)
	}
	return l.openLocked()
}

// Close flushes and closes the file.
func (l *Log) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f == nil {
		return nil
	}
	err := errors.Join(l.w.Flush(), l.f.Close())
	l.f, l.w = nil, nil
	return err
}
