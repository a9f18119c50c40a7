// SPDX-License-Identifier: Apache-2.0

package crtest

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// TestRuntimeRunsPods runs a host-network pod and a pod with its own network
// namespace and checks what the tests rely on: the container runs in the
// cgroup the runtime reports, below the pod's cgroup parent, in the network
// namespace the pod was given, and removing the pod removes its cgroups.
func TestRuntimeRunsPods(t *testing.T) {
	r := Start(t)
	mount := testutil.Cgroup2Mount(t)
	hostNet, err := os.Readlink("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	for _, host := range []bool{true, false} {
		p := r.RunPod(t, PodSpec{Namespace: "team-a", Name: "web", HostNetwork: host})
		if !strings.HasPrefix(p.ContainerCgroup, p.CgroupParent+"/") {
			t.Fatalf("container cgroup %q is not below the pod's %q", p.ContainerCgroup, p.CgroupParent)
		}
		b, err := os.ReadFile(filepath.Join("/proc", itoa(p.Pid), "cgroup"))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), "0::"+p.ContainerCgroup+"\n") {
			t.Fatalf("container process %d is not in %s:\n%s", p.Pid, p.ContainerCgroup, b)
		}
		ns, err := os.Readlink(filepath.Join("/proc", itoa(p.Pid), "ns/net"))
		if err != nil {
			t.Fatal(err)
		}
		if (ns == hostNet) != host {
			t.Fatalf("host network %v: container netns %s, host %s", host, ns, hostNet)
		}
		if !host && p.IP == "" {
			t.Fatal("a pod with its own network has no IP")
		}
		out, err := r.Exec(p, 5*time.Second, "/bin/echo", "hi")
		if err != nil || out != "hi\n" {
			t.Fatalf("exec: %q, %v", out, err)
		}
		r.RemovePod(t, p)
		if _, err := os.Stat(filepath.Join(mount, p.CgroupParent)); !os.IsNotExist(err) {
			t.Fatalf("the pod's cgroup is still there after RemovePod: %v", err)
		}
	}
}

func itoa(i int) string {
	return strconv.Itoa(i)
}
