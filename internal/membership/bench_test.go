// SPDX-License-Identifier: Apache-2.0

package membership

import (
	"fmt"
	"testing"
)

// kubeNode is a big node's membership: projects with 5 pods each, pods
// spread over kubelet's cgroupfs QoS classes, paths as long as real ones.
func kubeNode(projects, pods int) []Input {
	reg := Input{Source: "registered"}
	qos := []string{"", "burstable/", "besteffort/"}
	for i := range projects * pods {
		p := fmt.Sprintf("tenant-%05d", i/pods)
		cg := fmt.Sprintf("/sys/fs/cgroup/kubepods/%spod%08x-1f2e-4d3c-8b7a-%012x", qos[i%3], i, i)
		reg.Members = append(reg.Members, Member{Project: p, Cgroup: cg})
	}
	return []Input{reg}
}

// BenchmarkResolve unions 10,000 projects of 5 registered cgroups each
// (50,000): cold (no set in force: a daemon's first tick), steady (nothing
// changed since the set in force) and churn (100 new cgroups on top of the
// set in force, then Diff: a tick after a second of registrations at 100/s).
func BenchmarkResolve(b *testing.B) {
	inputs := kubeNode(10_000, 5)
	inForce := Resolve(inputs, nil).Accepted
	if len(inForce) != 50_000 {
		b.Fatalf("%d accepted", len(inForce))
	}
	b.Run("cold", func(b *testing.B) {
		for b.Loop() {
			Resolve(inputs, nil)
		}
	})
	b.Run("steady", func(b *testing.B) {
		for b.Loop() {
			Resolve(inputs, inForce)
		}
	})
	more := []Input{{Source: "registered", Found: Found{Members: append([]Member(nil), inputs[0].Members...)}}}
	for i := range 100 {
		more[0].Members = append(more[0].Members, Member{Project: fmt.Sprintf("new-%03d", i),
			Cgroup: fmt.Sprintf("/sys/fs/cgroup/kubepods/burstable/podnew%032x", i)})
	}
	b.Run("churn100+diff", func(b *testing.B) {
		for b.Loop() {
			r := Resolve(more, inForce)
			if c := Diff(inForce, r.Accepted); len(c.Added) != 100 {
				b.Fatalf("%d added", len(c.Added))
			}
		}
	})
	b.Run("diff", func(b *testing.B) {
		r := Resolve(more, inForce).Accepted
		for b.Loop() {
			Diff(inForce, r)
		}
	})
	b.Run("tree+find", func(b *testing.B) {
		for b.Loop() {
			t := NewTree(inForce)
			if _, ok := t.Find(inForce[25_000].Cgroup + "/ctr/x"); !ok {
				b.Fatal("not found")
			}
		}
	})
}

// BenchmarkFind is the cost of placing one process's cgroup (3 levels
// below its pod) in a 50,000-member tree.
func BenchmarkFind(b *testing.B) {
	t := NewTree(Resolve(kubeNode(10_000, 5), nil).Accepted)
	path := "/sys/fs/cgroup/kubepods/burstable/pod00000001-1f2e-4d3c-8b7a-000000000001" + "/ctr/a/b"
	for b.Loop() {
		if _, ok := t.Find(path); !ok {
			b.Fatal("not found")
		}
	}
}
