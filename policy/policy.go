// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"

	"github.com/fairshare-dev/fairshare/internal/project"
	"github.com/fairshare-dev/fairshare/pools"
)

// ErrInvalid is wrapped by every validation error.
var ErrInvalid = errors.New("invalid policy")

// The tiers a policy may name.
const (
	TierPro  = "pro"
	TierLite = "lite"
	TierNone = "none"
)

// MinRate and MaxRate bound a non-zero requests_per_sec, work_per_sec,
// connections_per_sec or accepts_per_sec (0 means unbounded): one per 1000 seconds up to a billion per second. Below
// the minimum a limit is a block, above the maximum a typo; both are
// pools.MinRate and pools.MaxRate, where the buckets explain why.
const (
	MinRate = pools.MinRate
	MaxRate = pools.MaxRate
)

// MaxShares bounds shares for the same reason.
const MaxShares = 1_000_000

// Policy is one project's policy.
type Policy struct {
	Tier           string  `json:"tier"`
	Shares         int     `json:"shares"`
	RequestsPerSec float64 `json:"requests_per_sec"`
	WorkPerSec     float64 `json:"work_per_sec"`
	// ConnectionsPerSec bounds the new TCP connections the project opens
	// (connect) per second, enforced in the kernel with a burst of one
	// second's worth; 0 is unbounded. A policy stored before the field
	// existed has none: unbounded.
	ConnectionsPerSec float64 `json:"connections_per_sec"`
	// AcceptsPerSec bounds the connections the project's listeners accept
	// (counted at the SYN) per second, from a bucket of its own: clients
	// outside the project, which the project cannot slow, never spend its
	// outbound budget. 0 is unbounded; omitted in JSON while 0, so a
	// policy stored before the field existed reads as unbounded.
	AcceptsPerSec float64 `json:"accepts_per_sec,omitempty"`
	// DryRun is `enforce: false`: the project's asks are decided and
	// counted as usual, but what would be refused (fair share, rates) is
	// admitted and counted as would_refuse. Omitted while enforced, so
	// policies stored before the field existed enforce.
	DryRun DryRun `json:"enforce,omitempty"`
}

// DryRun is a project's dry-run switch, written in JSON as its opposite,
// "enforce": true while false (the zero value, enforced). A value type keeps
// Policy comparable.
type DryRun bool

// MarshalJSON writes "enforce".
func (d DryRun) MarshalJSON() ([]byte, error) { return json.Marshal(!bool(d)) }

// UnmarshalJSON reads "enforce".
func (d *DryRun) UnmarshalJSON(b []byte) error {
	var enforce bool
	if err := json.Unmarshal(b, &enforce); err != nil {
		return fmt.Errorf("enforce must be true or false: %w", err)
	}
	*d = DryRun(!enforce)
	return nil
}

// Enforced reports whether the project's policy enforces (not dry-run).
func (p Policy) Enforced() bool { return !bool(p.DryRun) }

// Default is the policy of a project nobody set one for, unless the daemon's
// configuration says otherwise.
func Default() Policy { return Policy{Tier: TierNone, Shares: 1} }

// Validate returns an error wrapping ErrInvalid naming the first bad field.
func (p Policy) Validate() error {
	switch p.Tier {
	case TierPro, TierLite, TierNone:
	default:
		return fmt.Errorf("%w: tier must be pro, lite or none, got %q", ErrInvalid, p.Tier)
	}
	if p.Shares < 1 || p.Shares > MaxShares {
		return fmt.Errorf("%w: shares must be a whole number from 1 to %d, got %d", ErrInvalid, MaxShares, p.Shares)
	}
	if err := checkRate("requests per second", p.RequestsPerSec); err != nil {
		return err
	}
	if err := checkRate("work units per second", p.WorkPerSec); err != nil {
		return err
	}
	if err := checkRate("connections per second", p.ConnectionsPerSec); err != nil {
		return err
	}
	return checkRate("accepts per second", p.AcceptsPerSec)
}

// validTier says whether tier is one Validate accepts.
func validTier(tier string) bool {
	switch tier {
	case TierPro, TierLite, TierNone:
		return true
	}
	return false
}

