// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/user"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/internal/pace"
	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/internal/wire"
	"github.com/fairshare-dev/fairshare/pools"
)

// DefaultSocket is where the permit API listens when Config.Socket is empty;
// it is the client's default too (one definition, in internal/wire).
const DefaultSocket = wire.DefaultSocket

// DefaultMode is the socket's permission when Config.Mode is zero: owner and
// group may connect, others may not.
const DefaultMode os.FileMode = 0o660

// EvictionWait is how long a spawn waits for an object to be put to sleep
// before the pool refuses with TOO_MANY_RESIDENTS (the seed's one second).
const EvictionWait = time.Second

// MaxUnconfirmed is how many evictions in a row an owner may leave
// unconfirmed, of one project's objects, before the server puts that
// project's unconfirmed objects of the session to sleep without it
// (Server.evictionFailed). A runtime that is slow or busy now and then
// confirms most evictions; one that never does would otherwise keep its
// project over its share for ever, every other spawn refused.
const MaxUnconfirmed = 3

// maxRetry caps a retry hint: a project whose clients keep asking without
// waiting pushes its own return slots out, but not past this.
const maxRetry = time.Minute

// writeTimeout bounds how long an answer may wait on a client that does not
// read; such a client is disconnected rather than allowed to stall its reader.
const writeTimeout = 10 * time.Second

// Bounds of the operations that wait (acquire with wait_ms, a spawn that
// must wait for room or for a victim's owner), each of which holds a
// goroutine and a timer until it ends: past them an operation is answered
// TOO_MANY_WAITING at once. A runtime rarely needs more waiting at once than
// a pool has permits. The bound per user (the peer uid, subordinate uids
// folded onto their owner) is an eighth of the server's, so one member of
// the permit group, whatever number of sessions it opens, leaves most of
// the places to the others.
const (
	DefaultMaxWaiting           = 4096
	DefaultMaxWaitingPerUID     = 512
	DefaultMaxWaitingPerSession = 512
)

// The objects (resident or asleep) the server keeps at once, over all
// sessions and per user as the waiting bounds count them: each is kept until
// its owner removes it or its session ends, so without a bound a member of
// the permit group that spawns and puts to sleep names without end would
// grow the daemon until it is killed. Past either, a spawn of a new object
// answers TOO_MANY_OBJECTS.
const (
	DefaultMaxObjects       = 1 << 18
	DefaultMaxObjectsPerUID = 1 << 16
)

// MaxWaitMS caps wait_ms: a longer wait is taken as this one (ten minutes).
const MaxWaitMS = 10 * 60 * 1000

// MaxObjectLen bounds an object name, in bytes.
const MaxObjectLen = 1024

var (
	// ErrSocketInUse is returned when another server already answers on the socket path.
	ErrSocketInUse = errors.New("permit socket is in use by a live server")
	// ErrNoPools is returned by New when there is nothing to serve.
	ErrNoPools = errors.New("no pools to serve")
	// ErrServing is returned by Serve when it is called a second time.
	ErrServing = errors.New("server already served")
)

// Config configures the permit API's socket.
type Config struct {
	Socket string      // default DefaultSocket
	Mode   os.FileMode // default DefaultMode
	// Group may connect besides root and the daemon's user (the runtime's
	// group): a group name, or a numeric gid; "" = nobody else.
	Group string
	// MaxConns bounds the sessions open at once and MaxConnsPerPeer those of
	// one peer uid (package internal/listen); 0 means no bound.
	MaxConns, MaxConnsPerPeer int
	// Owners folds subordinate uids onto their owner for the per-peer
	// bounds; nil folds nothing.
	Owners *peercred.Owners
	// MaxWaiting bounds the operations waiting at once over all sessions,
	// MaxWaitingPerUID those of one peer (as MaxConnsPerPeer counts
	// them), MaxWaitingPerSession those of one session; 0 means
	// DefaultMaxWaiting, DefaultMaxWaitingPerUID and
	// DefaultMaxWaitingPerSession.
	MaxWaiting, MaxWaitingPerUID, MaxWaitingPerSession int
	// MaxObjects bounds the objects kept over all sessions,
	// MaxObjectsPerUID those of one peer; 0 means DefaultMaxObjects and
	// DefaultMaxObjectsPerUID.
	MaxObjects, MaxObjectsPerUID int
	// Events, if set, receives the refusals, would-be refusals (dry-run)
	// and evictions; it must not block.
	Events func(events.Event)
}

