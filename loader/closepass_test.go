// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// TestCloseWaitsForReconcilePass: Close while reconcile passes run (the
// daemon's stop racing its control loop) waits for the pass under way, and
// a pass begun after it finds the limiter closed: every pass ends with its
// report or ErrClosed, never with an error from a map whose descriptor
// closed under it (nor, under -race, a race on the descriptors). Before,
// Close closed the descriptors under a running pass. Close at random
// moments, 6 rounds, two passes at a time, on the same pins.
func TestCloseWaitsForReconcilePass(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	for round := range 6 {
		l, err := Open(rootOptions(t, root, Options{PinDir: pin, PoolSize: 64}))
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		errs := make(chan error, 1000)
		passes := make(chan struct{}, 1000)
		for range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					_, err := l.Reconcile(context.Background())
					if err != nil {
						errs <- err
						return
					}
					select {
					case passes <- struct{}{}:
					default: // enough counted: never block a pass
					}
				}
			}()
		}
		// At least one pass done before the close, so that passes are
		// under way when it comes.
		select {
		case <-passes:
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d: no reconcile pass in 30s", round)
		}
		time.Sleep(time.Duration(rand.IntN(5000)) * time.Microsecond)
		if err := l.Close(); err != nil {
			t.Fatalf("round %d: Close: %v", round, err)
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if !errors.Is(err, ErrClosed) {
				t.Fatalf("round %d: a pass racing Close ended with %v, want ErrClosed", round, err)
			}
		}
	}
}
