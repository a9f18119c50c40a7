// SPDX-License-Identifier: Apache-2.0

package kube

import (
	"fmt"
	"slices"
)

// DefaultProjectLabel is the usual pod label that names a pod's project,
// where the override is on (kubernetes.project_label; off by default: a
// tenant that may label its pods could split them into many projects).
const DefaultProjectLabel = "fairshare.io/project"

// DefaultSystemNamespaces are namespaces whose pods are never limited.
var DefaultSystemNamespaces = []string{"kube-system"}

// Rules decide which project a pod belongs to.
type Rules struct {
	// ProjectLabel is the pod label whose value names the project; "" turns
	// the override off.
	ProjectLabel string
	// Namespaces makes a pod without the label count for its namespace.
	// Off, only labelled pods are projects.
	Namespaces bool
	// System lists namespaces whose pods are not projects at all: probes,
	// DaemonSets and the node's own agents are never refused.
	System []string
	// Validate checks a project name (policy.ValidateProject).
	Validate func(string) error
	// Reserved are projects a label may not name (the front's exempt
	// projects: whoever may label a pod must not thereby make it exempt);
	// a pod labelled with one counts for its namespace. Its namespace may
	// still be one: that is the operator's choice.
	Reserved []string
}

// DefaultRules: the namespace is the project, kube-system is never
// limited, no label overrides the namespace.
func DefaultRules(validate func(string) error) Rules {
	return Rules{Namespaces: true, System: DefaultSystemNamespaces, Validate: validate}
}

// Project is the project p counts for, or "" if it counts for none (a
// system namespace, or no label while namespaces are not projects). A label
// that is not a valid project name is reported in err, and the pod then
// counts for its namespace as if it had no label.
func (r Rules) Project(p Pod) (project string, err error) {
	if slices.Contains(r.System, p.Namespace) {
		return "", nil
	}
	if r.ProjectLabel != "" {
		if v, ok := p.Labels[r.ProjectLabel]; ok {
			var verr error
			if slices.Contains(r.Reserved, v) {
				verr = fmt.Errorf("%q is an exempt project, which only an operator's configuration may name", v)
			} else if r.Validate != nil {
				verr = r.Validate(v)
			}
			if verr == nil {
				return v, nil
			} else {
				err = fmt.Errorf("pod %s/%s: label %s: %w", p.Namespace, p.Name, r.ProjectLabel, verr)
			}
		}
	}
	if !r.Namespaces || p.Namespace == "" {
		return "", err
	}
	if r.Validate != nil {
		if verr := r.Validate(p.Namespace); verr != nil {
			return "", fmt.Errorf("pod %s/%s: namespace: %w", p.Namespace, p.Name, verr)
		}
	}
	return p.Namespace, err
}
