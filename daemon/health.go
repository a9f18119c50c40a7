// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"fmt"
	"net/http"
	"sync/atomic"
	"time"
)

// healthStaleTicks is how many ticks the control loop may miss before
// /healthz says it stalled, and healthStaleMin the least time that is: a
// tick that reconciles a busy node's socket table may take a few periods,
// and a short tick must not make a probe fail on one slow pass.
const (
	healthStaleTicks = 5
	healthStaleMin   = 5 * time.Second
)

// health is what /healthz reads: when the control loop last finished a tick
// (Unix nanoseconds; set when the loop starts, so a daemon that just started
// is alive).
type health struct {
	last atomic.Int64
}

// beat records that the control loop finished a tick at now.
func (h *health) beat(now time.Time) { h.last.Store(now.UnixNano()) }

// staleAfter is how long the loop may go without a tick before /healthz
// answers 503.
func staleAfter(tick time.Duration) time.Duration {
	return max(healthStaleTicks*tick, healthStaleMin)
}

// handler answers /healthz: 200 "ok" while the control loop ticks, 503 with
// one line saying how long it has not when it stalled. The control loop is
// what keeps the kernel's shares, the membership and the policies current;
// the listeners answering says nothing of it. Kubernetes' liveness,
// readiness and startup probes use it (deploy/helm/fairshare).
func (h *health) handler(tick time.Duration) http.Handler {
	stale := staleAfter(tick)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		age := time.Since(time.Unix(0, h.last.Load()))
		if age > stale {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintf(w, "control loop stalled: no tick for %s (tick %s, unhealthy after %s)\n",
				age.Round(time.Millisecond), tick, stale)
			return
		}
		fmt.Fprintln(w, "ok")
	})
}
