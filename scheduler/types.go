// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Sentinel errors callers can branch on.
var (
	// ErrInvalidConfig is wrapped by New when a Config field is out of range.
	ErrInvalidConfig = errors.New("invalid scheduler config")
	// ErrRunning is returned by Run when another Run is already active: two
	// loops would break the one-cursor-per-class guarantee.
	ErrRunning = errors.New("scheduler loop already running")
	// ErrUnknownTier is wrapped by ParseTier.
	ErrUnknownTier = errors.New("unknown tier")
	// ErrWithdrawn is returned by Wait on a ticket already withdrawn.
	ErrWithdrawn = errors.New("ticket withdrawn")
)

// Tier decides which credit buckets a participant holds.
type Tier int

// The tiers, cheapest first. The zero value holds no bucket.
const (
	// TierNone holds no bucket: every request goes out as P3.
	TierNone Tier = iota
	// TierLite holds a P2 bucket only.
	TierLite
	// TierPro holds both a P1 and a P2 bucket.
	TierPro
)

// String returns "none", "lite" or "pro".
func (t Tier) String() string {
	switch t {
	case TierNone:
		return "none"
	case TierLite:
		return "lite"
	case TierPro:
		return "pro"
	}
	return fmt.Sprintf("Tier(%d)", int(t))
}

// ParseTier is the inverse of Tier.String (case-insensitive).
func ParseTier(s string) (Tier, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "none", "":
		return TierNone, nil
	case "lite":
		return TierLite, nil
	case "pro":
		return TierPro, nil
	}
	return TierNone, fmt.Errorf("parsing tier %q: %w", s, ErrUnknownTier)
}

// holdsP1 and holdsP2 are the tier table in one place.
func (t Tier) holdsP1() bool { return t == TierPro }
func (t Tier) holdsP2() bool { return t == TierPro || t == TierLite }

// Class is the priority a request is dispatched under. It is decided at
// dispatch, never at arrival.
type Class int

// The classes. The zero Class means "not dispatched".
const (
	// P1 is the highest class, paid for from the P1 bucket.
	P1 Class = 1
	// P2 is paid for from the P2 bucket.
	P2 Class = 2
	// P3 is the credit test switched off: any queue with work qualifies.
	P3 Class = 3
)

// String returns "P1", "P2", "P3", or "-" for the zero Class.
func (c Class) String() string {
	switch c {
	case 0:
		return "-"
	case P1:
		return "P1"
	case P2:
		return "P2"
	case P3:
		return "P3"
	}
	return fmt.Sprintf("Class(%d)", int(c))
}

// Policy is what a participant bought: a tier and a number of shares.
type Policy struct {
	Tier Tier
	// Shares multiplies the refill rate and the size of every bucket the
	// tier holds; it never multiplies turns. Values below 1 count as 1,
	// above 1<<24 as 1<<24.
	Shares int
}

// Defaults for Config fields left at zero. A credit pays for one dispatch, so
// rates read as "requests per second per share" at that class.
const (
	DefaultP1Rate  = 10.0 // P1 credits per second per share
	DefaultP1Burst = 20.0 // P1 bucket size per share
	DefaultP2Rate  = 40.0 // P2 credits per second per share
	DefaultP2Burst = 80.0 // P2 bucket size per share
	DefaultPoll    = time.Millisecond
	DefaultWindow  = time.Second
	DefaultKeep    = 50 * time.Millisecond
)

// MaxRate and MaxBurst bound the rates and bursts (per share) New accepts:
// far above what a node dispatches, a larger value is a typo. Times the
// most shares (1<<24) a burst stays a whole number of credits a float64
// counts exactly, and a day of refill stays finite: a burst of 1e308 made
// a bucket of +Inf, which the daemon's status could not encode.
const (
	MaxRate  = 1e6
	MaxBurst = 1e6
)

// Config tunes a Scheduler. Zero fields take the documented defaults.
type Config struct {
	P1Rate, P1Burst float64 // credits/s and bucket size per share
	P2Rate, P2Burst float64
	// MaxInFlight bounds dispatched-but-not-Done tickets (the places); 0
	// leaves the bound to HasRoom (and with neither, every request goes
	// out at once). The last of them, the fair-share rule's floor of
	// MaxInFlight, go first to participants under their share of places
	// (see "Room" in the package documentation).
	MaxInFlight int
	// Window is how long a participant still counts among those the
	// places are divided between after its last request ended: the
	// pools' active window. Default DefaultWindow.
	Window time.Duration
	// Keep is how long the place a participant under its share gave back
	// (its request ended, none of its requests waiting) is kept for its
	// next request, so that a client sending one request after another
	// finds it again; and how soon after one of its requests ended its
	// next must come for its requests to count as one after another, the
	// only ones (with a participant's first) a place is kept for (see "Room" in the package
	// documentation). Default DefaultKeep.
	Keep time.Duration
	// HasRoom is an optional extra room check, asked before each dispatch.
	// Submit asks it with the Scheduler's lock held (see Submit), so it
	// must not call back into the Scheduler and should be quick.
	HasRoom func() bool
	// Poll is how long the loop waits when the server has no room before
	// asking again.
	Poll time.Duration
	// DefaultPolicy applies to participants without a SetPolicy.
	DefaultPolicy Policy
}

// Snapshot is a consistent view for status output and metrics.
type Snapshot struct {
	InFlight     int
	Dispatched   [4]uint64 // by Class index 1..3
	Participants []ParticipantStat
	Wait         Histogram // wait time distribution (seconds)
}

// ParticipantStat is one participant's state in a Snapshot.
type ParticipantStat struct {
	Participant string
	Policy      Policy
	Queue       int
	InFlight    int     // places held: dispatched, not yet Done
	P1, P2      float64 // balances (0 if the tier has no such bucket)
	LastClass   Class
	Dispatched  [4]uint64
}

// Histogram is a bucketed distribution. Counts[i] counts observations
// <= Bounds[i] and > Bounds[i-1]; the last element counts those above every
// bound, so len(Counts) == len(Bounds)+1. Counts are not cumulative.
type Histogram struct {
	Bounds []float64
	Counts []uint64
	Count  uint64
	Sum    float64
}
