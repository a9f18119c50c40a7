// SPDX-License-Identifier: Apache-2.0

package admin

import (
	"fmt"
	"time"

	"github.com/fairshare-dev/fairshare/policy"
	"github.com/fairshare-dev/fairshare/pools"
)

// Status is the daemon's whole view of the node at one moment. The metrics
// collector reads the same structure, so `fairshare status` and /metrics agree.
type Status struct {
	Version string    `json:"version"`
	Time    time.Time `json:"time"`
	// Kernel is true when the connections pool is enforced by the BPF programs.
	Kernel    bool       `json:"kernel"`
	Pools     []Pool     `json:"pools"`
	Rates     []Rate     `json:"rates"`
	Scheduler *Scheduler `json:"scheduler,omitempty"`
	// Policies lists the policies in force: the stored ones, with the policies
	// file's in place of those it names. A project not listed runs on
	// DefaultPolicy. Tier and shares of a project are read here, not from
	// Scheduler.Participants, which lists only projects with recent requests.
	Policies      []Entry       `json:"policies"`
	DefaultPolicy policy.Policy `json:"default_policy"`
	// Source is "daemon" when the running daemon answered, "pins" when no
	// daemon runs and the connections pool was read from the maps it left
	// pinned (the kernel keeps enforcing them; nothing else is served).
	Source string `json:"source,omitempty"`
	// Reconcile is the last reconcile pass of the kernel's counts against
	// its socket table (nil without BPF, or before the first pass).
	Reconcile *Reconcile `json:"reconcile,omitempty"`
	// Listeners are the daemon's listeners and their connection counters.
	Listeners []Listener `json:"listeners,omitempty"`
	// PoliciesFile is the policies file the daemon follows, if any.
	PoliciesFile *PoliciesFile `json:"policies_file,omitempty"`
	// Membership is which cgroups are in which project (nil when no daemon
	// answered).
	Membership *Membership `json:"membership,omitempty"`
	// Events are the counters of the daemon's events (nil from pins).
	Events *Events `json:"events,omitempty"`
}

// Events counts the daemon's events (package events) since it started.
type Events struct {
	Published uint64 `json:"published"`
	// WouldRefuse counts the would_refuse events published (dry-run).
	WouldRefuse uint64 `json:"would_refuse"`
	// Dropped counts events over the per-project bound in the daemon,
	// KernelDropped those the BPF programs dropped over theirs; StreamLost
	// the deliveries lost by streams that did not keep up.
	Dropped       uint64 `json:"dropped"`
	KernelDropped uint64 `json:"kernel_dropped"`
	StreamLost    uint64 `json:"stream_lost"`
	Subscribers   int    `json:"subscribers"`
	// Log is events.log, if configured, and LogErrors the events it did
	// not write: the sum of LogFailed (lost to failed writes), LogDropped
	// (dropped while its queue was full: a file that did not keep up) and
	// LogClosed (published after it closed, at shutdown).
	Log        string `json:"log,omitempty"`
	LogErrors  uint64 `json:"log_errors"`
	LogFailed  uint64 `json:"log_failed"`
	LogDropped uint64 `json:"log_dropped"`
	LogClosed  uint64 `json:"log_closed"`
}

// PoliciesFile is what the daemon's policies file holds.
type PoliciesFile struct {
	Path string `json:"path"`
	// Projects is how many projects the file names (and owns).
	Projects int `json:"projects"`
	// LoadedAt is when the policies in force were read from it.
	LoadedAt time.Time `json:"loaded_at"`
	// Error is why the file's current content was refused; the policies
	// read at LoadedAt stay in force meanwhile.
	Error string `json:"error,omitempty"`
	// Refusals counts the contents refused since the daemon started (a
	// content refused once, however long it stays), and RefusedAt is when
	// the last was.
	Refusals  uint64    `json:"refusals"`
	RefusedAt time.Time `json:"refused_at,omitzero"`
	// Pending is set while the last poll read a change not yet in force:
	// the next poll puts it in force if it reads the same content.
	Pending bool `json:"pending,omitempty"`
}

