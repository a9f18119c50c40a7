// SPDX-License-Identifier: Apache-2.0

package permitd

import "time"

// SetSpawnTimer replaces the timer that starts each spawn's deadline, so
// that tests decide when a deadline passes instead of waiting for it.
func SetSpawnTimer(s *Server, after func(time.Duration) (<-chan time.Time, func() bool)) {
	s.after = after
}

// SetWaitLimits changes the bounds of waiting operations before Serve.
func SetWaitLimits(s *Server, total, perSession int) {
	s.cfg.MaxWaiting, s.cfg.MaxWaitingPerSession = total, perSession
}
