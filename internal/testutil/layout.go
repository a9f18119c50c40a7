// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// Pod is one pod of a kubelet layout: its cgroup, and the cgroups of its
// containers (the leaves, where the processes run).
type Pod struct {
	UID        string
	QoS        string // guaranteed, burstable or besteffort
	Cgroup     string
	Containers []string
}

// KubeletCgroupfs lays out pods below root as kubelet's cgroupfs driver
// does (root standing in for the cgroup2 mount): root/kubepods/pod<uid>/<ctr>
// for a Guaranteed pod, root/kubepods/burstable/pod<uid>/<ctr> and
// root/kubepods/besteffort/pod<uid>/<ctr> otherwise. qos names each pod's
// class; each pod gets ctrs containers with 64-hex ids, as containerd's.
// Everything is removed when the test ends.
func KubeletCgroupfs(t testing.TB, root string, qos []string, ctrs int) []Pod {
	t.Helper()
	pods := make([]Pod, len(qos))
	kubepods := mkdirAll(t, root, "kubepods")
	for i, q := range qos {
		uid := podUID(i)
		parent := kubepods
		if q != "guaranteed" {
			parent = mkdirAll(t, kubepods, q)
		}
		pod := MkCgroup(t, parent, "pod"+uid)
		pods[i] = Pod{UID: uid, QoS: q, Cgroup: pod}
		for c := range ctrs {
			pods[i].Containers = append(pods[i].Containers, MkCgroup(t, pod, ctrID(i, c)))
		}
	}
	return pods
}

// KubeletSystemd lays out pods below root as kubelet's systemd driver does:
// root/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope,
// the dashes of the pod UID turned to underscores, a Guaranteed pod directly
// in kubepods.slice (kubepods-pod<uid>.slice).
func KubeletSystemd(t testing.TB, root string, qos []string, ctrs int) []Pod {
	t.Helper()
	pods := make([]Pod, len(qos))
	kubepods := mkdirAll(t, root, "kubepods.slice")
	for i, q := range qos {
		uid := podUID(i)
		parent, prefix := kubepods, "kubepods-"
		if q != "guaranteed" {
			parent = mkdirAll(t, kubepods, "kubepods-"+q+".slice")
			prefix = "kubepods-" + q + "-"
		}
		pod := MkCgroup(t, parent, prefix+"pod"+strings.ReplaceAll(uid, "-", "_")+".slice")
		pods[i] = Pod{UID: uid, QoS: q, Cgroup: pod}
		for c := range ctrs {
			pods[i].Containers = append(pods[i].Containers, MkCgroup(t, pod, "cri-containerd-"+ctrID(i, c)+".scope"))
		}
	}
	return pods
}

// SystemdSlices lays out a slice of project slices below root as systemd
// does for units with Slice=<prefix>-<name>.slice: root/<parent>/<slice>/<unit>,
// where each key of units is a slice unit name as systemd writes it (a dash
// in a name escaped \x2d; an unescaped dash nests the slice in the slice of
// the name's first part, which is made too) and its value the units in it
// (a service, or a scope of systemd-run --scope). It returns the cgroup of
// each unit by "<slice>/<unit>" and of parent.
func SystemdSlices(t testing.TB, root, parent string, units map[string][]string) (map[string]string, string) {
	t.Helper()
	top := mkdirAll(t, root, parent)
	base := strings.TrimSuffix(parent, ".slice")
	out := map[string]string{}
	for slice, us := range units {
		// fairshare-a-b.slice lives in fairshare-a.slice, which lives in
		// fairshare.slice.
		name := strings.TrimSuffix(strings.TrimPrefix(slice, base+"-"), ".slice")
		dir := top
		parts := strings.Split(name, "-")
		for i := range parts {
			dir = mkdirAll(t, dir, base+"-"+strings.Join(parts[:i+1], "-")+".slice")
		}
		for _, u := range us {
			out[slice+"/"+u] = mkdirAll(t, dir, u)
		}
	}
	return out, top
}

// mkdirAll makes parent/name unless it exists, removing it at the end of
// the test if it made it.
func mkdirAll(t testing.TB, parent, name string) string {
	t.Helper()
	dir := filepath.Join(parent, name)
	if _, err := os.Stat(dir); err == nil {
		return dir
	}
	return MkCgroup(t, parent, name)
}

func podUID(i int) string {
	return fmt.Sprintf("%08x-1f2e-4d3c-8b7a-%012x", 0x5eed0000+i, i)
}

func ctrID(pod, ctr int) string {
	return fmt.Sprintf("%032x%032x", pod+1, ctr+1)
}