// Reconcile describes the reconcile passes: the last one's findings, and
// totals since the daemon started.
type Reconcile struct {
	Time time.Time `json:"time"` // when the last pass ended
	// Sockets is the number of project sockets the kernel's table listed
	// that should hold a permit; Held the permits held in the maps.
	Sockets int `json:"sockets"`
	Held    int `json:"held"`
	// Repairs is the number of corrections the last pass made: sockets
	// adopted, permits of gone sockets released, stale listeners uncounted
	// and the size of every in_use correction.
	Repairs        int `json:"repairs"`
	Adopted        int `json:"adopted"`
	Orphans        int `json:"orphans"`
	StaleListeners int `json:"stale_listeners"`
	// AdoptedPastTotal counts the sockets the passes adopted past the
	// rule (in_use may exceed the pool by them until they end).
	AdoptedPastTotal uint64 `json:"adopted_past_rule_total"`
	// MovedTotal counts the permits taken while a pod was unclassified
	// that the passes moved to its project once classified;
	// MovedPastTotal those of them moved past the rule (the project is
	// refused until back under its limit).
	MovedTotal     uint64 `json:"moved_total"`
	MovedPastTotal uint64 `json:"moved_past_rule_total"`
	// AbortedTotal counts the connections of MovedPastTotal aborted for it
	// (connections.abort_moved_past).
	AbortedTotal uint64 `json:"aborted_past_rule_total"`
	// Unadopted is the number of project sockets holding no permit that
	// the last pass could not adopt: the held-permit tables were full.
	// They count nowhere until a pass finds room.
	Unadopted    int    `json:"unadopted,omitempty"`
	Error        string `json:"error,omitempty"` // the last pass failed
	Passes       uint64 `json:"passes"`
	RepairsTotal uint64 `json:"repairs_total"`
	Failures     uint64 `json:"failures"`
}

// Listener is one of the daemon's listeners (package internal/listen).
type Listener struct {
	Name string `json:"name"`
	// Open connections now, the peers holding them (a local user, a
	// project, a remote address), and the caps: MaxConns for the
	// listener, MaxPerPeer for one peer; 0 is no cap.
	Open       int    `json:"open"`
	Peers      int    `json:"peers"`
	MaxConns   int    `json:"max_conns"`
	MaxPerPeer int    `json:"max_per_peer,omitempty"`
	Accepted   uint64 `json:"accepted"`
	// Refused counts connections closed at once for a cap, by reason
	// (listener_full, peer_full).
	Refused map[string]uint64 `json:"refused,omitempty"`
	// AcceptErrors counts accept errors waited out (out of descriptors, say).
	AcceptErrors uint64 `json:"accept_errors"`
}

// Forgotten sums the projects a pool dropped after they idled: with it, a
// pool's Admitted and Refused are the sums over its Projects plus these.
type Forgotten struct {
	Projects    uint64 `json:"projects"`
	Admitted    uint64 `json:"admitted"`
	Refused     uint64 `json:"refused"`
	WouldRefuse uint64 `json:"would_refuse,omitempty"`
	RateLimited uint64 `json:"rate_limited,omitempty"`
}

// Pool is one pool and the projects it knows, read as one snapshot: InUse
// is the sum of the projects' Held, Admitted, Refused and RateLimited the
// sums of theirs plus Forgotten's, and Share = max(Floor, Size/Active).
type Pool struct {
	Name string `json:"name"`
	// Enforcer is "kernel" (BPF maps) or "daemon" (user-space permits).
	Enforcer string `json:"enforcer"`
	Size     int    `json:"size"`
	Floor    int    `json:"floor"`
	InUse    int    `json:"in_use"`
	// Active is the count the share is computed from. In the kernel's pool
	// it is the programs' own count, which takes a newcomer in at its first
	// ask and lets a project that left the window go at the daemon's next
	// tick (never while no daemon runs), so it can exceed the projects
	// marked active.
	Active   int    `json:"active"`
	Share    int    `json:"share"`
	Admitted uint64 `json:"admitted"`
	Refused  uint64 `json:"refused"`
	// WouldRefuse counts asks admitted in dry-run that the rule refused
	// (they are in Admitted too). DryRun is set while the pool is in
	// dry-run (enforce: false); a project may be in dry-run alone.
	WouldRefuse uint64 `json:"would_refuse"`
	DryRun      bool   `json:"dry_run,omitempty"`
	// RateLimited counts asks refused by their project's rate (the
	// connections pool: the policy's connections_per_sec), not in Refused.
	RateLimited uint64    `json:"rate_limited"`
	Projects    []Project `json:"projects"`
	// Forgotten is what projects dropped after idling had been counted.
	Forgotten Forgotten `json:"forgotten"`
	// Exempt is the pool's exempt class, if it has one.
	Exempt *Exempt `json:"exempt,omitempty"`
	// Lapse is the kernel's pool's heartbeat and lapse
	// (connections.lapse_after), if the pins have one.
	Lapse *Lapse `json:"lapse,omitempty"`
	// KernelEvents are the BPF programs' node-wide event counters (the
	// kernel's pool only).
	KernelEvents *KernelEvents `json:"kernel_events,omitempty"`
	// Fleet is the pool's fleet view, when it is a fleet pool: then Size is
	// this node's allotment, and Fleet.Size the fleet's.
	Fleet *Fleet `json:"fleet,omitempty"`
	// Destinations are a destination pool's (docs/destination-pools.md):
	// the connections to them count in it and in the connections pool.
	Destinations []string `json:"destinations,omitempty"`
	// Removed is set for a destination pool no longer configured whose
	// connections still hold its permits (InUse).
	Removed bool `json:"removed,omitempty"`
}

