// SPDX-License-Identifier: Apache-2.0

// Package project holds the one rule for project names and the one way to
// print a name that may not follow it.
//
// A project name is at once a cgroup directory below the projects root, a
// header value, a metric label, a key of the policy store and a word in the
// permit protocol, so every place that takes a name from outside (the CLI,
// the admin API, the permit API, the HTTP front, the configuration) checks
// it with Validate: 1 to MaxLen bytes of ASCII letters, digits, '.', '_'
// and '-', starting with a letter or digit, and not starting with "cgroup."
// (cgroupfs's own files). Names the daemon prints for its own aggregates,
// such as "(other)" and "(forgotten)", can therefore never be a project's.
//
// Names that did not pass Validate still reach output: the kernel's pool
// counts connections per cgroup directory, and a directory may be named
// anything. Display renders any name so that it cannot break a table row or
// a terminal: printable ASCII is kept, anything else is quoted Go-style.
package project