func checkRate(what string, v float64) error {
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || v > MaxRate || (v > 0 && v < MinRate) {
		return fmt.Errorf("%w: %s must be 0 (unbounded) or a number from %g to %g, got %v",
			ErrInvalid, what, float64(MinRate), float64(MaxRate), v)
	}
	return nil
}

// InBounds returns p with every number brought within the bounds Validate
// checks, as the daemon enforces it: a rate as pools.ClampRate takes it,
// shares to 1..MaxShares, and an unknown tier to "none". changed says
// what was brought in ("requests_per_sec 1e-12 -> 0.001"), empty when p
// was within bounds. A store written by an older version may hold values
// out of today's bounds: the daemon writes them back in bounds (saying so)
// so that what the store shows is what is enforced.
func (p Policy) InBounds() (_ Policy, changed []string) {
	rate := func(name string, v *float64) {
		if c := pools.ClampRate(*v); c != *v {
			changed = append(changed, fmt.Sprintf("%s %v -> %v", name, *v, c))
			*v = c
		}
	}
	rate("requests_per_sec", &p.RequestsPerSec)
	rate("work_per_sec", &p.WorkPerSec)
	rate("connections_per_sec", &p.ConnectionsPerSec)
	rate("accepts_per_sec", &p.AcceptsPerSec)
	if s := min(max(p.Shares, 1), MaxShares); s != p.Shares {
		changed = append(changed, fmt.Sprintf("shares %d -> %d", p.Shares, s))
		p.Shares = s
	}
	switch p.Tier {
	case TierPro, TierLite, TierNone:
	default:
		changed = append(changed, fmt.Sprintf("tier %q -> %q", p.Tier, TierNone))
		p.Tier = TierNone
	}
	return p, changed
}

// Patch changes some fields of a policy; nil fields are kept.
type Patch struct {
	Tier           *string  `json:"tier,omitempty"`
	Shares         *int     `json:"shares,omitempty"`
	RequestsPerSec *float64 `json:"requests_per_sec,omitempty"`
	WorkPerSec     *float64 `json:"work_per_sec,omitempty"`
	// ConnectionsPerSec sets Policy.ConnectionsPerSec.
	ConnectionsPerSec *float64 `json:"connections_per_sec,omitempty"`
	// AcceptsPerSec sets Policy.AcceptsPerSec.
	AcceptsPerSec *float64 `json:"accepts_per_sec,omitempty"`
	// Enforce false puts the project in dry-run, true takes it out.
	Enforce *bool `json:"enforce,omitempty"`
}

// Empty reports whether the patch changes nothing.
func (pt Patch) Empty() bool {
	return pt.Tier == nil && pt.Shares == nil && pt.RequestsPerSec == nil && pt.WorkPerSec == nil &&
		pt.ConnectionsPerSec == nil && pt.AcceptsPerSec == nil && pt.Enforce == nil
}

// Apply returns p with the patch's fields set, validated.
func (pt Patch) Apply(p Policy) (Policy, error) {
	if pt.Tier != nil {
		p.Tier = *pt.Tier
	}
	if pt.Shares != nil {
		p.Shares = *pt.Shares
	}
	if pt.RequestsPerSec != nil {
		p.RequestsPerSec = *pt.RequestsPerSec
	}
	if pt.WorkPerSec != nil {
		p.WorkPerSec = *pt.WorkPerSec
	}
	if pt.ConnectionsPerSec != nil {
		p.ConnectionsPerSec = *pt.ConnectionsPerSec
	}
	if pt.AcceptsPerSec != nil {
		p.AcceptsPerSec = *pt.AcceptsPerSec
	}
	if pt.Enforce != nil {
		p.DryRun = DryRun(!*pt.Enforce)
	}
	return p, p.Validate()
}

// ErrBadProject is wrapped by ValidateProject's errors.
var ErrBadProject = project.ErrInvalid

// MaxProjectLen is the longest project name accepted (project.MaxLen).
const MaxProjectLen = project.MaxLen

// ValidateProject checks that name can be a project: the rule of package
// internal/project, which every entry point applies (a directory directly
// below the projects root that cannot collide with cgroupfs's own files).
func ValidateProject(name string) error { return project.Validate(name) }
