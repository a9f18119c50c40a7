// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"strings"
	"testing"
)

// Every value is checked when the file is loaded, and the error names the
// key (and the entry of a list): none of these was refused before, or one
// was refused under another key's name.
func TestValuesCheckedAtLoad(t *testing.T) {
	const fr = "front: {listen: '127.0.0.1:1', upstream: 'http://x', "
	tests := []struct{ in, want string }{
		{fr + "trusted_peers: [10.0.0.0/8, 10.0.0.0/33]}", `front.trusted_peers[1]: "10.0.0.0/33" is not a valid CIDR`},
		{fr + "trusted_peers: ['10.0.0.300']}", `front.trusted_peers[0]: "10.0.0.300" is not a valid address`},
		{fr + "trusted_peers: ['fe80::1::2']}", `front.trusted_peers[0]`},
		{fr + "trusted_peers: [alpha]}", `front.trusted_peers[0]: "alpha" is neither a CIDR, an address nor a cgroup path`},
		{fr + "trusted_peers: ['edge/../../x']}", `front.trusted_peers[0]`},
		{fr + "routes: {'a.example': 'bad name'}}", `front.routes["a.example"]: invalid project name`},
		{fr + "routes: {'a.example': '(other)'}}", `front.routes["a.example"]`},
		{fr + "routes: {' /x': alpha}}", `front.routes: key`},
		{fr + "exempt: {projects: [ok, 'cgroup.procs']}}", `front.exempt.projects[1]`},
		{fr + "exempt: {cgroups: ['../etc']}}", `front.exempt.cgroups[0]`},
		{fr + "exempt: {cgroups: ['a//b']}}", `front.exempt.cgroups[0]`},
		{fr + "max_in_flight: -1}", `front.max_in_flight must be >= 1, got -1`},
		{fr + "exempt_max: -2}", `front.exempt_max must be 0`},
		{"connections: {exempt: ['ok', 'a/./b']}", `connections.exempt[1]`},
		{"connections: {exempt: ['bad name/x']}", `connections.exempt[0]`},
		{"listeners: {max_conns: -1}", `listeners.max_conns`},
		{"listeners: {max_conns_per_peer: -1}", `listeners.max_conns_per_peer`},
		{"listeners: {subuid: etc/subuid}", `listeners.subuid`},
		{"permits: {max_waiting_per_uid: -2}", `permits.max_waiting_per_uid`},
		{"permits: {group: 'a b'}", `permits.group`},
		{"permits: {group: '-5'}", `permits.group`},
		{"permits: {max_waiting: -1}", `permits.max_waiting`},
		// Ports out of range and socket paths too long for sun_path were
		// found only when the daemon bound them (exit 1, directories made).
		{"metrics: {listen: '127.0.0.1:99999'}", `metrics.listen: "127.0.0.1:99999": the port must be a number from 0 to 65535`},
		{"metrics: {listen: '127.0.0.1:-1'}", `metrics.listen`},
		{"front: {listen: '[::1]:70000', upstream: 'http://x'}", `front.listen: "[::1]:70000"`},
		{"permits: {socket: /run/" + strings.Repeat("p", 110) + "}", `permits.socket is 115 bytes, longer than a unix socket path may be (107)`},
		{"admin_socket: /run/" + strings.Repeat("a", 110), `admin_socket is 115 bytes`},
	}
	for _, tt := range tests {
		c := Default()
		err := Parse(strings.NewReader(tt.in), &c)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s:\n got %v\nwant %s", tt.in, err, tt.want)
		}
	}
	// What is accepted, and what it means.
	c := Default()
	ok := fr + "trusted_peers: [10.0.0.0/8, '::1', '192.0.2.7', /sys/fs/cgroup/system.slice/edge.service, edge/proxy], " +
		"exempt: {cgroups: [ops, ops/probes]}}\nconnections: {exempt: [ops, /sys/fs/cgroup/fairshare/ops]}\npermits: {group: '1234'}"
	if err := Parse(strings.NewReader(ok), &c); err != nil {
		t.Fatal(err)
	}
}
