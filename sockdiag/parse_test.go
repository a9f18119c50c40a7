// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"testing"

	"golang.org/x/sys/unix"
)

// These tests feed the parser hand-built bytes laid out as the kernel's
// structures, to check offsets and the error paths a live dump rarely takes.

var ne = binary.NativeEndian

// diagMsg builds an inet_diag_msg with a cgroup id attribute (if cg != 0)
// preceded by an unrelated attribute.
func diagMsg(family uint8, state State, src, dst netip.AddrPort, cookie, cg uint64) []byte {
	b := make([]byte, sizeofInetDiagMsg)
	b[0], b[1] = family, uint8(state)
	binary.BigEndian.PutUint16(b[4:], src.Port())
	binary.BigEndian.PutUint16(b[6:], dst.Port())
	s, d := src.Addr().AsSlice(), dst.Addr().AsSlice()
	copy(b[8:], s)
	copy(b[24:], d)
	ne.PutUint32(b[44:], uint32(cookie))
	ne.PutUint32(b[48:], uint32(cookie>>32))
	ne.PutUint32(b[64:], 1000)            // uid
	ne.PutUint32(b[68:], 4242)            // inode
	b = appendAttr(b, 5, []byte{1, 2, 3}) // INET_DIAG_SHUTDOWN-like, 7 bytes, padded
	if cg != 0 {
		v := make([]byte, 8)
		ne.PutUint64(v, cg)
		b = appendAttr(b, inetDiagCgroupID, v)
	}
	return b
}

func appendAttr(b []byte, typ uint16, v []byte) []byte {
	h := make([]byte, unix.SizeofRtAttr)
	ne.PutUint16(h[0:], uint16(unix.SizeofRtAttr+len(v)))
	ne.PutUint16(h[2:], typ)
	b = append(append(b, h...), v...)
	for len(b)%unix.RTA_ALIGNTO != 0 {
		b = append(b, 0)
	}
	return b
}

func nlMsg(typ uint16, seq, pid uint32, body []byte) []byte {
	h := make([]byte, sizeofNlMsghdr)
	ne.PutUint32(h[0:], uint32(sizeofNlMsghdr+len(body)))
	ne.PutUint16(h[4:], typ)
	ne.PutUint32(h[8:], seq)
	ne.PutUint32(h[12:], pid)
	b := append(h, body...)
	for len(b)%unix.NLMSG_ALIGNTO != 0 {
		b = append(b, 0)
	}
	return b
}

func errBody(errno int32) []byte {
	b := make([]byte, 4+sizeofNlMsghdr)
	ne.PutUint32(b, uint32(errno))
	return b
}

func TestBuildRequest(t *testing.T) {
	b := buildRequest(unix.AF_INET6, StateMask(StateListen, StateEstablished), 7)
	if len(b) != 16+56 {
		t.Fatalf("request is %d bytes, want 72", len(b))
	}
	if l, typ, fl, seq := ne.Uint32(b), ne.Uint16(b[4:]), ne.Uint16(b[6:]), ne.Uint32(b[8:]); l != 72 || typ != unix.SOCK_DIAG_BY_FAMILY ||
		fl != unix.NLM_F_REQUEST|unix.NLM_F_DUMP || seq != 7 {
		t.Errorf("header len %d type %d flags %#x seq %d", l, typ, fl, seq)
	}
	r := b[16:]
	if r[0] != unix.AF_INET6 || r[1] != unix.IPPROTO_TCP || r[2] != 0 || ne.Uint32(r[4:]) != 1<<10|1<<1 {
		t.Errorf("inet_diag_req_v2 head % x", r[:8])
	}
	if ne.Uint64(r[48:]) != ^uint64(0) {
		t.Errorf("cookie % x, want INET_DIAG_NOCOOKIE", r[48:])
	}
}

