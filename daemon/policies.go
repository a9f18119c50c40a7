// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"strings"

	"github.com/fairshare-dev/fairshare/policy"
)

// storedPolicies returns the stored policies to apply at start, first
// writing back within bounds any that an older version stored out of them
// (a rate of 1e-12 passed validation once). The buckets could only enforce
// such a rate at pools.MinRate, so the store showed one rate while another
// was enforced, and every later 'policy set' of the project failed on the
// field it did not touch. Now the store says what is enforced, and the log
// says what changed.
func (d *Daemon) storedPolicies() ([]policy.Entry, error) {
	fixed, err := d.store.Repair()
	if err != nil {
		return nil, err
	}
	for project, changed := range fixed {
		d.log.Warn("stored policy was out of bounds; stored and enforced within them", "project", project,
			"changed", strings.Join(changed, ", "), "bounds", "rates 0 or 0.001..1e9, shares 1..1000000")
	}
	return d.store.List()
}
