// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fairshare-dev/fairshare/internal/wire"
	"github.com/fairshare-dev/fairshare/pools"
)

// lease is one permit held by a session. pool is nil for a resident's lease,
// whose permit lives in the residents pool under object.
type lease struct {
	pool    *pools.Pool
	permit  pools.Permit
	project string
	object  string
}

// session is one client connection and everything it holds.
type session struct {
	id     uint64
	srv    *Server
	conn   net.Conn
	cred   Cred
	peer   string // the peer as the listener's caps count it (listen.Peer.Key)
	opened time.Time
	ctx    context.Context // done when the connection closes
	cancel context.CancelFunc

	requests atomic.Uint64
	waiting  atomic.Int64 // operations of this session waiting (Server.startWait)

	names interner // used by the reader goroutine only

	wmu sync.Mutex // serialises writes of inline answers, late answers and events

	// owned: the objects of this session, guarded by the server's mu.
	owned map[string]*object
	// strikes: per project, the evictions of this session's objects left
	// unconfirmed since it last confirmed one, and the objects they left
	// resident (MaxUnconfirmed); guarded by the server's mu, nil until
	// one is left unconfirmed.
	strikes map[string]*strikes

	mu     sync.Mutex       // guards the fields below
	leases map[uint64]lease // by value: a grant allocates no lease
	closed bool
}

func newSession(s *Server, c net.Conn, cred Cred) *session {
	ctx, cancel := context.WithCancel(context.Background())
	return &session{
		id:     s.nextSession.Add(1),
		srv:    s,
		conn:   c,
		cred:   cred,
		opened: time.Now(),
		ctx:    ctx,
		cancel: cancel,
		leases: map[uint64]lease{},
		owned:  map[string]*object{},
		names:  interner{pools: s.poolNames},
	}
}

// run reads requests until the connection ends. Answers to non-blocking
// requests are batched and written when the reader has nothing more buffered,
// which is what makes a pipelining client cheap: one write per burst.
func (ss *session) run(ctx context.Context) {
	defer ss.cancel()
	stop := context.AfterFunc(ctx, func() { ss.conn.Close() })
	defer stop()
	r := &lineReader{rd: ss.conn}
	var out []byte
	var rq request
	var settle []response // spawns answered in out, settled once it is written
	for {
		line, err := r.readLine()
		if errors.Is(err, errLineTooLong) {
			out = appendResponse(out, &response{Code: CodeLineTooLong, Error: "request line exceeds 64 KiB; closing"})
			ss.srv.countCode(CodeLineTooLong)
			ss.write(out)
			return
		}
		if len(bytes.TrimSpace(line)) > 0 {
			ss.requests.Add(1)
			var resp response
			if ss.handle(line, &rq, &resp) {
				if resp.Code != "" {
					ss.srv.countCode(resp.Code)
				}
				out = appendResponse(out, &resp)
				if resp.settle != nil {
					settle = append(settle, resp)
				}
			}
		}
		if err != nil {
			ss.write(out)
			return
		}
		if r.buffered() == 0 || len(out) > 32<<10 {
			if !ss.write(out) {
				return
			}
			for i := range settle {
				ss.srv.settle(&settle[i])
			}
			clear(settle)
			settle = settle[:0]
			if cap(out) > minReadBuf {
				out = nil // a burst's answers are not kept for an idle session
			}
			out = out[:0]
		}
	}
}

// minReadBuf is a session's read buffer until a longer line, or a longer
// burst of pipelined lines, needs more.
const minReadBuf = 4 << 10

// errLineTooLong is readLine's error for a line longer than MaxLine.
var errLineTooLong = errors.New("request line too long")

// lineReader reads a session's request lines. Its buffer starts at
// minReadBuf and doubles, up to MaxLine, only while a line does not fit; once
// everything read has been handled it goes back to the small size. So an
// idle session holds 4 KiB for reading, where a bufio.Reader able to take
// the longest line holds 64 KiB for the session's whole life (2.7 GiB for
// the 43,000 sessions one user could open before the caps were bounded).
type lineReader struct {
	rd   io.Reader
	buf  []byte
	r, w int   // unread bytes are buf[r:w]
	err  error // the read error not yet returned
}

// readLine returns the next line, newline included, valid until the next
// call. At the end of the stream it returns what is left with the error.
func (lr *lineReader) readLine() ([]byte, error) {
	for {
		if i := bytes.IndexByte(lr.buf[lr.r:lr.w], '\n'); i >= 0 {
			line := lr.buf[lr.r : lr.r+i+1]
			lr.r += i + 1
			lr.shrink()
			return line, nil
		}
		if lr.err != nil {
			line, err := lr.buf[lr.r:lr.w], lr.err
			lr.r, lr.err = lr.w, nil
			lr.shrink()
			return line, err
		}
		if lr.w-lr.r >= MaxLine {
			return nil, errLineTooLong
		}
		lr.fill()
	}
}

// shrink drops a grown buffer once everything in it was handed out: the
// next read gets a small one (a line handed out keeps the big one alive
// only while it is used).
func (lr *lineReader) shrink() {
	if lr.r == lr.w && len(lr.buf) > minReadBuf {
		lr.buf, lr.r, lr.w = nil, 0, 0
	}
}

