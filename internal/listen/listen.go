// SPDX-License-Identifier: Apache-2.0

package listen

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/sockdiag"
)

// Refusal reasons, as counted in Stats.Refused.
const (
	ReasonFull     = "listener_full" // MaxConns (less the reserve) reached
	ReasonPeerFull = "peer_full"     // the peer (Peer.Key) holds MaxPerPeer
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
	// MaxPerPeer bounds the connections open at once per peer (Peer.Key);
	// 0 means no bound.
	MaxPerPeer int
	// Reserve is how many of MaxConns only privileged peers may use.
	Reserve int
	// Privileged reports whether a peer uid, as the kernel reported it (not
	// folded), may use the reserve and is free of MaxPerPeer; nil means
	// nobody is.
	Privileged func(uid uint32) bool
	// Owners folds subordinate uids onto their owner in Peer.Key; nil
	// folds nothing.
	Owners *peercred.Owners
	// Classify, if set, may change a peer's key after the default
	// identification (see Peer), say to the peer's project.
	Classify func(c net.Conn, p *Peer)
	// Refuse, if set, writes a short explanation to a connection past a
	// cap before it is closed. It runs with a write deadline of 100ms.
	Refuse func(c net.Conn, reason string)
	// Log receives accept errors and refusals; nil discards.
	Log *slog.Logger
}

// Peer is who a connection comes from, as far as the caps are concerned.
type Peer struct {
	// Key names the peer's share of MaxPerPeer: "uid:N" for a local user
	// (N its uid, a subordinate uid folded onto its owner), "net:P" for a
	// remote TCP peer (P its address, an IPv6 peer's /64), or what
	// Options.Classify made of it. "" leaves the connection under MaxConns
	// only.
	Key string
	// UID is the peer's uid as the kernel reports it: SO_PEERCRED on a
	// unix socket, the owner of the client's socket (sock_diag) for a
	// loopback TCP peer. HasUID says whether it is known.
	UID    uint32
	HasUID bool
	// Cgroup is the cgroup id of a loopback TCP peer's socket; 0 when
	// unknown or not a loopback TCP peer.
	Cgroup uint64
	// Privileged peers may use Options.Reserve and are free of MaxPerPeer.
	Privileged bool
}

// Stats are a listener's counters.
type Stats struct {
	Name         string
	Open         int // connections open now
	Peers        int // distinct peers (Peer.Key) holding them
	MaxConns     int
	MaxPerPeer   int
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
	perPeer   map[string]int
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
		perPeer: map[string]int{}, refused: map[string]uint64{}}
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
	p := l.identify(c)
	l.mu.Lock()
	limit := l.opts.MaxConns
	if !p.Privileged {
		limit -= l.opts.Reserve
	}
	reason := ""
	switch {
	case l.opts.MaxConns > 0 && l.open >= limit:
		reason = ReasonFull
	case p.Key != "" && !p.Privileged && l.opts.MaxPerPeer > 0 && l.perPeer[p.Key] >= l.opts.MaxPerPeer:
		reason = ReasonPeerFull
	}
	if reason != "" {
		l.refused[reason]++
		open, held := l.open, l.perPeer[p.Key]
		l.mu.Unlock()
		l.refuse(c, reason, p, open, held)
		return nil
	}
	l.open++
	if p.Key != "" {
		l.perPeer[p.Key]++
	}
	l.accepted++
	l.mu.Unlock()
	return &Conn{Conn: c, l: l, peer: p}
}

// identify finds who c is from: see Peer.
func (l *Listener) identify(c net.Conn) Peer {
	var p Peer
	switch nc := peercred.Unwrap(c).(type) {
	case *net.UnixConn:
		if cr, err := peercred.Of(nc); err == nil {
			p.UID, p.HasUID = cr.UID, true
		}
	case *net.TCPConn:
		ra, ok1 := nc.RemoteAddr().(*net.TCPAddr)
		la, ok2 := nc.LocalAddr().(*net.TCPAddr)
		if !ok1 || !ok2 {
			break
		}
		addr := ra.AddrPort().Addr().Unmap()
		if !addr.IsLoopback() && addr != la.AddrPort().Addr().Unmap() {
			p.Key = "net:" + remoteKey(addr)
			break
		}
		// Loopback, or the host's own address at both ends: a process of
		// this host (kubelet probing a host-network pod at the node's
		// address comes so), which sock_diag names as on loopback. Taken
		// for a remote address, root's probes shared the places with
		// every pod that reaches the node's address.
		// The client's socket has our ends the other way round; the
		// kernel knows who made it.
		if s, err := sockdiag.Lookup(ra.AddrPort(), la.AddrPort()); err == nil {
			p.UID, p.HasUID, p.Cgroup = s.UID, true, s.CgroupID
		} else {
			// Gone already, or sock_diag unusable: such peers share one
			// place rather than none.
			p.Key = "net:" + addr.String()
		}
	}
	if p.HasUID {
		p.Key = UIDKey(l.opts.Owners.Owner(p.UID))
		p.Privileged = l.opts.Privileged != nil && l.opts.Privileged(p.UID)
	}
	if l.opts.Classify != nil {
		l.opts.Classify(c, &p)
	}
	return p
}

// UIDKey is the Peer.Key of a local user whose uid (folded) is owner.
func UIDKey(owner uint32) string { return "uid:" + strconv.FormatUint(uint64(owner), 10) }

// remoteKey is what counts as one remote peer: its address, or for IPv6 the
// /64 a host is usually given whole.
func remoteKey(a netip.Addr) string {
	if a = a.Unmap(); a.Is6() {
		return netip.PrefixFrom(a, 64).Masked().String()
	}
	return a.String()
}

func (l *Listener) refuse(c net.Conn, reason string, p Peer, open, held int) {
	args := []any{"listener", l.opts.Name, "reason", reason, "open", open, "max_conns", l.opts.MaxConns}
	if p.Key != "" {
		args = append(args, "peer", p.Key, "peer_open", held, "max_per_peer", l.opts.MaxPerPeer)
	}
	if p.HasUID {
		args = append(args, "uid", p.UID)
	} else if a := c.RemoteAddr(); a != nil && a.String() != "" {
		args = append(args, "addr", a.String())
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
	if k := c.peer.Key; k != "" {
		if n := l.perPeer[k] - 1; n > 0 {
			l.perPeer[k] = n
		} else {
			delete(l.perPeer, k)
		}
	}
}

// Stats returns the listener's counters now.
func (l *Listener) Stats() Stats {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := Stats{Name: l.opts.Name, Open: l.open, Peers: len(l.perPeer), MaxConns: l.opts.MaxConns, MaxPerPeer: l.opts.MaxPerPeer,
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
	l    *Listener
	peer Peer
	once sync.Once
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

// Peer returns who the connection is from, as the caps counted it.
func (c *Conn) Peer() Peer { return c.peer }

// PeerCgroup is the cgroup id of a loopback TCP client's socket as the
// listener found it (0 when it did not look or found none), so the server
// behind need not look again.
func (c *Conn) PeerCgroup() uint64 { return c.peer.Cgroup }
