// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	chartv2 "helm.sh/helm/v4/pkg/chart/v2"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
)

// TestChartRefusesReusedValues: helm upgrade --reuse-values renders the new
// chart with the old chart's defaults (its values.yaml, coalesced with the
// release's own values) in place of the new chart's: keys added since are
// missing (a nil pointer at .Values.probes.startup), and a default fixed
// since (the nodeSelector's architecture, maxUnavailable) is silently the
// old one. The chart refuses such values with what to run instead;
// --reset-then-reuse-values and -f of 'helm get values' (the new defaults
// under the release's own values) render. The upgrades are Helm's own code
// (pkg/action's Upgrade.reuseValues), step by step.
func TestChartRefusesReusedValues(t *testing.T) {
	load := func() *chartv2.Chart {
		ch, err := loader.Load(ChartDir)
		if err != nil {
			t.Fatal(err)
		}
		return ch
	}
	// The chart before: no valuesVersion, no probes, no affinity, the
	// old nodeSelector and maxUnavailable.
	old := load()
	delete(old.Values, "valuesVersion")
	delete(old.Values, "probes")
	delete(old.Values, "affinity")
	old.Values["nodeSelector"] = map[string]any{"kubernetes.io/os": "linux"}
	old.Values["updateStrategy"] = map[string]any{"type": "RollingUpdate", "rollingUpdate": map[string]any{"maxUnavailable": 1}}
	// The release's own values (helm get values), and the upgrade's.
	release := func() map[string]any {
		return map[string]any{"image": map[string]any{"tag": "v1"}, "policies": map[string]any{"team-a": map[string]any{"tier": "pro"}}}
	}
	upgrade := func() map[string]any { return map[string]any{"detachOnExit": true} }
	caps := common.DefaultCapabilities

	// --reuse-values.
	oldVals, err := util.CoalesceValues(old, release())
	if err != nil {
		t.Fatal(err)
	}
	ch := load()
	ch.Values = oldVals
	_, err = renderChart(ch, "fs", "ops", util.CoalesceTables(upgrade(), release()), caps)
	if err == nil || !strings.Contains(err.Error(), "--reset-then-reuse-values") || !strings.Contains(err.Error(), "helm get values") {
		t.Errorf("--reuse-values from the chart before: %v, want a refusal naming --reset-then-reuse-values and helm get values", err)
	}

	// A values file copied from another chart's values.yaml, with its
	// valuesVersion.
	_, err = Render(ChartDir, "fs", "ops", map[string]any{"valuesVersion": 1})
	if err == nil || !strings.Contains(err.Error(), "valuesVersion 1") {
		t.Errorf("valuesVersion 1: %v", err)
	}

	// --reset-then-reuse-values, and -f of helm get values with the
	// change: the new chart's defaults.
	for name, vals := range map[string]map[string]any{
		"--reset-then-reuse-values": util.CoalesceTables(upgrade(), release()),
		"-f values":                 util.CoalesceTables(release(), upgrade()),
	} {
		s, err := renderChart(load(), "fs", "ops", vals, caps)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		ds := decode(t, s).daemonSet
		c := container(t, ds)
		if ds.Spec.Template.Spec.NodeSelector["kubernetes.io/arch"] != "amd64" || c.StartupProbe == nil || c.Image != "ghcr.io/fairshare-dev/fairshare:v1" {
			t.Errorf("%s: nodeSelector %v startup probe %v image %s: want the new defaults under the release's values",
				name, ds.Spec.Template.Spec.NodeSelector, c.StartupProbe, c.Image)
		}
	}
}

// fence is a fenced code block of a Markdown page.
var fence = regexp.MustCompile("(?s)```[a-z]*\n(.*?)```")

// TestChartDocsCommands: the commands the chart's documentation and its
// NOTES.txt give an operator are ones that work. No helm upgrade
// --reuse-values (the chart refuses the old chart's values it renders
// with, and it merges policies: a project removed keeps its policy); no
// kubectl exec ds/NAME, which runs in whichever pod kubectl picks (a
// policy set there changes that one node), but the pod of a node named;
// and namespace.create is for the static manifests only (helm install
// cannot use it).
func TestChartDocsCommands(t *testing.T) {
	reuse := regexp.MustCompile(`helm upgrade[^\n]*?\s--reuse-values\b`)
	notes := renderNotes(t, "ops", nil)
	texts := map[string]string{"NOTES.txt": notes}
	for _, page := range []string{"../docs/kubernetes.md", "../docs/install.md"} {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		var code []string
		for _, m := range fence.FindAllStringSubmatch(string(b), -1) {
			code = append(code, m[1])
		}
		// Inline commands too: `helm upgrade ...`.
		for _, m := range regexp.MustCompile("`((?:helm|kubectl) [^`]+)`").FindAllStringSubmatch(string(b), -1) {
			code = append(code, m[1])
		}
		texts[page] = strings.Join(code, "\n")
	}
	b, err := os.ReadFile(ChartDir + "/values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	texts["values.yaml"] = string(b)
	for name, text := range texts {
		if m := reuse.FindString(text); m != "" {
			t.Errorf("%s gives helm upgrade --reuse-values", name)
		}
		if strings.Contains(text, "exec ds/") {
			t.Errorf("%s gives kubectl exec ds/...: one pod of kubectl's choosing, not a node's", name)
		}
	}
	if !strings.Contains(notes, "--field-selector spec.nodeName=NODE") {
		t.Errorf("NOTES.txt names no node's pod:\n%s", notes)
	}
	k, err := os.ReadFile("../docs/kubernetes.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(k), "\n") {
		if strings.HasPrefix(line, "| `namespace.create`") && !strings.Contains(line, "static manifests only") {
			t.Errorf("docs/kubernetes.md offers namespace.create as a value for helm install: %s", line)
		}
	}
	if !strings.Contains(string(k), "--field-selector spec.nodeName=") {
		t.Error("docs/kubernetes.md names no node's pod for kubectl exec")
	}
}
