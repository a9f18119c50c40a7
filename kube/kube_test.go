// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/crtest"
	"github.com/fairshare-dev/fairshare/internal/testutil"
	"github.com/fairshare-dev/fairshare/policy"
)

func TestSliceDir(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"-.slice", "/"},
		{"kubepods.slice", "/kubepods.slice"},
		{"kubepods-burstable.slice", "/kubepods.slice/kubepods-burstable.slice"},
		{"kubepods-burstable-pod1234_56.slice", "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234_56.slice"},
		{"fairshare-alpha.slice", "/fairshare.slice/fairshare-alpha.slice"},
		{"bad", ""}, {"-a.slice", ""}, {"a-.slice", ""}, {"a--b.slice", ""}, {".slice", ""}, {"a/b.slice", ""},
	} {
		got, err := SliceDir(c.in)
		if (err != nil) != (c.want == "") || got != c.want {
			t.Errorf("SliceDir(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
}

func TestCgroupDir(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"/kubepods/burstable/podabc", "/kubepods/burstable/podabc"},
		{"/kubepods/podabc/", "/kubepods/podabc"},
		{"kubepods/podabc", "/kubepods/podabc"},
		{"kubepods-besteffort-podabc.slice", "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podabc.slice"},
		{"/kubepods/../etc", ""},
	} {
		got, err := CgroupDir(c.in)
		if (err != nil) != (c.want == "") || got != c.want {
			t.Errorf("CgroupDir(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
	for _, c := range []struct{ in, want string }{
		{"/kubepods/burstable/podabc/0123", "/kubepods/burstable/podabc/0123"},
		{"kubepods-burstable-podabc.slice:cri-containerd:0123", "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podabc.slice/cri-containerd-0123.scope"},
	} {
		got, err := cgroupOf(c.in)
		if err != nil || got != c.want {
			t.Errorf("cgroupOf(%q) = %q, %v; want %q", c.in, got, err, c.want)
		}
	}
}

func TestRulesProject(t *testing.T) {
	r := labelledRules()
	pod := func(ns string, labels map[string]string) Pod { return Pod{Namespace: ns, Name: "p", Labels: labels} }
	for _, c := range []struct {
		name    string
		rules   Rules
		pod     Pod
		want    string
		wantErr bool
	}{
		{"namespace", r, pod("team-a", nil), "team-a", false},
		{"label overrides", r, pod("team-a", map[string]string{DefaultProjectLabel: "billing"}), "billing", false},
		{"system namespace", r, pod("kube-system", map[string]string{DefaultProjectLabel: "billing"}), "", false},
		{"bad label falls back", r, pod("team-a", map[string]string{DefaultProjectLabel: "(other)"}), "team-a", true},
		{"label only", Rules{ProjectLabel: DefaultProjectLabel, Validate: policy.ValidateProject}, pod("team-a", nil), "", false},
		{"label only, labelled", Rules{ProjectLabel: DefaultProjectLabel, Validate: policy.ValidateProject}, pod("team-a", map[string]string{DefaultProjectLabel: "x"}), "x", false},
		{"label off", Rules{Namespaces: true, Validate: policy.ValidateProject}, pod("team-a", map[string]string{DefaultProjectLabel: "x"}), "team-a", false},
		// A label may not make a pod exempt by naming an exempt project; its
		// namespace may be one (the operator's choice).
		{"label names a reserved project", Rules{ProjectLabel: DefaultProjectLabel, Namespaces: true, Reserved: []string{"ops"}},
			pod("team-a", map[string]string{DefaultProjectLabel: "ops"}), "team-a", true},
		{"namespace is a reserved project", Rules{ProjectLabel: DefaultProjectLabel, Namespaces: true, Reserved: []string{"ops"}},
			pod("ops", nil), "ops", false},
	} {
		got, err := c.rules.Project(c.pod)
		if got != c.want || (err != nil) != c.wantErr {
			t.Errorf("%s: Project = %q, %v; want %q (error %v)", c.name, got, err, c.want, c.wantErr)
		}
	}
}

// TestCRIPods lists pods of a real containerd: their namespaces, labels,
// cgroups and network namespaces are the ones the runtime gave them, and a
// removed pod is no longer listed.
func TestCRIPods(t *testing.T) {
	r := crtest.Start(t)
	mount := testutil.Cgroup2Mount(t)
	host := r.RunPod(t, crtest.PodSpec{Namespace: "team-a", Name: "host", HostNetwork: true})
	own := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "own", Labels: map[string]string{DefaultProjectLabel: "billing"}})
	guaranteed := r.RunPod(t, crtest.PodSpec{Namespace: "team-b", Name: "g", HostNetwork: true, UID: "g" + strconv.Itoa(os.Getpid()), CgroupParent: "/kubepods/podg" + strconv.Itoa(os.Getpid())})

	c, err := DialCRI(r.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pods, err := c.Pods(ctx)
	if err != nil {
		t.Fatal(err)
	}
	byID := map[string]Pod{}
	for _, p := range pods {
		byID[p.ID] = p
	}
	rules := labelledRules()
	for _, c := range []struct {
		p       *crtest.Pod
		project string
		hostNet bool
	}{{host, "team-a", true}, {own, "billing", false}, {guaranteed, "team-b", true}} {
		got, ok := byID[c.p.ID]
		if !ok {
			t.Fatalf("pod %s/%s not listed: %+v", c.p.Namespace, c.p.Name, pods)
		}
		if got.Namespace != c.p.Namespace || got.Name != c.p.Name || got.UID != c.p.UID {
			t.Errorf("pod %s: identity %s/%s %s, want %s/%s %s", c.p.ID, got.Namespace, got.Name, got.UID, c.p.Namespace, c.p.Name, c.p.UID)
		}
		if got.Cgroup != c.p.CgroupParent {
			t.Errorf("pod %s/%s: cgroup %q, want %q", c.p.Namespace, c.p.Name, got.Cgroup, c.p.CgroupParent)
		}
		if !strings.HasPrefix(c.p.ContainerCgroup, got.Cgroup+"/") {
			t.Errorf("pod %s/%s: container cgroup %q is not below %q", c.p.Namespace, c.p.Name, c.p.ContainerCgroup, got.Cgroup)
		}
		if _, err := os.Stat(filepath.Join(mount, got.Cgroup)); err != nil {
			t.Errorf("pod %s/%s: %v", c.p.Namespace, c.p.Name, err)
		}
		if got.HostNetwork != c.hostNet || (got.NetNS == "") != c.hostNet {
			t.Errorf("pod %s/%s: host network %v netns %q, want host network %v", c.p.Namespace, c.p.Name, got.HostNetwork, got.NetNS, c.hostNet)
		}
		if !c.hostNet {
			ctr := filepath.Join("/proc", strconv.Itoa(c.p.Pid), "ns/net")
			st1, err1 := os.Stat(got.NetNS)
			st2, err2 := os.Stat(ctr)
			if err1 != nil || err2 != nil || !os.SameFile(st1, st2) {
				t.Errorf("pod %s/%s: netns %s is not the container's %s (%v, %v)", c.p.Namespace, c.p.Name, got.NetNS, ctr, err1, err2)
			}
		}
		if proj, err := rules.Project(got); err != nil || proj != c.project {
			t.Errorf("pod %s/%s: project %q, %v; want %q", c.p.Namespace, c.p.Name, proj, err, c.project)
		}
	}
	r.RemovePod(t, own)
	pods, err = c.Pods(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range pods {
		if p.ID == own.ID {
			t.Fatalf("removed pod still listed")
		}
	}
	if len(pods) != 2 {
		t.Fatalf("%d pods listed, want 2", len(pods))
	}
}

// TestCRIGone: a runtime that is not there is an ErrRuntime, not a hang.
func TestCRIGone(t *testing.T) {
	c, err := DialCRI(filepath.Join(t.TempDir(), "none.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	if _, err := c.Pods(ctx); !errors.Is(err, ErrRuntime) {
		t.Fatalf("Pods without a runtime: %v, want ErrRuntime", err)
	}
	if _, err := c.Ping(ctx); !errors.Is(err, ErrRuntime) {
		t.Fatalf("Ping without a runtime: %v, want ErrRuntime", err)
	}
}

// labelledRules are DefaultRules with the label override on, as the tests
// of labelled pods need it.
func labelledRules() Rules {
	r := DefaultRules(policy.ValidateProject)
	r.ProjectLabel = DefaultProjectLabel
	return r
}

// TestDefaultRulesIgnoreTheLabel: by default a pod's label does not move
// it out of its namespace's project: whoever may create pods may label
// them, and with the override on could split a tenant into as many
// projects, each with its own share, as it has pods.
func TestDefaultRulesIgnoreTheLabel(t *testing.T) {
	p := Pod{Namespace: "team-a", Name: "p", Labels: map[string]string{DefaultProjectLabel: "another"}}
	if got, err := DefaultRules(policy.ValidateProject).Project(p); got != "team-a" || err != nil {
		t.Fatalf("a labelled pod under the default rules: %q %v, want its namespace's", got, err)
	}
}
