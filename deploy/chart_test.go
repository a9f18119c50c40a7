// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	sigyaml "sigs.k8s.io/yaml"
)

var update = flag.Bool("update", false, "rewrite kubernetes/fairshare.yaml from the chart")

const (
	staticManifests = "kubernetes/fairshare.yaml"
	staticName      = "fairshare"
	staticNamespace = "fairshare-system"
)

// objects is a rendered chart decoded into the Kubernetes API types.
type objects struct {
	daemonSet  *appsv1.DaemonSet
	configMaps map[string]*corev1.ConfigMap
	services   []*corev1.Service
}

var codecs = func() serializer.CodecFactory {
	s := runtime.NewScheme()
	utilruntime.Must(appsv1.AddToScheme(s))
	utilruntime.Must(corev1.AddToScheme(s))
	// Strict: a misspelt or misplaced field is an error, as kubectl apply
	// --validate=strict would say, instead of being dropped.
	return serializer.NewCodecFactory(s, serializer.EnableStrict)
}()

// decode decodes every document of a rendered chart; any kind the chart is
// not known to make fails the test.
func decode(t *testing.T, stream string) objects {
	t.Helper()
	o := objects{configMaps: map[string]*corev1.ConfigMap{}}
	for _, doc := range strings.Split(stream, "\n---\n") {
		doc = strings.TrimPrefix(strings.TrimSpace(doc), "---\n")
		if strings.TrimSpace(doc) == "" {
			continue
		}
		obj, gvk, err := codecs.UniversalDeserializer().Decode([]byte(doc), nil, nil)
		if err != nil {
			t.Fatalf("decoding a manifest: %v\n%s", err, doc)
		}
		switch v := obj.(type) {
		case *appsv1.DaemonSet:
			if o.daemonSet != nil {
				t.Fatal("two DaemonSets")
			}
			o.daemonSet = v
		case *corev1.ConfigMap:
			o.configMaps[v.Name] = v
		case *corev1.Service:
			o.services = append(o.services, v)
		default:
			t.Fatalf("unexpected kind %s", gvk)
		}
	}
	if o.daemonSet == nil {
		t.Fatal("no DaemonSet rendered")
	}
	return o
}

func render(t *testing.T, values map[string]any) objects {
	t.Helper()
	s, err := Render(ChartDir, "fs", "ops", values)
	if err != nil {
		t.Fatal(err)
	}
	return decode(t, s)
}

func container(t *testing.T, ds *appsv1.DaemonSet) corev1.Container {
	t.Helper()
	if n := len(ds.Spec.Template.Spec.Containers); n != 1 {
		t.Fatalf("%d containers, want 1", n)
	}
	return ds.Spec.Template.Spec.Containers[0]
}

func mount(t *testing.T, c corev1.Container, path string) corev1.VolumeMount {
	t.Helper()
	for _, m := range c.VolumeMounts {
		if m.MountPath == path {
			return m
		}
	}
	t.Fatalf("no volume mounted at %s", path)
	return corev1.VolumeMount{}
}

func volume(t *testing.T, ds *appsv1.DaemonSet, name string) corev1.Volume {
	t.Helper()
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("no volume %s", name)
	return corev1.Volume{}
}