// fill reads once into the buffer, making room first.
func (lr *lineReader) fill() {
	if lr.r == lr.w {
		lr.r, lr.w = 0, 0
	}
	switch {
	case lr.buf == nil:
		lr.buf = make([]byte, minReadBuf)
	case lr.w == len(lr.buf) && lr.r > 0:
		lr.w = copy(lr.buf, lr.buf[lr.r:lr.w])
		lr.r = 0
	case lr.w == len(lr.buf):
		nb := make([]byte, min(2*len(lr.buf), MaxLine))
		lr.w = copy(nb, lr.buf[lr.r:lr.w])
		lr.r, lr.buf = 0, nb
	}
	n, err := lr.rd.Read(lr.buf[lr.w:])
	lr.w += n
	if err != nil {
		lr.err = err
	}
}

// buffered is how many bytes were read and not yet returned.
func (lr *lineReader) buffered() int { return lr.w - lr.r }

// write sends b whole; false means the connection is unusable.
func (ss *session) write(b []byte) bool {
	if len(b) == 0 {
		return true
	}
	ss.wmu.Lock()
	defer ss.wmu.Unlock()
	ss.conn.SetWriteDeadline(time.Now().Add(writeTimeout))
	if _, err := ss.conn.Write(b); err != nil {
		ss.conn.Close()
		return false
	}
	return true
}

// answerLate writes the answer of an operation that waited.
func (ss *session) answerLate(resp *response) {
	if resp.Code != "" {
		ss.srv.countCode(resp.Code)
	}
	if ss.write(appendResponse(nil, resp)) && resp.settle != nil {
		ss.srv.settle(resp)
	}
}

// handle decodes and runs one request. It returns false when the answer
// will come later from another goroutine.
func (ss *session) handle(line []byte, rq *request, resp *response) bool {
	if !ss.names.parseFast(line, rq) {
		if err := parseRequest(line, rq); err != nil {
			*resp = response{ID: rq.ID, Code: CodeBadRequest, Error: err.Error()}
			return true
		}
	}
	resp.ID = rq.ID
	s := ss.srv
	switch rq.Op {
	case "acquire":
		if rq.Pool == ResidentsPool {
			return s.startSpawn(ss, rq, resp)
		}
		return s.acquire(ss, rq, resp)
	case "release":
		s.release(ss, rq, resp)
	case "spawn":
		return s.startSpawn(ss, rq, resp)
	case "touch":
		s.touch(ss, rq, resp)
	case "sleep":
		s.sleep(ss, rq, resp, false)
	case "remove":
		s.sleep(ss, rq, resp, true)
	case "hello":
		resp.OK, resp.Session, resp.Server = true, ss.id, "fairshare-permitd/1"
	case "ping":
		resp.OK = true
	case "":
		resp.Code, resp.Error = CodeUnknownOp, "missing op"
	default:
		resp.Code, resp.Error = CodeUnknownOp, "unknown op "+quote(rq.Op)
	}
	return true
}

// addLease records l under a new id drawn from next, one the session does
// not hold: ids are 32 bits of a counter under the server's epoch, so a
// session that keeps a lease through 2^32 grants of the server (hours at
// full speed) would otherwise be given its id again, and lose the first
// lease. ok is false, and nothing recorded, once the session has closed.
func (ss *session) addLease(next func() uint64, l lease) (id uint64, ok bool) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		return 0, false
	}
	id = ss.freshLocked(next)
	ss.leases[id] = l
	return id, true
}

// freshLease is a lease id drawn from next that the session does not hold,
// for putLease: a residence's id is the object's before its lease is the
// session's (Server.admitted). Another grant meanwhile draws another count.
func (ss *session) freshLease(next func() uint64) uint64 {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.freshLocked(next)
}

func (ss *session) freshLocked(next func() uint64) uint64 {
	for {
		id := next()
		if _, taken := ss.leases[id]; !taken {
			return id
		}
	}
}

// putLease records l under id (freshLease's); false, nothing recorded,
// once the session has closed.
func (ss *session) putLease(id uint64, l lease) bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		return false
	}
	ss.leases[id] = l
	return true
}

// takeLease removes and returns the lease; ok is false when this session
// does not hold it. Whoever takes a lease is the one who ends it, exactly once.
func (ss *session) takeLease(id uint64) (l lease, ok bool) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	l, ok = ss.leases[id]
	if ok {
		delete(ss.leases, id)
	}
	return l, ok
}

// close marks the session closed and hands back all its leases.
func (ss *session) close() map[uint64]lease {
	ss.cancel()
	ss.conn.Close()
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.closed = true
	ls := ss.leases
	ss.leases = map[uint64]lease{}
	return ls
}

// strikes are one project's evictions left unconfirmed by a session.
type strikes struct {
	n       int                // in a row: a confirmation starts over
	objects map[string]*object // marked unconfirmed, still resident as far as is known
}

func (ss *session) sendEvent(kind string, ev *pools.Eviction, lease uint64) {
	ss.write(appendEvent(nil, kind, ev, lease))
}

func quote(s string) string {
	return string(wire.AppendString(nil, s))
}
