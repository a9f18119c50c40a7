// SPDX-License-Identifier: Apache-2.0

// Package kube finds the pods of a Kubernetes node the way a node agent
// can without the API server: from the container runtime, over the CRI. A
// pod sandbox carries kubelet's labels (namespace, name, uid, and the pod's
// own labels) and its verbose status names the pod's cgroup and network
// namespace; that is all fairshare needs to count a pod's connections for a
// project. No Kubernetes credentials or RBAC are involved, only the
// runtime's socket.
//
// Rules decide the project: the pod's namespace by default (so a tenant's
// replicas share one project instead of each taking a share), overridden by
// the pod label fairshare.io/project; pods of system namespaces (kube-system)
// are no project and are never limited.
package kube