// Server serves pools over the permit protocol described in doc.go.
type Server struct {
	cfg       Config
	gid       int // group allowed to connect; -1 when none
	uid       int // the daemon's own uid, always allowed
	pools     map[string]*pools.Pool
	poolNames map[string]string // the names served, residents too: every session's interner reads it
	residents *pools.Residents
	log       *slog.Logger
	epoch     uint64 // high bits of every lease id, random per server
	pacer     *pace.Pacer
	// after starts a spawn's deadline; tests replace it with a timer they
	// fire themselves.
	after func(time.Duration) (<-chan time.Time, func() bool)
	// now is the clock a spawn reads to tell how much of its second had
	// passed when the victim's owner was asked (spawn); tests replace it.
	now func() time.Time
	// maxUnconfirmed is MaxUnconfirmed; 0 never drops (tests).
	maxUnconfirmed int

	nextLease   atomic.Uint64
	nextSession atomic.Uint64
	wg          sync.WaitGroup // sessions, their waiting operations and eviction notices

	mu        sync.Mutex // guards the fields below
	ln        *listen.Listener
	served    bool
	stopping  bool
	sessions  map[uint64]*session
	objects   map[string]*object
	sleepers  map[string][]chan struct{} // object -> spawns waiting for it to leave residence
	counters  Counters
	byCode    map[string]uint64
	evictions map[string]uint64 // reason -> evict events sent
	dropped   map[string]uint64 // project -> objects put to sleep without their owner (MaxUnconfirmed)
	waiting   int               // operations waiting, all sessions
	// waitingAcquires: of waiting, the acquires (spawnReserve).
	waitingAcquires int
	waitingBy       map[string]int // operations waiting by peer (session.peer)
	objectsBy       map[string]int // objects kept by peer (session.peer)
}

// object is a resident or sleeping object known through this server.
type object struct {
	project  string
	owner    *session
	lease    uint64 // 0 while sleeping
	resident bool   // resident as far as its owner knows
	evicting bool   // the pool counts it asleep; its owner was asked to confirm
	spawning bool
	// unconfirmed: its owner was asked to put it to sleep and did not
	// confirm in time; it is resident again, in its owner's
	// session.strikes, until it leaves residence.
	unconfirmed bool
	touched     time.Time
}

