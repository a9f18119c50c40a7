// SPDX-License-Identifier: Apache-2.0

// Package crtest runs a real container runtime for tests: a private
// containerd (Debian's, with runc) with its own root, state, socket and CNI
// bridge, and a busybox image built from the host's busybox-static, so that
// pods can be created through the CRI exactly as kubelet creates them, on a
// machine with no registry and no kubelet.
//
// containerd's CRI on the development machines needs restrict_oom_score_adj
// (runc cannot lower its own oom_score_adj there) and the cgroupfs driver
// (no systemd as PID 1). Pods get their own network namespace through
// Debian's containernetworking-plugins (bridge, host-local, loopback) when
// they are installed; host-network pods need nothing more.
//
// Only _test.go files import it.
package crtest
