// SPDX-License-Identifier: Apache-2.0

package limits

import "time"

// MaxPoolSize is the largest POOL (pools.connections.size). The held-permit
// table is sized at twice the pool (32 bytes a slot): 16 MiB at this size.
const MaxPoolSize = 262144

// ExemptCap is the most cgroups the exempt set may name
// (connections.exempt): the size of the fs_exempt map, which the loader
// creates with this many entries. The set is an operator's list of probe
// and admin cgroups; its budget, not its length, is what bounds the traffic
// it lets through.
const ExemptCap = 64

// DefaultReservationTTL is how old a permit reserved for an inbound
// handshake (taken when the kernel makes its request socket) must be before
// the loader's Tick asks the kernel whether the request socket still exists
// and, if it does not, gives the permit back.
//
// Handshakes the kernel drops before making a request socket (a segment
// that is not a SYN, a full accept queue, a SYN answered with a cookie)
// never take a permit; a request socket that still exists keeps its permit
// however old (the handshake can still complete; the kernel keeps one about
// a minute at most); the TTL bounds the rest: a client that reset its
// handshake or vanished, a request socket the kernel timed out. Such a
// permit is held at most the TTL plus one Tick period. A reservation of
// another network namespace, whose sockets the daemon cannot list, is given
// back after the TTL as it is; if its handshake completes later, the child
// is admitted again.
const DefaultReservationTTL = 3 * time.Second

// MinReservationTTL and MaxReservationTTL bound the reservation TTL
// (connections.reservation_ttl). Below the minimum the expiry would list
// the host's request sockets at nearly every Tick for handshakes that are
// only a round trip old; above the maximum a reservation of another network
// namespace would outlive its request socket, which the kernel keeps about a
// minute (tcp_synack_retries = 5: 63 s).
const (
	MinReservationTTL = 100 * time.Millisecond
	MaxReservationTTL = 2 * time.Minute
)

// DefaultMaxNetns is how many network namespaces the kernel side attaches
// inbound admission in besides the daemon's own (connections.max_netns):
// each costs a program instance (BenchmarkAttachNetns, ~30 ms to load),
// and a tenant's processes can make namespaces. MaxNetns bounds the
// setting.
const (
	DefaultMaxNetns = 4096
	MaxNetns        = 65536
)

// Destination pools (loader/dest.go): DefaultMaxDestPools is how many the
// kernel side's tables hold at once (connections.max_destination_pools 0),
// removed ones still holding permits included; MaxDestPools bounds that;
// MaxDestinations bounds the destinations of all of them together.
const (
	DefaultMaxDestPools = 16
	MaxDestPools        = 256
	MaxDestinations     = 1024
)