// New builds a server over the given pools. residents may be nil when the
// node serves no residents pool; pools may be empty when it serves only
// residents. A pool named ResidentsPool in pools is rejected, because that
// name routes acquire to spawn.
func New(cfg Config, pls map[string]*pools.Pool, residents *pools.Residents, log *slog.Logger) (*Server, error) {
	if len(pls) == 0 && residents == nil {
		return nil, ErrNoPools
	}
	if cfg.Socket == "" {
		cfg.Socket = DefaultSocket
	}
	if cfg.Mode == 0 {
		cfg.Mode = DefaultMode
	}
	if cfg.MaxWaiting <= 0 {
		cfg.MaxWaiting = DefaultMaxWaiting
	}
	if cfg.MaxWaitingPerSession <= 0 {
		cfg.MaxWaitingPerSession = DefaultMaxWaitingPerSession
	}
	if cfg.MaxWaitingPerUID <= 0 {
		cfg.MaxWaitingPerUID = DefaultMaxWaitingPerUID
	}
	if cfg.MaxObjects <= 0 {
		cfg.MaxObjects = DefaultMaxObjects
	}
	if cfg.MaxObjectsPerUID <= 0 {
		cfg.MaxObjectsPerUID = DefaultMaxObjectsPerUID
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{
		cfg:            cfg,
		gid:            -1,
		uid:            os.Geteuid(),
		pools:          make(map[string]*pools.Pool, len(pls)),
		residents:      residents,
		log:            log,
		pacer:          pace.New(maxRetry),
		after:          realAfter,
		now:            time.Now,
		maxUnconfirmed: MaxUnconfirmed,
		sessions:       map[uint64]*session{},
		objects:        map[string]*object{},
		sleepers:       map[string][]chan struct{}{},
		byCode:         map[string]uint64{},
		evictions:      map[string]uint64{},
		dropped:        map[string]uint64{},
		waitingBy:      map[string]int{},
		objectsBy:      map[string]int{},
	}
	for name, p := range pls {
		if name == "" || p == nil {
			return nil, fmt.Errorf("pool %q: empty name or nil pool", name)
		}
		if name == ResidentsPool {
			return nil, fmt.Errorf("pool %q: name is reserved for the residents pool", name)
		}
		s.pools[name] = p
	}
	s.poolNames = make(map[string]string, len(s.pools)+1)
	for name := range s.pools {
		s.poolNames[name] = name
	}
	if residents != nil {
		s.poolNames[ResidentsPool] = ResidentsPool
	}
	if cfg.Group != "" {
		gid, err := LookupGroup(cfg.Group)
		if err != nil {
			return nil, err
		}
		s.gid = gid
	}
	var e [8]byte
	if _, err := rand.Read(e[:]); err != nil {
		return nil, fmt.Errorf("reading lease epoch: %w", err)
	}
	// 21 bits of epoch above a 32-bit counter keeps ids below 2^53, exact in
	// every JSON implementation.
	s.epoch = (binary.LittleEndian.Uint64(e[:])&(1<<21-1) | 1) << 32
	return s, nil
}

// LookupGroup returns the gid of a group given by name or as a number.
func LookupGroup(name string) (int, error) {
	if gid, err := strconv.Atoi(name); err == nil {
		if gid < 0 {
			return 0, fmt.Errorf("permit socket group %q: a gid is not negative", name)
		}
		return gid, nil
	}
	g, err := user.LookupGroup(name)
	if err != nil {
		return 0, fmt.Errorf("looking up permit socket group %q: %w", name, err)
	}
	gid, err := strconv.Atoi(g.Gid)
	if err != nil {
		return 0, fmt.Errorf("group %q has non-numeric gid %q: %w", name, g.Gid, err)
	}
	return gid, nil
}

// Socket is the path the server listens on.
func (s *Server) Socket() string { return s.cfg.Socket }

// Listen creates the socket with its mode and group. Serve calls it when it
// was not called before; calling it first lets a caller know the socket is
// ready before clients dial.
func (s *Server) Listen() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln != nil {
		return nil
	}
	path := s.cfg.Socket
	ul, warn, err := listen.Unix(path, s.cfg.Mode, s.gid)
	if errors.Is(err, listen.ErrInUse) {
		return fmt.Errorf("listening on %s: %w", path, ErrSocketInUse)
	}
	if err != nil {
		return fmt.Errorf("permit socket: %w", err)
	}
	if warn != "" {
		s.log.Warn("the permit socket's intended users may not reach it", "socket", path, "problem", warn)
	}
	ln := listen.Wrap(ul, listen.Options{Name: "permits", MaxConns: s.cfg.MaxConns, MaxPerPeer: s.cfg.MaxConnsPerPeer,
		Owners: s.cfg.Owners, Refuse: refuseSession, Log: s.log})
	s.ln = ln
	return nil
}

// Serve accepts sessions until ctx is done, then closes every session, ends
// every lease and removes the socket before returning.
func (s *Server) Serve(ctx context.Context) error {
	if err := s.Listen(); err != nil {
		return err
	}
	s.mu.Lock()
	if s.served {
		s.mu.Unlock()
		return ErrServing
	}
	s.served = true
	ln := s.ln
	s.mu.Unlock()
	s.log.Info("permit api listening", "socket", s.cfg.Socket, "mode", s.cfg.Mode, "group", s.cfg.Group)

	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	// The listener waits out accept errors (out of descriptors, say) by
	// itself: Accept fails only once the listener is closed.
	var acceptErr error
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				acceptErr = fmt.Errorf("accepting permit session: %w", err)
			}
			break
		}
		s.startSession(ctx, c)
	}
	ln.Close()
	s.mu.Lock()
	s.stopping = true
	open := make([]*session, 0, len(s.sessions))
	for _, ss := range s.sessions {
		open = append(open, ss)
	}
	s.mu.Unlock()
	for _, ss := range open {
		ss.conn.Close()
	}
	s.wg.Wait()
	return acceptErr
}

