// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/textproto"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/answerfield"
)

// errStaleConn means a reused upstream connection failed before any byte of
// the answer arrived: the upstream most likely closed it while it was idle,
// and the request (body-less, idempotent) may be sent again on a fresh one.
var errStaleConn = errors.New("reused upstream connection failed before the answer")

// directUpstream forwards requests to an http:// upstream over HTTP/1.1
// keep-alive connections it owns, on the handler's own goroutine (and the
// request body on one of its own): write the request, read the answer, copy
// it to the client. http.Transport, under httputil.ReverseProxy, spends two goroutine hand-offs
// per request (its write and read loops), a deep copy of the request and its
// header map, and its connection bookkeeping; for the front's commonest
// request that was a fifth of its CPU. Tunnels (WebSocket, CONNECT), h2c or
// https to the upstream and an upstream base path keep going through
// ReverseProxy.
//
// A connection goes back to the pool only when its answer ended exactly at
// its framing with nothing more buffered, and it is checked again when taken
// out: anything the upstream sent while the connection was idle (a late or
// second answer, a body longer than its Content-Length, a body after HEAD)
// is an answer nobody asked for, and the connection is closed instead of
// handing those bytes to the next request. A sweep every idleSweep closes
// the idle connections that spoke, hung up or outlived idleFor.
//
// A connection serves one project (one upKey) for its whole life: the idle
// ones are kept by key, and a request takes only one of its own key, so an
// answer the upstream sends too late for the check above reaches at most
// the project that was answered on the connection before.
type directUpstream struct {
	addr string // host:port
	dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// maxIdle bounds the idle connections in all, maxIdlePer those of one
	// key (0: maxIdle).
	maxIdle    int
	maxIdlePer int
	idleFor    time.Duration
	maxHead    int64 // bytes of answer heads (1xx included) per request
	max1xx     int   // informational answers per request
	// headFor bounds the wait for an answer's head once the whole request
	// went out (Config.UpstreamHeadTimeout).
	headFor time.Duration
	// sendFor bounds each piece of a request body the upstream does not
	// take (Config.WriteTimeout): see armSend.
	sendFor time.Duration
	// readFor bounds each read of an answer's body (Config.
	// UpstreamReadTimeout; 0: no bound): see upConn.armRead.
	readFor  time.Duration
	unasked  func(why string)
	stripOwn func(http.Header) // Front.stripOwn
	bufs     *bufferPool       // for request bodies
	// sentHook, when set (tests), runs when a request body has gone out,
	// before its sender reports it.
	sentHook func()

	// What the front changes in the requests it forwards (as its rewrite
	// does on the ReverseProxy path): the Host when the client sent none,
	// the project header (canonical), set to the request's project only
	// with forwardProject, and the claims (isClaim) that are dropped.
	host           string
	projectKey     string
	forwardProject bool
	isClaim        func(key string) bool

	mu sync.Mutex // guards the fields below
	// idle is the direct path's idle connections by key; its budget is
	// shared with the fast path's loops (see sharedBudget).
	idle  idlePool[*upConn]
	sweep *time.Timer // pending sweep of idle, nil when none
	gen   int         // closeIdle calls so far
}

// sharedBudget is the budget of the direct path's idle pool, which every
// pool of the front's idle upstream connections shares: the bounds are
// the front's, not each pool's.
func (d *directUpstream) sharedBudget() *idleBudget {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.idle.budget()
}

// perKey is how many idle connections one key may hold.
func (d *directUpstream) perKey() int {
	if d.maxIdlePer <= 0 {
		return d.maxIdle
	}
	return min(d.maxIdlePer, d.maxIdle)
}

// idleSweep is how often idle upstream connections are checked while some
// are pooled. The check at reuse is what keeps bytes from reaching the
// wrong request; the sweep only frees the connections sooner.
const idleSweep = time.Second

// upConn is one upstream connection with its buffers.
type upConn struct {
	c        net.Conn
	rc       syscall.RawConn // for the idle check; nil when c has none
	br       *bufio.Reader
	bw       *bufio.Writer
	lastUsed time.Time
	// key is the requests the connection serves, from its dial; link is
	// its place in the idle pool.
	key  upKey
	link idleLink[*upConn]

	// While headLeft >= 0 reads are counted against it: the bound on an
	// answer's head. rec, while non-nil, records what is read (see
	// readHead).
	headLeft int64
	rec      []byte

	peekN   int
	peekErr syscall.Errno
	peekFn  func(fd uintptr)

	// For received, on the goroutine that sends a request body.
	recvd  uint64
	recvOK bool
	infoFn func(fd uintptr)

	// aborted: the exchange on the connection was ended from outside (the
	// client went away, its body failed, the answer was over before the
	// body); every deadline set after it is the past too.
	aborted atomic.Bool
	headMu  sync.Mutex // guards awaiting and the read deadline while it is set
	// awaiting: the request is being sent or its answer's head awaited;
	// the read deadline bounds the wait for the head once the request is
	// all out, and is lifted when the head comes.
	awaiting bool

	// Once the head came (gotHead), until the next exchange (begin), on
	// the goroutine that reads the answer: bodyFor bounds each read of the
	// body (directUpstream.readFor; 0: none), and readBy is the read
	// deadline armRead set for it (zero: none set).
	bodyFor time.Duration
	readBy  time.Time
}

