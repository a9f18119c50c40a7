// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"errors"
	"fmt"
	"math"

	"github.com/fairshare-dev/fairshare/internal/project"
)

// ErrInvalid is wrapped by every validation error.
var ErrInvalid = errors.New("invalid policy")

// The tiers a policy may name.
const (
	TierPro  = "pro"
	TierLite = "lite"
	TierNone = "none"
)

// MaxRate bounds requests_per_sec and work_per_sec; anything above it is a typo
// rather than a limit.
const MaxRate = 1e9

// MaxShares bounds shares for the same reason.
const MaxShares = 1_000_000

// Policy is one project's policy.
type Policy struct {
	Tier           string  `json:"tier"`
	Shares         int     `json:"shares"`
	RequestsPerSec float64 `json:"requests_per_sec"`
	WorkPerSec     float64 `json:"work_per_sec"`
}

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
	return checkRate("work units per second", p.WorkPerSec)
}

func checkRate(what string, v float64) error {
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || v > MaxRate {
		return fmt.Errorf("%w: %s must be a number from 0 (unbounded) to %g, got %v", ErrInvalid, what, float64(MaxRate), v)
	}
	return nil
}

// Patch changes some fields of a policy; nil fields are kept.
type Patch struct {
	Tier           *string  `json:"tier,omitempty"`
	Shares         *int     `json:"shares,omitempty"`
	RequestsPerSec *float64 `json:"requests_per_sec,omitempty"`
	WorkPerSec     *float64 `json:"work_per_sec,omitempty"`
}

// Empty reports whether the patch changes nothing.
func (pt Patch) Empty() bool {
	return pt.Tier == nil && pt.Shares == nil && pt.RequestsPerSec == nil && pt.WorkPerSec == nil
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
