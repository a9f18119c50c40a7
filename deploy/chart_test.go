// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	sigyaml "sigs.k8s.io/yaml"

	fsconfig "github.com/fairshare-dev/fairshare/config"
)

var update = flag.Bool("update", false, "rewrite kubernetes/fairshare.yaml from the chart")

// regenerate rewrites kubernetes/fairshare.yaml; deploy is a module of its
// own, so from the repository's root the package is named by its directory
// with -C.
const regenerate = "go test -C deploy -run TestStaticManifests . -update"

// staticValues are the values the static manifests are rendered with: the
// chart's defaults, and the namespace (kubectl apply has no --create-namespace).
var staticValues = map[string]any{"namespace": map[string]any{"create": true}}

const (
	staticManifests = "kubernetes/fairshare.yaml"
	staticName      = "fairshare"
	staticNamespace = "fairshare-system"
)

// minKube is the oldest Kubernetes the chart supports, from Chart.yaml's
// kubeVersion (">=1.28.0-0"): the static manifests are rendered for it, so
// that they hold no field an older API server would refuse.
func minKube(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ChartDir, "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var meta struct {
		KubeVersion string `json:"kubeVersion"`
	}
	if err := sigyaml.Unmarshal(b, &meta); err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`^>=\s*v?([0-9]+\.[0-9]+\.[0-9]+)(-0)?$`).FindStringSubmatch(meta.KubeVersion)
	if m == nil {
		t.Fatalf("Chart.yaml kubeVersion %q: not >=X.Y.Z, the test cannot tell the oldest version", meta.KubeVersion)
	}
	return m[1]
}

// objects is a rendered chart decoded into the Kubernetes API types.
type objects struct {
	daemonSet       *appsv1.DaemonSet
	configMaps      map[string]*corev1.ConfigMap
	services        []*corev1.Service
	namespaces      []*corev1.Namespace
	serviceMonitors []*monitoringv1.ServiceMonitor
	rules           []*monitoringv1.PrometheusRule
	quotas          []*corev1.ResourceQuota
}

