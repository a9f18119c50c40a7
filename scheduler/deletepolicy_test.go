// SPDX-License-Identifier: Apache-2.0

package scheduler

import (
	"testing"
	"time"
)

// DeletePolicy puts a known participant on the default at once and leaves
// nothing behind for a forgotten one: it comes back on the default.
func TestDeletePolicyFallsBackToTheDefault(t *testing.T) {
	def := Policy{Tier: TierLite, Shares: 1}
	h := newHarness(t, Config{P1Rate: 1, P1Burst: 2, P2Rate: 1, P2Burst: 2, DefaultPolicy: def})
	h.s.SetPolicy("a", pro(3))
	h.submit("a", 1)
	h.s.DeletePolicy("a")
	policyOf := func(who string) (Policy, bool) {
		for _, p := range h.s.Snapshot().Participants {
			if p.Participant == who {
				return p.Policy, true
			}
		}
		return Policy{}, false
	}
	if got, _ := policyOf("a"); got != def {
		t.Fatalf("known participant after DeletePolicy: %+v, want the default %+v", got, def)
	}
	if p1, _ := h.balances("a"); p1 != 0 {
		t.Fatalf("lite by default, yet holds P1 %v", p1)
	}
	_, _, tk := h.step()
	tk.Done(1)
	h.clk.Advance(time.Minute)
	h.s.mu.Lock()
	h.s.sweepLocked(h.s.now())
	_, kept := h.s.policies["a"]
	h.s.mu.Unlock()
	if kept {
		t.Fatal("the deleted policy is still in the policies map")
	}
	if _, known := policyOf("a"); known {
		t.Fatal("idle participant not forgotten")
	}
	h.submit("a", 1)
	if got, _ := policyOf("a"); got != def {
		t.Fatalf("participant back after DeletePolicy: %+v, want the default %+v", got, def)
	}
	h.s.DeletePolicy("never-seen") // no state, no panic
}
