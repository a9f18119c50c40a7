// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"helm.sh/helm/v4/pkg/engine"

	fsconfig "github.com/fairshare-dev/fairshare/config"
)

// withKey is values with the dotted key set to v (maps made as needed).
func withKey(values map[string]any, key string, v any) map[string]any {
	out := map[string]any{}
	for k, val := range values {
		out[k] = val
	}
	m := out
	parts := strings.Split(key, ".")
	for _, p := range parts[:len(parts)-1] {
		next, ok := m[p].(map[string]any)
		if !ok {
			next = map[string]any{}
		} else {
			cp := map[string]any{}
			for k, val := range next {
				cp[k] = val
			}
			next = cp
		}
		m[p] = next
		m = next
	}
	m[parts[len(parts)-1]] = v
	return out
}

// renderNotes is the chart's NOTES.txt as helm install prints it.
func renderNotes(t *testing.T, namespace string, values map[string]any) string {
	t.Helper()
	ch, err := loader.Load(ChartDir)
	if err != nil {
		t.Fatal(err)
	}
	vals, err := util.ToRenderValues(ch, values, common.ReleaseOptions{Name: "fs", Namespace: namespace, Revision: 1, IsInstall: true}, common.DefaultCapabilities)
	if err != nil {
		t.Fatal(err)
	}
	files, err := engine.Render(ch, vals)
	if err != nil {
		t.Fatal(err)
	}
	notes, ok := files["fairshare/templates/NOTES.txt"]
	if !ok {
		t.Fatal("no NOTES.txt rendered")
	}
	return notes
}

// daemonConfig is the daemon's reading of the configuration the chart wrote.
func daemonConfig(t *testing.T, o objects) fsconfig.Config {
	t.Helper()
	raw := o.configMaps["fs-config"].Data["config.yaml"]
	dc := fsconfig.Default()
	if err := fsconfig.Parse(strings.NewReader(raw), &dc); err != nil {
		t.Fatalf("the daemon refuses the chart's config: %v\n%s", err, raw)
	}
	return dc
}

// TestChartBooleanStrings: every boolean value of the chart means what it
// says whether it comes as a YAML boolean or as a string (--set-string,
// a GitOps tool's parameters, a quoted "false" in a values file): a plain
// {{ if }} took "false" for true, and detachOnExit: "false" made every
// daemon unpin as it stopped. A value that is neither fails, naming it.
func TestChartBooleanStrings(t *testing.T) {
	etcd := map[string]any{"fleet": map[string]any{"etcd": []any{"https://etcd-0:2379"}}}
	rule := map[string]any{"metrics": map[string]any{"prometheusRule": map[string]any{"enabled": true}}}
	labelled := map[string]any{"kubernetes": map[string]any{"projectLabel": "fairshare.io/project"}}
	for _, c := range []struct {
		key  string
		base map[string]any
		on   func(o objects, notes string) bool
	}{
		{"detachOnExit", nil, func(o objects, notes string) bool {
			args := slices.Contains(container(t, o.daemonSet).Args, "--detach-on-exit")
			if said := strings.Contains(notes, "detachOnExit is set"); said != args {
				t.Errorf("detachOnExit: the notes say it is set %v, the daemon's args %v", said, args)
			}
			return args
		}},
		{"mountBPFFS", nil, func(o objects, _ string) bool {
			sc := container(t, o.daemonSet).SecurityContext
			return *sc.Privileged && *sc.AllowPrivilegeEscalation
		}},
		{"pools.db.fleet", withKey(etcd, "pools.db.size", 100), func(o objects, _ string) bool {
			return daemonConfig(t, o).Pools["db"].Fleet
		}},
		{"namespace.create", nil, func(o objects, _ string) bool { return len(o.namespaces) == 1 }},
		{"metrics.service.enabled", nil, func(o objects, _ string) bool { return len(o.services) == 1 }},
		{"metrics.serviceMonitor.enabled", nil, func(o objects, _ string) bool { return len(o.serviceMonitors) == 1 }},
		{"metrics.prometheusRule.enabled", nil, func(o objects, _ string) bool { return len(o.rules) == 1 }},
		{"metrics.prometheusRule.kubeStateMetrics", rule, func(o objects, _ string) bool {
			for _, r := range o.rules[0].Spec.Groups[0].Rules {
				if r.Alert == "FairshareDaemonSetNotReady" {
					return true
				}
			}
			return false
		}},
		{"kubernetes.namespaceProjects", labelled, func(o objects, _ string) bool {
			return daemonConfig(t, o).Kubernetes.NamespaceProjects
		}},
		{"connections.limitHostNetworkPods", nil, func(o objects, _ string) bool {
			return daemonConfig(t, o).Connections.LimitHostNetworkPods
		}},
		{"priorityClassQuota.enabled", nil, func(o objects, _ string) bool { return len(o.quotas) == 1 }},
		{"allowSharedNamespace", nil, func(o objects, _ string) bool { return len(o.quotas) == 0 }},
	} {
		for _, v := range []any{true, "true", "True", "yes", "on", false, "false", "False", "no", "off", "N"} {
			values := withKey(c.base, c.key, v)
			want := slices.Contains([]any{true, "true", "True", "yes", "on"}, v)
			if got := c.on(render(t, values), renderNotes(t, "ops", values)); got != want {
				t.Errorf("%s: %#v is taken as %v", c.key, v, got)
			}
		}
		if _, err := RenderFor(ChartDir, "fs", "ops", "1.33.0", withKey(c.base, c.key, "maybe")); err == nil || !strings.Contains(err.Error(), c.key) {
			t.Errorf("%s: \"maybe\": %v, want a refusal naming the key", c.key, err)
		}
	}
}

