// SPDX-License-Identifier: Apache-2.0

// An admitted request's way to the upstream and its answer's way back:
// forward (the direct path of upstream.go, or httputil.ReverseProxy for
// the rest), the answer relayed (relay, copyBody), the fields the front
// adds, consumes or strips (annotate, answered, stripOwn), the upstream's
// failures answered (upstreamFailed), and the client's body read under its
// deadline (timedBody).

package front

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/textproto"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fairshare-dev/fairshare/internal/answerfield"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// unasked logs an upstream that sent what nobody asked for; the connection
// it came on is closed.
func (f *Front) unasked(why string) {
	f.log.Warn("upstream sent an answer nobody asked for; closing its connection", "why", why)
}

// bufferPool recycles the copy buffers of the direct path (get and put)
// and of the reverse proxy (Get and Put, httputil.BufferPool).
type bufferPool struct{ p sync.Pool }

// get returns a buffer as the pointer the pool keeps, so that putting it
// back allocates nothing (Put has to allocate one for the slice it is given).
func (b *bufferPool) get() *[]byte {
	if v, ok := b.p.Get().(*[]byte); ok {
		return v
	}
	buf := make([]byte, 32<<10)
	return &buf
}

func (b *bufferPool) put(buf *[]byte) { b.p.Put(buf) }

func (b *bufferPool) Get() []byte { return *b.get() }

func (b *bufferPool) Put(buf []byte) { b.p.Put(&buf) }

// forward proxies an admitted request: on the direct path when it can take
// it, through ReverseProxy otherwise.
func (f *Front) forward(w http.ResponseWriter, r *http.Request, x *exchange) {
	if hasBody(r) {
		// Let the upstream's answer start while the client is still
		// sending (HTTP/1 otherwise drains the request body first).
		// HTTP/2 is always full duplex and reports an error here, which
		// is fine. A body left unread is closed here, before the handler
		// returns: in full duplex the HTTP/1 server would otherwise read
		// it to its end after the handler and then panic on the next
		// request (golang/go#68560).
		_ = http.NewResponseController(w).EnableFullDuplex()
		x.body = f.timedBody(w, r)
		defer x.body.Close()
		r.Body = x.body
	}
	tunnel := r.Header["Upgrade"] != nil && tunnelUpgrade(r)
	if f.up != nil && f.up.takes(r) {
		f.serveDirect(w, r, x)
		return
	}
	ctx := context.WithValue(r.Context(), exchangeKey{}, x)
	var sb *sendBody
	if tunnel {
		// A tunnel holds its request's permit while it lasts: it is
		// closed, both ends, after Config.TunnelTimeout (ReverseProxy
		// closes the upstream end when the request's context ends).
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, f.cfg.TunnelTimeout)
		defer cancel()
	} else if f.cfg.readFor() > 0 || (x.body != nil && f.cfg.WriteTimeout > 0) {
		// The answer's body is read under UpstreamReadTimeout (see
		// stallBody), and the request's sent under WriteTimeout (see
		// sendBody), either of which stops the upstream request when a
		// read or a piece of the body waits that long.
		var cancel context.CancelCauseFunc
		ctx, cancel = context.WithCancelCause(ctx)
		defer cancel(nil)
		stop := func(err error) {
			cancel(err)
			// An HTTP/2 stream whose request body waits for a
			// flow-control window does not see its context end once
			// the answer's head is in (http.Transport waits on the
			// connection alone there): closing the answer's body
			// resets the stream, which wakes it.
			if b := x.upBody.Load(); b != nil {
				_ = (*b).Close()
			}
		}
		if f.cfg.readFor() > 0 {
			x.stopUp = stop
		}
		if x.body != nil && f.cfg.WriteTimeout > 0 {
			sb = newSendBody(r.Body, f.cfg.WriteTimeout, stop)
			defer sb.done()
			r.Body = sb
		}
	}
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		GotConn: func(i httptrace.GotConnInfo) { x.upConn = i.Conn },
		WroteRequest: func(httptrace.WroteRequestInfo) {
			if sb != nil {
				sb.done()
			}
		},
		Got1xxResponse: func(int, textproto.MIMEHeader) error {
			// ReverseProxy has passed it on by now; the next is refused.
			if x.n1xx++; x.n1xx > f.cfg.MaxInformational {
				return fmt.Errorf("upstream sent more than %d informational answers", f.cfg.MaxInformational)
			}
			return nil
		},
	})
	f.proxy.ServeHTTP(&proxyWriter{w, f, r, ctx}, r.WithContext(ctx))
}

