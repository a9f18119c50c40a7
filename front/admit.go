// SPDX-License-Identifier: Apache-2.0

// A request's way in, in the order of "Order of checks" in doc.go: its
// exchange, ServeHTTP, the front's decision (admit: identity, exempt
// budget, rate buckets, pool, scheduler ticket), its refusals (refuse,
// event, hint), the scheduler's word (dispatched, unscheduled), and the end
// of its admission, the permit given back and the cost charged (finish).

package front

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/pools"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// exchange is the state of one proxied request, shared between ServeHTTP and
// the reverse proxy's callbacks, which all run on the request's goroutine.
type exchange struct {
	project string
	class   scheduler.Class
	waited  time.Duration
	outcome outcome
	cost    float64 // from the upstream's cost header; valid if hasCost
	hasCost bool
	exempt  bool
	w       http.ResponseWriter // the client's, for 1xx answers on the direct path
	at      time.Time           // when it was handed to the upstream

	// On the ReverseProxy path: the upstream connection (to close it after
	// an answer the front refuses) and the informational answers so far.
	upConn net.Conn
	n1xx   int
	// body is the request body with its read deadline, when there is one.
	body *timedBody
	// stopUp, on the ReverseProxy path, cancels the upstream request: an
	// answer's body stalled (see stallBody). Nil for a tunnel, or with no
	// UpstreamReadTimeout.
	stopUp context.CancelCauseFunc
	// upBody, on the ReverseProxy path, is the upstream answer's body as
	// http.Transport gave it, once it has: the stops close it.
	upBody atomic.Pointer[io.ReadCloser]
	// gone: its client went away, as the front heard it (a hang-up while
	// it waited in the queue, hangup.go; a write or the watch during its
	// answer, relay) before net/http may have.
	gone bool
}

type exchangeKey struct{}

func exchangeOf(r *http.Request) *exchange {
	x, _ := r.Context().Value(exchangeKey{}).(*exchange)
	return x
}

// ServeHTTP admits, schedules and proxies one request.
func (f *Front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.handlers.Add(1)
	defer f.handlers.Add(-1)
	if res, dropped := takeResume(r); res != nil {
		f.serveResumed(w, r, res)
		return
	} else if dropped {
		// Its exchange was given back: it is not sent again.
		panic(http.ErrAbortHandler)
	}
	if r.ProtoMajor == 2 && f.cfg.WriteTimeout > 0 {
		sw := newStreamWriter(w, f.cfg.WriteTimeout)
		defer sw.close()
		w = sw
	}
	if err := wellFormed(r); err != nil {
		f.stats.badRequest(http.StatusBadRequest)
		http.Error(w, "fairshare: "+err.Error(), http.StatusBadRequest)
		return
	}
	a := f.admit(w, r, peerOf(r))
	if a == nil {
		return
	}
	// One deferred exit for every path below, panics included: the reverse
	// proxy aborts a response broken mid-body with panic(http.ErrAbortHandler),
	// and the permit must still go back exactly once.
	defer func() {
		p := recover()
		f.finish(a, p != nil, p != nil && (clientGone(r) || a.x.gone))
		if p != nil {
			panic(p)
		}
	}()
	if a.ticket != nil {
		ctx, stop := r.Context(), func() {}
		if _, ready, _ := a.ticket.TryWait(); !ready && needsHangupWatch(r) {
			ctx, stop = watchHangup(ctx, peerOf(r))
		}
		class, err := a.ticket.Wait(ctx)
		stop()
		a.x.gone = err != nil && errors.Is(context.Cause(ctx), errClientGone)
		if !f.dispatched(a, class, err) {
			f.unscheduled(w, r, a.x, err)
			return
		}
	} else {
		f.dispatched(a, 0, nil)
	}
	f.forward(w, r, a.x)
}

// wellFormed refuses a request whose head the front could not pass on as
// written: a method that is not a token, a query holding a space or a
// control byte, a Host that is not a host. net/http's HTTP/1 server
// refuses these before a handler runs; its HTTP/2 server passes them on
// (it checks :method and :path for control bytes only). Written into the
// upstream's request line, "GET /v1/x /healthz" routed and charged as
// /healthz (perhaps exempt) and served as /v1/x by a lenient upstream, and
// "HEAD " (a HEAD to the upstream, not to the front) held its permit and
// place waiting for a body the answer never had.
func wellFormed(r *http.Request) error {
	if r.Method == "" || strings.IndexFunc(r.Method, func(c rune) bool { return !httpguts.IsTokenRune(c) }) >= 0 {
		return fmt.Errorf("bad method %q", r.Method)
	}
	for i := 0; i < len(r.URL.RawQuery); i++ {
		if c := r.URL.RawQuery[i]; c <= ' ' || c == 0x7f {
			return fmt.Errorf("bad query: byte %#02x", c)
		}
	}
	if !httpguts.ValidHostHeader(r.Host) {
		return fmt.Errorf("bad host %q", r.Host)
	}
	return nil
}

