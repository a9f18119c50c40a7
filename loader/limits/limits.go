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

// DefaultReservationTTL is how long a permit reserved at an inbound SYN waits
// for its handshake to finish before the loader's Tick gives it back. It
// covers a client that retransmits its final ACK once or twice; a handshake
// slower than that is admitted again when it completes.
//
// Handshakes the kernel drops (a full accept queue, a SYN cookie whose ACK
// finds no room, a client that resets) never take a permit or give it back
// at once; the TTL bounds the rest: a client that vanished without a word, a
// request socket the kernel timed out, a SYN lost to a race with the queue
// check. Such a permit is held at most the TTL plus one Tick period.
const DefaultReservationTTL = 3 * time.Second

// MinReservationTTL and MaxReservationTTL bound the reservation TTL
// (connections.reservation_ttl). Below the minimum a handshake across a
// slow network would lose its permit before it completes (and be admitted
// again at completion, possibly over its share); above the maximum a
// reservation would outlive the request socket itself, which the kernel
// keeps about a minute (tcp_synack_retries = 5: 63 s).
const (
	MinReservationTTL = 100 * time.Millisecond
	MaxReservationTTL = 2 * time.Minute
)