// Lapse is the state of the kernel's lapse: the daemon renews a heartbeat
// in the pins every tick, and once it is older than After the programs
// count and stop refusing.
type Lapse struct {
	// After is connections.lapse_after in seconds; 0 never lapses.
	After float64 `json:"after_seconds"`
	// HeartbeatAge is the time since the daemon's last heartbeat, in
	// seconds.
	HeartbeatAge float64 `json:"heartbeat_age_seconds"`
	// Lapsed says the programs do not refuse now.
	Lapsed bool `json:"lapsed"`
	// Admitted counts the refusals admitted because enforcement had
	// lapsed (in Admitted too).
	Admitted uint64 `json:"admitted"`
	// FleetAfter is, when the kernel has fleet pools (0: none), the time
	// in seconds from the last heartbeat to the end of their leases as it
	// wrote it, and FleetSafe says they are held to their safe slices
	// now, that end being past (docs/fleet.md).
	FleetAfter float64 `json:"fleet_after_seconds,omitempty"`
	FleetSafe  bool    `json:"fleet_safe,omitempty"`
}

// KernelEvents are the BPF programs' node-wide counters of what they did
// beside admitting and refusing, ever on these pins (a migration to maps
// of another layout starts them again at zero).
type KernelEvents struct {
	// Adopted counts the sockets reconcile passes found holding no permit
	// and counted.
	Adopted uint64 `json:"adopted"`
	// Late counts the children established without a reservation (a SYN
	// cookie's, or one whose reservation was given back), put under the
	// rule then; Unaccounted the children the rule refused once
	// established, which are up and hold no permit.
	Late        uint64 `json:"late"`
	Unaccounted uint64 `json:"unaccounted"`
	// Expired counts the reservations given back past
	// connections.reservation_ttl: their request socket was gone.
	Expired uint64 `json:"expired"`
	// MapFull counts what a full kernel table left uncounted: a connection
	// holding no permit, or a project's listener whose inbound connections
	// the rule neither counts nor refuses (counted again at every
	// reconcile pass while the table stays full).
	MapFull uint64 `json:"map_full"`
}

// Fleet is a fleet pool as one node sees it (package fleet).
type Fleet struct {
	Node string `json:"node"`
	// State is "connected", "waiting for etcd" or "cut off from etcd: ...".
	State string    `json:"state"`
	Since time.Time `json:"since"`
	// Size, Floor, Active and Share are the fleet's; Allotment this node's
	// POOL, Spare its part nobody was allocated (its newcomers' room), Safe
	// the safe slice it decays to when cut off.
	Size      int `json:"size"`
	Floor     int `json:"floor"`
	Active    int `json:"active"`
	Share     int `json:"share"`
	Allotment int `json:"allotment"`
	Spare     int `json:"spare"`
	Safe      int `json:"safe"`
	// Nodes is the number of live nodes in the last view; Writes this
	// node's publications to etcd.
	Nodes    int            `json:"nodes"`
	Writes   uint64         `json:"writes"`
	Projects []FleetProject `json:"projects"`
}

// FleetProject is one project of a fleet pool: its fleet allocation, what
// it holds on the fleet (as published) and here, and its cap here (-1:
// none, the node's rule).
type FleetProject struct {
	Project   string `json:"project"`
	Alloc     int    `json:"alloc"`
	FleetHeld int    `json:"fleet_held"`
	Nodes     int    `json:"nodes"`
	Cap       int    `json:"cap"`
	Held      int    `json:"held"`
}

