// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"fmt"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	chart "helm.sh/helm/v4/pkg/chart/v2"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"helm.sh/helm/v4/pkg/engine"
)

// ChartDir is the chart, relative to this package.
const ChartDir = "helm/fairshare"

// Render renders the chart in dir as release name in namespace, with values
// on top of the chart's own, and returns its manifests (NOTES.txt left out)
// as one YAML stream, in a stable order.
func Render(dir, name, namespace string, values map[string]any) (string, error) {
	return renderFor(dir, name, namespace, values, common.DefaultCapabilities)
}

// RenderFor is Render for a cluster of Kubernetes version kube ("1.29.3").
func RenderFor(dir, name, namespace, kube string, values map[string]any) (string, error) {
	kv, err := common.ParseKubeVersion(kube)
	if err != nil {
		return "", err
	}
	caps := common.DefaultCapabilities.Copy()
	caps.KubeVersion = *kv
	return renderFor(dir, name, namespace, values, caps)
}

func renderFor(dir, name, namespace string, values map[string]any, caps *common.Capabilities) (string, error) {
	ch, err := loader.Load(dir)
	if err != nil {
		return "", fmt.Errorf("loading chart %s: %w", dir, err)
	}
	return renderChart(ch, name, namespace, values, caps)
}

// renderChart is Render of a loaded chart, whose Values may have been
// replaced (as helm upgrade --reuse-values replaces them).
func renderChart(ch *chart.Chart, name, namespace string, values map[string]any, caps *common.Capabilities) (string, error) {
	dir := ch.Name()
	vals, err := util.ToRenderValues(ch, values, common.ReleaseOptions{
		Name: name, Namespace: namespace, Revision: 1, IsInstall: true,
	}, caps)
	if err != nil {
		return "", fmt.Errorf("chart values: %w", err)
	}
	files, err := engine.Render(ch, vals)
	if err != nil {
		return "", fmt.Errorf("rendering chart %s: %w", dir, err)
	}
	names := make([]string, 0, len(files))
	for n := range files {
		if strings.HasSuffix(n, ".yaml") && !strings.HasPrefix(filepath.Base(n), "_") {
			names = append(names, n)
		}
	}
	// kubectl apply creates in the stream's order: the namespace first, then
	// the quota that admits the DaemonSet's pods (created before it, they
	// would be refused until the controller's next try), as Helm orders them.
	first := map[string]int{"namespace.yaml": 1, "resourcequota.yaml": 2}
	rank := func(n string) int {
		if r, ok := first[filepath.Base(n)]; ok {
			return r
		}
		return len(first) + 1
	}
	sort.Slice(names, func(i, j int) bool {
		if ri, rj := rank(names[i]), rank(names[j]); ri != rj {
			return ri < rj
		}
		return names[i] < names[j]
	})
	var b strings.Builder
	for _, n := range names {
		for _, doc := range strings.Split(files[n], "\n---") {
			doc = strings.TrimSpace(doc)
			if doc == "" || doc == "---" {
				continue
			}
			fmt.Fprintf(&b, "---\n# Source: %s\n%s\n", strings.TrimPrefix(n, ch.Name()+"/"), strings.TrimPrefix(doc, "---\n"))
		}
	}
	return b.String(), nil
}

// helmLabels are the labels that say Helm manages an object and which
// chart made it: the manifests for kubectl apply carry neither, since no
// Helm release manages them (tools and people that select on
// app.kubernetes.io/managed-by=Helm would take them for one).
var helmLabels = regexp.MustCompile(`(?m)^[ \t]*(app\.kubernetes\.io/managed-by: Helm|helm\.sh/chart: \S+)\n`)

// KubectlManifests is a rendered chart (Render) as the manifests for
// kubectl apply: without the labels of a Helm release.
func KubectlManifests(rendered string) string {
	return helmLabels.ReplaceAllString(rendered, "")
}