// Close closes a socket Listen made that Serve never served (and removes
// it): a daemon whose start failed after Listen leaves no socket behind.
// After Serve began it does nothing; Serve closes its socket when its
// context ends.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ln == nil || s.served {
		return nil
	}
	err := s.ln.Close()
	s.ln = nil
	return err
}

// refuseSession tells a connection past the listener's caps why it is
// closed, in the protocol's own words.
func refuseSession(c net.Conn, reason string) {
	msg := "too many permit sessions are open"
	if reason == listen.ReasonPeerFull {
		msg = "too many permit sessions are open for this user"
	}
	io.WriteString(c, string(appendResponse(nil, &response{Code: CodeTooManySessions, Error: msg + "; closing"})))
}

// ListenerStats returns the socket's connection counters.
func (s *Server) ListenerStats() (listen.Stats, bool) {
	s.mu.Lock()
	ln := s.ln
	s.mu.Unlock()
	if ln == nil {
		return listen.Stats{}, false
	}
	return ln.Stats(), true
}

func (s *Server) startSession(ctx context.Context, c net.Conn) {
	cred, err := peercred.Of(c)
	if err != nil {
		s.log.Warn("permit session without peer credentials", "err", err)
		c.Close()
		return
	}
	ss := newSession(s, c, cred)
	ss.peer = listen.UIDKey(s.cfg.Owners.Owner(cred.UID))
	if lc, ok := c.(*listen.Conn); ok && lc.Peer().Key != "" {
		ss.peer = lc.Peer().Key
	}
	if !s.allowed(cred) {
		s.log.Warn("permit session refused", "pid", cred.PID, "uid", cred.UID, "gid", cred.GID)
		c.SetWriteDeadline(time.Now().Add(time.Second))
		c.Write(appendResponse(nil, &response{Code: CodeForbidden, Error: "peer is not root, the daemon's user, or in the permit group"}))
		c.Close()
		return
	}
	s.mu.Lock()
	if s.stopping {
		s.mu.Unlock()
		c.Close()
		return
	}
	s.sessions[ss.id] = ss
	s.counters.Sessions++
	s.mu.Unlock()
	// Not an audit line (those are never limited): any member of the
	// group may open and close sessions in a loop, and the node's log
	// would carry every one. Limited, a flood comes out as a summary.
	s.log.Info("permit session opened", "session", ss.id, "pid", cred.PID, "uid", cred.UID, "gid", cred.GID)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		ss.run(ctx)
		s.endSession(ss)
	}()
}

func (s *Server) allowed(c Cred) bool {
	if c.UID == 0 || int(c.UID) == s.uid {
		return true
	}
	if s.gid < 0 {
		return false
	}
	return int(c.GID) == s.gid || inGroup(c.PID, s.gid)
}

// newLease returns the next lease id: unique among the leases a session
// holds (session.addLease), and of this server (its epoch).
func (s *Server) newLease() uint64 {
	return s.epoch | s.nextLease.Add(1)&(1<<32-1)
}

// endSession ends everything the session held: its leases go back to their
// pools and its objects leave the residents pool.
func (s *Server) endSession(ss *session) {
	leases := ss.close()
	var released, removed int
	for id, l := range leases {
		if l.pool != nil {
			if err := l.pool.Release(l.permit); err != nil {
				s.log.Error("releasing lease of closed session", "session", ss.id, "lease", id, "err", err)
			}
			released++
		}
	}
	s.mu.Lock()
	delete(s.sessions, ss.id)
	var gone []string
	for name, o := range ss.owned {
		if !o.spawning {
			gone = append(gone, name)
			s.dropObjectLocked(name)
		}
	}
	s.mu.Unlock()
	for _, name := range gone {
		if err := s.residents.Remove(name); err != nil {
			s.log.Error("removing object of closed session", "session", ss.id, "object", name, "err", err)
		}
		removed++
		s.wakeSleepers(name)
	}
	s.log.Info("permit session closed", "session", ss.id, "pid", ss.cred.PID, "leases_released", released, "objects_removed", removed)
}

