// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"fmt"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// Kubernetes configures the kubernetes source of projects.sources: the pods
// of the node's container runtime, found over the CRI (package kube). The
// source is on when projects.sources names it; this section only says how
// it reads the runtime and which project a pod counts for.
type Kubernetes struct {
	// RuntimeEndpoint is the runtime's CRI socket: a path, or unix://path.
	RuntimeEndpoint string `yaml:"runtime_endpoint"`
	// ProjectLabel is the pod label whose value names the pod's project;
	// "" turns the override off.
	ProjectLabel string `yaml:"project_label"`
	// NamespaceProjects makes a pod without the label count for its
	// namespace; off, only labelled pods are in projects.
	NamespaceProjects bool `yaml:"namespace_projects"`
	// SystemNamespaces are namespaces whose pods are in no project and are
	// never limited (probes, DaemonSets, the node's own agents).
	SystemNamespaces []string `yaml:"system_namespaces"`
	// PodCgroups are the cgroups kubelet places the pods below (paths below
	// the cgroup2 mount); a pod whose cgroup, as the runtime reports it, is
	// not strictly below one of them is in no project.
	PodCgroups []string `yaml:"pod_cgroups"`
}

// Endpoint is the runtime's socket path (runtime_endpoint without unix://).
func (k *Kubernetes) Endpoint() string { return strings.TrimPrefix(k.RuntimeEndpoint, "unix://") }

// A Kubernetes namespace is a DNS-1123 label; a label key is an optional
// DNS-1123 subdomain prefix and "/", then a name of at most 63 characters.
var (
	dnsLabel     = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`)
	dnsSubdomain = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
	labelName    = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$`)
)

// checkLabelKey checks a Kubernetes label key (the rule of
// k8s.io/apimachinery's IsQualifiedName).
func checkLabelKey(k string) error {
	prefix, name, ok := strings.Cut(k, "/")
	if !ok {
		name, prefix = prefix, ""
	} else if prefix == "" || len(prefix) > 253 || !dnsSubdomain.MatchString(prefix) {
		return fmt.Errorf("%q: the prefix before / must be a DNS subdomain (lowercase letters, digits, - and .) of at most 253 characters", k)
	}
	if len(name) == 0 || len(name) > 63 || !labelName.MatchString(name) {
		return fmt.Errorf("%q: the name must be 1 to 63 characters of letters, digits, -, _ and ., beginning and ending with a letter or digit", k)
	}
	return nil
}

func (k *Kubernetes) validate(on bool) error {
	ep := k.Endpoint()
	if !filepath.IsAbs(ep) || strings.Contains(k.RuntimeEndpoint, "://") && !strings.HasPrefix(k.RuntimeEndpoint, "unix://") {
		return fmt.Errorf("kubernetes.runtime_endpoint must be the runtime's socket, an absolute path or unix:///path, got %q", k.RuntimeEndpoint)
	}
	if len(ep) > MaxSocketPath {
		return fmt.Errorf("kubernetes.runtime_endpoint is %d bytes, longer than a unix socket path may be (%d)", len(ep), MaxSocketPath)
	}
	if k.ProjectLabel != "" {
		if err := checkLabelKey(k.ProjectLabel); err != nil {
			return fmt.Errorf("kubernetes.project_label is not a label key: %v", err)
		}
	}
	for i, ns := range k.SystemNamespaces {
		if len(ns) > 63 || !dnsLabel.MatchString(ns) {
			return fmt.Errorf("kubernetes.system_namespaces[%d]: %q is not a namespace name (1 to 63 lowercase letters, digits and -)", i, ns)
		}
		if slices.Contains(k.SystemNamespaces[:i], ns) {
			return fmt.Errorf("kubernetes.system_namespaces names %s twice", ns)
		}
	}
	if len(k.PodCgroups) == 0 {
		return errors.New("kubernetes.pod_cgroups is empty: name the cgroups kubelet places the pods below (default [/kubepods, /kubepods.slice])")
	}
	for i, cg := range k.PodCgroups {
		if !strings.HasPrefix(cg, "/") || path.Clean(cg) != cg || cg == "/" {
			return fmt.Errorf("kubernetes.pod_cgroups[%d]: %q is not a clean absolute path below the cgroup2 root (as /proc/<pid>/cgroup shows one: /kubepods)", i, cg)
		}
	}
	if on && k.ProjectLabel == "" && !k.NamespaceProjects {
		return errors.New("kubernetes: with project_label empty and namespace_projects false no pod is in a project; set one of them")
	}
	return nil
}