// readSlack is the part of bodyFor by which a read deadline armRead sets
// goes past the bound: a read may wait up to bodyFor*(1+1/readSlack), and
// on a connection that keeps reading the deadline (a runtime timer) is
// moved once every bodyFor/readSlack at most, not at every read.
const readSlack = 8

// errAnswerStalled: a read of an answer's body waited
// Config.UpstreamReadTimeout for the upstream.
var errAnswerStalled = errors.New("the upstream stopped sending its answer")

// begin starts an exchange on uc, on the goroutine that reads its answer:
// the head is awaited, and the bound on the last answer's body reads is
// lifted. body: the request has a body, whose sender reads the answer's
// head before the request is all out (without a deadline); a request
// without one has its deadline set (sent) before any read.
func (uc *upConn) begin(body bool) {
	uc.awaiting = true
	uc.bodyFor = 0
	if !uc.readBy.IsZero() {
		uc.readBy = time.Time{}
		if body {
			uc.setReadDeadline(time.Time{})
		}
	}
}

// armRead bounds the read of an answer's body about to be made by
// bodyFor from now: the deadline already set is kept when it gives the
// read as long, else it is moved bodyFor/readSlack past the bound.
func (uc *upConn) armRead() {
	by := time.Now().Add(uc.bodyFor)
	if uc.readBy.Before(by) {
		uc.readBy = by.Add(uc.bodyFor / readSlack)
		uc.setReadDeadline(uc.readBy)
	}
}

// abort ends whatever waits on the connection, for good: the exchange on it
// is over.
func (uc *upConn) abort() {
	uc.aborted.Store(true)
	_ = uc.c.SetDeadline(time.Unix(1, 0))
}

// setReadDeadline sets the read deadline unless the connection was
// aborted.
func (uc *upConn) setReadDeadline(t time.Time) {
	_ = uc.c.SetReadDeadline(t)
	if uc.aborted.Load() {
		_ = uc.c.SetDeadline(time.Unix(1, 0))
	}
}

// setWriteDeadline sets the write deadline unless the connection was
// aborted.
func (uc *upConn) setWriteDeadline(t time.Time) {
	_ = uc.c.SetWriteDeadline(t)
	if uc.aborted.Load() {
		_ = uc.c.SetDeadline(time.Unix(1, 0))
	}
}

// sent starts the wait for the answer's head, bounded by d, now that the
// whole request went out; unless the head came already.
func (uc *upConn) sent(d time.Duration) {
	uc.headMu.Lock()
	if uc.awaiting {
		uc.setReadDeadline(time.Now().Add(d))
	}
	uc.headMu.Unlock()
}

// gotHead ends the wait for the head. The body of the answer may be a long
// stream: the whole of it is not bounded, but each read of it is, by
// bodyFor (Config.UpstreamReadTimeout; 0: none), so that an upstream that
// stops sending does not hold the request, its permit and its place, for
// as long as the client waits (see armRead).
//
// The bound is set by the first read of the body from the connection: an
// answer that came whole with its head (the commonest) costs no timer.
func (uc *upConn) gotHead(bodyFor time.Duration) {
	uc.headMu.Lock()
	if uc.awaiting {
		uc.awaiting = false
		uc.bodyFor = bodyFor
		uc.setReadDeadline(time.Time{})
	}
	uc.headMu.Unlock()
}

// errHeadTooLarge: the upstream's answer head passed Config.MaxUpstreamHead.
var errHeadTooLarge = errors.New("upstream answer head too large")

func (uc *upConn) Read(p []byte) (int, error) {
	if uc.headLeft >= 0 {
		if uc.headLeft == 0 {
			return 0, errHeadTooLarge
		}
		if int64(len(p)) > uc.headLeft {
			p = p[:uc.headLeft]
		}
	} else if uc.bodyFor > 0 {
		uc.armRead()
	}
	n, err := uc.c.Read(p)
	if err != nil && uc.bodyFor > 0 && errors.Is(err, os.ErrDeadlineExceeded) && !uc.aborted.Load() {
		// Not an abort (its deadline is the past too): the bound.
		err = fmt.Errorf("%w: no byte for %v: %w", errAnswerStalled, uc.bodyFor, err)
	}
	if uc.headLeft >= 0 {
		uc.headLeft -= int64(n)
		if uc.rec != nil {
			uc.rec = append(uc.rec, p[:n]...)
		}
	}
	return n, err
}

