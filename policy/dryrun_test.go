// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestEnforce: "enforce" is omitted while enforced (so a policy stored
// before the field existed enforces), written false in dry-run, patched
// from the CLI and read from the policies file.
func TestEnforce(t *testing.T) {
	var old Policy
	if err := json.Unmarshal([]byte(`{"tier":"pro","shares":2,"requests_per_sec":0,"work_per_sec":0}`), &old); err != nil {
		t.Fatal(err)
	}
	if !old.Enforced() {
		t.Fatal("a policy stored without enforce is in dry-run")
	}
	off := false
	p, err := Patch{Enforce: &off}.Apply(old)
	if err != nil || p.Enforced() {
		t.Fatalf("patch enforce=false: %+v %v", p, err)
	}
	b, _ := json.Marshal(p)
	if !strings.Contains(string(b), `"enforce":false`) {
		t.Fatalf("dry-run written as %s", b)
	}
	var back Policy
	if err := json.Unmarshal(b, &back); err != nil || back != p {
		t.Fatalf("round trip: %+v %v", back, err)
	}
	if b, _ := json.Marshal(old); strings.Contains(string(b), "enforce") {
		t.Fatalf("enforced policy written as %s", b)
	}
	if err := json.Unmarshal([]byte(`{"enforce":"no"}`), &back); err == nil {
		t.Fatal("enforce: \"no\" accepted")
	}
	m, err := ParseFile([]byte("alpha: {enforce: false}\nbeta: {tier: pro}\n"), Default())
	if err != nil {
		t.Fatal(err)
	}
	if m["alpha"].Enforced() || !m["beta"].Enforced() {
		t.Fatalf("file: %+v", m)
	}
	if _, err := ParseFile([]byte("alpha: {enforce: maybe}\n"), Default()); err == nil {
		t.Fatal("enforce: maybe accepted")
	}
}
