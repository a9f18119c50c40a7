// SPDX-License-Identifier: Apache-2.0

package admin

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"syscall"
	"time"

	"github.com/fairshare-dev/fairshare/events"
	"github.com/fairshare-dev/fairshare/policy"
)

// EventSource is what a Backend implements to serve GET /v1/events.
type EventSource interface {
	// RecentEvents returns the events kept that match f, oldest first.
	RecentEvents(f events.Filter) []events.Event
	// SubscribeEvents streams the next events matching f, at most buf of
	// them waiting; the stream is told what it lost beyond that.
	SubscribeEvents(f events.Filter, buf int) *events.Sub
}

// StreamBuffer bounds the events waiting for one stream of GET /v1/events;
// past it the stream loses events and is told how many (a dropped event).
const StreamBuffer = 1024

// MaxStreams bounds the streams of GET /v1/events open at once, so that
// followers never take the admin socket's places the CLI needs (32).
const MaxStreams = 8

// streamWrite bounds one write to a stream's reader: a reader that takes
// longer is gone, and its stream ends.
const streamWrite = 10 * time.Second

// poolName is a pool name as config allows it.
var poolName = regexp.MustCompile(`^[a-z][a-z0-9_]{0,31}$`)

// events answers GET /v1/events?project=P&pool=NAME[&follow=1]: the kept
// events that match, one JSON object a line, then (with follow) the new
// ones as they come, until the client hangs up.
func (s *Server) events(w http.ResponseWriter, r *http.Request) {
	src, ok := s.b.(EventSource)
	if !ok {
		writeError(w, http.StatusNotFound, "this daemon keeps no events")
		return
	}
	q := r.URL.Query()
	f := events.Filter{Project: q.Get("project"), Pool: q.Get("pool")}
	if f.Project != "" {
		if err := policy.ValidateProject(f.Project); err != nil {
			writeError(w, http.StatusBadRequest, "project: "+err.Error())
			return
		}
	}
	if f.Pool != "" && !poolName.MatchString(f.Pool) {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("pool: %q is not a pool name", f.Pool))
		return
	}
	follow := q.Get("follow") == "1" || q.Get("follow") == "true"
	if n := s.streams.Add(1); n > MaxStreams {
		s.streams.Add(-1)
		writeError(w, http.StatusServiceUnavailable, fmt.Sprintf("%d event streams are open already, the most the daemon serves at once", MaxStreams))
		return
	}
	defer s.streams.Add(-1)
	var sub *events.Sub
	if follow {
		// Subscribed before the recent ones are read, so nothing falls
		// between; what both hold is sent once (by Seq).
		sub = src.SubscribeEvents(f, StreamBuffer)
		defer sub.Close()
	}
	rc := http.NewResponseController(w)
	// A stream outlives the server's read and write timeouts, which are
	// for the one-shot requests: the write deadline moves with each write.
	_ = rc.SetReadDeadline(time.Time{})
	w.Header().Set("Content-Type", "application/x-ndjson")
	w.WriteHeader(http.StatusOK)
	enc := json.NewEncoder(w)
	var last uint64
	send := func(e events.Event) bool {
		_ = rc.SetWriteDeadline(time.Now().Add(streamWrite))
		if enc.Encode(e) != nil {
			return false
		}
		if e.Seq > last {
			last = e.Seq
		}
		return true
	}
	for _, e := range src.RecentEvents(f) {
		if !send(e) {
			return
		}
	}
	_ = rc.Flush()
	if !follow {
		return
	}
	// A loss is reported with the next event; the ticker reports one that
	// no event followed.
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-r.Context().Done():
			return
		case <-s.stopping:
			return
		case now := <-tick.C:
			if len(sub.C) > 0 {
				continue
			}
			if n := sub.TakeLost(); n > 0 {
				if !send(events.DroppedNotice(now, n)) || rc.Flush() != nil {
					return
				}
			}
		case e, ok := <-sub.C:
			if !ok {
				return
			}
			if e.Seq != 0 && e.Seq <= last {
				continue
			}
			if !send(e) {
				return
			}
			// Whatever else is waiting goes in the same write.
			for n := len(sub.C); n > 0; n-- {
				if !send(<-sub.C) {
					return
				}
			}
			if rc.Flush() != nil {
				return
			}
		}
	}
}

// Events reads GET /v1/events: the kept events matching f, then with
// follow the new ones, calling fn for each until fn returns an error, ctx
// ends or the daemon closes the stream.
func (c *Client) Events(ctx context.Context, f events.Filter, follow bool, fn func(events.Event) error) error {
	v := url.Values{}
	if f.Project != "" {
		v.Set("project", f.Project)
	}
	if f.Pool != "" {
		v.Set("pool", f.Pool)
	}
	if follow {
		v.Set("follow", "1")
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://fairshare/v1/events?"+v.Encode(), nil)
	if err != nil {
		return fmt.Errorf("building request: %w", err)
	}
	// The stream has no overall timeout: it ends with ctx.
	hc := &http.Client{Transport: c.hc.Transport}
	resp, err := hc.Do(req)
	if err != nil {
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			return fmt.Errorf("%w (%s)", ErrNoDaemon, c.socket)
		}
		return fmt.Errorf("calling the daemon at %s: %w", c.socket, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
		var e struct {
			Error string `json:"error"`
		}
		if json.Unmarshal(raw, &e) != nil || e.Error == "" {
			e.Error = fmt.Sprintf("the daemon answered %s", resp.Status)
		}
		return &APIError{Code: resp.StatusCode, Message: e.Error}
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var e events.Event
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			return fmt.Errorf("decoding an event: %w", err)
		}
		if err := fn(e); err != nil {
			return err
		}
	}
	if err := sc.Err(); err != nil && ctx.Err() == nil {
		return fmt.Errorf("reading events: %w", err)
	}
	if follow && ctx.Err() == nil {
		// A followed stream ends only with ctx, or with the daemon (it
		// stopped): the caller should hear of the latter.
		return ErrStreamEnded
	}
	return nil
}

// ErrStreamEnded is Events' error when the daemon ended a followed stream
// (it stopped or restarted): a forwarder should connect again.
var ErrStreamEnded = errors.New("the daemon ended the event stream (it stopped or restarted)")