var codecs = func() serializer.CodecFactory {
	s := runtime.NewScheme()
	utilruntime.Must(appsv1.AddToScheme(s))
	utilruntime.Must(corev1.AddToScheme(s))
	utilruntime.Must(monitoringv1.AddToScheme(s))
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
		case *corev1.Namespace:
			o.namespaces = append(o.namespaces, v)
		case *monitoringv1.ServiceMonitor:
			o.serviceMonitors = append(o.serviceMonitors, v)
		case *monitoringv1.PrometheusRule:
			o.rules = append(o.rules, v)
		case *corev1.ResourceQuota:
			o.quotas = append(o.quotas, v)
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
	s, err := RenderFor(ChartDir, "fs", "ops", "1.33.0", values) // a cluster of today's
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
	if k["runtime_endpoint"] != cri.MountPath+"/containerd.sock" || k["project_label"] != "" {
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
	if !slices.Contains(env, "FAIRSHARE_METRICS_LISTEN=[$(NODE_IP)]:9464") {
		t.Errorf("metrics do not listen on the node's address: env %v", env)
	}
	// kubelet puts the node's address in; the daemon takes either
	// family's (fd00::5:9464 unbracketed was refused: too many colons).
	for _, ip := range []string{"10.0.0.5", "fd00::5"} {
		dc := fsconfig.Default()
		listen := strings.ReplaceAll("[$(NODE_IP)]:9464", "$(NODE_IP)", ip)
		if err := fsconfig.Parse(strings.NewReader("metrics: {listen: '"+listen+"'}\n"), &dc); err != nil || dc.Metrics.Listen != listen {
			t.Errorf("metrics.listen %s on a node at %s: %v", listen, ip, err)
		}
	}
	if a := ds.Spec.Template.Annotations["container.apparmor.security.beta.kubernetes.io/fairshare"]; a != "" {
		t.Errorf("the AppArmor annotation on a cluster that reads appArmorProfile: %q", a)
	}
	if p := sc.AppArmorProfile; p == nil || p.Type != corev1.AppArmorProfileTypeUnconfined {
		t.Errorf("appArmorProfile %+v, want Unconfined", p)
	}
}

// TestChartPoolKeysChecked: a pool's window without its unit, an enforce
// that is no boolean, or the residents pool in dry-run would be refused by
// the daemon on every node at start (a crash loop); the chart refuses them
// at install, naming the key.
func TestChartPoolKeysChecked(t *testing.T) {
	for _, c := range []struct {
		pool map[string]any
		says string
	}{
		{map[string]any{"db": map[string]any{"size": 10, "window": 30}}, "pools.db.window"},
		{map[string]any{"db": map[string]any{"size": 10, "window": "30"}}, "pools.db.window"},
		{map[string]any{"db": map[string]any{"size": 10, "enforce": "maybe"}}, "pools.db.enforce"},
		{map[string]any{"db": map[string]any{"size": 10, "window": "30 s"}}, "pools.db.window"},
		{map[string]any{"residents": map[string]any{"size": 10, "enforce": "False"}}, "pools.residents.enforce"},
		{map[string]any{"residents": map[string]any{"size": 10, "enforce": false}}, "pools.residents.enforce"},
	} {
		if _, err := RenderFor(ChartDir, "fs", "ops", "1.33.0", map[string]any{"pools": c.pool}); err == nil || !strings.Contains(err.Error(), c.says) {
			t.Errorf("pools %v: %v, want a refusal naming %s", c.pool, err, c.says)
		}
	}
	// What the daemon takes, a boolean as --set-string passes it included;
	// an empty or zero window is the default, as before.
	for _, c := range []struct {
		window  any
		enforce any
		dry     bool
	}{{"1m30s", true, false}, {"1.5m", "false", true}, {".5s", "No", true}, {"0", "on", false}, {"", false, true}, {0, "true", false}} {
		s, err := RenderFor(ChartDir, "fs", "ops", "1.33.0", map[string]any{"pools": map[string]any{
			"db": map[string]any{"size": 10, "window": c.window, "enforce": c.enforce}}})
		if err != nil {
			t.Errorf("window %v enforce %v: %v", c.window, c.enforce, err)
			continue
		}
		dc := fsconfig.Default()
		if err := fsconfig.Parse(strings.NewReader(decode(t, s).configMaps["fs-config"].Data["config.yaml"]), &dc); err != nil {
			t.Errorf("window %v enforce %v: the daemon refuses the chart's config: %v", c.window, c.enforce, err)
		} else if dc.Pools["db"].Enforced() == c.dry {
			t.Errorf("window %v enforce %v: enforced %v", c.window, c.enforce, dc.Pools["db"].Enforced())
		}
	}
}

// TestChartOldKubernetes: before Kubernetes 1.30 the container's
// appArmorProfile is not read, and only the annotation keeps the runtime's
// default profile (which denies pinning below /sys/fs/bpf) off the daemon;
// nor is it known, so kubectl apply's strict validation (and Helm's, on
// install) refuses the field: there the chart renders the annotation alone,
// from 1.30 on the field alone.
func TestChartOldKubernetes(t *testing.T) {
	for kube, want := range map[string]string{"1.28.3": "unconfined", "v1.29.9-gke.100": "unconfined", "1.30.0": "", "1.31.2": "", "1.33.1": ""} {
		s, err := RenderFor(ChartDir, "fs", "ops", kube, nil)
		if err != nil {
			t.Fatal(err)
		}
		ds := decode(t, s).daemonSet
		if a := ds.Spec.Template.Annotations["container.apparmor.security.beta.kubernetes.io/fairshare"]; a != want {
			t.Errorf("Kubernetes %s: AppArmor annotation %q, want %q", kube, a, want)
		}
		field := container(t, ds).SecurityContext.AppArmorProfile
		if want != "" && field != nil {
			t.Errorf("Kubernetes %s: appArmorProfile %+v, a field this API server does not know", kube, field)
		}
		if want == "" && (field == nil || field.Type != corev1.AppArmorProfileTypeUnconfined) {
			t.Errorf("Kubernetes %s: appArmorProfile %+v, want Unconfined", kube, field)
		}
	}
}

// TestChartPriorityQuota: outside kube-system, a ResourceQuota scoped to the
// DaemonSet's critical priority class admits its pods where the ResourceQuota
// admission limits those classes to kube-system (GKE's default); none in
// kube-system, none when turned off, none for a priority class of another
// kind.
func TestChartPriorityQuota(t *testing.T) {
	o := render(t, nil)
	if len(o.quotas) != 1 {
		t.Fatalf("%d ResourceQuotas, want 1", len(o.quotas))
	}
	q := o.quotas[0]
	pods := q.Spec.Hard[corev1.ResourcePods]
	if q.Namespace != "ops" || pods.Value() < 100000 {
		t.Errorf("quota %s/%s pods %s: want one in the release namespace, far above any node count", q.Namespace, q.Name, pods.String())
	}
	want := []corev1.ScopedResourceSelectorRequirement{{ScopeName: corev1.ResourceQuotaScopePriorityClass,
		Operator: corev1.ScopeSelectorOpIn, Values: []string{o.daemonSet.Spec.Template.Spec.PriorityClassName}}}
	if q.Spec.ScopeSelector == nil || !reflect.DeepEqual(q.Spec.ScopeSelector.MatchExpressions, want) || len(q.Spec.Scopes) != 0 {
		t.Errorf("quota scope %+v, want %+v", q.Spec.ScopeSelector, want)
	}
	if want[0].Values[0] != "system-node-critical" {
		t.Errorf("the DaemonSet's priority class %s", want[0].Values[0])
	}
	o = render(t, map[string]any{"priorityClassName": "system-cluster-critical", "priorityClassQuota": map[string]any{"pods": "10k"}})
	if len(o.quotas) != 1 || o.quotas[0].Spec.ScopeSelector.MatchExpressions[0].Values[0] != "system-cluster-critical" ||
		o.quotas[0].Spec.Hard.Pods().String() != "10k" {
		t.Errorf("system-cluster-critical, pods 10k: quotas %+v", o.quotas)
	}
	s, err := RenderFor(ChartDir, "fs", "kube-system", "1.33.0", nil)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(decode(t, s).quotas); n != 0 {
		t.Errorf("%d ResourceQuotas in kube-system, where the critical classes need none", n)
	}
	for _, v := range []map[string]any{
		{"priorityClassQuota": map[string]any{"enabled": false}},
		{"priorityClassQuota": map[string]any{"enabled": "false"}},
		{"priorityClassName": "fairshare-high"},
		{"priorityClassName": ""},
		// A namespace shared with tenants: the quota would give each of
		// their pods the critical class.
		{"allowSharedNamespace": true},
	} {
		if n := len(render(t, v).quotas); n != 0 {
			t.Errorf("values %v: %d ResourceQuotas, want none", v, n)
		}
	}
}

// TestChartRefusesSharedNamespace: the daemon exempts its own namespace's
// pods, so a release in default (or in a namespace the policies name as a
// project) would leave that namespace's tenants unlimited: refused at render,
// naming the value that accepts it.
func TestChartRefusesSharedNamespace(t *testing.T) {
	for ns, v := range map[string]map[string]any{
		"default": nil,
		"team-a":  {"policies": map[string]any{"team-a": map[string]any{"tier": "pro"}}},
	} {
		_, err := RenderFor(ChartDir, "fs", ns, "1.33.0", v)
		if err == nil || !strings.Contains(err.Error(), "allowSharedNamespace") || !strings.Contains(err.Error(), ns) {
			t.Errorf("namespace %s: %v, want a refusal naming allowSharedNamespace", ns, err)
		}
		v = maps.Clone(v)
		if v == nil {
			v = map[string]any{}
		}
		v["allowSharedNamespace"] = true
		if _, err := RenderFor(ChartDir, "fs", ns, "1.33.0", v); err != nil {
			t.Errorf("namespace %s with allowSharedNamespace: %v", ns, err)
		}
	}
	if _, err := RenderFor(ChartDir, "fs", "default", "1.33.0", map[string]any{"allowSharedNamespace": "false"}); err == nil {
		t.Error(`namespace default with allowSharedNamespace "false" (--set-string): accepted`)
	}
	// Labelled pods only: no policy names a namespace.
	if _, err := RenderFor(ChartDir, "fs", "team-a", "1.33.0", map[string]any{
		"kubernetes": map[string]any{"projectLabel": "fairshare.io/project", "namespaceProjects": false},
		"policies":   map[string]any{"team-a": map[string]any{"tier": "pro"}}}); err != nil {
		t.Errorf("labelled projects only, a policy named like the release namespace: %v", err)
	}
}

// TestChartPoliciesRestartNothing: the policies apply live, so a change of
// them leaves the pods' template as it was (a rolling restart of every
// daemon, each with its moment unclassified, for a policy); a change of the
// daemon's configuration restarts them.
func TestChartPoliciesRestartNothing(t *testing.T) {
	sum := func(values map[string]any) string {
		return render(t, values).daemonSet.Spec.Template.Annotations["checksum/config"]
	}
	base := sum(nil)
	if base == "" {
		t.Fatal("no checksum/config annotation")
	}
	if s := sum(map[string]any{"policies": map[string]any{"team-a": map[string]any{"tier": "pro", "shares": 2}}}); s != base {
		t.Error("a policy change restarts the daemons")
	}
	if s := sum(map[string]any{"pools": map[string]any{"connections": map[string]any{"size": 1000}}}); s == base {
		t.Error("a configuration change does not restart the daemons")
	}
}

// TestChartValues: the values users set reach the manifests.
func TestChartValues(t *testing.T) {
	o := render(t, map[string]any{
		"pools": map[string]any{"connections": map[string]any{"size": 1000, "floor": 20},
			"db": map[string]any{"size": 200, "destinations": []any{"10.0.0.5/32:5432", "[2001:db8::5]/128:5432"},
				"enforce": false, "window": "30s"}},
		"policies": map[string]any{"team-a": map[string]any{"tier": "pro", "shares": 2}},
		"kubernetes": map[string]any{
			"runtimeSocket": "/run/k3s/containerd/containerd.sock", "projectLabel": "example.com/tenant",
			"systemNamespaces": []any{"kube-system", "monitoring"},
			"podCgroups":       []any{"/k8s/kubepods"},
		},
		"connections": map[string]any{"maxNetns": 100, "maxNetnsPerProject": 10, "lapseAfter": "20m"},
		"metrics":     map[string]any{"port": 9100, "service": map[string]any{"enabled": false}},
		"mountBPFFS":  true,
	})
	var conf struct {
		Pools map[string]struct {
			Size, Floor  int
			Destinations []string
		}
		Kubernetes struct {
			RuntimeEndpoint  string   `json:"runtime_endpoint"`
			ProjectLabel     string   `json:"project_label"`
			SystemNamespaces []string `json:"system_namespaces"`
			PodCgroups       []string `json:"pod_cgroups"`
		}
		Connections struct {
			MaxNetns           int    `json:"max_netns"`
			MaxNetnsPerProject int    `json:"max_netns_per_project"`
			LapseAfter         string `json:"lapse_after"`
		}
	}
	if err := sigyaml.Unmarshal([]byte(o.configMaps["fs-config"].Data["config.yaml"]), &conf); err != nil {
		t.Fatal(err)
	}
	if p := conf.Pools["connections"]; p.Size != 1000 || p.Floor != 20 || conf.Pools["requests"].Size != 400 || p.Destinations != nil {
		t.Errorf("pools %+v", conf.Pools)
	}
	if p := conf.Pools["db"]; p.Size != 200 || !slices.Equal(p.Destinations, []string{"10.0.0.5/32:5432", "[2001:db8::5]/128:5432"}) {
		t.Errorf("the destination pool %+v", p)
	}
	// The daemon takes it as written.
	dc := fsconfig.Default()
	if err := fsconfig.Parse(strings.NewReader(o.configMaps["fs-config"].Data["config.yaml"]), &dc); err != nil || !dc.Pools["db"].IsDestination() {
		t.Errorf("the daemon's reading of the chart's config: %v", err)
	}
	if db := dc.Pools["db"]; db.Enforced() || db.Window != 30*time.Second || !dc.Pools["connections"].Enforced() {
		t.Errorf("enforce and window of the destination pool (the chart dropped both): %+v", db)
	}
	if k := conf.Kubernetes; k.ProjectLabel != "example.com/tenant" || !slices.Equal(k.SystemNamespaces, []string{"kube-system", "monitoring"}) || filepath.Base(k.RuntimeEndpoint) != "containerd.sock" {
		t.Errorf("kubernetes %+v", k)
	}
	if k := conf.Kubernetes; !slices.Equal(k.PodCgroups, []string{"/k8s/kubepods"}) {
		t.Errorf("pod cgroups %v", k.PodCgroups)
	}
	if c := conf.Connections; c.MaxNetns != 100 || c.MaxNetnsPerProject != 10 || c.LapseAfter != "20m" {
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
	kube := minKube(t)
	rendered, err := RenderFor(ChartDir, staticName, staticNamespace, kube, staticValues)
	if err != nil {
		t.Fatal(err)
	}
	s := KubectlManifests(rendered)
	stamp := chartStampOf(t)
	head := fmt.Sprintf("# fairshare for kubectl apply: the Helm chart in deploy/helm/fairshare rendered\n"+
		"# with its default values and its namespace (release %q in namespace %q),\n"+
		"# for Kubernetes %s, the oldest it supports: they apply on every later one.\n"+
		"%s"+
		"# Regenerate from the repository's root: %s\n", staticName, staticNamespace, kube, stamp.line(), regenerate)
	want := head + s
	got, err := os.ReadFile(staticManifests)
	if err != nil {
		t.Fatal(err)
	}
	if *update {
		// A default changed with the chart's version and values layout
		// as they were: helm upgrade --reuse-values from the release
		// before would keep the old default, and nothing would say so.
		if old, ok := parseChartStamp(string(got)); ok && old.defaults != stamp.defaults && (old.version == stamp.version || old.layout == stamp.layout) {
			t.Fatalf("values.yaml's defaults changed since %s was written (chart %s, values layout %s), but not both the chart's version (%s) and its values layout (%s): "+
				"bump Chart.yaml's version, and valuesVersion in values.yaml with fairshare.valuesVersion in _helpers.tpl, then run %s again",
				staticManifests, old.version, old.layout, stamp.version, stamp.layout, regenerate)
		}
		if err := os.WriteFile(staticManifests, []byte(want), 0o644); err != nil {
			t.Fatal(err)
		}
		got = []byte(want)
	}
	if string(got) != want {
		t.Fatalf("%s differs from the chart rendered with its defaults; run %s", staticManifests, regenerate)
	}
	o := decode(t, s)
	if len(o.namespaces) != 1 || o.namespaces[0].Name != staticNamespace ||
		o.namespaces[0].Labels["pod-security.kubernetes.io/enforce"] != "privileged" {
		t.Errorf("the manifests' namespace %+v: want %s, labelled for the privileged Pod Security level", o.namespaces, staticNamespace)
	}
	// kubectl apply creates in the file's order: the namespace first, then
	// the quota that admits the DaemonSet's critical pods.
	if i := strings.Index(want, "kind: "); !strings.HasPrefix(want[i:], "kind: Namespace") {
		t.Error("the namespace is not the manifests' first object")
	}
	if len(o.quotas) != 1 || strings.Index(want, "kind: ResourceQuota") > strings.Index(want, "kind: DaemonSet") {
		t.Errorf("%d ResourceQuotas: want one, before the DaemonSet", len(o.quotas))
	}
	// What an API server of every supported version takes: before 1.30 the
	// container's appArmorProfile is an unknown field that kubectl apply
	// refuses; the annotation is read by all (from 1.30 on the API server
	// copies it into the field as it creates the pod).
	if a := o.daemonSet.Spec.Template.Annotations["container.apparmor.security.beta.kubernetes.io/fairshare"]; a != "unconfined" {
		t.Errorf("the manifests' AppArmor annotation %q, want unconfined", a)
	}
	if p := container(t, o.daemonSet).SecurityContext.AppArmorProfile; p != nil {
		t.Errorf("the manifests' container has appArmorProfile %+v, which Kubernetes 1.28 and 1.29 refuse", p)
	}
	// The command deploy/doc.go gives is the one this test names.
	doc, err := os.ReadFile("doc.go")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), "\t"+regenerate+"\n") {
		t.Errorf("deploy/doc.go does not give the regenerate command %q", regenerate)
	}
	if strings.Contains(want, "{{") || strings.Contains(want, ".Release") {
		t.Fatal("template text left in the manifests")
	}
	// No Helm release manages what kubectl applies: none of its labels.
	for _, l := range []string{"app.kubernetes.io/managed-by", "helm.sh/chart"} {
		if strings.Contains(s, l) {
			t.Errorf("the manifests for kubectl carry the Helm label %s", l)
		}
	}
	if !strings.Contains(rendered, "helm.sh/chart: fairshare-"+stamp.version) {
		t.Errorf("the chart (for helm) lacks its helm.sh/chart label")
	}
}

