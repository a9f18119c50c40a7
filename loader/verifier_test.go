// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"reflect"
	"testing"

	"github.com/cilium/ebpf"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// verifierLimit is the kernel's BPF_COMPLEXITY_LIMIT_INSNS: the
// instructions the verifier may walk through one program's paths before it
// refuses the load.
const verifierLimit = 1_000_000

// TestVerifierHeadroom loads the programs as the daemon can at most (the
// default project ids, so every destination pool path is live, and the
// deepest cgroup walk, MaxDepth levels) and checks that the verifier walked
// each within a quarter of its limit. The walk is what a start costs
// (connect6 alone took 1.6-1.9 s of CPU, walking 748k-839k instructions
// by the depth) and it grows with paths, not lines: another kernel prunes
// differently, and a program near the limit here may be refused there, so
// the daemon would not start at all. A change that multiplies the paths of
// connect4 or connect6 again (the destination pool's lookup and rule
// inlined in front of the node's admission did) fails here, not at a
// user's start.
func TestVerifierHeadroom(t *testing.T) {
	testutil.RequireRoot(t)
	root, pin := newRoot(t), newPinDir(t)
	o := rootOptions(t, root, Options{PinDir: pin, PoolSize: 64})
	o.MaxDepth = MaxDepth
	l, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if l.maxProj != DefaultMaxProjects || l.depth != MaxDepth {
		t.Fatalf("project ids %d and depth %d, want %d and %d", l.maxProj, l.depth, DefaultMaxProjects, MaxDepth)
	}
	v := reflect.ValueOf(l.objs.limiterPrograms)
	for i := range v.NumField() {
		name := v.Type().Field(i).Tag.Get("ebpf")
		p, ok := v.Field(i).Interface().(*ebpf.Program)
		if !ok || p == nil {
			t.Fatalf("%s: not loaded", name)
		}
		info, err := p.Info()
		if err != nil {
			t.Fatal(err)
		}
		n, ok := info.VerifiedInstructions()
		if !ok {
			t.Skip("the kernel does not report verified instructions (before 5.16)")
		}
		t.Logf("%-18s %7d instructions verified", name, n)
		if n > verifierLimit/4 {
			t.Errorf("%s: the verifier walked %d instructions, more than a quarter of its limit of %d", name, n, verifierLimit)
		}
	}
}