// TestChartDefaults renders the chart as a user installs it and checks what
// the daemon needs from the node, and that it gets no more than that.
func TestChartDefaults(t *testing.T) {
	o := render(t, nil)
	ds := o.daemonSet
	spec := ds.Spec.Template.Spec
	if ds.Namespace != "ops" || ds.Name != "fs" {
		t.Errorf("DaemonSet %s/%s, want ops/fs", ds.Namespace, ds.Name)
	}
	if !spec.HostNetwork || !spec.HostPID {
		t.Errorf("hostNetwork %v hostPID %v: the daemon needs both", spec.HostNetwork, spec.HostPID)
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("a service account token is mounted: the daemon needs no API access")
	}
	if !slices.ContainsFunc(spec.Tolerations, func(tl corev1.Toleration) bool { return tl.Operator == corev1.TolerationOpExists && tl.Key == "" }) {
		t.Error("the DaemonSet does not tolerate every taint: nodes would go unenforced")
	}
	c := container(t, ds)
	sc := c.SecurityContext
	if sc == nil || sc.Privileged == nil || *sc.Privileged {
		t.Fatal("the container is privileged by default")
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Error("privilege escalation is allowed")
	}
	var caps []string
	for _, c := range sc.Capabilities.Add {
		caps = append(caps, string(c))
	}
	slices.Sort(caps)
	want := []string{"BPF", "CHOWN", "DAC_OVERRIDE", "FOWNER", "NET_ADMIN", "PERFMON", "SYS_ADMIN", "SYS_PTRACE", "SYS_RESOURCE"}
	if !slices.Equal(caps, want) || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("capabilities add %v drop %v, want add %v drop [ALL]", caps, sc.Capabilities.Drop, want)
	}
	if m := mount(t, c, "/sys/fs/bpf"); m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationHostToContainer {
		t.Errorf("bpffs propagation %v, want HostToContainer", m.MountPropagation)
	}
	if v := volume(t, ds, "bpffs"); v.HostPath == nil || v.HostPath.Path != "/sys/fs/bpf" || *v.HostPath.Type != corev1.HostPathDirectory {
		t.Errorf("bpffs volume %+v", v.HostPath)
	}
	mount(t, c, "/sys/fs/cgroup")
	// The socket's directory: a bind mount of the socket itself would keep
	// the old one when the runtime restarts.
	cri := mount(t, c, "/run/fairshare-cri")
	if v := volume(t, ds, cri.Name); v.HostPath == nil || v.HostPath.Path != "/run/containerd" || *v.HostPath.Type != corev1.HostPathDirectory {
		t.Errorf("runtime socket volume %+v", v.HostPath)
	}
	// The policies must be a directory mount: a subPath mount never sees
	// kubelet's ..data swap, so a ConfigMap edit would never arrive.
	if m := mount(t, c, "/etc/fairshare/policies"); m.SubPath != "" || !m.ReadOnly {
		t.Errorf("policies mount %+v: want the whole ConfigMap, read-only", m)
	}
	if v := volume(t, ds, "policies"); v.ConfigMap == nil || v.ConfigMap.Name != "fs-policies" {
		t.Errorf("policies volume %+v", v)
	}
	if ds.Spec.Template.Annotations["checksum/config"] == "" {
		t.Error("no config checksum: a new configuration would not restart the pods")
	}
	cfg, ok := o.configMaps["fs-config"]
	if !ok {
		t.Fatalf("no ConfigMap fs-config; have %v", o.configMaps)
	}
	var conf map[string]any
	if err := sigyaml.UnmarshalStrict([]byte(cfg.Data["config.yaml"]), &conf); err != nil {
		t.Fatalf("config.yaml: %v\n%s", err, cfg.Data["config.yaml"])
	}
	if got := fmt.Sprint(conf["policies_file"]); got != "/etc/fairshare/policies/policies.yaml" {
		t.Errorf("policies_file %s is not where the ConfigMap is mounted", got)
	}
	k, _ := conf["kubernetes"].(map[string]any)
	if k["runtime_endpoint"] != cri.MountPath+"/containerd.sock" || k["project_label"] != "fairshare.io/project" {
		t.Errorf("kubernetes config %v does not match the mounts", k)
	}
	// The kubernetes source is on by projects.sources, its one switch
	// (config.Load of this file is config's TestChartConfigLoads).
	if p, _ := conf["projects"].(map[string]any); fmt.Sprint(p["sources"]) != "[kubernetes registered]" {
		t.Errorf("projects %v: the kubernetes source is not on", p)
	}
	if _, ok := o.configMaps["fs-policies"]; !ok {
		t.Error("no policies ConfigMap")
	}
	if len(o.services) != 1 || o.services[0].Spec.ClusterIP != "None" || o.services[0].Spec.Ports[0].Port != 9464 {
		t.Errorf("metrics services %+v", o.services)
	}
	var env []string
	for _, e := range c.Env {
		env = append(env, e.Name+"="+e.Value)
	}
	if !slices.Contains(env, "FAIRSHARE_METRICS_LISTEN=$(NODE_IP):9464") {
		t.Errorf("metrics do not listen on the node's address: env %v", env)
	}
}