// chartStamp is what the static manifests' header says of the chart they
// were rendered from: its version, its values layout (valuesVersion) and a
// digest of its defaults.
type chartStamp struct{ version, layout, defaults string }

func (c chartStamp) line() string {
	return fmt.Sprintf("# Chart version %s, values layout %s, defaults %s.\n", c.version, c.layout, c.defaults)
}

var stampLine = regexp.MustCompile(`(?m)^# Chart version (\S+), values layout (\S+), defaults (\S+)\.$`)

func parseChartStamp(manifests string) (chartStamp, bool) {
	m := stampLine.FindStringSubmatch(manifests)
	if m == nil {
		return chartStamp{}, false
	}
	return chartStamp{m[1], m[2], m[3]}, true
}

func chartStampOf(t *testing.T) chartStamp {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(ChartDir, "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var meta struct{ Version string }
	if err := sigyaml.Unmarshal(b, &meta); err != nil || meta.Version == "" {
		t.Fatalf("Chart.yaml version: %v", err)
	}
	if b, err = os.ReadFile(filepath.Join(ChartDir, "values.yaml")); err != nil {
		t.Fatal(err)
	}
	var vals map[string]any
	if err := sigyaml.Unmarshal(b, &vals); err != nil {
		t.Fatal(err)
	}
	layout := fmt.Sprint(vals["valuesVersion"])
	delete(vals, "valuesVersion")
	canon, err := json.Marshal(vals) // map keys sorted: comments and order do not count
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(canon)
	return chartStamp{version: meta.Version, layout: layout, defaults: "sha256:" + hex.EncodeToString(sum[:8])}
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

// TestChartRefusesSurge: a rollout that surges (a node's new pod started
// beside the old) fails at install: the new pod cannot take the pin
// directory's lock the old one holds, so it never becomes ready and the
// rollout never ends. 0 is what the default is.
func TestChartRefusesSurge(t *testing.T) {
	for _, surge := range []any{1, "25%"} {
		_, err := Render(ChartDir, "fs", "ops", map[string]any{"updateStrategy": map[string]any{
			"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxSurge": surge, "maxUnavailable": 0}}})
		if err == nil || !strings.Contains(err.Error(), "maxSurge") {
			t.Errorf("maxSurge %v: %v", surge, err)
		}
	}
	for _, surge := range []any{0, "0%"} {
		if _, err := Render(ChartDir, "fs", "ops", map[string]any{"updateStrategy": map[string]any{
			"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxSurge": surge, "maxUnavailable": 1}}}); err != nil {
			t.Errorf("maxSurge %v: %v", surge, err)
		}
	}
}

