// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"errors"
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

	// A bad file: refused whole, nothing changes, said once.
	write("alpha: {tier: lite}\nbeta: {tier: gold}\n")
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
	if p, _ := schedPolicy(d, "beta"); p.Tier != scheduler.TierNone || p.Shares != 2 {
		t.Fatalf("beta %+v after the file let go, want its stored x2", p)
	}
}
