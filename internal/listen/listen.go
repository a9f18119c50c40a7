// SPDX-License-Identifier: Apache-2.0

package listen

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/peercred"
)

// Refusal reasons, as counted in Stats.Refused.
const (
	ReasonFull    = "listener_full" // MaxConns (less the reserve) reached
	ReasonUIDFull = "uid_full"      // the peer's uid holds MaxPerUID
)

// Backoff bounds of Accept after an error.
const (
	minBackoff = 5 * time.Millisecond
	maxBackoff = time.Second
	// errLogEvery is how often a run of accept errors that does not end is
	// logged again.
	errLogEvery = time.Minute
)

// Options configure Wrap.
type Options struct {
	// Name names the listener in logs and Stats ("front", "permits", ...).
	Name string
	// MaxConns bounds the connections open at once; 0 means no bound.
	MaxConns int
	// MaxPerUID bounds the connections open at once per peer uid, on unix
	// sockets; 0 means no bound.
	MaxPerUID int
	// Reserve is how many of MaxConns only privileged peers may use.
	Reserve int
	// Privileged reports whether a peer uid may use the reserve and is free
	// of MaxPerUID; nil means nobody is.
	Privileged func(uid uint32) bool
	// Refuse, if set, writes a short explanation to a connection past a
	// cap before it is closed. It runs with a write deadline of 100ms.
	Refuse func(c net.Conn, reason string)
	// Log receives accept errors and refusals; nil discards.
	Log *slog.Logger
}

// Stats are a listener's counters.
type Stats struct {
	Name         string
	Open         int // connections open now
	MaxConns     int
	MaxPerUID    int
	Accepted     uint64
	Refused      map[string]uint64 // by reason
	AcceptErrors uint64            // transient accept errors waited out
}

// Listener wraps a net.Listener with the backoff and caps of the package
// documentation. Its connections are *Conn.
type Listener struct {
	net.Listener
	opts Options

	done      chan struct{}
	closeOnce sync.Once

	mu        sync.Mutex // guards the fields below
	open      int
	perUID    map[uint32]int
	accepted  uint64
	refused   map[string]uint64
	errTotal  uint64
	errRun    uint64    // errors in the current run
	errSince  time.Time // start of the current run
	errLogged time.Time // when the run was last logged
}

// Wrap returns ln with backoff and caps.
func Wrap(ln net.Listener, opts Options) *Listener {
	if opts.Log == nil {
		opts.Log = slog.New(slog.DiscardHandler)
	}
	if opts.Reserve > opts.MaxConns {
		opts.Reserve = opts.MaxConns
	}
	return &Listener{Listener: ln, opts: opts, done: make(chan struct{}),
		perUID: map[uint32]int{}, refused: map[string]uint64{}}
}

// Close closes the listener; a pending Accept returns.
func (l *Listener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// Accept waits for the next connection within the caps. It returns an
// error only when the listener is closed.
func (l *Listener) Accept() (net.Conn, error) {
	var backoff time.Duration
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			select {
			case <-l.done:
				return nil, err
			default:
			}
			if errors.Is(err, net.ErrClosed) {
				return nil, err
			}
			backoff = min(max(2*backoff, minBackoff), maxBackoff)
			l.noteError(err, backoff)
			t := time.NewTimer(backoff)
			select {
			case <-t.C:
			case <-l.done:
				t.Stop()
				return nil, fmt.Errorf("listener %s: %w", l.opts.Name, net.ErrClosed)
			}
			continue
		}
		backoff = 0
		l.noteRecovery()
		if cc := l.admit(c); cc != nil {
			return cc, nil
		}
	}
}

// noteError counts a transient accept error and logs the first of a run.
func (l *Listener) noteError(err error, backoff time.Duration) {
	now := time.Now()
	l.mu.Lock()
	l.errTotal++
	l.errRun++
	first := l.errRun == 1
	if first {
		l.errSince = now
	}
	again := !first && now.Sub(l.errLogged) >= errLogEvery
	if first || again {
		l.errLogged = now
	}
	n, since := l.errRun, l.errSince
	l.mu.Unlock()
	switch {
	case first:
		l.opts.Log.Warn("accepting connections failed; backing off and retrying", "listener", l.opts.Name,
			"err", err, "backoff", backoff)
	case again:
		l.opts.Log.Warn("accepting connections still fails; retrying", "listener", l.opts.Name,
			"err", err, "errors", n, "for", time.Since(since).Round(time.Millisecond))
	}
}