// TestChartOperations: what an operator expects of an agent's DaemonSet
// (as Cilium's and Tetragon's charts give it): probes on /healthz, the
// termination message from the log, the SELinux type, the image of the
// chart's appVersion, the pins where pinDir says, and nothing of the
// Prometheus Operator or the namespace unless asked.
func TestChartOperations(t *testing.T) {
	o := render(t, nil)
	c := container(t, o.daemonSet)
	for name, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "liveness": c.LivenessProbe, "readiness": c.ReadinessProbe} {
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/healthz" || p.HTTPGet.Port.String() != "metrics" {
			t.Errorf("%s probe %+v: want GET /healthz on the metrics port", name, p)
			continue
		}
		if p.PeriodSeconds == 0 || p.FailureThreshold == 0 || p.TimeoutSeconds == 0 {
			t.Errorf("%s probe %+v: period, failure threshold and timeout unset", name, p)
		}
	}
	if p := c.StartupProbe; p != nil && time.Duration(p.PeriodSeconds*p.FailureThreshold)*time.Second < time.Minute {
		t.Errorf("the startup probe gives a first load %ds", p.PeriodSeconds*p.FailureThreshold)
	}
	if c.TerminationMessagePolicy != corev1.TerminationMessageFallbackToLogsOnError {
		t.Errorf("terminationMessagePolicy %q", c.TerminationMessagePolicy)
	}
	if se := c.SecurityContext.SELinuxOptions; se == nil || se.Type != "spc_t" || se.Level != "s0" {
		t.Errorf("seLinuxOptions %+v, want spc_t s0", se)
	}
	chart, err := os.ReadFile(filepath.Join(ChartDir, "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var meta struct {
		AppVersion string `json:"appVersion"`
	}
	if err := sigyaml.Unmarshal(chart, &meta); err != nil || meta.AppVersion == "" {
		t.Fatalf("Chart.yaml appVersion: %v", err)
	}
	if c.Image != "ghcr.io/fairshare-dev/fairshare:"+meta.AppVersion {
		t.Errorf("image %s: want the chart's appVersion %s", c.Image, meta.AppVersion)
	}
	if slices.Contains(c.Args, "--detach-on-exit") {
		t.Error("the daemon detaches on exit by default: an upgrade would leave nodes unenforced")
	}
	if conf := config(t, o); conf.PinDir != "/sys/fs/bpf/fairshare" {
		t.Errorf("pin_dir %q", conf.PinDir)
	}
	if len(o.serviceMonitors)+len(o.rules)+len(o.namespaces) != 0 {
		t.Error("a ServiceMonitor, PrometheusRule or Namespace by default")
	}

	o = render(t, map[string]any{"seLinuxOptions": nil, "image": map[string]any{"tag": "v9"}, "pinDir": "/sys/fs/bpf/fs-b",
		"probes": map[string]any{"liveness": map[string]any{"periodSeconds": 30}}})
	c = container(t, o.daemonSet)
	if c.SecurityContext.SELinuxOptions != nil || c.Image != "ghcr.io/fairshare-dev/fairshare:v9" {
		t.Errorf("seLinuxOptions %+v image %s", c.SecurityContext.SELinuxOptions, c.Image)
	}
	if c.LivenessProbe.PeriodSeconds != 30 || c.LivenessProbe.FailureThreshold != 3 {
		t.Errorf("liveness %+v: one value set, the others kept", c.LivenessProbe)
	}
	if conf := config(t, o); conf.PinDir != "/sys/fs/bpf/fs-b" {
		t.Errorf("pin_dir %q", conf.PinDir)
	}
	for _, bad := range []string{"/var/run/fairshare", "/sys/fs/bpf", "/sys/fs/bpf/", "/sys/fs/bpfx/a"} {
		if _, err := Render(ChartDir, "fs", "ops", map[string]any{"pinDir": bad}); err == nil || !strings.Contains(err.Error(), "pinDir") {
			t.Errorf("pinDir %s: %v, want a refusal naming pinDir", bad, err)
		}
	}
}