// tunnelUpgrade settles the upgrade r asks for (it has an Upgrade field)
// and reports whether r is to be a tunnel. The front tunnels WebSocket
// alone: an HTTP/1.1 request that lists upgrade in Connection and websocket
// among the protocols of Upgrade keeps that one protocol in Upgrade, as the
// client spelled it, so that the upstream can switch to nothing else. Any
// other upgrade (h2c, a protocol the front does not know, one asked for
// without Connection: upgrade or over HTTP/1.0) is ignored, as RFC 9110 7.8
// lets a server do: Upgrade and HTTP2-Settings are deleted and r goes
// upstream as the plain request it also is, which an h2c client then
// follows in HTTP/1.1 (RFC 7540 3.2). Passed on, an h2c upgrade the
// upstream took made the client's connection an HTTP/2 one straight to the
// upstream for up to TunnelTimeout: its requests skipped the rate buckets
// and the scheduler, on one permit, and their fields (the project header,
// the client's X-Forwarded-For) went upstream as the client wrote them.
func tunnelUpgrade(r *http.Request) bool {
	h := r.Header
	delete(h, "Http2-Settings")
	if r.ProtoMajor == 1 && r.ProtoMinor >= 1 && hasToken(h["Connection"], "upgrade") {
		for _, v := range h["Upgrade"] {
			for p := range strings.SplitSeq(v, ",") {
				if p = textproto.TrimString(p); strings.EqualFold(p, "websocket") {
					h["Upgrade"] = []string{p}
					return true
				}
			}
		}
	}
	delete(h, "Upgrade")
	return false
}

// serveDirect proxies r on the direct path.
func (f *Front) serveDirect(w http.ResponseWriter, r *http.Request, x *exchange) {
	x.w = w
	a, err := f.up.roundTrip(r, x)
	if err != nil {
		f.upstreamFailed(w, r, x, err)
		return
	}
	f.relay(w, r, x, a)
}

// relay passes the upstream's answer a to the client, ending it with
// up.done.
func (f *Front) relay(w http.ResponseWriter, r *http.Request, x *exchange, a upAnswer) {
	keep := false
	defer func() { f.up.done(a, keep, x.at) }()
	resp := a.Response
	dst := w.Header()
	if h := resp.Header; h == nil {
		// A plain head (see plainHead): its end-to-end fields are in dst.
		f.annotate(x, dst)
	} else {
		conn := h["Connection"]
		for k := range h {
			if answerfield.IsHopByHop(k) || (len(conn) > 0 && connectionListed(conn, k)) {
				delete(h, k)
			}
		}
		f.annotate(x, h)
		for k, vv := range h {
			if dst[k] == nil {
				dst[k] = vv // resp.Header is ours alone: no copy needed
				continue
			}
			dst[k] = append(dst[k], vv...)
		}
	}
	f.stripOwn(resp.Trailer)
	announced := len(resp.Trailer)
	if announced > 0 {
		keys := make([]string, 0, announced)
		for k := range resp.Trailer {
			keys = append(keys, k)
		}
		dst.Add("Trailer", strings.Join(keys, ", "))
	}
	w.WriteHeader(resp.StatusCode)
	// A response of unknown length may be a stream (server-sent events, a
	// long poll): pass each piece on as it arrives, as ReverseProxy does.
	stream := resp.ContentLength < 0
	if err := f.copyBody(w, resp.Body, stream); err != nil {
		if a.watch.clientGone(r.Context()) || errors.Is(err, errClientWrite) {
			// Nobody reads the rest, or a client that only half-closed
			// its side does: the answer is aborted, not ended, so that
			// it cannot read as complete (returning, net/http would end
			// a chunked answer with its last chunk).
			x.outcome, x.gone = outcomeCanceled, true
			noAnswer(w)
			return
		}
		f.log.Debug("upstream answer cut short", "project", x.project, "err", err)
		// The head is out: abort the client's response so it cannot read
		// as complete (ServeHTTP's deferred exit counts it as an error).
		panic(http.ErrAbortHandler)
	}
	resp.Body.Close()
	if len(resp.Trailer) > 0 {
		// The values came with the end of the body, under any name.
		f.stripOwn(resp.Trailer)
		for k, vv := range resp.Trailer {
			if announced == 0 {
				k = http.TrailerPrefix + k
			}
			dst[k] = append(dst[k], vv...)
		}
	}
	keep = !resp.Close
}

