// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fairshare-dev/fairshare/config"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/policy"
	"github.com/fairshare-dev/fairshare/scheduler"
)

// schedPolicy is the scheduler's policy of participant, as it dispatches
// (reported while the participant is known to the scheduler).
func schedPolicy(d *Daemon, participant string) (scheduler.Policy, bool) {
	for _, p := range d.sched.Snapshot().Participants {
		if p.Participant == participant {
			return p.Policy, true
		}
	}
	return scheduler.Policy{}, false
}

// TestPoliciesFile: the file's policies reach the scheduler and the rate
// buckets; the CLI cannot change a project the file names; a bad file
// changes nothing; a project the file stops naming goes back to its stored
// policy, and one that never had a stored policy to the default.
func TestPoliciesFile(t *testing.T) {
	cm := testutil.NewConfigMapDir(t)
	write := func(s string) { cm.Write(map[string]string{"policies.yaml": s}) }
	write("alpha: {tier: pro, shares: 3, requests_per_sec: 50}\n")
	d, _, logs := newTestDaemon(t, func(c *config.Config) { c.PoliciesFile = cm.Path("policies.yaml") })
	// A queued request makes each a participant the scheduler reports.
	d.sched.Submit("alpha")
	d.sched.Submit("beta")

	if p, ok := schedPolicy(d, "alpha"); !ok || p.Tier != scheduler.TierPro || p.Shares != 3 {
		t.Fatalf("scheduler has %+v (%v) for alpha, want the file's pro x3", p, ok)
	}
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 50 {
		t.Fatalf("alpha's rate %v, want the file's 50", l.RequestsPerSec)
	}
	if _, err := d.PatchPolicy("alpha", policy.Patch{Shares: new(int)}); !errors.Is(err, policy.ErrFromFile) {
		t.Fatalf("patching a project the file owns: %v, want ErrFromFile", err)
	}
	if _, err := d.DeletePolicy("alpha"); !errors.Is(err, policy.ErrFromFile) {
		t.Fatalf("deleting a project the file owns: %v, want ErrFromFile", err)
	}
	two := 2
	if _, err := d.PatchPolicy("beta", policy.Patch{Shares: &two}); err != nil {
		t.Fatalf("a project the file does not name: %v", err)
	}
	e, found, err := d.Policy("alpha")
	if err != nil || !found || e.Source != policy.SourceFile || e.Shares != 3 {
		t.Fatalf("Policy(alpha) = %+v %v %v", e, found, err)
	}

	// A bad file: refused whole, nothing changes, said once (at the
	// second poll that reads it, as any change).
	write("alpha: {tier: lite}\nbeta: {tier: gold}\n")
	d.followPolicies()
	if n := len(logs.find("policies file refused; the policies in force stay")); n != 0 {
		t.Fatalf("the refusal was logged at the first poll that read the file")
	}
	d.followPolicies()
	d.followPolicies()
	if n := len(logs.find("policies file refused; the policies in force stay")); n != 1 {
		t.Fatalf("the refusal was logged %d times, want once", n)
	}
	if p, _ := schedPolicy(d, "alpha"); p.Tier != scheduler.TierPro {
		t.Fatalf("a refused file changed alpha to %+v", p)
	}
	if st := d.file.status(); st.Error == "" || st.Projects != 1 {
		t.Fatalf("status of a refused file: %+v", st)
	}

	// The file takes beta and lets go of alpha.
	write("beta: {tier: lite, shares: 5}\n")
	d.followPolicies()
	d.followPolicies()
	if p, _ := schedPolicy(d, "beta"); p.Tier != scheduler.TierLite || p.Shares != 5 {
		t.Fatalf("beta %+v, want the file's lite x5 over its stored x2", p)
	}
	if p, _ := schedPolicy(d, "alpha"); p.Tier != scheduler.TierNone || p.Shares != 1 {
		t.Fatalf("alpha %+v after the file let go, want the default", p)
	}
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 0 {
		t.Fatalf("alpha's rate %v after the file let go, want unbounded", l.RequestsPerSec)
	}
	if st := d.file.status(); st.Error != "" || st.Projects != 1 {
		t.Fatalf("status after a good file: %+v", st)
	}
	list, err := d.Policies()
	if err != nil || len(list) != 1 || list[0].Project != "beta" || list[0].Source != policy.SourceFile {
		t.Fatalf("Policies() = %+v, %v", list, err)
	}

	// And lets go of beta: its stored policy applies again.
	write("{}\n")
	d.followPolicies()
	if p, _ := schedPolicy(d, "beta"); p.Tier != scheduler.TierLite || p.Shares != 5 {
		t.Fatalf("beta %+v at the first poll of an empty file, want the file's lite x5 until the next", p)
	}
	d.followPolicies()
	if p, _ := schedPolicy(d, "beta"); p.Tier != scheduler.TierNone || p.Shares != 2 {
		t.Fatalf("beta %+v after the file let go, want its stored x2", p)
	}
}