// config is the daemon's configuration the chart rendered.
func config(t *testing.T, o objects) (c struct {
	PinDir string `json:"pin_dir"`
}) {
	t.Helper()
	if err := sigyaml.Unmarshal([]byte(o.configMaps["fs-config"].Data["config.yaml"]), &c); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestChartUninstall: detachOnExit makes every daemon detach and unpin as
// its pod stops, so the uninstall after it leaves no pins; the grace period
// gives it the time.
func TestChartUninstall(t *testing.T) {
	o := render(t, map[string]any{"detachOnExit": true})
	c := container(t, o.daemonSet)
	if !slices.Contains(c.Args, "--detach-on-exit") {
		t.Errorf("args %v: detachOnExit does not reach the daemon", c.Args)
	}
	if g := o.daemonSet.Spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || *g < 10 {
		t.Errorf("termination grace %v: too short to detach", g)
	}
}

// TestChartNamespace: the namespace the chart renders carries the Pod
// Security Admission labels of the privileged level, every mode.
func TestChartNamespace(t *testing.T) {
	o := render(t, map[string]any{"namespace": map[string]any{"create": true}})
	if len(o.namespaces) != 1 || o.namespaces[0].Name != "ops" {
		t.Fatalf("namespaces %+v", o.namespaces)
	}
	for _, mode := range []string{"enforce", "audit", "warn"} {
		if v := o.namespaces[0].Labels["pod-security.kubernetes.io/"+mode]; v != "privileged" {
			t.Errorf("pod-security.kubernetes.io/%s %q, want privileged", mode, v)
		}
	}
}

// pendingMetrics are names the alerts use that another part of issue 32
// adds to the daemon; the test says so until they exist.
var pendingMetrics = map[string]string{}

// TestChartMonitoring: the ServiceMonitor scrapes the metrics Service's
// port with each target named by its node; the PrometheusRule has the five
// alerts on the daemon's metrics, and every metric their expressions name is one the daemon exports
// (and two on its scrape: a daemon down exports nothing, and one on
// kube-state-metrics: a pod that never started has no scrape target)
// (read from the daemon's sources: a renamed metric fails here).
func TestChartMonitoring(t *testing.T) {
	o := render(t, map[string]any{"metrics": map[string]any{
		"serviceMonitor": map[string]any{"enabled": true, "labels": map[string]any{"release": "prom"}},
		"prometheusRule": map[string]any{"enabled": true, "refusalsPerSecond": 5},
	}})
	if len(o.serviceMonitors) != 1 || len(o.services) != 1 {
		t.Fatalf("%d ServiceMonitors, %d Services", len(o.serviceMonitors), len(o.services))
	}
	sm, svc := o.serviceMonitors[0], o.services[0]
	if sm.Labels["release"] != "prom" {
		t.Errorf("ServiceMonitor labels %v", sm.Labels)
	}
	for k, v := range sm.Spec.Selector.MatchLabels {
		if svc.Labels[k] != v {
			t.Errorf("the ServiceMonitor selects %s=%s, the Service has %q", k, v, svc.Labels[k])
		}
	}
	if ep := sm.Spec.Endpoints; len(ep) != 1 || ep[0].Port != svc.Spec.Ports[0].Name || ep[0].Path != "/metrics" ||
		len(ep[0].RelabelConfigs) != 1 || ep[0].RelabelConfigs[0].TargetLabel != "node" {
		t.Errorf("ServiceMonitor endpoints %+v", ep)
	}
	if len(o.rules) != 1 || len(o.rules[0].Spec.Groups) != 1 {
		t.Fatalf("PrometheusRules %+v", o.rules)
	}
	known := exportedNames(t)
	alerts := map[string]string{}
	for _, r := range o.rules[0].Spec.Groups[0].Rules {
		alerts[r.Alert] = r.Expr.String()
	}
	for _, a := range []string{"FairsharePodSourceDown", "FairsharePoliciesFileRefused", "FairshareHeartbeatStale", "FairshareUnadoptedSockets", "FairshareProjectRefusals"} {
		expr, ok := alerts[a]
		if !ok {
			t.Errorf("no alert %s; have %v", a, alerts)
			continue
		}
		names := regexp.MustCompile(`fairshare_[a-z_]+`).FindAllString(expr, -1)
		if len(names) == 0 {
			t.Errorf("%s: %q names no fairshare metric", a, expr)
		}
		for _, n := range names {
			switch {
			case known[n]:
			case pendingMetrics[n] != "":
				t.Logf("%s: %s is not exported yet: %s", a, n, pendingMetrics[n])
			default:
				t.Errorf("%s: %q uses %s, which the daemon does not export", a, expr, n)
			}
		}
	}
	// A daemon that exports nothing: its scrape, by the Service's job.
	up := `up{job="fs-metrics", namespace="ops"}`
	if svc.Name != "fs-metrics" || alerts["FairshareDaemonDown"] != up+" == 0" || alerts["FairshareDaemonsAbsent"] != "absent("+up+")" {
		t.Errorf("the alerts of a daemon down (Service %s): %q, %q", svc.Name, alerts["FairshareDaemonDown"], alerts["FairshareDaemonsAbsent"])
	}
	// A node whose pod never started has no scrape target: kube-state-
	// metrics' DaemonSet series of this release's DaemonSet see it.
	ksm := `namespace="ops", daemonset="fs"`
	if want := "kube_daemonset_status_desired_number_scheduled{" + ksm + "} - kube_daemonset_status_number_ready{" + ksm + "} > 0"; alerts["FairshareDaemonSetNotReady"] != want ||
		o.daemonSet.Name != "fs" || o.daemonSet.Namespace != "ops" {
		t.Errorf("FairshareDaemonSetNotReady %q, want %q", alerts["FairshareDaemonSetNotReady"], want)
	}
	if !strings.Contains(alerts["FairshareProjectRefusals"], "> 5") {
		t.Errorf("refusalsPerSecond does not reach the alert: %s", alerts["FairshareProjectRefusals"])
	}

	// Scraped otherwise, the job is not the chart's: no alert on it
	// (absent() of a job nobody scrapes would page for ever).
	o = render(t, map[string]any{"metrics": map[string]any{"prometheusRule": map[string]any{"enabled": true}}})
	for _, r := range o.rules[0].Spec.Groups[0].Rules {
		if r.Alert == "FairshareDaemonDown" || r.Alert == "FairshareDaemonsAbsent" {
			t.Errorf("%s without the chart's ServiceMonitor: %s", r.Alert, r.Expr.String())
		}
	}

	_, err := Render(ChartDir, "fs", "ops", map[string]any{"metrics": map[string]any{
		"serviceMonitor": map[string]any{"enabled": true}, "service": map[string]any{"enabled": false}}})
	if err == nil || !strings.Contains(err.Error(), "metrics.service.enabled") {
		t.Errorf("a ServiceMonitor without the Service: %v", err)
	}
}

// exportedNames are the metric names the daemon's sources define: the
// collectors name them "fairshare_" + a quoted suffix.
func exportedNames(t *testing.T) map[string]bool {
	t.Helper()
	files, err := filepath.Glob("../*/*.go")
	if err != nil || len(files) == 0 {
		t.Fatalf("the daemon's sources: %v", err)
	}
	quoted := regexp.MustCompile(`"(?:fairshare_)?([a-z][a-z0-9_]+)"`)
	known := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") || strings.HasPrefix(f, "../deploy/") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range quoted.FindAllStringSubmatch(string(b), -1) {
			known["fairshare_"+m[1]] = true
		}
	}
	return known
}