// TestChartValues: the values users set reach the manifests.
func TestChartValues(t *testing.T) {
	o := render(t, map[string]any{
		"pools":    map[string]any{"connections": map[string]any{"size": 1000, "floor": 20}},
		"policies": map[string]any{"team-a": map[string]any{"tier": "pro", "shares": 2}},
		"kubernetes": map[string]any{
			"runtimeSocket": "/run/k3s/containerd/containerd.sock", "projectLabel": "example.com/tenant",
			"systemNamespaces": []any{"kube-system", "monitoring"},
			"podCgroups":       []any{"/k8s/kubepods"},
		},
		"connections": map[string]any{"maxNetns": 100, "maxNetnsPerProject": 10},
		"metrics":     map[string]any{"port": 9100, "service": map[string]any{"enabled": false}},
		"mountBPFFS":  true,
	})
	var conf struct {
		Pools      map[string]struct{ Size, Floor int }
		Kubernetes struct {
			RuntimeEndpoint  string   `json:"runtime_endpoint"`
			ProjectLabel     string   `json:"project_label"`
			SystemNamespaces []string `json:"system_namespaces"`
			PodCgroups       []string `json:"pod_cgroups"`
		}
		Connections struct {
			MaxNetns           int `json:"max_netns"`
			MaxNetnsPerProject int `json:"max_netns_per_project"`
		}
	}
	if err := sigyaml.Unmarshal([]byte(o.configMaps["fs-config"].Data["config.yaml"]), &conf); err != nil {
		t.Fatal(err)
	}
	if p := conf.Pools["connections"]; p.Size != 1000 || p.Floor != 20 || conf.Pools["requests"].Size != 400 {
		t.Errorf("pools %+v", conf.Pools)
	}
	if k := conf.Kubernetes; k.ProjectLabel != "example.com/tenant" || !slices.Equal(k.SystemNamespaces, []string{"kube-system", "monitoring"}) || filepath.Base(k.RuntimeEndpoint) != "containerd.sock" {
		t.Errorf("kubernetes %+v", k)
	}
	if k := conf.Kubernetes; !slices.Equal(k.PodCgroups, []string{"/k8s/kubepods"}) {
		t.Errorf("pod cgroups %v", k.PodCgroups)
	}
	if c := conf.Connections; c.MaxNetns != 100 || c.MaxNetnsPerProject != 10 {
		t.Errorf("connections %+v", c)
	}
	var pol map[string]map[string]any
	if err := sigyaml.Unmarshal([]byte(o.configMaps["fs-policies"].Data["policies.yaml"]), &pol); err != nil || pol["team-a"]["tier"] != "pro" {
		t.Errorf("policies %v, %v", pol, err)
	}
	if len(o.services) != 0 {
		t.Error("metrics service rendered although disabled")
	}
	c := container(t, o.daemonSet)
	if !*c.SecurityContext.Privileged || *mount(t, c, "/sys/fs/bpf").MountPropagation != corev1.MountPropagationBidirectional {
		t.Error("mountBPFFS: want a privileged container with Bidirectional bpffs propagation")
	}
	if c.Ports[0].ContainerPort != 9100 {
		t.Errorf("metrics port %d", c.Ports[0].ContainerPort)
	}
	if v := volume(t, o.daemonSet, "cri"); v.HostPath.Path != "/run/k3s/containerd" {
		t.Errorf("runtime socket %s", v.HostPath.Path)
	}
}

// TestStaticManifests: kubernetes/fairshare.yaml is the chart rendered with
// its defaults (run with -update to rewrite it).
func TestStaticManifests(t *testing.T) {
	s, err := Render(ChartDir, staticName, staticNamespace, nil)
	if err != nil {
		t.Fatal(err)
	}
	ns := fmt.Sprintf("# fairshare for kubectl apply: the Helm chart in deploy/helm/fairshare rendered\n"+
		"# with its default values (release %q in namespace %q).\n"+
		"# Regenerate: go test ./deploy -run TestStaticManifests -update\n"+
		"---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: %s\n", staticName, staticNamespace, staticNamespace)
	want := ns + s
	if *update {
		if err := os.WriteFile(staticManifests, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(staticManifests)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != want {
		t.Fatalf("%s differs from the chart rendered with its defaults; run go test ./deploy -run TestStaticManifests -update", staticManifests)
	}
	if strings.Contains(want, "helm.sh/chart") && strings.Contains(want, "Release") {
		t.Fatal("template text left in the manifests")
	}
}

// TestChartRefusesNoProjects: values under which no pod would be in a
// project fail at install, with the daemon's reason, rather than give a
// DaemonSet whose daemons exit at start.
func TestChartRefusesNoProjects(t *testing.T) {
	_, err := Render(ChartDir, "fs", "ops", map[string]any{
		"kubernetes": map[string]any{"projectLabel": "", "namespaceProjects": false},
	})
	if err == nil || !strings.Contains(err.Error(), "no pod is in a project") {
		t.Fatalf("render: %v", err)
	}
	if _, err := Render(ChartDir, "fs", "ops", map[string]any{"kubernetes": map[string]any{"projectLabel": ""}}); err != nil {
		t.Fatalf("namespaces only: %v", err)
	}
}