// TestChartRuntimeSocketURL: kubernetes.runtimeSocket as kubelet's
// --container-runtime-endpoint writes it (unix:///run/...) mounts the
// socket's directory on the node, not "unix:/run/containerd", and the
// daemon is given the socket in the pod; what is no unix socket's path
// fails at install, naming the value.
func TestChartRuntimeSocketURL(t *testing.T) {
	for sock, dir := range map[string]string{
		"unix:///run/containerd/containerd.sock": "/run/containerd",
		"/var/run/crio/crio.sock":                "/var/run/crio",
		"unix:///var/run/crio/crio.sock":         "/var/run/crio",
		"/run/k3s//containerd/containerd.sock":   "/run/k3s/containerd",
	} {
		o := render(t, map[string]any{"kubernetes": map[string]any{"runtimeSocket": sock}})
		if v := volume(t, o.daemonSet, "cri"); v.HostPath == nil || v.HostPath.Path != dir {
			t.Errorf("runtimeSocket %s: the socket's directory on the node %+v, want %s", sock, v.HostPath, dir)
		}
		base := sock[strings.LastIndex(sock, "/")+1:]
		dc := daemonConfig(t, o)
		if ep := dc.Kubernetes.Endpoint(); ep != "/run/fairshare-cri/"+base {
			t.Errorf("runtimeSocket %s: the daemon's runtime_endpoint %s", sock, ep)
		}
	}
	for _, bad := range []string{"containerd.sock", "unix://run/containerd.sock", "tcp://10.0.0.1:2375", "/containerd.sock", ""} {
		_, err := Render(ChartDir, "fs", "ops", map[string]any{"kubernetes": map[string]any{"runtimeSocket": bad}})
		if err == nil || !strings.Contains(err.Error(), "kubernetes.runtimeSocket") {
			t.Errorf("runtimeSocket %q: %v, want a refusal naming kubernetes.runtimeSocket", bad, err)
		}
	}
}

// TestChartEnvIsRead: every variable the chart puts in the daemon's
// environment is one the daemon reads (a FAIRSHARE_* of one of its flags)
// or one another variable or the args refer to as $(NAME). A NODE_NAME
// nothing read looked like the fleet's node name; the daemon has no
// variable or flag for fleet.node and takes the host name, the node's
// under hostNetwork.
func TestChartEnvIsRead(t *testing.T) {
	src, err := os.ReadFile("../cmd/fairshare/flags.go")
	if err != nil {
		t.Fatal(err)
	}
	read := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s*flag\w+\s*=\s*"([a-z-]+)"`).FindAllStringSubmatch(string(src), -1) {
		read["FAIRSHARE_"+strings.ToUpper(strings.ReplaceAll(m[1], "-", "_"))] = true
	}
	if !read["FAIRSHARE_METRICS_LISTEN"] {
		t.Fatalf("the daemon's flags from cmd/fairshare/flags.go: %v", read)
	}
	c := container(t, render(t, nil).daemonSet)
	refs := strings.Join(c.Args, " ")
	for _, e := range c.Env {
		refs += " " + e.Value
	}
	for _, e := range c.Env {
		if !read[e.Name] && !strings.Contains(refs, "$("+e.Name+")") {
			t.Errorf("env %s: the daemon does not read it, and nothing refers to it", e.Name)
		}
	}
}

// TestChartExtraConfig: extraConfig reaches the daemon's configuration
// for keys the chart has no value for, merged key by key over what the
// chart writes; without it the file is the chart's, comments and all.
func TestChartExtraConfig(t *testing.T) {
	o := render(t, map[string]any{"extraConfig": map[string]any{
		"reconcile": "30s",
		"pools":     map[string]any{"connections": map[string]any{"window": "1m"}},
		"events":    map[string]any{"recent": 500},
	}})
	dc := daemonConfig(t, o)
	if dc.Reconcile != 30*time.Second || dc.Events.Recent != 500 {
		t.Errorf("reconcile %s events.recent %d: extraConfig not applied", dc.Reconcile, dc.Events.Recent)
	}
	if p := dc.Pools["connections"]; p.Window != time.Minute || p.Size != 4096 {
		t.Errorf("connections %+v: want the window of extraConfig and the chart's size", p)
	}
	if dc.PinDir != "/sys/fs/bpf/fairshare" || dc.Kubernetes.Endpoint() != "/run/fairshare-cri/containerd.sock" || !slices.Contains(dc.Projects.Sources, "kubernetes") {
		t.Errorf("the chart's keys lost in the merge: pin_dir %s, endpoint %s, sources %v", dc.PinDir, dc.Kubernetes.Endpoint(), dc.Projects.Sources)
	}
	if base := render(t, nil).configMaps["fs-config"].Data["config.yaml"]; !strings.Contains(base, "# The node's pods are the projects' members") {
		t.Errorf("without extraConfig the file lost its comments:\n%s", base)
	}
	if _, err := Render(ChartDir, "fs", "ops", map[string]any{"extraConfig": "reconcile: 30s"}); err == nil || !strings.Contains(err.Error(), "extraConfig") {
		t.Errorf("extraConfig as a string: %v, want a refusal naming it", err)
	}
}
