// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"fmt"
	"io"
	"net"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/front"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/permitd"
	"golang.org/x/sys/unix"
)

// The descriptor budget. Listeners are the only way an outsider makes the
// daemon hold descriptors, so capping them below the open-files limit keeps
// everything else working through a flood: the admin socket first of all.
const (
	// fdOwn is what the daemon keeps for itself beyond the listeners and
	// the upstream: BPF maps and links, the store, netlink sockets, logs.
	fdOwn = 256
	// adminConns caps the admin socket; half of it only root may use, and
	// a non-root peer (refused by the API anyway) holds at most
	// adminPerUID. It is counted in the budget, so the CLI always gets in.
	adminConns, adminReserve, adminPerUID = 32, 16, 4
	// metricsConns caps /metrics: a scraper or two, and curl.
	metricsConns = 32
	// minConns is the least a capped listener is given on a tiny limit.
	minConns = 16
)

// Caps are the connection caps of the daemon's listeners, from the
// open-files limit and the configuration.
type Caps struct {
	NoFile uint64
	// PerListener caps each of the front's TCP listener, the front's unix
	// socket and the permit socket; PerUID one local user on the unix
	// sockets.
	PerListener, PerUID int
	Admin, Metrics      int
	// Over is true when configured caps (listeners.max_conns) promise more
	// connections than the limit holds beside the daemon's own descriptors:
	// a flood can then exhaust them, and the admin socket with them.
	Over bool
}

// BudgetCaps divides nofile among the listeners cfg enables. A configured
// listeners.max_conns (or max_conns_per_uid) is taken as it is.
func BudgetCaps(cfg config.Config, nofile uint64) Caps {
	c := Caps{NoFile: nofile, Admin: adminConns, Metrics: metricsConns}
	upstream := 0
	n := 0
	if cfg.Front.Enabled() {
		exempt := cfg.Front.ExemptMax
		if exempt == 0 {
			exempt = front.DefaultExemptMax
		}
		// In flight, plus the idle pool the front keeps (front.New).
		upstream = cfg.Front.MaxInFlight + exempt + max(64, 2*cfg.Front.MaxInFlight)
		if cfg.Front.Listen != "" {
			n++
		}
		if cfg.Front.Socket != "" {
			n++
		}
	}
	if cfg.Permits.Socket != "" {
		n++
	}
	rest := int(min(nofile, 1<<30)) - fdOwn - upstream - adminConns - metricsConns
	c.PerListener = max(rest/max(n, 1), minConns)
	if cfg.Listeners.MaxConns > 0 {
		c.PerListener = cfg.Listeners.MaxConns
	}
	c.PerUID = max(c.PerListener/4, 1)
	if cfg.Listeners.MaxConnsPerUID > 0 {
		c.PerUID = cfg.Listeners.MaxConnsPerUID
	}
	c.Over = n*c.PerListener > rest
	return c
}

// hardFileLimit is the hard RLIMIT_NOFILE, which the daemon raises its
// soft limit to.
func hardFileLimit() (uint64, error) {
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err != nil {
		return 0, fmt.Errorf("reading RLIMIT_NOFILE: %w", err)
	}
	return rl.Max, nil
}

// refuseHTTP answers a connection past its listener's cap with a 503 that
// says why, before the listener closes it.
func refuseHTTP(c net.Conn, reason string) {
	msg := "fairshare: too many open connections; try again later\n"
	if reason == listen.ReasonUIDFull {
		msg = "fairshare: too many open connections from your user; close some and try again\n"
	}
	io.WriteString(c, fmt.Sprintf("HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"+
		"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s", len(msg), msg))
}

// permitsConfig is the permit API's configuration with its caps.
func permitsConfig(cfg config.Config, caps Caps) permitd.Config {
	return permitd.Config{Socket: cfg.Permits.Socket, Group: cfg.Permits.Group,
		MaxConns: caps.PerListener, MaxConnsPerUID: caps.PerUID,
		MaxWaiting: cfg.Permits.MaxWaiting, MaxWaitingPerSession: cfg.Permits.MaxWaitingPerSession}
}