// Consistent checks what Status promises of a pool: its rows add up to its
// numbers, and (unless the pool is not enforced) its share is the one its
// active count gives.
func (p Pool) Consistent() error {
	held := 0
	adm, ref, would, lim := p.Forgotten.Admitted, p.Forgotten.Refused, p.Forgotten.WouldRefuse, p.Forgotten.RateLimited
	for _, pr := range p.Projects {
		held += pr.Held
		adm += pr.Admitted
		ref += pr.Refused
		would += pr.WouldRefuse
		lim += pr.RateLimited
	}
	switch {
	case held != p.InUse:
		return fmt.Errorf("pool %s: projects hold %d, in_use %d", p.Name, held, p.InUse)
	case adm != p.Admitted || ref != p.Refused:
		return fmt.Errorf("pool %s: projects admitted %d refused %d, the pool %d %d", p.Name, adm, ref, p.Admitted, p.Refused)
	case would != p.WouldRefuse:
		return fmt.Errorf("pool %s: projects would refuse %d, the pool %d", p.Name, would, p.WouldRefuse)
	case lim != p.RateLimited:
		return fmt.Errorf("pool %s: projects rate limited %d, the pool %d", p.Name, lim, p.RateLimited)
	case p.Enforcer != "off" && p.Share != pools.Share(p.Size, p.Floor, p.Active):
		return fmt.Errorf("pool %s: share %d with %d active (size %d, floor %d)", p.Name, p.Share, p.Active, p.Size, p.Floor)
	}
	return nil
}

// Exempt is a pool's exempt class: traffic that takes neither pool permits
// nor refusals from the rule, within a budget of its own.
type Exempt struct {
	// Members names what is exempt (cgroup paths for connections).
	Members []string `json:"members"`
	// Missing are exempt cgroups of the configuration that do not exist
	// yet: exempt once they do.
	Missing []string `json:"missing,omitempty"`
	// Max is the budget: exempt permits held at most at a time.
	Max   int `json:"max"`
	InUse int `json:"in_use"`
	// Admitted counts exempt permits granted; OverBudget counts exempt
	// asks that found the budget spent and went under the rule.
	Admitted   uint64 `json:"admitted"`
	OverBudget uint64 `json:"over_budget"`
}

// Project is one project's standing in one pool.
type Project struct {
	Project  string `json:"project"`
	Held     int    `json:"held"`
	Admitted uint64 `json:"admitted"`
	Refused  uint64 `json:"refused"`
	// WouldRefuse counts the project's asks dry-run admitted; DryRun is
	// set while the project is in dry-run by its policy (enforce: false).
	WouldRefuse uint64    `json:"would_refuse,omitempty"`
	DryRun      bool      `json:"dry_run,omitempty"`
	Active      bool      `json:"active"`
	LastSeen    time.Time `json:"last_seen,omitzero"`
	// RateLimited counts the project's asks refused by its rate, not in
	// Refused; ConnectionsPerSec is the outbound rate in force in the
	// kernel (the connections pool; 0 unbounded) and RateTokens its
	// bucket's tokens; AcceptsPerSec and AcceptTokens the same of the
	// inbound one (accepts_per_sec).
	RateLimited       uint64  `json:"rate_limited,omitempty"`
	ConnectionsPerSec float64 `json:"connections_per_sec,omitempty"`
	RateTokens        float64 `json:"rate_tokens,omitempty"`
	AcceptsPerSec     float64 `json:"accepts_per_sec,omitempty"`
	AcceptTokens      float64 `json:"accept_tokens,omitempty"`
	// Sleeping and Evictions are set for the residents pool only.
	Sleeping  int               `json:"sleeping,omitempty"`
	Evictions map[string]uint64 `json:"evictions,omitempty"`
}

// Rate is one project's rate buckets.
type Rate struct {
	Project        string  `json:"project"`
	RequestsPerSec float64 `json:"requests_per_sec"`
	WorkPerSec     float64 `json:"work_per_sec"`
	RequestTokens  float64 `json:"request_tokens"`
	// WorkTokens below zero is work debt.
	WorkTokens float64 `json:"work_tokens"`
	Limited    uint64  `json:"limited"`
}

// Scheduler is the request-class scheduler's state.
type Scheduler struct {
	InFlight     int               `json:"in_flight"`
	Dispatched   map[string]uint64 `json:"dispatched"` // by class: P1, P2, P3
	Participants []Participant     `json:"participants"`
	Wait         Histogram         `json:"wait_seconds"`
}

// Participant is one scheduler queue.
type Participant struct {
	Participant string            `json:"participant"`
	Tier        string            `json:"tier"`
	Shares      int               `json:"shares"`
	Queue       int               `json:"queue"`
	P1          float64           `json:"p1"`
	P2          float64           `json:"p2"`
	LastClass   string            `json:"last_class,omitempty"`
	Dispatched  map[string]uint64 `json:"dispatched"`
}

// Histogram is a distribution with per-bucket (not cumulative) counts:
// Counts[i] counts values <= Bounds[i] and above the previous bound; the last
// element of Counts, if len(Counts) == len(Bounds)+1, counts the rest.
type Histogram struct {
	Bounds []float64 `json:"bounds"`
	Counts []uint64  `json:"counts"`
	Count  uint64    `json:"count"`
	Sum    float64   `json:"sum"`
}

// Entry is a stored policy as the API returns it.
type Entry = policy.Entry
