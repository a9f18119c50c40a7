// SPDX-License-Identifier: Apache-2.0

// Package etcdtest runs a real etcd (Debian's etcd-server, /usr/bin/etcd)
// for tests: one member on loopback ports in a temporary directory, which a
// test can stop and start again on the same data. A test that needs it
// skips when the binary is missing (CI installs etcd-server).
package etcdtest
