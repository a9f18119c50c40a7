// SPDX-License-Identifier: Apache-2.0

// Package loader loads the fairshare BPF programs, attaches them to the
// projects' cgroup v2 root, pins them under bpffs and reads their maps.
package loader