// logged counts the records whose message starts with prefix.
func logged(logs *records, prefix string) int {
	n := 0
	for _, r := range logs.all() {
		if strings.HasPrefix(r.Message, prefix) {
			n++
		}
	}
	return n
}

// TestPoliciesFileHalfWritten: an editor saving in place truncates the
// file, then writes it. A poll between the two released every project the
// file named (its rate buckets deleted); one in the middle of the write
// put a part of a rate in force. Now the file's policies stay until two
// polls in a row read the same content.
func TestPoliciesFileHalfWritten(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policies.yaml")
	if err := os.WriteFile(path, []byte("alpha: {requests_per_sec: 100}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d, _, _ := newTestDaemon(t, func(c *config.Config) { c.PoliciesFile = path })
	w, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	d.followPolicies()
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 100 {
		t.Fatalf("alpha's rate %v with the file truncated, want the file's 100 kept", l.RequestsPerSec)
	}
	if _, err := w.WriteString("alpha: {requests_per_sec: 1"); err != nil {
		t.Fatal(err)
	}
	d.followPolicies()
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 100 {
		t.Fatalf("alpha's rate %v with the file half written, want the file's 100 kept", l.RequestsPerSec)
	}
	if !d.file.status().Pending {
		t.Errorf("status does not show the change read and not yet in force")
	}
	if _, err := w.WriteString("50}\n"); err != nil {
		t.Fatal(err)
	}
	d.followPolicies()
	d.followPolicies()
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 150 {
		t.Fatalf("alpha's rate %v once written, want 150", l.RequestsPerSec)
	}
	if d.file.status().Pending {
		t.Errorf("status shows a change pending once it is in force")
	}
}

// TestPoliciesFileKeptAcrossRestart: the file's policies were never kept,
// so a daemon that started with a file that does not validate (after an
// upgrade, or a SIGKILL in the middle of an edit) owned no project and
// every project the file named fell back to its stored policy or the
// default, with no rate limits. Now the content in force is kept in the
// store and put in force again at start, marked stale in status while the
// file is refused.
func TestPoliciesFileKeptAcrossRestart(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state")
	path := filepath.Join(t.TempDir(), "policies.yaml")
	if err := os.WriteFile(path, []byte("alpha: {tier: pro, requests_per_sec: 50}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	edit := func(c *config.Config) { c.StateDir, c.PoliciesFile = state, path }
	d, _, _ := newTestDaemon(t, edit)
	if err := os.WriteFile(path, []byte("alpha: {tier: gold, requests_per_sec: 50}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d.Close()

	d, _, logs := newTestDaemon(t, edit)
	check := func(when string) {
		t.Helper()
		e, found, err := d.Policy("alpha")
		if err != nil || !found || e.Source != policy.SourceFile || e.Tier != "pro" || e.RequestsPerSec != 50 {
			t.Fatalf("%s: Policy(alpha) = %+v %v %v; want the file's, as last in force", when, e, found, err)
		}
		if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 50 {
			t.Fatalf("%s: alpha's rate %v, want the file's 50", when, l.RequestsPerSec)
		}
		if _, err := d.PatchPolicy("alpha", policy.Patch{Shares: new(int)}); !errors.Is(err, policy.ErrFromFile) {
			t.Fatalf("%s: patching alpha: %v, want ErrFromFile", when, err)
		}
	}
	check("at start")
	if logged(logs, "the policies file differs from the content in force when the daemon last ran") != 1 {
		t.Errorf("no warning at start that the file differs from the policies in force")
	}
	d.followPolicies()
	check("refused")
	if st := d.file.status(); !strings.Contains(st.Error, "tier must be") || !strings.Contains(st.Error, "STALE") || st.Projects != 1 {
		t.Fatalf("status of a file refused since start: %+v; want the refusal, marked stale", st)
	}

	// A good file: in force, no longer stale, and kept for the next start.
	if err := os.WriteFile(path, []byte("alpha: {tier: lite, requests_per_sec: 70}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d.followPolicies()
	d.followPolicies()
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 70 {
		t.Fatalf("alpha's rate %v after a good file, want 70", l.RequestsPerSec)
	}
	if st := d.file.status(); st.Error != "" {
		t.Fatalf("status after a good file: %+v", st)
	}
	d.Close()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	// Missing at start: the policies in force before stay until the next
	// poll finds it missing still, then the file owns nothing.
	d, _, _ = newTestDaemon(t, edit)
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 70 {
		t.Fatalf("alpha's rate %v with the file missing at start, want the last file's 70 until the next poll", l.RequestsPerSec)
	}
	d.followPolicies()
	if e, _, err := d.Policy("alpha"); err != nil || e.Source == policy.SourceFile || d.rates.State("alpha").Limits.RequestsPerSec != 0 {
		t.Fatalf("alpha %+v (%v) once the file was missing at two polls, want the default", e, err)
	}
}

// TestPoliciesFileUnsetForgetsItsContent: a start without a policies file
// forgets the content an earlier run kept, so that a later start naming the
// file again, and refusing it, puts none of that old content in force.
func TestPoliciesFileUnsetForgetsItsContent(t *testing.T) {
	state := filepath.Join(t.TempDir(), "state")
	path := filepath.Join(t.TempDir(), "policies.yaml")
	if err := os.WriteFile(path, []byte("alpha: {requests_per_sec: 50}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d, _, _ := newTestDaemon(t, func(c *config.Config) { c.StateDir, c.PoliciesFile = state, path })
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 50 {
		t.Fatalf("alpha's rate %v, want the file's 50", l.RequestsPerSec)
	}
	d.Close()

	d, _, _ = newTestDaemon(t, func(c *config.Config) { c.StateDir = state })
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 0 {
		t.Fatalf("alpha's rate %v without a policies file, want none", l.RequestsPerSec)
	}
	if _, found, err := d.store.LoadAccepted(); err != nil || found {
		t.Fatalf("the file's content still kept (%v, %v) after a start without the file", found, err)
	}
	d.Close()

	if err := os.WriteFile(path, []byte("alpha: {tier: gold}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d, _, _ = newTestDaemon(t, func(c *config.Config) { c.StateDir, c.PoliciesFile = state, path })
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 0 {
		t.Fatalf("alpha's rate %v with the file refused at start, want none: the old content came back", l.RequestsPerSec)
	}
	if st := d.file.status(); st.Error == "" || strings.Contains(st.Error, "STALE") {
		t.Fatalf("status %+v, want the refusal, not stale", st)
	}
}

// Keeping the file's content in the store may fail: the daemon starts and
// follows the file all the same, says so once, and keeps it at a later
// poll.
func TestPoliciesFileStoreWriteFails(t *testing.T) {
	broken := errors.New("disk full")
	saveAccepted = func(*policy.Store, policy.Accepted) error { return broken }
	defer func() { saveAccepted = (*policy.Store).SaveAccepted }()
	path := filepath.Join(t.TempDir(), "policies.yaml")
	if err := os.WriteFile(path, []byte("alpha: {requests_per_sec: 50}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d, _, logs := newTestDaemon(t, func(c *config.Config) { c.PoliciesFile = path })
	if l := d.rates.State("alpha").Limits; l.RequestsPerSec != 50 {
		t.Fatalf("alpha's rate %v, want the file's 50", l.RequestsPerSec)
	}
	d.followPolicies()
	if n := logged(logs, "the policies file's content could not be kept in the policy store"); n != 1 {
		t.Fatalf("the failed write was logged %d times, want once", n)
	}
	saveAccepted = (*policy.Store).SaveAccepted
	d.followPolicies()
	a, found, err := d.store.LoadAccepted()
	if err != nil || !found || string(a.Content) != "alpha: {requests_per_sec: 50}\n" || a.Path != path {
		t.Fatalf("stored after the write works again: %+v %v %v", a, found, err)
	}
	if n := logged(logs, "the policies file's content is kept in the policy store again"); n != 1 {
		t.Errorf("the write that worked again was logged %d times, want once", n)
	}
}

// TestPoliciesFileReleaseStoreError: a project the file let go goes back
// to its stored policy; when the store could not be read, the stored policy
// was dropped without a word (the project went to the default). Now the
// error is logged, the project keeps the policy in force, and each poll
// tries again.
func TestPoliciesFileReleaseStoreError(t *testing.T) {
	cm := testutil.NewConfigMapDir(t)
	write := func(s string) { cm.Write(map[string]string{"policies.yaml": s}) }
	write("alpha: {shares: 3}\n")
	d, _, logs := newTestDaemon(t, func(c *config.Config) { c.PoliciesFile = cm.Path("policies.yaml") })
	d.sched.Submit("beta")
	two := 2
	if _, err := d.PatchPolicy("beta", policy.Patch{Shares: &two}); err != nil {
		t.Fatal(err)
	}
	write("alpha: {shares: 3}\nbeta: {shares: 5, requests_per_sec: 9}\n")
	d.followPolicies()
	d.followPolicies()
	if p, _ := schedPolicy(d, "beta"); p.Shares != 5 {
		t.Fatalf("beta %+v, want the file's x5", p)
	}

	d.store.Close() // every read fails
	write("alpha: {shares: 3}\n")
	d.followPolicies()
	d.followPolicies()
	d.followPolicies()
	if n := logged(logs, "the policies file let go of a project whose stored policy could not be read"); n != 1 {
		t.Fatalf("the failed read was logged %d times, want once", n)
	}
	if p, _ := schedPolicy(d, "beta"); p.Shares != 5 || d.rates.State("beta").Limits.RequestsPerSec != 9 {
		t.Fatalf("beta %+v, rate %v with its stored policy unread; want the policy in force kept", p, d.rates.State("beta").Limits)
	}

	s, err := policy.Open(d.cfg.StateDir, policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	d.store = s
	d.followPolicies()
	if p, _ := schedPolicy(d, "beta"); p.Shares != 2 || d.rates.State("beta").Limits.RequestsPerSec != 0 {
		t.Fatalf("beta %+v, rate %v once the store reads; want its stored x2 and no rate", p, d.rates.State("beta").Limits)
	}
}