// errClientWrite: a write of the answer to the client failed (it went away,
// or did not read within Config.WriteTimeout).
var errClientWrite = errors.New("writing to the client")

// copyBody copies the upstream body to the client with a pooled buffer,
// flushing after every read when stream is set.
func (f *Front) copyBody(w http.ResponseWriter, body io.Reader, stream bool) error {
	bp := f.bufs.get()
	defer f.bufs.put(bp)
	buf := *bp
	var fl http.Flusher
	if stream {
		fl, _ = w.(http.Flusher)
	}
	for {
		n, rerr := body.Read(buf)
		if n > 0 {
			if _, err := w.Write(buf[:n]); err != nil {
				return fmt.Errorf("%w: %w", errClientWrite, err)
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if rerr == io.EOF {
			return nil
		}
		if rerr != nil {
			return fmt.Errorf("reading the upstream answer: %w", rerr)
		}
	}
}

func (f *Front) rewrite(pr *httputil.ProxyRequest) {
	pr.SetURL(f.upstream)
	pr.Out.Host = pr.In.Host
	pr.Out.Header.Del(f.cfg.ProjectHeader)
	for k := range pr.Out.Header {
		if f.isClaim(k) {
			delete(pr.Out.Header, k)
		}
	}
	for k := range pr.Out.Trailer { // as the direct path's trailers
		if f.isClaim(k) {
			delete(pr.Out.Trailer, k)
		}
	}
	// As the direct path (see isClaim), once the client's claims are
	// gone (Rewrite has dropped its Forwarded and X-Forwarded-{For,Host,
	// Proto}, the loop above the others).
	if ip, _, err := net.SplitHostPort(pr.In.RemoteAddr); err == nil {
		pr.Out.Header.Set("X-Forwarded-For", ip)
	}
	if pr.In.TLS != nil {
		pr.Out.Header.Set("X-Forwarded-Proto", "https")
	}
	if f.cfg.ForwardProject {
		if x := exchangeOf(pr.In); x != nil {
			pr.Out.Header.Set(f.cfg.ProjectHeader, x.project)
		}
	}
}

func (f *Front) modifyResponse(resp *http.Response) error {
	x := exchangeOf(resp.Request)
	if resp.StatusCode < 100 || resp.StatusCode > 599 {
		// net/http reads any three digits; the client is answered 502 and
		// the connection that spoke them is not used again.
		if x != nil && x.upConn != nil {
			x.upConn.Close()
		}
		return fmt.Errorf("upstream status %d outside 100-599", resp.StatusCode)
	}
	if x != nil {
		f.annotate(x, resp.Header)
		if resp.Body != http.NoBody && resp.StatusCode != http.StatusSwitchingProtocols {
			// Closed once, whoever closes it first: a second Close of an
			// HTTP/2 answer's body gives its unread bytes back to the
			// connection's window again. (A 101's body is the tunnel's
			// connection, which ReverseProxy needs writable, and no stop
			// watches it.)
			oc := &onceCloser{ReadCloser: resp.Body}
			resp.Body = oc
			var body io.ReadCloser = oc
			x.upBody.Store(&body)
			// A stop that came before the Store found no body to close.
			if c := context.Cause(resp.Request.Context()); errors.Is(c, errSendStalled) || errors.Is(c, errAnswerStalled) {
				_ = oc.Close()
				return c
			}
		}
		if x.stopUp != nil && resp.StatusCode != http.StatusSwitchingProtocols && resp.Body != http.NoBody {
			resp.Body = newStallBody(resp.Body, f.cfg.readFor(), x.stopUp)
		}
	}
	if len(resp.Trailer) > 0 {
		f.stripOwn(resp.Trailer) // not announced
		resp.Body = &ownTrailer{resp.Body, f, resp}
	}
	return nil
}

// annotate records the upstream's answer in x (it came, its cost) and sets
// the front's headers on it.
func (f *Front) annotate(x *exchange, h http.Header) {
	f.answered(x, h.Get(f.cfg.CostHeader))
	delete(h, f.costKey)
	delete(h, HeaderRefused)
	// The values are shared, read-only slices (net/http copies a header's
	// values when it writes them; len == cap, so an append copies too): three
	// fewer allocations per request than Set and formatting each time.
	if class := classOf(x); class != nil {
		h[HeaderClass] = class
	} else {
		// No scheduler: no class, and none from the upstream either.
		delete(h, HeaderClass)
	}
	h[HeaderQueueWait] = queueWaitOf(x)
}

// answered records in x that the upstream answered, at the cost its cost
// header says (v; "" when it sent none).
func (f *Front) answered(x *exchange, v string) {
	x.outcome = outcomeOK
	if v == "" {
		return
	}
	c, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
	if err == nil && c >= 0 && !math.IsInf(c, 0) {
		x.cost, x.hasCost = c, true
	} else {
		f.log.Warn("ignoring bad cost header", "project", x.project, "value", v)
	}
}

// classOf is the value of HeaderClass on x's answer; nil when x went
// through no scheduler.
func classOf(x *exchange) []string {
	switch {
	case x.exempt:
		return classExempt
	case x.class >= scheduler.P1 && x.class <= scheduler.P3:
		return classValues[x.class]
	case x.class != 0:
		return []string{x.class.String()}
	}
	return nil
}

// queueWaitOf is the value of HeaderQueueWait on x's answer.
func queueWaitOf(x *exchange) []string {
	if x.waited == 0 {
		return noWait
	}
	return []string{strconv.FormatFloat(x.waited.Seconds(), 'f', 6, 64)}
}

// The values of HeaderClass and of HeaderQueueWait for a request that did
// not wait, set by annotate. HeaderClass and HeaderQueueWait are already in
// canonical form, as keys set directly in a header map must be.
var (
	classExempt = []string{ClassExempt}
	classValues = [...][]string{
		scheduler.P1: {scheduler.P1.String()},
		scheduler.P2: {scheduler.P2.String()},
		scheduler.P3: {scheduler.P3.String()},
	}
	noWait = []string{strconv.FormatFloat(0, 'f', 6, 64)}
)

// stripOwn deletes from h, an upstream's informational head or trailer,
// the fields the front sets itself or consumes (its class, queue wait and
// refusal, the cost header): the upstream does not speak for the front.
func (f *Front) stripOwn(h http.Header) {
	if len(h) == 0 {
		return
	}
	for k := range h {
		if f.own(k) {
			delete(h, k)
		}
	}
}

// stripHop removes from an informational answer's fields h those of the
// upstream's connection: the hop-by-hop fields, those its Connection field
// names, and the body's framing (an informational answer has no body). A
// final answer's are removed by ReverseProxy and by the direct path's
// relay; an informational one's were passed on as the upstream wrote them.
func stripHop(h http.Header) {
	for _, k := range h["Connection"] {
		for f := range strings.SplitSeq(k, ",") {
			if f = textproto.TrimString(f); f != "" {
				h.Del(f)
			}
		}
	}
	for k := range h {
		if answerfield.IsHopByHop(k) || k == "Content-Length" {
			delete(h, k)
		}
	}
}

// own reports whether canonical key k is a field the front sets itself or
// consumes: its class, queue wait and refusal, and the cost header.
func (f *Front) own(k string) bool {
	return k == HeaderClass || k == HeaderQueueWait || k == HeaderRefused || k == f.costKey
}

// may1xx reports whether an informational answer may be passed to
// the client of r: not to an HTTP/1.0 client, which does not know them
// (RFC 9110 15.2).
func may1xx(r *http.Request) bool { return r.ProtoAtLeast(1, 1) }

// proxyWriter is the client's ResponseWriter as ReverseProxy sees it: an
// informational answer reaches only a client that may have one, and without
// the front's own fields; a tunnel's client connection is closed when the
// tunnel's time is up.
type proxyWriter struct {
	http.ResponseWriter
	f   *Front
	r   *http.Request
	ctx context.Context // the request's as ReverseProxy has it: a tunnel's ends at TunnelTimeout
}

// Hijack hands ReverseProxy the client's connection for a tunnel, and closes
// it when the request's context ends. When the tunnel's time is up
// ReverseProxy closes the upstream's end only, then waits for its copy of
// the client's bytes to end: with a client that keeps its connection open
// and silent (after the upstream closed its side, say) it waited for good,
// and the tunnel held its permit. At the handler's normal end ReverseProxy
// has closed the connection already.
func (w *proxyWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	c, brw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	if err == nil {
		context.AfterFunc(w.ctx, func() { _ = c.Close() })
	}
	return c, brw, err
}

func (w *proxyWriter) WriteHeader(code int) {
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		if !may1xx(w.r) {
			clear(w.Header()) // ReverseProxy copied the answer's fields in
			return
		}
		w.f.stripOwn(w.Header())
		stripHop(w.Header())
	}
	w.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController (ReverseProxy's flushes, hijacks
// and deadlines) reach the server's writer.
func (w *proxyWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// waitWatch bounds waits on the fallback path, where http.Transport does
// the reads and writes and the connection cannot carry the bound as a
// deadline (an HTTP/2 one carries other streams, and http.Transport reads
// and writes an HTTP/1 one from goroutines of its own): a wait begins and
// ends around what the transport does, and a timer looks at the wait in
// progress; one that has lasted d stops the upstream request (stop cancels
// its context with the cause: http.Transport closes the HTTP/1 connection
// or resets the HTTP/2 stream), which ends the wait with an error. Per wait
// it costs two atomic stores and a clock reading; the timer fires once
// every d at most.
type waitWatch struct {
	d     time.Duration
	stop  context.CancelCauseFunc
	cause error // what stop is given
	base  time.Time
	// since is when the wait in progress began, in nanoseconds after
	// base; -1 when none is.
	since  atomic.Int64
	fired  atomic.Bool
	closed atomic.Bool
	mu     sync.Mutex // guards t
	t      *time.Timer
}

func (w *waitWatch) init(d time.Duration, stop context.CancelCauseFunc, cause error) {
	w.d, w.stop, w.cause, w.base = d, stop, cause, time.Now()
	w.since.Store(-1)
	w.mu.Lock()
	w.t = time.AfterFunc(d, w.check)
	w.mu.Unlock()
}

func (w *waitWatch) begin() { w.since.Store(int64(time.Since(w.base))) }
func (w *waitWatch) end()   { w.since.Store(-1) }

// check stops the exchange when the wait in progress has lasted d, and
// otherwise comes back when it would have.
func (w *waitWatch) check() {
	w.mu.Lock()
	if w.closed.Load() {
		w.mu.Unlock()
		return
	}
	wait := w.d
	if s := w.since.Load(); s >= 0 {
		waited := time.Since(w.base) - time.Duration(s)
		if waited >= w.d {
			w.fired.Store(true)
			w.mu.Unlock()
			// Past the lock: the stop closes the answer's body, which
			// may wait for the connection's writer, and close must not
			// wait for that.
			w.stop(w.cause)
			return
		}
		wait = w.d - waited
	}
	w.t.Reset(wait)
	w.mu.Unlock()
}

func (w *waitWatch) close() {
	w.closed.Store(true)
	w.mu.Lock()
	w.t.Stop()
	w.mu.Unlock()
}

// stallBody is an upstream answer's body on the fallback path, each read
// of which may wait d at most, as on the direct path (upConn.armRead):
// http.Transport bounds no read of a body. A read that waits d stops the
// upstream request, and ReverseProxy aborts the client's answer as for an
// upstream that broke off.
type stallBody struct {
	io.ReadCloser
	w waitWatch
}

func newStallBody(rc io.ReadCloser, d time.Duration, stop context.CancelCauseFunc) *stallBody {
	b := &stallBody{ReadCloser: rc}
	b.w.init(d, stop, fmt.Errorf("%w: no byte for %v", errAnswerStalled, d))
	return b
}

func (b *stallBody) Read(p []byte) (int, error) {
	b.w.begin()
	n, err := b.ReadCloser.Read(p)
	b.w.end()
	if err != nil && err != io.EOF && b.w.fired.Load() && !errors.Is(err, errAnswerStalled) {
		err = fmt.Errorf("%w: no byte for %v: %w", errAnswerStalled, b.w.d, err)
	}
	return n, err
}

func (b *stallBody) Close() error {
	b.w.close()
	return b.ReadCloser.Close()
}

// sendBody is a request body on the fallback path, each piece of which the
// upstream must take within d (Config.WriteTimeout), as on the direct path
// (directUpstream.armSend): http.Transport bounds no write of a request
// body, and an upstream that stops reading it (having answered early, or
// not at all) held the request, its permit and its place for as long as it
// kept the connection open. A piece is out when http.Transport asks for the
// next one, or says the request is written (done, from the trace's
// WroteRequest: both transports call it once the body is out or dropped,
// an HTTP/2 answer of 300 or more dropping it): the wait runs from a Read's
// return, the last one's (io.EOF) included, to the next Read or to done, so
// the client's own pace (the Read itself, bounded by timedBody) is not
// counted, and what comes after the request (the wait for the answer, which
// may be long) is not a send. A Read is given at most bodyPiece bytes: the
// HTTP/2 transport takes up to 512 KiB at once and counts it out only when
// the whole has a window, which asked an upstream reading steadily for 17
// KiB/s at the default bound, where the direct path asks 1 KiB/s.
type sendBody struct {
	io.ReadCloser
	w waitWatch
}

// bodyPiece is the most a sendBody's Read gives at once: the direct path's
// buffer.
const bodyPiece = 32 << 10

func newSendBody(rc io.ReadCloser, d time.Duration, stop context.CancelCauseFunc) *sendBody {
	b := &sendBody{ReadCloser: rc}
	// os.ErrDeadlineExceeded: a timeout, answered 504 as on the direct path.
	b.w.init(d, stop, fmt.Errorf("writing upstream request body: %w: no piece of it taken for %v: %w",
		errSendStalled, d, os.ErrDeadlineExceeded))
	return b
}

func (b *sendBody) Read(p []byte) (int, error) {
	b.w.end()
	n, err := b.ReadCloser.Read(p[:min(len(p), bodyPiece)])
	if err == nil || err == io.EOF {
		b.w.begin()
	}
	return n, err
}

// done stops the watch: the request is out, or dropped.
func (b *sendBody) done() { b.w.close() }

// Close stops the watch too, though ReverseProxy hands http.Transport the
// body behind a Close that does nothing (done is what ends it).
func (b *sendBody) Close() error {
	b.w.close()
	return b.ReadCloser.Close()
}

// onceCloser closes what it wraps once, whoever asks first.
type onceCloser struct {
	io.ReadCloser
	once sync.Once
	err  error
}

func (c *onceCloser) Close() error {
	c.once.Do(func() { c.err = c.ReadCloser.Close() })
	return c.err
}

// ownTrailer removes the front's own fields from an answer's trailer when
// its body ends: the values only come then, and would be passed on by
// ReverseProxy under whatever names the upstream chose.
type ownTrailer struct {
	io.ReadCloser
	f    *Front
	resp *http.Response
}

func (b *ownTrailer) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.f.stripOwn(b.resp.Trailer)
	}
	return n, err
}

func (f *Front) proxyError(w http.ResponseWriter, r *http.Request, err error) {
	f.upstreamFailed(w, r, exchangeOf(r), err)
}

// upstreamFailed answers a request the upstream did not answer: 408 when
// the client's body stalled past Config.BodyReadTimeout, 400 when it broke
// off, 504 when the upstream did not answer in time (a connection within
// the dialer's 5 seconds, a head within Config.UpstreamHeadTimeout), 502
// otherwise, or nothing (see noAnswer)
// when the client went away.
func (f *Front) upstreamFailed(w http.ResponseWriter, r *http.Request, x *exchange, err error) {
	if x != nil && x.body != nil && x.body.timedOut.Load() {
		// The client's own stall; its connection cannot be trusted to be
		// in step, and the server's read of it failed.
		x.outcome = outcomeCanceled
		w.Header().Set("Connection", "close")
		http.Error(w, "fairshare: the request body stalled", http.StatusRequestTimeout)
		return
	}
	if c := context.Cause(r.Context()); errors.Is(c, errSendStalled) {
		// The fallback stopped the request (sendBody): the upstream's
		// stall, not the client's leaving.
		err = c
	} else if r.Context().Err() != nil || errors.Is(err, errClientGone) {
		// The client went away; there is nobody to answer.
		if x != nil {
			x.outcome = outcomeCanceled
		}
		noAnswer(w)
		return
	}
	if errors.Is(err, errClientBody) {
		if x != nil {
			x.outcome = outcomeCanceled
		}
		w.Header().Set("Connection", "close")
		http.Error(w, "fairshare: bad request body", http.StatusBadRequest)
		return
	}
	status, msg := http.StatusBadGateway, "fairshare: upstream unavailable"
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		status, msg = http.StatusGatewayTimeout, "fairshare: the upstream did not answer in time"
	}
	if x != nil {
		x.outcome = outcomeError
		f.log.Warn("upstream error", "project", x.project, "status", status, "err", err)
	}
	http.Error(w, msg, status)
}

// timedBody is a client's request body each read of which must return
// within Config.BodyReadTimeout: a client that stops sending does not hold
// its request, and its permit, for longer.
type timedBody struct {
	io.ReadCloser
	d time.Duration
	// minRate (bytes/s, 0 none) bounds the whole body: by start + d +
	// read/minRate the client must have sent read bytes and more.
	minRate int64
	start   time.Time
	read    int64
	conn    net.Conn                 // the client's connection, HTTP/1 under Front.Serve
	rc      *http.ResponseController // otherwise
	// timedOut: a read failed on the deadline.
	timedOut atomic.Bool
	// mu is held by Read and Close: Close sets its deadline once no Read
	// can lift it (a Read in progress ends within its own).
	mu  sync.Mutex
	eof bool // a Read returned io.EOF
	h2  bool // an HTTP/2 stream's body
	// closed: Close ran. A Read after it (http.Transport's writer reads
	// the body past the handler's end, as long as its connection takes
	// it) touches neither the body nor its deadline: the server's
	// stream is gone by then, and an HTTP/2 one's deadline setter
	// dereferenced its freed state (a nil pointer panic that killed the
	// process, seen in CI).
	closed atomic.Bool
}

func (f *Front) timedBody(w http.ResponseWriter, r *http.Request) *timedBody {
	b := &timedBody{ReadCloser: r.Body, d: f.cfg.BodyReadTimeout, minRate: f.cfg.BodyMinRate, start: time.Now(), h2: r.ProtoMajor == 2}
	if cc := peerOf(r).cc; cc != nil && r.ProtoMajor == 1 {
		b.conn = cc.Conn
	} else {
		b.rc = http.NewResponseController(w)
	}
	return b
}

func (b *timedBody) setDeadline(t time.Time) {
	if b.conn != nil {
		_ = b.conn.SetReadDeadline(t)
	} else {
		_ = b.rc.SetReadDeadline(t)
	}
}

// Read reads within the deadline, and lifts it after: at the end of an
// HTTP/1 body net/http starts reading the connection for the next request,
// which must not fail on it.
func (b *timedBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed.Load() {
		return 0, http.ErrBodyReadAfterClose
	}
	start := time.Now()
	deadline := start.Add(b.d)
	if b.minRate > 0 {
		// The whole body's bound: a client trickling a byte before each
		// read's deadline still has to keep the average rate.
		deadline = minTime(deadline, b.start.Add(b.d+time.Duration(float64(b.read+1)/float64(b.minRate)*float64(time.Second))))
	}
	b.setDeadline(deadline)
	n, err := b.ReadCloser.Read(p)
	b.read += int64(n)
	if err != nil && err != io.EOF && (errors.Is(err, os.ErrDeadlineExceeded) || !time.Now().Before(deadline)) {
		// The deadline stays in the past: the server's own read of the
		// rest of the body, when the handler closes it, fails at once
		// too rather than wait for a client that stopped.
		b.timedOut.Store(true)
		b.setDeadline(time.Unix(1, 0))
		return n, err
	}
	b.eof = b.eof || err == io.EOF
	b.setDeadline(time.Time{})
	return n, err
}

// Close closes the body within the read timeout. net/http's Close of a body
// not read to its end reads up to 256 KiB more of it, to keep the
// connection, on whatever deadline the connection has: after an upstream
// that answered early and hung up, and a Read that had lifted the
// deadline, a client gone silent held the handler, and its permit, for as
// long as it kept the connection open. A body closed after a timed-out
// Read keeps its deadline in the past; one read to its end has nothing to
// wait for.
func (b *timedBody) Close() error {
	if b.h2 && !b.closed.Load() {
		// HTTP/2: a Read in
		// progress (ReverseProxy's sender, waiting on a client that
		// says nothing) ends now rather than at its deadline, which held
		// the end of the answer, and its permit, that long. The
		// stream's Close discards the rest; it reads nothing.
		b.setDeadline(time.Unix(1, 0))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed.Swap(true) {
		return nil
	}
	if b.eof || b.timedOut.Load() {
		return b.ReadCloser.Close()
	}
	deadline := time.Now().Add(b.d)
	b.setDeadline(deadline)
	err := b.ReadCloser.Close()
	if !time.Now().Before(deadline) {
		b.timedOut.Store(true)
		b.setDeadline(time.Unix(1, 0))
		return err
	}
	b.setDeadline(time.Time{})
	return err
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}
