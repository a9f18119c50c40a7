// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// schedulable says whether the scheduler would place the pod spec on a
// node with these labels, as far as its nodeSelector and required node
// affinity go (the DaemonSet tolerates every taint).
func schedulable(t *testing.T, spec corev1.PodSpec, labels map[string]string) bool {
	t.Helper()
	for k, v := range spec.NodeSelector {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	a := spec.Affinity
	if a == nil || a.NodeAffinity == nil || a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil {
		return true
	}
	// The terms are ORed, a term's expressions ANDed; an empty term
	// matches no node.
	for _, term := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		if len(term.MatchFields) != 0 {
			t.Fatalf("node affinity term with matchFields %+v: teach the test", term.MatchFields)
		}
		if len(term.MatchExpressions) == 0 {
			continue
		}
		ok := true
		for _, e := range term.MatchExpressions {
			v, has := labels[e.Key]
			switch e.Operator {
			case corev1.NodeSelectorOpIn:
				ok = ok && has && slices.Contains(e.Values, v)
			case corev1.NodeSelectorOpNotIn:
				ok = ok && !(has && slices.Contains(e.Values, v))
			case corev1.NodeSelectorOpExists:
				ok = ok && has
			case corev1.NodeSelectorOpDoesNotExist:
				ok = ok && !has
			default:
				t.Fatalf("node affinity operator %s: teach the test", e.Operator)
			}
		}
		if ok {
			return true
		}
	}
	return false
}

// TestChartNodes: the DaemonSet tolerates every taint, so its node
// selection alone keeps it off nodes where the daemon cannot run: an
// arm64 node (the binary is amd64 only), a virtual kubelet (AKS virtual
// nodes) or an EKS Fargate node (no kernel of its own). A pod there would
// crash-loop and hold a slot of maxUnavailable for ever, so that no
// rollout (helm upgrade, the uninstall's detachOnExit) ever ends; and
// maxUnavailable is a share of the nodes, so that one such node does not
// stop the rollout of all the others. Both are values an operator can
// override.
func TestChartNodes(t *testing.T) {
	linux := func(more ...string) map[string]string {
		l := map[string]string{"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64", "kubernetes.io/hostname": "n1"}
		for i := 0; i+1 < len(more); i += 2 {
			l[more[i]] = more[i+1]
		}
		return l
	}
	nodes := []struct {
		name   string
		labels map[string]string
		runs   bool
	}{
		{"an amd64 Linux node", linux(), true},
		{"an amd64 node labelled type=worker", linux("type", "worker"), true},
		{"an arm64 node", linux("kubernetes.io/arch", "arm64"), false},
		{"a Windows node", linux("kubernetes.io/os", "windows"), false},
		{"an AKS virtual node", linux("type", "virtual-kubelet", "kubernetes.io/role", "agent"), false},
		{"an EKS Fargate node", linux("eks.amazonaws.com/compute-type", "fargate"), false},
		{"an EKS EC2 node", linux("eks.amazonaws.com/compute-type", "ec2"), true},
	}
	spec := render(t, nil).daemonSet.Spec.Template.Spec
	for _, n := range nodes {
		if got := schedulable(t, spec, n.labels); got != n.runs {
			t.Errorf("%s (%v): scheduled %v, want %v", n.name, n.labels, got, n.runs)
		}
	}

	ds := render(t, nil).daemonSet
	ru := ds.Spec.UpdateStrategy.RollingUpdate
	if ru == nil || ru.MaxUnavailable == nil || ru.MaxUnavailable.Type != intstr.String {
		t.Fatalf("updateStrategy %+v: want maxUnavailable as a share of the nodes", ds.Spec.UpdateStrategy)
	}
	// The DaemonSet controller rounds a percentage up.
	for nodes, least := range map[int]int{1: 1, 5: 1, 20: 2, 200: 20} {
		n, err := intstr.GetScaledValueFromIntOrPercent(ru.MaxUnavailable, nodes, true)
		if err != nil || n < least {
			t.Errorf("maxUnavailable %s of %d nodes: %d (%v), want at least %d", ru.MaxUnavailable.String(), nodes, n, err, least)
		}
	}

	// Overridable: a key set to null drops it.
	spec = render(t, map[string]any{"nodeSelector": map[string]any{"kubernetes.io/arch": nil}, "affinity": nil}).daemonSet.Spec.Template.Spec
	if !schedulable(t, spec, linux("kubernetes.io/arch", "arm64", "type", "virtual-kubelet")) || schedulable(t, spec, linux("kubernetes.io/os", "windows")) {
		t.Errorf("nodeSelector %v affinity %+v: the arch and affinity not dropped, or the os dropped with them", spec.NodeSelector, spec.Affinity)
	}
}
