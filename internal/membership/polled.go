// SPDX-License-Identifier: Apache-2.0

package membership

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// ErrNotRead is Scan's error from a Polled source whose first fetch has not
// ended yet.
var ErrNotRead = errors.New("not read yet")

// Polled is a source read by polling something slow or remote, such as a
// container runtime over its API (the Kubernetes source): the caller's
// Scan, which runs in the daemon's control loop at every tick and every
// wake, must not wait on it. A goroutine calls fetch at once and then every
// interval, each call bounded by the interval (or, after calls that ran out
// of it, by up to twice as long as the last, at most maxFetch, coming back
// by halves once the source answers quickly: a runtime slower than the
// interval is still read); Scan returns the last result
// without waiting, and Changed receives when a fetch found other members
// than the one before (or succeeded after an error). While fetch fails, Scan
// returns its error, and the caller keeps the members of the last good
// fetch in force and shows the error (status, the source_up metric).
type Polled struct {
	name    string
	fetch   func(context.Context) (Found, error)
	every   time.Duration
	changed chan struct{}
	kick    chan struct{} // Poke: fetch now
	limit   time.Duration // the next fetch's bound (run's goroutine only)
	start   sync.Once
	cancel  context.CancelFunc // set by Start
	done    chan struct{}

	mu    sync.Mutex // guards the fields below
	found Found
	err   error
}

// NewPolled starts polling fetch every interval for the source named name;
// Close stops it.
func NewPolled(name string, every time.Duration, fetch func(context.Context) (Found, error)) *Polled {
	p := PreparePolled(name, every, fetch)
	p.Start()
	return p
}

// PreparePolled is NewPolled without the start: for a source whose fetch
// calls the Polled itself (Signal), which must be stored where fetch finds
// it before the first fetch runs. Start begins the polling, once.
func PreparePolled(name string, every time.Duration, fetch func(context.Context) (Found, error)) *Polled {
	return &Polled{name: name, fetch: fetch, every: every, changed: make(chan struct{}, 1), kick: make(chan struct{}, 1),
		limit: every, done: make(chan struct{}), err: ErrNotRead}
}

// Start begins polling: the first fetch at once, then one every interval.
// Only the first call starts it.
func (p *Polled) Start() {
	p.start.Do(func() {
		ctx, cancel := context.WithCancel(context.Background())
		p.cancel = cancel
		go p.run(ctx)
	})
}

func (p *Polled) run(ctx context.Context) {
	defer close(p.done)
	t := time.NewTicker(p.every)
	defer t.Stop()
	for {
		p.poll(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-p.kick:
		}
	}
}

// Poke asks for a fetch now, without waiting for it: one at once if none
// is under way, else one more as soon as it ends. Pokes meanwhile
// coalesce, so a burst of them costs at most two fetches. A source that
// learns of a change between polls (a container runtime's events) pokes,
// and its members are read within a fetch rather than within a period.
func (p *Polled) Poke() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// maxFetch bounds a fetch whose bound has grown (Polled).
const maxFetch = 30 * time.Second

// poll runs one fetch and keeps its result.
func (p *Polled) poll(ctx context.Context) {
	limit := p.limit
	fctx, cancel := context.WithTimeout(ctx, limit)
	began := time.Now()
	f, err := p.fetch(fctx)
	took := time.Since(began)
	late := errors.Is(fctx.Err(), context.DeadlineExceeded)
	cancel()
	if ctx.Err() != nil {
		return // closing: the fetch was cut short, not failed
	}
	switch {
	case err != nil && late:
		err = fmt.Errorf("no answer within %s: %w", limit, err)
		// A source that answers, but slower than the interval, would
		// never be read: the next fetch may take twice as long.
		p.limit = min(2*limit, max(maxFetch, p.every))
	case err == nil:
		// Twice what this one took, and the interval at least, coming
		// down at most by half a fetch: back to the interval once the
		// source is quick again (a hung call cut as soon as before),
		// without cutting the next slow answer of a source whose
		// answers come slow and quick in turn.
		p.limit = min(max(2*took, limit/2, p.every), max(maxFetch, p.every))
	}
	p.mu.Lock()
	changed := false
	switch {
	case err != nil:
		p.err = err
	default:
		changed = p.err != nil || !slices.Equal(p.found.Members, f.Members) || !slices.Equal(p.found.Skipped, f.Skipped)
		p.found, p.err = f, nil
	}
	p.mu.Unlock()
	if changed {
		p.Signal()
	}
}

// Signal notifies Changed's reader now: for a source whose fetch found a
// change of something besides the members and the skipped cgroups (the
// kubernetes source's no-project pods and namespaces), which the
// comparison after the fetch does not see.
func (p *Polled) Signal() {
	select {
	case p.changed <- struct{}{}:
	default:
	}
}

// Name implements Source.
func (p *Polled) Name() string { return p.name }

// Scan implements Source: the last fetch's members, or its error.
func (p *Polled) Scan(context.Context) (Found, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		return Found{}, p.err
	}
	return Found{Members: slices.Clone(p.found.Members), Skipped: slices.Clone(p.found.Skipped)}, nil
}

// Changed implements Notifier.
func (p *Polled) Changed() <-chan struct{} { return p.changed }

// Close stops polling, cancelling a fetch under way, and waits for it.
func (p *Polled) Close() error {
	// A Polled never started has nothing to stop, and is never started
	// from here on.
	p.start.Do(func() { close(p.done) })
	if p.cancel != nil {
		p.cancel()
	}
	<-p.done
	return nil
}
