// SPDX-License-Identifier: Apache-2.0

package main

import (
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// TestPoliciesFileThroughDaemon runs the daemon with a policies file laid
// out as kubelet mounts a ConfigMap: a swap reaches the daemon within two
// seconds (its tick is one), the CLI refuses to change what the file owns
// and says where to change it, and a file that does not validate changes
// nothing and shows in status.
func TestPoliciesFileThroughDaemon(t *testing.T) {
	cm := testutil.NewConfigMapDir(t)
	write := func(s string) { cm.Write(map[string]string{"policies.yaml": s}) }
	write("alpha: {tier: pro, shares: 2}\n")
	n := newNode(t, "policies_file: "+cm.Path("policies.yaml")+"\nbpf: false\n")
	n.start()

	out, errOut, code := n.cli("policy", "get", "--json", "alpha")
	if code != 0 || !strings.Contains(out, `"source": "file"`) || !strings.Contains(out, `"shares": 2`) {
		t.Fatalf("policy get alpha: %d %s %s", code, out, errOut)
	}
	_, errOut, code = n.cli("policy", "set", "--shares", "5", "alpha")
	if code == 0 || !strings.Contains(errOut, cm.Path("policies.yaml")) {
		t.Fatalf("policy set on a file's project: exit %d, %q; want a refusal naming the file", code, errOut)
	}

	swapped := time.Now()
	write("alpha: {tier: lite, shares: 7}\n")
	var took time.Duration
	for {
		out, _, _ = n.cli("policy", "get", "--json", "alpha")
		if strings.Contains(out, `"shares": 7`) {
			took = time.Since(swapped)
			break
		}
		if time.Since(swapped) > 10*time.Second {
			t.Fatalf("the swapped file never took effect: %s\n%s", out, n.log)
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("a ConfigMap swap took effect in %v", took)
	// Read at the next tick, in force at the one after (two reads must
	// agree): two seconds at the default tick, and a margin for a loaded
	// machine.
	if took > 3*time.Second {
		t.Errorf("a ConfigMap swap took %v, more than two ticks and a margin", took)
	}

	write("alpha: {tier: lite, shares: -1}\n")
	deadline := time.Now().Add(10 * time.Second)
	for {
		st := n.status()
		if st.PoliciesFile != nil && strings.Contains(st.PoliciesFile.Error, "shares") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a refused file does not show in status: %+v", st.PoliciesFile)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if out, _, _ = n.cli("policy", "get", "--json", "alpha"); !strings.Contains(out, `"shares": 7`) {
		t.Fatalf("a refused file changed the policy in force: %s", out)
	}
	if !strings.Contains(n.log.String(), "policies file refused") {
		t.Fatalf("no log line for the refused file:\n%s", n.log)
	}
	// The refusal in status's text and in /metrics, for the alert.
	out, errOut, code = n.cli("status")
	if code != 0 || !strings.Contains(out, "its current content is REFUSED since ") || !strings.Contains(out, "shares") ||
		!strings.Contains(out, "1 contents refused since the daemon started") {
		t.Errorf("status with a refused policies file: exit %d\n%s%s", code, out, errOut)
	}
	met := n.metrics()
	for _, w := range []string{"fairshare_policies_file_refused 1", "fairshare_policies_file_refusals_total 1",
		"fairshare_policies_file_projects 1", "fairshare_policies_file_last_refused_timestamp_seconds "} {
		if !strings.Contains(met, w) {
			t.Errorf("/metrics with a refused policies file lacks %q", w)
		}
	}
	// A good file again: no longer refused, the count stays.
	write("alpha: {tier: lite, shares: 3}\n")
	deadline = time.Now().Add(10 * time.Second)
	for met = n.metrics(); !strings.Contains(met, "fairshare_policies_file_refused 0"); met = n.metrics() {
		if time.Now().After(deadline) {
			t.Fatalf("the refusal outlived a good file:\n%s", met)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(met, "fairshare_policies_file_refusals_total 1") {
		t.Error("the refusals counter went down")
	}
	if out, _, _ = n.cli("status"); strings.Contains(out, "content is REFUSED") {
		t.Errorf("status after a good file still says REFUSED:\n%s", out)
	}
}
