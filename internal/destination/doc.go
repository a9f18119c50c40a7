// SPDX-License-Identifier: Apache-2.0

// Package destination parses and checks the destinations of a destination
// pool (pools.<name>.destinations in the configuration): a CIDR with an
// optional port, IPv4 or IPv6. An IPv4 destination and its v4-mapped IPv6
// form are the same destination, as the kernel side keeps them
// (bpf/lib/dest.h).
//
// An IPv6 prefix that covers the v4-mapped range (::ffff:0:0/96), such as
// [::]/0, covers IPv4 as well.
//
// A connection matches at most one pool: a destination that names the port
// wins over one of every port, and among those the longest prefix. Two
// pools may nest (10.0.0.0/8 in one, 10.0.0.5/32 in another); they may not
// list the same prefix and port, which Check refuses naming both.
package destination
