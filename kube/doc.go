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
// replicas share one project instead of each taking a share), overridden,
// where Rules.ProjectLabel is set (off in DefaultRules: whoever creates a pod
// labels it), by a pod label such as fairshare.io/project; pods of system
// namespaces (kube-system) are no project and are never limited.
//
// Source is the daemon's kubernetes source of members (projects.sources):
// a membership.Polled that lists the pods each tick, and at once on each of
// the runtime's container events where it may follow them (containerd 2.0
// and later: a new pod is read as its sandbox starts, before its first
// container; containerd 1.6 has no events, and containerd 1.7 and CRI-O give
// each event to one reader only, which may be kubelet's: there, the polls
// alone), makes each pod's cgroup a member of its project, gives
// the network namespaces of pods not on the host's network to the daemon for
// inbound admission, reports a runtime that does not answer with one error
// per cause, and keeps its last good poll in a file so that a daemon
// restarted while the runtime is away starts from the pods it last saw.
//
// The runtime's account of a pod is checked, not trusted: its cgroup must
// be kubelet's for the pod's uid below the pods' cgroups (CheckPodCgroup),
// and, when the runtime gives the sandbox's pid, that process must be in
// the cgroup or below it (read through a pidfd, once per sandbox and pid),
// so a runtime lying consistently about a pod's uid and cgroup still cannot
// place the pod in another pod's cgroup.
package kube
