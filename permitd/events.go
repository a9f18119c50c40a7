// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"strconv"

	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/pools"
)

// publish hands e to Config.Events, if set.
func (s *Server) publish(e events.Event) {
	if s.cfg.Events != nil {
		e.Source = events.SourcePermits
		s.cfg.Events(e)
	}
}

// peerText names a session's peer in an event: its uid and pid.
func peerText(ss *session) string {
	if ss == nil {
		return ""
	}
	return "uid " + strconv.FormatUint(uint64(ss.cred.UID), 10) + " pid " + strconv.FormatInt(int64(ss.cred.PID), 10)
}

// refusalEvent publishes a refusal (kind refused) or a refusal dry-run
// admitted (would_refuse) of the pool's rule, with its numbers.
func (s *Server) refusalEvent(ss *session, kind string, rf *pools.Refusal) {
	if s.cfg.Events == nil {
		return
	}
	reason := events.ReasonShare
	switch {
	case rf.Is(pools.ErrTooManyResidents):
		reason = events.ReasonResidents
	case rf.Reason == pools.ReasonFull:
		reason = events.ReasonPoolFull
	}
	s.publish(events.Event{Kind: kind, Pool: rf.Pool, Project: rf.Project, Reason: reason, Remote: peerText(ss),
		Held: rf.Held, InUse: rf.InUse, Share: rf.Share, PoolSize: rf.Size})
}