// buffered is how many bytes the connection holds that were received and
// not read: in br, and what a loop had read before handing it over.
func (uc *upConn) buffered() int {
	n := uc.br.Buffered()
	if pc, ok := uc.c.(*prefixConn); ok {
		n += len(pc.prefix)
	}
	return n
}

// quiet reports whether nothing arrived on an idle connection: no byte and
// no end of stream. It peeks without blocking, so it costs one system call.
func (uc *upConn) quiet() bool {
	if uc.rc == nil || uc.buffered() > 0 {
		return false
	}
	if err := uc.rc.Control(uc.peekFn); err != nil {
		return false
	}
	return uc.peekN < 0 && (uc.peekErr == syscall.EAGAIN || uc.peekErr == syscall.EWOULDBLOCK)
}

func (uc *upConn) peek(fd uintptr) {
	var b [1]byte
	n, _, e := syscall.Syscall6(syscall.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1,
		syscall.MSG_PEEK|syscall.MSG_DONTWAIT, 0, 0)
	uc.peekN, uc.peekErr = int(n), e
	if e != 0 {
		uc.peekN = -1
	}
}

// received returns the bytes the connection has received since it opened
// (the kernel's count, whether read yet or not), for TCP connections.
func (uc *upConn) received() (uint64, bool) {
	if uc.rc == nil || uc.rc.Control(uc.infoFn) != nil {
		return 0, false
	}
	return uc.recvd, uc.recvOK
}

func (uc *upConn) tcpInfo(fd uintptr) {
	var info unix.TCPInfo
	size := uint32(unsafe.Sizeof(info))
	_, _, e := syscall.Syscall6(syscall.SYS_GETSOCKOPT, fd, unix.IPPROTO_TCP, unix.TCP_INFO,
		uintptr(unsafe.Pointer(&info)), uintptr(unsafe.Pointer(&size)), 0)
	// Bytes_received came with Linux 4.1; a shorter answer lacks it.
	uc.recvOK = e == 0 && uintptr(size) >= unsafe.Offsetof(info.Bytes_received)+8
	uc.recvd = info.Bytes_received
}

// get returns an idle connection of key k (reused true) or dials a new one
// for k; a new one when fresh. now need not be precise (the idle limit is long): callers pass a
// time they already read, as reading the clock is a noticeable part of a
// request's cost.
func (d *directUpstream) get(ctx context.Context, k upKey, now time.Time, fresh bool) (*upConn, bool, error) {
	for {
		var uc *upConn
		ok := false
		if !fresh {
			d.mu.Lock()
			uc, ok = d.idle.take(k)
			d.mu.Unlock()
		}
		if !ok {
			return d.dialNew(ctx, k)
		}
		if now.Sub(uc.lastUsed) >= d.idleFor {
			uc.c.Close()
			continue
		}
		if !uc.quiet() {
			d.spoke(uc)
			continue
		}
		return uc, true, nil
	}
}

// spoke closes an idle connection on which the upstream sent something
// (or hung up), and says so when it was more than a hang-up.
func (d *directUpstream) spoke(uc *upConn) {
	if uc.peekN > 0 || uc.buffered() > 0 {
		d.unasked("bytes arrived on an idle upstream connection")
	}
	uc.c.Close()
}

// dialNew dials a new upstream connection for the requests of k.
func (d *directUpstream) dialNew(ctx context.Context, k upKey) (*upConn, bool, error) {
	c, err := d.dial(ctx, "tcp", d.addr)
	if err != nil {
		return nil, false, fmt.Errorf("dialing upstream: %w", err)
	}
	return d.newUpConn(c, k), false, nil
}

// newUpConn makes an upstream connection of c, to serve the requests of
// k for its whole life.
func (d *directUpstream) newUpConn(c net.Conn, k upKey) *upConn {
	uc := &upConn{c: c, key: k, headLeft: -1, bw: bufio.NewWriterSize(c, 4<<10)}
	uc.link.v = uc
	uc.br = bufio.NewReaderSize(uc, 4<<10)
	sc, ok := c.(syscall.Conn)
	if pc, isPrefix := c.(*prefixConn); isPrefix {
		// What a loop read already comes first; the idle check and the
		// kernel's count are the socket's.
		sc, ok = pc.Conn.(syscall.Conn)
	}
	if ok {
		if rc, err := sc.SyscallConn(); err == nil {
			uc.rc = rc
			uc.peekFn, uc.infoFn = uc.peek, uc.tcpInfo
		}
	}
	return uc
}

