// SPDX-License-Identifier: Apache-2.0

package permitd_test

import (
	"context"
	"log/slog"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"

	"github.com/fairshare-dev/fairshare/internal/logrl"
	"github.com/fairshare-dev/fairshare/permitd"
	"github.com/fairshare-dev/fairshare/pools"
)

// countHandler counts the records that reach it.
type countHandler struct{ n *atomic.Int64 }

func (h countHandler) Enabled(context.Context, slog.Level) bool  { return true }
func (h countHandler) Handle(context.Context, slog.Record) error { h.n.Add(1); return nil }
func (h countHandler) WithAttrs([]slog.Attr) slog.Handler        { return h }
func (h countHandler) WithGroup(string) slog.Handler             { return h }

// TestSessionFloodLogsBounded: a member of the permits group opening and
// closing sessions in a loop does not write a line per session to the
// node's log: the lines go through the daemon's limiter of repeated lines.
// Before, they were audit lines, which the limiter always writes: 50,000
// sessions in 2 s wrote 75,000 lines, and journald's own limit then threw
// away the daemon's real errors. 2,000 sessions here.
func TestSessionFloodLogsBounded(t *testing.T) {
	var n atomic.Int64
	log := slog.New(logrl.New(countHandler{&n}, logrl.Options{}))
	fp, err := pools.New(pools.Config{Name: "flights", Size: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	rp, err := pools.NewResidents(pools.Config{Name: "residents", Size: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "permits.sock")
	srv, err := permitd.New(permitd.Config{Socket: sock}, map[string]*pools.Pool{"flights": fp}, rp, log)
	if err != nil {
		t.Fatal(err)
	}
	f := serveFixture(t, srv, fp, rp)
	const sessions = 2000
	for range sessions {
		c, err := net.Dial("unix", f.sock)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
	eventually(t, "the sessions counted", func() bool { s := srv.Snapshot(); return s.Counters.Sessions >= sessions && len(s.Sessions) == 0 })
	f.stop()
	if got := n.Load(); got > 100 {
		t.Errorf("%d sessions wrote %d log lines, want a bounded number (the limiter's burst and summaries)", sessions, got)
	}
}
