// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"fmt"
	"io"
	"net"
	"time"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/front"
	"github.com/fairshare-dev/fairshare/internal/listen"
	"github.com/fairshare-dev/fairshare/internal/peercred"
	"github.com/fairshare-dev/fairshare/permitd"
	"golang.org/x/sys/unix"
)

// The descriptor and memory budget. Listeners are the only way an outsider
// makes the daemon hold descriptors and memory, so capping them below the
// open-files limit and within a memory budget keeps everything else working
// through a flood: the admin socket first of all.
const (
	// fdOwn is what the daemon keeps for itself beyond the listeners and
	// the upstream: BPF maps and links, the store, netlink sockets, logs.
	fdOwn = 256
	// adminConns caps the admin socket; half of it only root may use, and
	// a non-root peer (refused by the API anyway) holds at most
	// adminPerPeer. It is counted in the budget, so the CLI always gets in.
	adminConns, adminReserve, adminPerPeer = 32, 16, 4
	// metricsConns caps /metrics: a scraper or two, and curl. A quarter is
	// root's alone, and one peer (a local user, a remote address) holds
	// at most metricsPerPeer: no local user can shut root's curl out.
	metricsConns, metricsReserve, metricsPerPeer = 32, 8, 4
	// metricsIdle closes a /metrics connection idle this long: a scraper
	// comes back every 10 s or more, and a held connection is a place
	// taken from the others.
	metricsIdle = 5 * time.Second
	// minConns is the least a capped listener is given on a tiny limit.
	minConns = 16
	// connCost is what one open connection of a capped listener may cost
	// the daemon in memory, rounded up from what was measured (medians of
	// 5): an idle permit session 4.7 KB (BenchmarkIdleSessionMemory; 53 KB
	// with the 64 KiB read buffer it had before), an idle keep-alive
	// connection of the front 9.1 KB (BenchmarkIdleConnMemory), more while
	// a request head is read. connMemory is the budget of one listener's
	// connections, so by default each holds at most connMemory/connCost =
	// 4096.
	connCost   = 16 << 10
	connMemory = 64 << 20
	// peerShare is the part of a listener one peer may hold by default
	// (a 64th), and minPerPeer the least it is given.
	peerShare, minPerPeer = 64, 4
)

// Caps are the connection caps of the daemon's listeners, from the
// open-files limit, the memory budget and the configuration.
type Caps struct {
	NoFile uint64
	// PerListener caps each of the front's TCP listener, the front's unix
	// socket and the permit socket; PerPeer one peer of each.
	PerListener, PerPeer int
	Admin, Metrics       int
	// Upstream is the most upstream connections the front holds.
	Upstream int
	// Over is true when configured caps (listeners.max_conns) promise more
	// connections than the limit holds beside the daemon's own descriptors:
	// a flood can then exhaust them, and the admin socket with them.
	Over bool
}

// BudgetCaps divides nofile among the listeners cfg enables, each at most
// connMemory/connCost. A configured listeners.max_conns (or
// max_conns_per_peer) is taken as it is.
func BudgetCaps(cfg config.Config, nofile uint64) Caps {
	c := Caps{NoFile: nofile, Admin: adminConns, Metrics: metricsConns}
	n := 0
	if cfg.Front.Enabled() {
		c.Upstream = front.MaxUpstreamConns(cfg.Front.MaxInFlight, cfg.Front.ExemptMax)
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
	rest := int(min(nofile, 1<<30)) - fdOwn - c.Upstream - adminConns - metricsConns
	c.PerListener = max(min(rest/max(n, 1), connMemory/connCost), minConns)
	if cfg.Listeners.MaxConns > 0 {
		c.PerListener = cfg.Listeners.MaxConns
	}
	c.PerPeer = max(c.PerListener/peerShare, minPerPeer)
	if cfg.Listeners.MaxConnsPerPeer > 0 {
		c.PerPeer = cfg.Listeners.MaxConnsPerPeer
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
	if reason == listen.ReasonPeerFull {
		msg = "fairshare: too many open connections from your user, project or address; close some and try again\n"
	}
	io.WriteString(c, fmt.Sprintf("HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"+
		"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s", len(msg), msg))
}

func isRoot(uid uint32) bool { return uid == 0 }

// listenOptions are the caps and peer rules of the listener name (admin,
// metrics, front, front_socket). Who a peer is (package internal/listen):
// a local user (subordinate uids folded onto their owner), a remote
// address; on the front's two listeners a client in a project's cgroup is
// its project instead, so tenants running as one uid (nobody, uid 1000 in
// every pod) do not share one place, and a trusted peer (an edge proxy) is
// not capped per peer.
func (d *Daemon) listenOptions(name string) listen.Options {
	o := listen.Options{Name: name, Owners: d.owners, Refuse: refuseHTTP}
	switch name {
	case "admin":
		o.MaxConns, o.Reserve, o.MaxPerPeer, o.Privileged = d.caps.Admin, adminReserve, adminPerPeer, isRoot
	case "metrics":
		// A remote scraper cannot be told apart from another on its
		// address: remote peers share the places outside root's reserve,
		// each address holding at most metricsPerPeer.
		o.MaxConns, o.Reserve, o.MaxPerPeer, o.Privileged = d.caps.Metrics, metricsReserve, metricsPerPeer, isRoot
	case "front", "front_socket":
		o.MaxConns, o.MaxPerPeer = d.caps.PerListener, d.caps.PerPeer
		if d.front != nil {
			f := d.front
			o.Classify = func(c net.Conn, p *listen.Peer) {
				project, trusted := f.PeerClass(c, p.Cgroup)
				switch {
				case trusted:
					p.Key = ""
				case project != "":
					p.Key = "project:" + project
				}
			}
		}
	}
	return o
}

// logCaps says at start what the listeners are capped at.
func (d *Daemon) logCaps() {
	ranges, err := d.owners.Ranges()
	args := []any{"open_files", d.caps.NoFile, "per_listener", d.caps.PerListener, "per_peer", d.caps.PerPeer,
		"admin", d.caps.Admin, "admin_root_reserve", adminReserve, "metrics", d.caps.Metrics,
		"metrics_root_reserve", metricsReserve, "subuid_file", d.owners.Path(), "subuid_ranges", ranges}
	if err != nil {
		args = append(args, "subuid_problem", err)
	}
	d.log.Info("connection caps", args...)
}

// newOwners folds the subordinate uid ranges of cfg's subuid file.
func newOwners(cfg config.Config) *peercred.Owners {
	return peercred.NewOwners(cfg.Listeners.SubUID)
}

// permitsConfig is the permit API's configuration with its caps.
func permitsConfig(cfg config.Config, caps Caps, owners *peercred.Owners) permitd.Config {
	return permitd.Config{Socket: cfg.Permits.Socket, Group: cfg.Permits.Group,
		MaxConns: caps.PerListener, MaxConnsPerPeer: caps.PerPeer, Owners: owners,
		MaxWaiting: cfg.Permits.MaxWaiting, MaxWaitingPerUID: cfg.Permits.MaxWaitingPerUID,
		MaxWaitingPerSession: cfg.Permits.MaxWaitingPerSession}
}