// admission is an admitted request: what finish needs to account for it.
type admission struct {
	project    string
	start      time.Time
	permit     pools.Permit
	ticket     *scheduler.Ticket // nil without a scheduler, or once withdrawn
	dispatched time.Time
	x          *exchange
}

// admitted holds an admission and its exchange in one allocation.
type admitted struct {
	admission
	exchange
}

// admit decides about r from peer p, before any upstream work: its
// identity, the exempt budget, the rate buckets and the requests pool. A
// refusal is answered on w and admit returns nil; otherwise the request is
// admitted (its ticket submitted, not yet waited on) and must be ended with
// finish.
func (f *Front) admit(w http.ResponseWriter, r *http.Request, p *peer) *admission {
	start := f.clk.Now()
	id, status, err := f.resolvePeer(r, p)
	if err != nil {
		f.stats.badRequest(status)
		if f.deps.Events != nil {
			reason := events.ReasonNoIdent
			if status == http.StatusForbidden {
				reason = events.ReasonUntrust
			}
			f.deps.Events(events.Event{Source: events.SourceFront, Kind: events.KindRefused, Pool: poolRequests,
				Reason: reason, Remote: peerText(r), Detail: strconv.Itoa(status) + ": " + err.Error()})
		}
		http.Error(w, "fairshare: "+err.Error(), status)
		return nil
	}
	project := id.project
	if id.exempt {
		if f.exemptInFlight.Add(1) <= int64(f.cfg.ExemptMax) {
			return &admission{project: project, start: start,
				x: &exchange{project: project, outcome: outcomeCanceled, exempt: true, at: start}}
		}
		f.exemptInFlight.Add(-1)
		f.stats.overBudget()
	}
	if rates := f.deps.Rates; rates != nil {
		if ok, retry := rates.Allow(project); !ok {
			st := rates.State(project)
			reason, oc, rate := "rate", outcomeRefusedRate, st.Limits.RequestsPerSec
			msg := fmt.Sprintf("fairshare: project %s is over its requests/s rate", project)
			if st.WorkTokens < 0 {
				// Once out of debt, requests pass at the work refill rate
				// divided by their cost; one unit each is the estimate.
				reason, oc, rate = "debt", outcomeRefusedDebt, st.Limits.WorkPerSec
				msg = fmt.Sprintf("fairshare: project %s is in work-units debt", project)
			}
			if f.deps.DryRun != nil && f.deps.DryRun(project) {
				f.stats.wouldRefuse(reason)
				f.event(r, events.KindWouldRefuse, project, reason, nil)
			} else {
				f.event(r, events.KindRefused, project, reason, nil)
				f.refuse(w, project, reason, retry, rate, msg)
				f.stats.record(project, oc, 0, 0, false, start)
				return nil
			}
		}
	}
	ax := &admitted{admission: admission{project: project, start: start},
		exchange: exchange{project: project, outcome: outcomeCanceled}}
	a := &ax.admission
	a.x = &ax.exchange
	if pool := f.deps.Requests; pool != nil {
		// A flood is refused here, request after request: the refusal is
		// written into storage of this call, not allocated.
		var ref pools.Refusal
		pm, ok := pool.TryAcquireInto(project, &ref)
		if ok && ref.WouldRefuse {
			f.stats.wouldRefuse("share")
			f.event(r, events.KindWouldRefuse, project, events.ReasonShare, &ref)
		}
		if !ok {
			f.event(r, events.KindRefused, project, events.ReasonShare, &ref)
			f.refuse(w, project, "share", ref.RetryAfter, ref.ReleaseRate, fmt.Sprintf(
				"fairshare: project %s holds %d requests, its share is %d: %s", project, ref.Held, ref.Share, ref.Reason))
			f.stats.record(project, outcomeRefusedShare, 0, 0, false, start)
			return nil
		}
		a.permit = pm
	}
	if s := f.deps.Sched; s != nil {
		a.ticket = s.Submit(project)
	}
	return a
}

// unscheduled answers a request the scheduler did not dispatch (err ended
// its ticket's wait): nothing when the client went away (the wait ended
// with the request's context), 503 otherwise (the ticket was withdrawn).
func (f *Front) unscheduled(w http.ResponseWriter, r *http.Request, x *exchange, err error) {
	if r.Context().Err() != nil || errors.Is(err, context.Canceled) {
		x.outcome = outcomeCanceled
		noAnswer(w)
		return
	}
	x.outcome = outcomeError
	f.log.Warn("request not dispatched", "project", x.project, "err", err)
	http.Error(w, "fairshare: the scheduler did not dispatch the request", http.StatusServiceUnavailable)
}

