// SPDX-License-Identifier: Apache-2.0

package deploy

import (
	"slices"
	"strings"
	"testing"

	sigyaml "sigs.k8s.io/yaml"
)

// TestChartFleet: the chart takes the etcd endpoints and a TLS Secret for
// fleet pools: the config names them, the Secret is mounted read-only where
// the config points, and a fleet pool without etcd fails at install.
func TestChartFleet(t *testing.T) {
	o := render(t, map[string]any{
		"pools": map[string]any{"db": map[string]any{"size": 1000, "fleet": true}},
		"fleet": map[string]any{"etcd": []any{"https://etcd-0:2379", "https://etcd-1:2379"}, "prefix": "/prod",
			"safeFraction": 0.02, "tlsSecret": "etcd-client", "leaseTTL": "8s", "period": "2s"},
	})
	var conf struct {
		Pools map[string]struct {
			Size  int
			Fleet bool
		}
		Fleet struct {
			Etcd         []string
			Prefix       string
			SafeFraction float64 `json:"safe_fraction"`
			LeaseTTL     string  `json:"lease_ttl"`
			Period       string
			TLS          struct{ CA, Cert, Key string }
		}
	}
	raw := o.configMaps["fs-config"].Data["config.yaml"]
	if err := sigyaml.Unmarshal([]byte(raw), &conf); err != nil {
		t.Fatalf("%v\n%s", err, raw)
	}
	if p := conf.Pools["db"]; p.Size != 1000 || !p.Fleet || conf.Pools["connections"].Fleet {
		t.Errorf("pools %+v", conf.Pools)
	}
	f := conf.Fleet
	if !slices.Equal(f.Etcd, []string{"https://etcd-0:2379", "https://etcd-1:2379"}) || f.Prefix != "/prod" || f.SafeFraction != 0.02 ||
		f.LeaseTTL != "8s" || f.Period != "2s" {
		t.Errorf("fleet %+v", f)
	}
	if f.TLS.CA != "/etc/fairshare/fleet-tls/ca.crt" || f.TLS.Cert != "/etc/fairshare/fleet-tls/tls.crt" || f.TLS.Key != "/etc/fairshare/fleet-tls/tls.key" {
		t.Errorf("tls %+v", f.TLS)
	}
	c := container(t, o.daemonSet)
	if m := mount(t, c, "/etc/fairshare/fleet-tls"); !m.ReadOnly {
		t.Errorf("TLS mount %+v: want read-only", m)
	}
	if v := volume(t, o.daemonSet, "fleet-tls"); v.Secret == nil || v.Secret.SecretName != "etcd-client" || *v.Secret.DefaultMode != 0o400 {
		t.Errorf("TLS volume %+v", v)
	}

	// Without leaseTTL and period the daemon's defaults apply: no key.
	if raw := render(t, map[string]any{"fleet": map[string]any{"etcd": []any{"https://etcd-0:2379"}}}).configMaps["fs-config"].Data["config.yaml"]; strings.Contains(raw, "lease_ttl") || strings.Contains(raw, "period") {
		t.Errorf("lease_ttl or period without their values:\n%s", raw)
	}
	// A duration without its unit fails at install, not on every node.
	for _, bad := range []any{5, "5", "soon"} {
		_, err := Render(ChartDir, "fs", "ops", map[string]any{"fleet": map[string]any{"etcd": []any{"https://etcd-0:2379"}, "leaseTTL": bad}})
		if err == nil || !strings.Contains(err.Error(), "fleet.leaseTTL") {
			t.Errorf("leaseTTL %v: %v", bad, err)
		}
	}
	if _, err := Render(ChartDir, "fs", "ops", map[string]any{"fleet": map[string]any{"etcd": []any{"https://etcd-0:2379"}, "period": "1.5s"}}); err != nil {
		t.Errorf("period 1.5s: %v", err)
	}
	// Defaults: no fleet section, no Secret.
	d := render(t, nil)
	if strings.Contains(d.configMaps["fs-config"].Data["config.yaml"], "fleet") {
		t.Errorf("a fleet section by default:\n%s", d.configMaps["fs-config"].Data["config.yaml"])
	}
	for _, v := range d.daemonSet.Spec.Template.Spec.Volumes {
		if v.Name == "fleet-tls" {
			t.Error("a TLS volume by default")
		}
	}
	// A fleet pool without etcd fails at install, naming the key.
	_, err := Render(ChartDir, "fs", "ops", map[string]any{"pools": map[string]any{"db": map[string]any{"size": 10, "fleet": true}}})
	if err == nil || !strings.Contains(err.Error(), "fleet.etcd") {
		t.Fatalf("render: %v", err)
	}
}
