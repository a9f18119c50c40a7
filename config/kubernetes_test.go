// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/fairshare-dev/fairshare/kube"
	"go.yaml.in/yaml/v3"
)

func TestKubernetesDefaults(t *testing.T) {
	k := Default().Kubernetes
	if k.RuntimeEndpoint != kube.DefaultEndpoint || k.ProjectLabel != kube.DefaultRules(nil).ProjectLabel || !k.NamespaceProjects ||
		!slices.Equal(k.SystemNamespaces, kube.DefaultSystemNamespaces) || !slices.Equal(k.PodCgroups, kube.DefaultPodCgroups) {
		t.Errorf("kubernetes defaults %+v disagree with package kube", k)
	}
	c := Default()
	if err := Parse(strings.NewReader("projects: {sources: [kubernetes]}\nkubernetes: {runtime_endpoint: 'unix:///run/k3s/containerd/containerd.sock', system_namespaces: []}\n"), &c); err != nil {
		t.Fatal(err)
	}
	if c.Kubernetes.Endpoint() != "/run/k3s/containerd/containerd.sock" || len(c.Kubernetes.SystemNamespaces) != 0 ||
		c.Kubernetes.ProjectLabel != "" {
		t.Errorf("overlay: %+v", c.Kubernetes)
	}
}

// TestKubernetesRejects: each bad value is refused naming its key.
func TestKubernetesRejects(t *testing.T) {
	for in, want := range map[string]string{
		"kubernetes: {runtime_endpoint: ''}":                                                            "kubernetes.runtime_endpoint must be",
		"kubernetes: {runtime_endpoint: run/containerd.sock}":                                           "kubernetes.runtime_endpoint must be",
		"kubernetes: {runtime_endpoint: 'tcp://10.0.0.1:1234'}":                                         "kubernetes.runtime_endpoint must be",
		"kubernetes: {runtime_endpoint: /" + strings.Repeat("a", 110) + "}":                             "kubernetes.runtime_endpoint is 111 bytes",
		"kubernetes: {project_label: 'fairshare.io/'}":                                                  "kubernetes.project_label is not a label key",
		"kubernetes: {project_label: 'Example.com/x'}":                                                  "kubernetes.project_label is not a label key",
		"kubernetes: {project_label: '-x'}":                                                             "kubernetes.project_label is not a label key",
		"kubernetes: {system_namespaces: [kube-system, Kube]}":                                          "kubernetes.system_namespaces[1]",
		"kubernetes: {system_namespaces: [a, a]}":                                                       "kubernetes.system_namespaces names a twice",
		"kubernetes: {pod_cgroups: []}":                                                                 "kubernetes.pod_cgroups is empty",
		"kubernetes: {pod_cgroups: [/]}":                                                                "kubernetes.pod_cgroups[0]",
		"kubernetes: {pod_cgroups: [/kubepods, kubepods.slice]}":                                        "kubernetes.pod_cgroups[1]",
		"kubernetes: {pod_cgroups: [/kubelet/../kubepods]}":                                             "kubernetes.pod_cgroups[0]",
		"kubernetes: {pod_cgroups: [/kubepods/]}":                                                       "kubernetes.pod_cgroups[0]",
		"kubernetes: {enabled: true}":                                                                   "field enabled not found",
		"projects: {sources: [kubernetes]}\nkubernetes: {project_label: '', namespace_projects: false}": "no pod is in a project",
	} {
		c := Default()
		err := Parse(strings.NewReader(in+"\n"), &c)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want %q", in, err, want)
		}
	}
	// Without the source, a section that selects no pod is no error.
	c := Default()
	if err := Parse(strings.NewReader("kubernetes: {project_label: '', namespace_projects: false}\n"), &c); err != nil {
		t.Errorf("without the kubernetes source: %v", err)
	}
	for _, ok := range []string{"tenant", "example.com/tenant", "a.b-c.d/x_y.z-9"} {
		if err := checkLabelKey(ok); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
}

// TestChartConfigLoads: the configuration the Helm chart renders (at its
// defaults: deploy/kubernetes/fairshare.yaml, which the deploy module's
// TestStaticManifests keeps equal to the chart's output) is one the daemon
// loads, with the kubernetes source on and the chart's values in force.
func TestChartConfigLoads(t *testing.T) {
	raw, err := os.ReadFile("../deploy/kubernetes/fairshare.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var conf string
	for _, doc := range strings.Split(string(raw), "\n---\n") {
		var cm struct {
			Kind     string
			Metadata struct{ Name string }
			Data     map[string]string
		}
		if err := yaml.Unmarshal([]byte(doc), &cm); err != nil {
			t.Fatal(err)
		}
		if cm.Kind == "ConfigMap" && cm.Data["config.yaml"] != "" {
			conf = cm.Data["config.yaml"]
		}
	}
	if conf == "" {
		t.Fatal("no ConfigMap with config.yaml in the manifests")
	}
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := Load(path)
	if err != nil {
		t.Fatalf("the chart's config does not load: %v\n%s", err, conf)
	}
	if !slices.Equal(c.Projects.Sources, []string{"kubernetes", "registered"}) || c.Kubernetes.Endpoint() != "/run/fairshare-cri/containerd.sock" ||
		c.PoliciesFile == "" || c.Pools[PoolConnections].Size != 4096 {
		t.Errorf("the chart's config loaded as %+v %+v", c.Projects, c.Kubernetes)
	}
}