// noAnswer ends a request the front cannot answer, its client gone. A
// handler that returns without writing gets an empty 200 from net/http, a
// success nobody gave, read by a client that only half-closed its
// connection: the answer is aborted instead (net/http closes the
// connection, HTTP/2 resets the stream), and a loop's captured answer
// marked so.
func noAnswer(w http.ResponseWriter) {
	if cw, ok := w.(*captured); ok {
		cw.abort = true
		return
	}
	panic(http.ErrAbortHandler)
}

// clientGone reports whether r's client went away: its context ended, or
// a read of its connection failed (which the watch hears a moment before
// net/http cancels the context).
func clientGone(r *http.Request) bool {
	if r.Context().Err() != nil {
		return true
	}
	p, ok := r.Context().Value(peerKey{}).(*peer)
	return ok && p.cc != nil && p.cc.isGone()
}

// dispatched records the end of a's wait for the scheduler (class and err
// from its ticket; none without one) and reports whether it may go
// upstream: false when its ticket was withdrawn.
func (f *Front) dispatched(a *admission, class scheduler.Class, err error) bool {
	if a.ticket != nil {
		a.x.waited = a.ticket.Waited()
		if err != nil {
			a.ticket = nil // withdrawn: nothing to complete
			return false
		}
		a.x.class = class
	}
	a.dispatched = f.clk.Now()
	a.x.at = a.dispatched
	return true
}

// finish ends an admitted request, exactly once: its ticket is completed
// and its cost charged, its permit (or exempt place) given back and its
// outcome counted. panicked: the handler is unwinding (an aborted answer);
// canceled: the client went away.
func (f *Front) finish(a *admission, panicked, canceled bool) {
	x, project := a.x, a.project
	end := f.clk.Now()
	if x.exempt {
		f.exemptInFlight.Add(-1)
		oc := x.outcome
		if oc == outcomeOK {
			oc = outcomeExempt
		}
		f.stats.record(project, oc, end.Sub(a.start), 0, true, end)
		return
	}
	if panicked {
		x.outcome = outcomeError
		if canceled {
			x.outcome = outcomeCanceled
		}
	}
	var service time.Duration
	if !a.dispatched.IsZero() {
		service = end.Sub(a.dispatched)
		cost := f.cost(x, service)
		if a.ticket != nil {
			a.ticket.Done(cost)
		}
		if f.deps.Rates != nil {
			f.deps.Rates.Charge(project, cost)
		}
	}
	if a.permit.Valid() {
		if err := f.deps.Requests.Release(a.permit); err != nil {
			f.log.Error("releasing request permit", "project", project, "err", err)
		}
	}
	f.stats.record(project, x.outcome, end.Sub(a.start), x.waited, !a.dispatched.IsZero(), end)
}

// cost is what a finished request is charged, in work units.
func (f *Front) cost(x *exchange, service time.Duration) float64 {
	switch {
	case x.hasCost:
		return x.cost
	case f.cfg.CostFromTime:
		return float64(service) / float64(f.cfg.CostUnit)
	default:
		return 1
	}
}

// refuse answers 429 with a Retry-After for this project: the estimate,
// spread over whole seconds at the rate the project can be admitted again
// (see retryPacer), and the same slot to the millisecond in
// HeaderRetryAfterMs.
func (f *Front) refuse(w http.ResponseWriter, project, reason string, est time.Duration, rate float64, msg string) {
	h := w.Header()
	secs, ms := f.retry.hint(project, f.clk.Now(), est, rate)
	h.Set("Retry-After", strconv.Itoa(secs))
	h.Set(HeaderRetryAfterMs, strconv.FormatInt(ms, 10))
	h.Set(HeaderRefused, reason)
	http.Error(w, msg, http.StatusTooManyRequests)
}

// poolRequests is the name of the front's pool (config.PoolRequests).
const poolRequests = "requests"

// event publishes a decision about r of project (rf: the rule's numbers,
// for a share refusal).
func (f *Front) event(r *http.Request, kind, project, reason string, rf *pools.Refusal) {
	if f.deps.Events == nil {
		return
	}
	e := events.Event{Source: events.SourceFront, Kind: kind, Pool: poolRequests, Project: project, Reason: reason, Remote: peerText(r)}
	if rf != nil {
		if rf.Reason == pools.ReasonFull {
			e.Reason = events.ReasonPoolFull
		}
		e.Held, e.InUse, e.Share, e.PoolSize = rf.Held, rf.InUse, rf.Share, rf.Size
	}
	f.deps.Events(e)
}

// peerText is the client as an event names it: its address, or "unix" on
// the front's socket.
func peerText(r *http.Request) string {
	if r.RemoteAddr == "" || r.RemoteAddr == "@" {
		return "unix"
	}
	return r.RemoteAddr
}

// hint is the Retry-After, in seconds, of a refusal of project now: the
// refusal's estimate est and the rate at which the project can be admitted
// again.
func (f *Front) hint(project string, est time.Duration, rate float64) int {
	return f.retry.seconds(project, f.clk.Now(), est, rate)
}
