// SPDX-License-Identifier: Apache-2.0

package sockdiag

import "strconv"

// State is a TCP state as the kernel numbers it (include/net/tcp_states.h).
type State uint8

// TCP states. StateNewSynRecv is never reported (the kernel reports request
// sockets as StateSynRecv). StateBoundInactive is a request bit only
// (Linux 6.7+): it asks for sockets that are bound to a port but neither
// listening nor connected, which the kernel then reports as StateClose.
const (
	StateEstablished   State = 1
	StateSynSent       State = 2
	StateSynRecv       State = 3
	StateFinWait1      State = 4
	StateFinWait2      State = 5
	StateTimeWait      State = 6
	StateClose         State = 7
	StateCloseWait     State = 8
	StateLastAck       State = 9
	StateListen        State = 10
	StateClosing       State = 11
	StateNewSynRecv    State = 12
	StateBoundInactive State = 13
)

// AllStates is the mask of every state a socket with a connection or a
// listener can be in; it is what a zero Options.States means. It leaves out
// StateBoundInactive, as ss -a does: those sockets hold no connection, and
// asking for them makes the kernel walk its whole bind hash as well, which
// added about 30% to the CPU cost of a 10k-socket dump here (BenchmarkList).
const AllStates = 1<<(StateNewSynRecv+1) - 2

// String returns the kernel's name of the state, or "STATE(n)" for a number
// this package does not know.
func (s State) String() string {
	switch s {
	case StateEstablished:
		return "ESTABLISHED"
	case StateSynSent:
		return "SYN_SENT"
	case StateSynRecv:
		return "SYN_RECV"
	case StateFinWait1:
		return "FIN_WAIT1"
	case StateFinWait2:
		return "FIN_WAIT2"
	case StateTimeWait:
		return "TIME_WAIT"
	case StateClose:
		return "CLOSE"
	case StateCloseWait:
		return "CLOSE_WAIT"
	case StateLastAck:
		return "LAST_ACK"
	case StateListen:
		return "LISTEN"
	case StateClosing:
		return "CLOSING"
	case StateNewSynRecv:
		return "NEW_SYN_RECV"
	case StateBoundInactive:
		return "BOUND_INACTIVE"
	}
	return "STATE(" + strconv.Itoa(int(s)) + ")"
}

// Mask returns the bit of s in an Options.States mask.
func (s State) Mask() uint32 { return 1 << s }

// StateMask returns the mask selecting exactly the given states.
func StateMask(states ...State) uint32 {
	var m uint32
	for _, s := range states {
		m |= s.Mask()
	}
	return m
}
