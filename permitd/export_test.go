// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"time"

	"github.com/fairshare-dev/fairshare/events"
)

// SetSpawnTimer replaces the timer that starts each spawn's deadline, so
// that tests decide when a deadline passes instead of waiting for it.
func SetSpawnTimer(s *Server, after func(time.Duration) (<-chan time.Time, func() bool)) {
	s.after = after
}

// SetClock replaces the clock a spawn reads to tell whether the victim's
// owner was asked within the first half of the spawn's second, so that
// tests decide how late a victim is named instead of waiting for it.
func SetClock(s *Server, now func() time.Time) {
	s.now = now
}

// SetWaitLimits changes the bounds of waiting operations before Serve.
func SetWaitLimits(s *Server, total, perSession int) {
	s.cfg.MaxWaiting, s.cfg.MaxWaitingPerSession = total, perSession
}

// SetLeaseCounter sets the count the next lease id is drawn from.
func SetLeaseCounter(s *Server, n uint64) {
	s.nextLease.Store(n)
}

// SetObjectLimits changes the bounds of kept objects before Serve.
func SetObjectLimits(s *Server, total, perUID int) {
	s.cfg.MaxObjects, s.cfg.MaxObjectsPerUID = total, perUID
}

// SetUnconfirmedLimit changes MaxUnconfirmed before Serve; 0 never drops.
func SetUnconfirmedLimit(s *Server, n int) {
	s.maxUnconfirmed = n
}

// SetEvents sets Config.Events before Serve.
func SetEvents(s *Server, f func(events.Event)) {
	s.cfg.Events = f
}