func TestParseReplies(t *testing.T) {
	v4s, v4d := netip.MustParseAddrPort("10.1.2.3:80"), netip.MustParseAddrPort("10.9.8.7:54321")
	v6s, v6d := netip.MustParseAddrPort("[2001:db8::1]:443"), netip.MustParseAddrPort("[::ffff:10.0.0.1]:1")
	const seq, pid = 3, 99
	var dgram []byte
	dgram = append(dgram, nlMsg(unix.SOCK_DIAG_BY_FAMILY, seq, pid, diagMsg(unix.AF_INET, StateEstablished, v4s, v4d, 0x1_0000_0002, 77))...)
	dgram = append(dgram, nlMsg(unix.SOCK_DIAG_BY_FAMILY, seq-1, pid, diagMsg(unix.AF_INET, StateListen, v4s, v4d, 5, 5))...) // stale: dropped
	dgram = append(dgram, nlMsg(unix.SOCK_DIAG_BY_FAMILY, seq, pid, diagMsg(unix.AF_INET6, StateTimeWait, v6s, v6d, 9, 0))...)
	socks, done, err := parseReplies(nil, dgram, seq, pid)
	if err != nil || done {
		t.Fatalf("parseReplies: done %v err %v", done, err)
	}
	want := []Socket{
		{Family: unix.AF_INET, State: StateEstablished, Src: v4s, Dst: v4d, Cookie: 0x1_0000_0002, CgroupID: 77, Inode: 4242, UID: 1000},
		{Family: unix.AF_INET6, State: StateTimeWait, Src: v6s, Dst: v6d, Cookie: 9, Inode: 4242, UID: 1000},
	}
	if len(socks) != len(want) {
		t.Fatalf("parsed %d sockets, want %d: %+v", len(socks), len(want), socks)
	}
	for i := range want {
		if socks[i] != want[i] {
			t.Errorf("socket %d = %+v, want %+v", i, socks[i], want[i])
		}
	}

	socks, done, err = parseReplies(socks, nlMsg(unix.NLMSG_DONE, seq, pid, []byte{0, 0, 0, 0}), seq, pid)
	if err != nil || !done || len(socks) != 2 {
		t.Errorf("NLMSG_DONE: done %v err %v, %d sockets", done, err, len(socks))
	}
}

func TestParseErrors(t *testing.T) {
	const seq, pid = 1, 2
	good := diagMsg(unix.AF_INET, StateListen, netip.MustParseAddrPort("1.2.3.4:5"), netip.MustParseAddrPort("0.0.0.0:0"), 1, 1)
	badAttr := append([]byte(nil), good...)
	ne.PutUint16(badAttr[sizeofInetDiagMsg:], 200) // attribute longer than the message
	badFamily := append([]byte(nil), good...)
	badFamily[0] = unix.AF_UNIX
	truncated := nlMsg(unix.SOCK_DIAG_BY_FAMILY, seq, pid, good)
	ne.PutUint32(truncated, uint32(len(truncated)+8))

	for _, tc := range []struct {
		name  string
		dgram []byte
		want  error
	}{
		{"short inet_diag_msg", nlMsg(unix.SOCK_DIAG_BY_FAMILY, seq, pid, good[:40]), ErrMalformed},
		{"attribute overruns", nlMsg(unix.SOCK_DIAG_BY_FAMILY, seq, pid, badAttr), ErrMalformed},
		{"unknown family", nlMsg(unix.SOCK_DIAG_BY_FAMILY, seq, pid, badFamily), ErrMalformed},
		{"message overruns datagram", truncated, ErrMalformed},
		{"kernel error", nlMsg(unix.NLMSG_ERROR, seq, pid, errBody(-int32(unix.EINVAL))), unix.EINVAL},
		{"dump ends in error", nlMsg(unix.NLMSG_DONE, seq, pid, errBody(-int32(unix.ENOBUFS))[:4]), unix.ENOBUFS},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, err := parseReplies(nil, tc.dgram, seq, pid); !errors.Is(err, tc.want) {
				t.Errorf("err = %v, want %v", err, tc.want)
			}
		})
	}
}

func TestStateString(t *testing.T) {
	for s, want := range map[State]string{StateEstablished: "ESTABLISHED", StateListen: "LISTEN", StateTimeWait: "TIME_WAIT",
		StateBoundInactive: "BOUND_INACTIVE", 0: "STATE(0)", 200: "STATE(200)"} {
		if got := s.String(); got != want {
			t.Errorf("State(%d).String() = %q, want %q", s, got, want)
		}
	}
}

func TestCountByCgroup(t *testing.T) {
	socks := []Socket{{CgroupID: 1, State: StateListen}, {CgroupID: 1, State: StateEstablished}, {CgroupID: 2, State: StateEstablished}, {State: StateTimeWait}}
	all := CountByCgroup(socks, nil)
	if all[1] != 2 || all[2] != 1 || all[0] != 1 || len(all) != 3 {
		t.Errorf("CountByCgroup(nil) = %v", all)
	}
	est := CountByCgroup(socks, func(s Socket) bool { return s.State == StateEstablished })
	if est[1] != 1 || est[2] != 1 || len(est) != 2 {
		t.Errorf("CountByCgroup(established) = %v", est)
	}
	byP := CountByProject(all, map[uint64]string{1: "a", 2: "a"})
	if byP["a"] != 3 || byP[""] != 1 || len(byP) != 2 {
		t.Errorf("CountByProject = %v", byP)
	}
}
