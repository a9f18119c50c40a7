// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"strings"
	"sync"
	"time"

	"github.com/fairshare-dev/fairshare/admin"
	"github.com/fairshare-dev/fairshare/internal/clock"

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

// policyFile follows the policies file (config policies_file) for the
// daemon. A nil *policyFile is a daemon without one: every method is a
// no-op then.
type policyFile struct {
	f *policy.File

	mu sync.Mutex // guards the fields below
	// owned is the file's policies in force: the projects it owns.
	owned    map[string]policy.Policy
	loadedAt time.Time
	lastErr  string
	// refusals counts the refused contents, refusedAt the last one's time.
	refusals  uint64
	refusedAt time.Time
}

func newPolicyFile(path string, def policy.Policy, configDir string) *policyFile {
	return &policyFile{f: policy.NewFile(path, def, configDir), owned: map[string]policy.Policy{}}
}

// owns returns the file's policy for project, if the file names it.
func (pf *policyFile) owns(project string) (policy.Policy, bool) {
	if pf == nil {
		return policy.Policy{}, false
	}
	pf.mu.Lock()
	defer pf.mu.Unlock()
	p, ok := pf.owned[project]
	return p, ok
}

// refuse is the error for a change of a project the file owns, or nil.
func (pf *policyFile) refuse(project string) error {
	if _, ok := pf.owns(project); !ok {
		return nil
	}
	return policy.FromFile(pf.f.Path(), project)
}

// merge returns the stored list with the file's policies in place of the
// stored ones of the projects it owns, sorted by project.
func (pf *policyFile) merge(stored []policy.Entry) []policy.Entry {
	if pf == nil {
		return stored
	}
	pf.mu.Lock()
	defer pf.mu.Unlock()
	return policy.Merge(stored, pf.owned)
}

// status says what the file holds, for admin.Status.
func (pf *policyFile) status() *admin.PoliciesFile {
	if pf == nil {
		return nil
	}
	pf.mu.Lock()
	defer pf.mu.Unlock()
	return &admin.PoliciesFile{Path: pf.f.Path(), Projects: len(pf.owned), LoadedAt: pf.loadedAt, Error: pf.lastErr,
		Refusals: pf.refusals, RefusedAt: pf.refusedAt}
}

// followPolicies reads the policies file if it changed and puts what it
// says in force: a project it now names gets the file's policy, a project
// it no longer names goes back to its stored policy (or the default). A
// file that does not validate changes nothing; its error is logged once
// and shown in status until a good file replaces it.
func (d *Daemon) followPolicies() {
	pf := d.file
	if pf == nil {
		return
	}
	d.polMu.Lock()
	defer d.polMu.Unlock()
	next, changed, err := pf.f.Poll()
	if err != nil {
		pf.mu.Lock()
		pf.lastErr = err.Error()
		pf.refusals++
		pf.refusedAt = clock.Or(d.opts.Clock).Now()
		pf.mu.Unlock()
		d.log.Error("policies file refused; the policies in force stay", "path", pf.f.Path(), "err", err)
		return
	}
	if !changed {
		return
	}
	pf.mu.Lock()
	prev := pf.owned
	pf.owned, pf.loadedAt, pf.lastErr = next, clock.Or(d.opts.Clock).Now(), ""
	pf.mu.Unlock()
	var set, released int
	for name, p := range next {
		if old, ok := prev[name]; !ok || old != p {
			d.apply(name, p)
			set++
		}
	}
	for name := range prev {
		if _, ok := next[name]; ok {
			continue
		}
		released++
		if p, found, err := d.store.Get(name); err == nil && found {
			d.apply(name, p)
		} else {
			d.unapply(name)
		}
	}
	d.log.Info("policies file applied", "path", pf.f.Path(), "projects", len(next), "changed", set, "released", released)
}
