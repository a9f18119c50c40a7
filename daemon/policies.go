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
	// stale is set while owned is the file's content as an earlier run
	// put it in force (kept in the store), not yet read from the file
	// again; storedAt is when that run read it.
	stale    bool
	storedAt time.Time
	// pending is the file's Pending after the last poll.
	pending bool

	// Under the daemon's polMu:
	// started is set once the first poll (in New) has run.
	started bool
	// unsaved is set while the content in force is not in the store.
	unsaved bool
	// releasing holds the projects the file let go whose stored policy
	// could not be read: each keeps the policy in force until a poll
	// reads it.
	releasing map[string]bool
}

func newPolicyFile(path string, def policy.Policy, configDir string) *policyFile {
	return &policyFile{f: policy.NewFile(path, def, configDir), owned: map[string]policy.Policy{}, releasing: map[string]bool{}}
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
		Refusals: pf.refusals, RefusedAt: pf.refusedAt, Pending: pf.pending}
}

// staleNote is what a refusal adds while the policies in force are the
// ones an earlier run kept in the store.
func staleNote(at time.Time) string {
	return "; STALE: the policies in force are the file's as read at " + at.Format(time.RFC3339) +
		" before the daemon started, kept in the policy store"
}

// followPolicies reads the policies file if it changed and puts what it
// says in force: a project it now names gets the file's policy, a project
// it no longer names goes back to its stored policy (or the default). A
// change is put in force once two polls in a row read the same content
// (policy.File). A file that does not validate changes nothing; its error
// is logged once and shown in status until a good file replaces it. The
// content in force is kept in the store, and the first poll (in New) puts
// it in force again before it reads the file: a file refused at start
// leaves the file's last policies in force, marked stale.
func (d *Daemon) followPolicies() {
	pf := d.file
	if pf == nil {
		return
	}
	d.polMu.Lock()
	defer d.polMu.Unlock()
	first := !pf.started
	if first {
		pf.started = true
		d.resumePolicies()
	}
	d.retryReleases()
	next, changed, err := pf.f.Poll()
	pf.mu.Lock()
	pf.pending = pf.f.Pending()
	pf.mu.Unlock()
	if err != nil {
		pf.mu.Lock()
		pf.lastErr = err.Error()
		stale, storedAt := pf.stale, pf.storedAt
		if stale {
			pf.lastErr += staleNote(storedAt)
		}
		pf.refusals++
		pf.refusedAt = clock.Or(d.opts.Clock).Now()
		pf.mu.Unlock()
		if stale {
			d.log.Error("policies file refused; the policies in force stay", "path", pf.f.Path(), "err", err,
				"stale", "the file's policies as an earlier run read them, from the policy store", "read_at", storedAt)
		} else {
			d.log.Error("policies file refused; the policies in force stay", "path", pf.f.Path(), "err", err)
		}
		return
	}
	if !changed {
		if first && pf.stale {
			if pf.f.Pending() {
				d.log.Warn("the policies file differs from the content in force when the daemon last ran: that content, from the policy store, stays in force until the next poll reads the file the same",
					"path", pf.f.Path(), "read_at", pf.storedAt)
			} else {
				// The file holds what the store kept.
				pf.mu.Lock()
				pf.stale, pf.loadedAt = false, clock.Or(d.opts.Clock).Now()
				pf.mu.Unlock()
			}
		}
		if pf.unsaved {
			d.saveAccepted()
		}
		return
	}
	pf.mu.Lock()
	prev := pf.owned
	pf.owned, pf.loadedAt, pf.lastErr, pf.stale = next, clock.Or(d.opts.Clock).Now(), "", false
	pf.mu.Unlock()
	var set, released int
	for name, p := range next {
		delete(pf.releasing, name)
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
		d.release(name)
	}
	d.log.Info("policies file applied", "path", pf.f.Path(), "projects", len(next), "changed", set, "released", released)
	d.saveAccepted()
}

// resumePolicies puts in force the file's content the store kept from the
// run before, if any, and makes it what the first poll compares the file
// with. Under polMu.
func (d *Daemon) resumePolicies() {
	pf := d.file
	a, found, err := d.store.LoadAccepted()
	if err != nil {
		d.log.Warn("the policies file's last content could not be read from the store: its policies are in force only once the file is read",
			"path", pf.f.Path(), "err", err)
		return
	}
	if !found || a.Path != pf.f.Path() {
		return
	}
	owned, err := policy.ParseFile(a.Content, d.defPolicy)
	if err != nil {
		d.log.Warn("the policies file's last content, kept in the store, no longer validates: its policies are in force only once the file is read",
			"path", pf.f.Path(), "err", err)
		return
	}
	pf.mu.Lock()
	pf.owned, pf.loadedAt, pf.stale, pf.storedAt = owned, a.At, true, a.At
	pf.mu.Unlock()
	for name, p := range owned {
		d.apply(name, p)
	}
	pf.f.Resume(a.Content)
}

// saveAccepted keeps the file's content in force in the store, for the
// next start. A failure is logged once, and the next poll tries again: the
// daemon goes on, and only a start with a file that does not validate
// would miss it. Under polMu.
func (d *Daemon) saveAccepted() {
	pf := d.file
	pf.mu.Lock()
	at := pf.loadedAt
	pf.mu.Unlock()
	err := saveAccepted(d.store, policy.Accepted{Path: pf.f.Path(), Content: pf.f.Accepted(), At: at})
	switch {
	case err != nil && !pf.unsaved:
		pf.unsaved = true
		d.log.Warn("the policies file's content could not be kept in the policy store; a restart with a file that does not validate "+
			"would not have its policies. Retrying at each poll", "path", pf.f.Path(), "err", err)
	case err == nil && pf.unsaved:
		pf.unsaved = false
		d.log.Info("the policies file's content is kept in the policy store again", "path", pf.f.Path())
	}
}

// saveAccepted stores the policies file's content in force (a variable for
// the tests).
var saveAccepted = (*policy.Store).SaveAccepted

// release puts project, which the file let go, back on its stored policy
// (or the default, without one). When the store cannot be read the
// project keeps the policy in force, and each poll tries again until it
// can. Under polMu.
func (d *Daemon) release(project string) {
	p, found, err := d.store.Get(project)
	if err != nil {
		if !d.file.releasing[project] {
			d.log.Error("the policies file let go of a project whose stored policy could not be read: it keeps the policy in force, "+
				"and each poll tries again", "project", project, "err", err)
		}
		d.file.releasing[project] = true
		return
	}
	if d.file.releasing[project] {
		delete(d.file.releasing, project)
		d.log.Info("the stored policy of a project the policies file let go is read: it is in force", "project", project, "stored", found)
	}
	if found {
		d.apply(project, p)
	} else {
		d.unapply(project)
	}
}

// retryReleases tries release again for the projects it could not read
// the stored policy of. Under polMu.
func (d *Daemon) retryReleases() {
	for project := range d.file.releasing {
		d.release(project)
	}
}