// put keeps uc for the next request of its key, or closes it when its
// answer left bytes behind. When its key, or the pool, holds as many idle
// connections as it may, the least recently used of them is closed.
func (d *directUpstream) put(uc *upConn, now time.Time) {
	if uc.buffered() > 0 {
		d.unasked("bytes after the end of an upstream answer")
		uc.c.Close()
		return
	}
	uc.lastUsed = now
	d.mu.Lock()
	old, evicted := d.idle.put(uc.key, &uc.link, d.perKey(), d.maxIdle)
	if d.sweep == nil && d.idle.len() > 0 {
		d.sweep = time.AfterFunc(idleSweep, d.sweepIdle)
	}
	d.mu.Unlock()
	if evicted {
		old.c.Close()
	}
}

// sweepIdle closes the idle connections that spoke, hung up or were idle
// too long, and comes back while any are left.
func (d *directUpstream) sweepIdle() {
	now := time.Now()
	d.mu.Lock()
	// Out of the pool while they are checked: a request must not take one
	// whose check is under way.
	idle, gen := d.idle.takeAll(nil), d.gen
	d.mu.Unlock()
	kept := idle[:0]
	for _, l := range idle {
		uc := l.v
		switch {
		case now.Sub(uc.lastUsed) >= d.idleFor:
			uc.c.Close()
		case !uc.quiet():
			d.spoke(uc)
		default:
			kept = append(kept, l)
		}
	}
	var over []*upConn
	d.mu.Lock()
	if gen != d.gen {
		// closeIdle ran meanwhile: it could not see these.
		for _, l := range kept {
			over = append(over, l.v)
		}
		kept = kept[:0]
	}
	// Connections put back meanwhile are the most recent: those kept go
	// before them, most recent first, as far as the bounds leave room
	// (the loops' idle connections count in them too). Each goes back
	// under its own key.
	for i := len(kept) - 1; i >= 0; i-- {
		if !d.idle.putOldest(kept[i].v.key, kept[i], d.perKey(), d.maxIdle) {
			over = append(over, kept[i].v)
		}
	}
	if d.idle.len() > 0 {
		d.sweep = time.AfterFunc(idleSweep, d.sweepIdle)
	} else {
		d.sweep = nil
	}
	d.mu.Unlock()
	for _, uc := range over {
		uc.c.Close()
	}
}

// closeIdle closes every idle connection.
func (d *directUpstream) closeIdle() {
	d.mu.Lock()
	idle := d.idle.takeAll(nil)
	d.idle = idlePool[*upConn]{b: d.idle.budget()} // the loops share the budget
	d.gen++
	if d.sweep != nil {
		d.sweep.Stop()
		d.sweep = nil
	}
	d.mu.Unlock()
	for _, l := range idle {
		l.v.c.Close()
	}
}

// takes reports whether r can take the direct path: any request but a
// tunnel (CONNECT, or an Upgrade field, which forward has left only on a
// WebSocket handshake: see tunnelUpgrade), whose bytes after the head are
// not HTTP, and an opaque request URI. (The front uses the direct path
// only for an upstream that is plain HTTP/1.1 with no base path.)
func (d *directUpstream) takes(r *http.Request) bool {
	return r.Method != http.MethodConnect && r.Header["Upgrade"] == nil && r.URL.Opaque == ""
}

// hasBody reports whether r has a body to send upstream.
func hasBody(r *http.Request) bool {
	return r.ContentLength != 0 && r.Body != nil && r.Body != http.NoBody
}