// wakeSleepers tells spawns waiting on object that it left residence.
func (s *Server) wakeSleepers(object string) {
	s.mu.Lock()
	ws := s.sleepers[object]
	delete(s.sleepers, object)
	s.mu.Unlock()
	for _, ch := range ws {
		close(ch)
	}
}

// addObjectLocked records a new object of ss under name, or says why it
// cannot (the object bounds).
func (s *Server) addObjectLocked(ss *session, name string, o *object) string {
	if n := s.objectsBy[ss.peer]; n >= s.cfg.MaxObjectsPerUID {
		return fmt.Sprintf("your user already keeps %d objects over all its sessions (at most %d); remove some", n, s.cfg.MaxObjectsPerUID)
	}
	if n := len(s.objects); n >= s.cfg.MaxObjects {
		return fmt.Sprintf("the server already keeps %d objects (at most %d); retry later", n, s.cfg.MaxObjects)
	}
	s.objects[name] = o
	ss.owned[name] = o
	s.objectsBy[ss.peer]++
	return ""
}

// dropObjectLocked forgets object name, of whichever session.
func (s *Server) dropObjectLocked(name string) {
	o := s.objects[name]
	if o == nil {
		return
	}
	delete(s.objects, name)
	ss := o.owner
	delete(ss.owned, name)
	s.confirmedLocked(name, o, false)
	if n := s.objectsBy[ss.peer] - 1; n > 0 {
		s.objectsBy[ss.peer] = n
	} else {
		delete(s.objectsBy, ss.peer)
	}
}

// Kinds of waiting operations (startWait).
const (
	waitAcquire = false
	waitSpawn   = true
)

// spawnReserve is the part of the server's bound of waiting operations
// (Config.MaxWaiting) that only spawns may take: a quarter. An acquire may
// wait ten minutes and a spawn at most a second, so without it a flood of
// acquire waits held every place, and every spawn that had to wait for a
// victim's owner was refused TOO_MANY_WAITING, evictions and all.
func spawnReserve(maxWaiting int) int { return maxWaiting / 4 }

// startWait takes a place for a waiting operation of ss (waitAcquire or
// waitSpawn), or says why there is none.
func (s *Server) startWait(ss *session, spawn bool) string {
	if n := ss.waiting.Add(1); n > int64(s.cfg.MaxWaitingPerSession) {
		ss.waiting.Add(-1)
		return fmt.Sprintf("this session already has %d operations waiting (at most %d); retry when one has ended",
			n-1, s.cfg.MaxWaitingPerSession)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := s.waitingBy[ss.peer]; n >= s.cfg.MaxWaitingPerUID {
		ss.waiting.Add(-1)
		return fmt.Sprintf("your user already has %d operations waiting over all its sessions (at most %d); retry when one has ended",
			n, s.cfg.MaxWaitingPerUID)
	}
	if s.waiting >= s.cfg.MaxWaiting {
		ss.waiting.Add(-1)
		return fmt.Sprintf("the server already has %d operations waiting (at most %d); retry later", s.waiting, s.cfg.MaxWaiting)
	}
	if limit := s.cfg.MaxWaiting - spawnReserve(s.cfg.MaxWaiting); !spawn && s.waitingAcquires >= limit {
		ss.waiting.Add(-1)
		return fmt.Sprintf("the server already has %d acquires waiting (at most %d, the rest of its %d places being kept for spawns); retry later",
			s.waitingAcquires, limit, s.cfg.MaxWaiting)
	}
	s.waitingBy[ss.peer]++
	s.waiting++
	if !spawn {
		s.waitingAcquires++
	}
	return ""
}

// endWait gives back a place taken by startWait for the same kind.
func (s *Server) endWait(ss *session, spawn bool) {
	ss.waiting.Add(-1)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.waiting--
	if !spawn {
		s.waitingAcquires--
	}
	if n := s.waitingBy[ss.peer] - 1; n > 0 {
		s.waitingBy[ss.peer] = n
	} else {
		delete(s.waitingBy, ss.peer)
	}
}

func (s *Server) countCode(code string) {
	s.mu.Lock()
	s.byCode[code]++
	s.mu.Unlock()
}

// sortedKeys returns the keys of m in order, for stable snapshots.
func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}