// noteRecovery ends a run of accept errors.
func (l *Listener) noteRecovery() {
	l.mu.Lock()
	n, since := l.errRun, l.errSince
	l.errRun = 0
	l.mu.Unlock()
	if n > 0 {
		l.opts.Log.Info("accepting connections again", "listener", l.opts.Name, "errors", n,
			"for", time.Since(since).Round(time.Millisecond))
	}
}

// admit applies the caps to a freshly accepted connection: it returns it
// wrapped, or refuses and closes it and returns nil.
func (l *Listener) admit(c net.Conn) *Conn {
	var uid uint32
	hasUID := false
	if cr, err := peercred.Of(c); err == nil {
		uid, hasUID = cr.UID, true
	}
	priv := hasUID && l.opts.Privileged != nil && l.opts.Privileged(uid)
	l.mu.Lock()
	limit := l.opts.MaxConns
	if !priv {
		limit -= l.opts.Reserve
	}
	reason := ""
	switch {
	case l.opts.MaxConns > 0 && l.open >= limit:
		reason = ReasonFull
	case hasUID && !priv && l.opts.MaxPerUID > 0 && l.perUID[uid] >= l.opts.MaxPerUID:
		reason = ReasonUIDFull
	}
	if reason != "" {
		l.refused[reason]++
		open, perUID := l.open, l.perUID[uid]
		l.mu.Unlock()
		l.refuse(c, reason, uid, hasUID, open, perUID)
		return nil
	}
	l.open++
	if hasUID {
		l.perUID[uid]++
	}
	l.accepted++
	l.mu.Unlock()
	return &Conn{Conn: c, l: l, uid: uid, hasUID: hasUID}
}

func (l *Listener) refuse(c net.Conn, reason string, uid uint32, hasUID bool, open, perUID int) {
	args := []any{"listener", l.opts.Name, "reason", reason, "open", open, "max_conns", l.opts.MaxConns}
	if hasUID {
		args = append(args, "uid", uid, "uid_open", perUID, "max_per_uid", l.opts.MaxPerUID)
	} else if a := c.RemoteAddr(); a != nil {
		args = append(args, "peer", a.String())
	}
	l.opts.Log.Warn("connection refused: too many open connections", args...)
	if l.opts.Refuse != nil {
		c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
		l.opts.Refuse(c, reason)
	}
	c.Close()
}

func (l *Listener) release(c *Conn) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.open--
	if c.hasUID {
		if n := l.perUID[c.uid] - 1; n > 0 {
			l.perUID[c.uid] = n
		} else {
			delete(l.perUID, c.uid)
		}
	}
}

// Stats returns the listener's counters now.
func (l *Listener) Stats() Stats {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := Stats{Name: l.opts.Name, Open: l.open, MaxConns: l.opts.MaxConns, MaxPerUID: l.opts.MaxPerUID,
		Accepted: l.accepted, AcceptErrors: l.errTotal, Refused: make(map[string]uint64, len(l.refused))}
	for k, v := range l.refused {
		s.Refused[k] = v
	}
	return s
}

// Conn is a connection accepted through a Listener; closing it gives its
// place back. NetConn returns the connection it wraps, so peer lookups
// (SO_PEERCRED, sock_diag) still reach the socket.
type Conn struct {
	net.Conn
	l      *Listener
	uid    uint32
	hasUID bool
	once   sync.Once
}

// Close closes the connection and frees its place under the caps.
func (c *Conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.release(c) })
	return err
}

// NetConn returns the wrapped connection.
func (c *Conn) NetConn() net.Conn { return c.Conn }

// CloseWrite half-closes the connection when the wrapped one can, as
// net/http does before closing.
func (c *Conn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// PeerUID returns the peer's uid on a unix socket.
func (c *Conn) PeerUID() (uint32, bool) { return c.uid, c.hasUID }