// replayable reports whether r may be sent again on a fresh connection when
// a reused one failed before any answer: no body, and a method that does not
// change anything or a request that says it may be repeated, as
// http.Transport decides.
func replayable(r *http.Request) bool {
	if hasBody(r) {
		return false
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return r.Header["Idempotency-Key"] != nil || r.Header["X-Idempotency-Key"] != nil
}

// cleanQuery is the query ReverseProxy sends upstream: as the client wrote
// it, unless net/url would not parse it as written (a ';', a bad escape,
// too many parameters), when it is re-encoded from what parses.
func cleanQuery(q string) string {
	reencode := func() string {
		v, _ := url.ParseQuery(q)
		return v.Encode()
	}
	if strings.Count(q, "&")+1 > 10000 { // net/url's limit
		return reencode()
	}
	for i := 0; i < len(q); {
		switch q[i] {
		case ';':
			return reencode()
		case '%':
			if i+2 >= len(q) || !isHex(q[i+1]) || !isHex(q[i+2]) {
				return reencode()
			}
			i += 3
		default:
			i++
		}
	}
	return q
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// hasToken reports whether the comma-separated values vv name token (case
// does not count), as in Te: trailers.
func hasToken(vv []string, token string) bool {
	for _, v := range vv {
		for f := range strings.SplitSeq(v, ",") {
			if f, _, _ = strings.Cut(f, ";"); strings.EqualFold(textproto.TrimString(f), token) {
				return true
			}
		}
	}
	return false
}

// connectionListed reports whether header key is named in the request's or
// response's Connection header (and so is hop-by-hop too).
func connectionListed(conn []string, key string) bool {
	for _, v := range conn {
		for f := range strings.SplitSeq(v, ",") {
			if http.CanonicalHeaderKey(textproto.TrimString(f)) == key {
				return true
			}
		}
	}
	return false
}

// writeHead writes the head of the upstream request for r into bw (not
// flushed): its method, URI, Host and end-to-end headers, the project
// header only when configured, X-Forwarded-For and, over TLS,
// X-Forwarded-Proto (see isClaim), and the body's framing: its
// Content-Length, or chunked when its length is unknown. Expect is not
// passed on: the client's 100-continue is answered by the front's server
// when the body is first read, after the request was admitted.
func (d *directUpstream) writeHead(bw *bufio.Writer, r *http.Request, x *exchange) {
	host := r.Host
	if host == "" {
		host = d.host
	}
	bw.WriteString(r.Method)
	bw.WriteByte(' ')
	if q := r.URL.RawQuery; q != "" && cleanQuery(q) != q {
		u := *r.URL
		u.RawQuery = cleanQuery(q)
		bw.WriteString(u.RequestURI())
	} else {
		bw.WriteString(r.URL.RequestURI())
	}
	bw.WriteString(" HTTP/1.1\r\nHost: ")
	bw.WriteString(host)
	bw.WriteString("\r\n")
	conn := r.Header["Connection"]
	for k, vv := range r.Header {
		if k == "Host" || answerfield.IsHopByHop(k) || k == "Content-Length" || k == "Expect" || k == d.projectKey ||
			(len(conn) > 0 && connectionListed(conn, k)) || d.isClaim(k) {
			continue
		}
		for _, v := range vv {
			writeHeaderLine(bw, k, v)
		}
	}
	if d.forwardProject {
		writeHeaderLine(bw, d.projectKey, x.project)
	}
	// The client's own X-Forwarded-For is not extended but replaced, as
	// with ReverseProxy.Rewrite: the front does not vouch for it.
	if ip, _, err := net.SplitHostPort(r.RemoteAddr); err == nil {
		writeHeaderLine(bw, "X-Forwarded-For", ip)
	}
	if r.TLS != nil {
		writeHeaderLine(bw, "X-Forwarded-Proto", "https")
	}
	// Te is hop-by-hop, but an upstream may want to know that trailers
	// reach the client (ReverseProxy says so too).
	if te := r.Header["Te"]; te != nil && hasToken(te, "trailers") {
		writeHeaderLine(bw, "Te", "trailers")
	}
	switch {
	case hasBody(r) && r.ContentLength > 0:
		writeHeaderLine(bw, "Content-Length", strconv.FormatInt(r.ContentLength, 10))
	case hasBody(r):
		writeHeaderLine(bw, "Transfer-Encoding", "chunked")
		if len(r.Trailer) > 0 {
			keys := make([]string, 0, len(r.Trailer))
			for k := range r.Trailer {
				// Not the project header nor a proxy claim (isClaim
				// covers both), which an upstream merging trailers into
				// the head would read as the front's word.
				if !d.isClaim(k) {
					keys = append(keys, k)
				}
			}
			if len(keys) > 0 {
				writeHeaderLine(bw, "Trailer", strings.Join(keys, ", "))
			}
		}
	case r.Method == http.MethodPost || r.Method == http.MethodPut || r.Method == http.MethodPatch:
		// As http.Transport does: these methods say their empty body.
		writeHeaderLine(bw, "Content-Length", "0")
	}
	bw.WriteString("\r\n")
}

// writeHeaderLine writes "key: value". Values come from a request net/http
// already parsed and checked, so they hold no line breaks.
func writeHeaderLine(bw *bufio.Writer, k, v string) {
	bw.WriteString(k)
	bw.WriteString(": ")
	bw.WriteString(v)
	bw.WriteString("\r\n")
}

// upAnswer is an upstream answer on the direct path: its head, with the
// body to read, the connection it came on, the watch on the client and the
// request body still being sent, if any.
type upAnswer struct {
	*http.Response
	conn  *upConn
	watch clientWatch
	send  *bodySend
}

// roundTrip sends r upstream and reads the answer's head. A reused
// connection that fails before the answer began is replaced by a fresh one,
// once, when r may be sent again (see replayable). The answer is to be
// ended with done.
func (d *directUpstream) roundTrip(r *http.Request, x *exchange) (upAnswer, error) {
	ctx := r.Context()
	cc := peerOf(r).cc
	if r.ProtoMajor != 1 {
		// HTTP/2 streams share the connection and end on their own: only
		// the request's context knows.
		cc = nil
	}
	retry := replayable(r)
	for attempt := 0; ; attempt++ {
		// The retry goes on a new connection, as the fast path's does:
		// the other idle ones may be as stale as the one that failed.
		uc, reused, err := d.get(ctx, keyOf(x), x.at, attempt > 0)
		if err != nil {
			return upAnswer{}, err
		}
		// The client going away aborts whatever waits on the upstream,
		// the answer's head or its body.
		w := clientWatch{cc: cc}
		if cc != nil {
			cc.watch(uc)
		} else {
			w.stop = context.AfterFunc(ctx, uc.abort)
		}
		uc.begin(hasBody(r))
		d.writeHead(uc.bw, r, x)
		var send *bodySend
		if hasBody(r) {
			// The body goes on its own goroutine while the answer is
			// read: an upstream may answer before it has read all of it.
			send = d.sendBody(uc, r, x)
		} else if err = uc.bw.Flush(); err != nil {
			err = fmt.Errorf("writing upstream request: %w", err)
			if reused {
				err = fmt.Errorf("%w: %w", errStaleConn, err)
			}
		} else {
			uc.sent(d.headFor)
		}
		var resp *http.Response
		if err == nil {
			resp, err = d.readAnswer(uc, r, x, reused)
		}
		uc.gotHead(d.readFor)
		if err == nil {
			return upAnswer{Response: resp, conn: uc, watch: w, send: send}, nil
		}
		fired := !w.end()
		if send != nil {
			// The client's body failing, or the upstream not taking it,
			// is the cause of what followed.
			if serr := send.end(uc); errors.Is(serr, errClientBody) || errors.Is(serr, errSendStalled) {
				err = serr
			}
		}
		uc.c.Close()
		if fired {
			return upAnswer{}, fmt.Errorf("%w: %w", errClientGone, err)
		}
		if !retry || !errors.Is(err, errStaleConn) || attempt > 0 || ctx.Err() != nil {
			return upAnswer{}, err
		}
	}
}

// done ends the watch on the client and keeps a's connection for the next
// request, if keep, the client is still there and the whole request body
// went out; otherwise it closes it.
func (d *directUpstream) done(a upAnswer, keep bool, now time.Time) {
	if !a.watch.end() {
		keep = false
	}
	if a.send != nil && a.send.end(a.conn) != nil {
		keep = false
	}
	if keep {
		d.put(a.conn, now)
	} else {
		a.conn.c.Close()
	}
}

// errClientBody marks an exchange that failed because the client's request
// body could not be read (the client went away, or broke off its body).
var errClientBody = errors.New("reading the client's request body")

// bodySend is a request body on its way upstream, sent by its own goroutine
// (see sendBody).
type bodySend struct {
	src     io.Reader
	eof     atomic.Bool // the client's body was read to its end
	readErr error       // a read of the client's body failed; the sender's until done
	done    chan error  // the sender's result
	// unblock ends a read of the client's body that waits, for an HTTP/2
	// stream; nil for HTTP/1, where the end of the body starts net/http's
	// read of the next request on the connection and a deadline set from
	// here could fail that read instead (the read of the body has its own
	// deadline).
	unblock func()
	// early: the answer began to arrive before the whole body went out
	// (or the front cannot tell). The upstream may not have read all of
	// it, and what it left unread would be taken for the next request on
	// the connection: it is not reused. The sender's until done.
	early bool
	err   error // the result, once ended
	ended bool
}

// senderGrace is how long the end of an answer waits for a sender that
// read the whole request body to be done with it, before giving up the
// connection (see bodySend.end).
const senderGrace = 100 * time.Millisecond

// errEarlyAnswer: the upstream answered before the request body was sent.
var errEarlyAnswer = errors.New("the upstream answered before the request body was sent")

func (s *bodySend) Read(p []byte) (int, error) {
	n, err := s.src.Read(p)
	if err == io.EOF {
		s.eof.Store(true)
	} else if err != nil {
		s.readErr = err
	}
	return n, err
}

// sendBody starts sending r's body on uc, after the head writeHead left in
// uc.bw: as it is, or chunked when its length is unknown. When the client's
// body fails the reading of the answer is aborted: an upstream waiting for
// the rest of the body would not answer.
func (d *directUpstream) sendBody(uc *upConn, r *http.Request, x *exchange) *bodySend {
	s := &bodySend{src: r.Body, done: make(chan error, 1)}
	if r.ProtoMajor >= 2 {
		rc := http.NewResponseController(x.w)
		s.unblock = func() { _ = rc.SetReadDeadline(time.Unix(1, 0)) }
	}
	go func() {
		// What the connection received before the last byte of the body
		// went out can only be an answer that came early: the kernel's
		// count of received bytes tells, read or not.
		base, ok := uc.received()
		err := d.writeBody(uc, s, r)
		if err == nil {
			d.armSend(uc)
			err = uc.bw.Flush()
		}
		if err == nil {
			d.disarmSend(uc)
			n, ok2 := uc.received()
			s.early = !ok || !ok2 || n != base
			uc.sent(d.headFor)
			if d.sentHook != nil {
				d.sentHook()
			}
		}
		if s.readErr != nil {
			err = fmt.Errorf("%w: %w", errClientBody, s.readErr)
			uc.abort()
		} else if err != nil {
			err = d.sendFailed(uc, err)
		}
		s.done <- err
	}()
	return s
}

// armSend bounds the writes of a request body to uc that follow by
// d.sendFor from now: an upstream that takes no piece of it for that long
// fails them (see sendFailed). Each piece is armed anew, as the client
// may take its time between two (within BodyReadTimeout).
func (d *directUpstream) armSend(uc *upConn) {
	if d.sendFor > 0 {
		uc.setWriteDeadline(time.Now().Add(d.sendFor))
	}
}

// disarmSend lifts armSend's bound once the request went out: the
// connection may carry the next.
func (d *directUpstream) disarmSend(uc *upConn) {
	if d.sendFor > 0 {
		uc.setWriteDeadline(time.Time{})
	}
}

// errSendStalled: the upstream took no piece of a request body for
// Config.WriteTimeout.
var errSendStalled = errors.New("the upstream stopped reading the request")

// sendFailed is the error of a request body's sender whose write to uc
// failed with err. When the upstream took no piece for d.sendFor it is
// errSendStalled, and the exchange is aborted: an upstream that does not
// take the request may never answer it, or never end its answer, and the
// request would hold its permit for as long. Otherwise (the upstream hung
// up, or the exchange was aborted) what the upstream answered before is
// still read.
func (d *directUpstream) sendFailed(uc *upConn, err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) && !uc.aborted.Load() {
		uc.abort()
		return d.stalled(err)
	}
	return fmt.Errorf("writing upstream request body: %w", err)
}

// stalled is err, a write of a request body that failed on its deadline,
// as the upstream not taking it for d.sendFor.
func (d *directUpstream) stalled(err error) error {
	return fmt.Errorf("writing upstream request body: %w: no piece of it taken for %v: %w", errSendStalled, d.sendFor, err)
}

// writeBody copies the request body from s to uc, each piece as it comes
// and within d.sendFor (armSend): as it is when its length is known
// (net/http's reader ends it there), else in chunks and then the trailer
// the client sent.
func (d *directUpstream) writeBody(uc *upConn, s *bodySend, r *http.Request) error {
	bw := uc.bw
	bp := d.bufs.get()
	defer d.bufs.put(bp)
	buf := *bp
	var sent int64
	var size [16]byte
	for {
		n, rerr := s.Read(buf)
		if n > 0 {
			sent += int64(n)
			d.armSend(uc)
			if r.ContentLength < 0 {
				bw.Write(strconv.AppendInt(size[:0], int64(n), 16))
				bw.WriteString("\r\n")
			}
			if _, err := bw.Write(buf[:n]); err != nil {
				return err
			}
			if r.ContentLength < 0 {
				bw.WriteString("\r\n")
			}
			// What the client sent goes on at once: a body may be a
			// stream the upstream answers piece by piece.
			if err := bw.Flush(); err != nil {
				return err
			}
		}
		switch {
		case rerr == io.EOF && r.ContentLength >= 0:
			if sent != r.ContentLength {
				s.readErr = fmt.Errorf("body of %d bytes, not its Content-Length %d", sent, r.ContentLength)
				return s.readErr
			}
			return nil
		case rerr == io.EOF:
			d.armSend(uc)
			bw.WriteString("0\r\n")
			for k, vv := range r.Trailer {
				if d.isClaim(k) { // as announced in writeHead
					continue
				}
				for _, v := range vv {
					writeHeaderLine(bw, k, v)
				}
			}
			_, err := bw.WriteString("\r\n")
			return err
		case rerr != nil:
			return rerr
		}
	}
}

// end waits for the sender and returns its result: nil when the whole body
// went out before the answer came, and the connection may be reused. A
// sender still at work when the answer is over (the upstream answered
// without reading all of the body) is stopped: the upstream connection is
// aborted and, on HTTP/2, a read of the client's body that waits is ended.
func (s *bodySend) end(uc *upConn) error {
	if s.ended {
		return s.err
	}
	var done bool
	select {
	case s.err = <-s.done:
		done = true
	default:
		if s.eof.Load() {
			// The sender has the whole body and is writing its end out
			// (and then asking the kernel what came meanwhile): an
			// upstream that read it all answers that fast, over
			// loopback before the sender is done. A moment for it keeps
			// the connection; an upstream that does not read does not
			// hold the request for longer than that.
			t := time.NewTimer(senderGrace)
			select {
			case s.err = <-s.done:
				done = true
			case <-t.C:
			}
			t.Stop()
		}
	}
	if !done {
		uc.abort()
		if s.unblock != nil && !s.eof.Load() {
			s.unblock()
		}
		// Even if the sender was done by now, the connection is aborted.
		if s.err = <-s.done; s.err == nil {
			s.err = errEarlyAnswer
		}
	}
	if s.err == nil && s.early {
		s.err = errEarlyAnswer
	}
	s.ended = true
	return s.err
}

// readAnswer reads the answer's head from uc, passing informational 1xx
// answers on to the client. The heads together may take at most maxHead
// bytes and there may be at most max1xx informational ones; a head that is
// not plain (see plainHead) must pass strictHead.
func (d *directUpstream) readAnswer(uc *upConn, r *http.Request, x *exchange, reused bool) (*http.Response, error) {
	uc.headLeft = max(0, d.maxHead-int64(uc.br.Buffered()))
	defer func() { uc.headLeft, uc.rec = -1, nil }()
	if _, err := uc.br.Peek(1); err != nil {
		if reused && !errors.Is(err, errHeadTooLarge) && !errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, fmt.Errorf("%w: %w", errStaleConn, err)
		}
		return nil, fmt.Errorf("reading upstream answer: %w", err)
	}
	for informational := 0; ; informational++ {
		if status, n, ok := plainHead(uc.br, r.Method, x.w.Header()); ok {
			// The fields are in the client's header already: no Header.
			return &http.Response{StatusCode: status, ContentLength: n,
				Body: &plainBody{io.LimitedReader{R: uc.br, N: n}}}, nil
		}
		resp, err := readHead(uc, r)
		if err != nil {
			return nil, fmt.Errorf("reading upstream answer: %w", err)
		}
		if resp.StatusCode >= 200 {
			return resp, nil
		}
		if resp.StatusCode == http.StatusSwitchingProtocols {
			return nil, errors.New("upstream switched protocols unasked")
		}
		if informational == d.max1xx {
			return nil, fmt.Errorf("upstream sent more than %d informational answers", d.max1xx)
		}
		// As ReverseProxy does: pass the informational answer on (not to
		// an HTTP/1.0 client; still counted), then forget its fields. The
		// front's own fields are not the upstream's to send.
		if !may1xx(r) {
			continue
		}
		d.stripOwn(resp.Header)
		stripHop(resp.Header)
		h := x.w.Header()
		for k, vv := range resp.Header {
			h[k] = vv
		}
		x.w.WriteHeader(resp.StatusCode)
		for k := range resp.Header {
			h.Del(k)
		}
	}
}

// readHead reads an answer head that is not plain with http.ReadResponse,
// and then checks the bytes it read with strictHead: what net/http would
// tolerate but a proxy should not pass on (a folded line, a bare LF, both
// Content-Length and Transfer-Encoding, a status outside 100-599) is an
// error, and the connection is closed.
func readHead(uc *upConn, r *http.Request) (*http.Response, error) {
	// What ReadResponse reads is what was buffered plus what it reads
	// from the connection, less what it leaves buffered.
	before, _ := uc.br.Peek(uc.br.Buffered())
	uc.rec = append(make([]byte, 0, max(512, 2*len(before))), before...)
	resp, err := http.ReadResponse(uc.br, r)
	raw := uc.rec[:len(uc.rec)-uc.br.Buffered()]
	uc.rec = nil
	if err != nil {
		return nil, err
	}
	if err := strictHead(raw); err != nil {
		resp.Body.Close()
		return nil, err
	}
	return resp, nil
}
