// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"bytes"
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

func TestBuildRequest(t *testing.T) {
	r := (&diagReq{family: unix.AF_INET6, states: StateMask(StateListen, StateEstablished)}).Serialize()
	if len(r) != 56 {
		t.Fatalf("inet_diag_req_v2 is %d bytes, want 56", len(r))
	}
	if r[0] != unix.AF_INET6 || r[1] != unix.IPPROTO_TCP || r[2] != 0 || ne.Uint32(r[4:]) != 1<<10|1<<1 {
		t.Errorf("inet_diag_req_v2 head % x", r[:8])
	}
	if ne.Uint64(r[48:]) != ^uint64(0) {
		t.Errorf("cookie % x, want INET_DIAG_NOCOOKIE", r[48:])
	}
	if !bytes.Equal(r[8:48], make([]byte, 40)) {
		t.Errorf("dump request carries a socket id: % x", r[8:48])
	}

	src, dst := netip.MustParseAddrPort("10.1.2.3:80"), netip.MustParseAddrPort("10.9.8.7:54321")
	r = (&diagReq{family: unix.AF_INET, states: AllStates, src: src, dst: dst}).Serialize()
	if binary.BigEndian.Uint16(r[8:]) != 80 || binary.BigEndian.Uint16(r[10:]) != 54321 ||
		!bytes.Equal(r[12:16], []byte{10, 1, 2, 3}) || !bytes.Equal(r[28:32], []byte{10, 9, 8, 7}) {
		t.Errorf("lookup socket id % x", r[8:48])
	}
}

func TestParseMsg(t *testing.T) {
	v4s, v4d := netip.MustParseAddrPort("10.1.2.3:80"), netip.MustParseAddrPort("10.9.8.7:54321")
	v6s, v6d := netip.MustParseAddrPort("[2001:db8::1]:443"), netip.MustParseAddrPort("[::ffff:10.0.0.1]:1")
	for _, tc := range []struct {
		msg  []byte
		want Socket
	}{
		{diagMsg(unix.AF_INET, StateEstablished, v4s, v4d, 0x1_0000_0002, 77),
			Socket{Family: unix.AF_INET, State: StateEstablished, Src: v4s, Dst: v4d, Cookie: 0x1_0000_0002, CgroupID: 77, Inode: 4242, UID: 1000}},
		{diagMsg(unix.AF_INET6, StateTimeWait, v6s, v6d, 9, 0),
			Socket{Family: unix.AF_INET6, State: StateTimeWait, Src: v6s, Dst: v6d, Cookie: 9, Inode: 4242, UID: 1000}},
	} {
		s, err := parseMsg(tc.msg)
		if err != nil || s != tc.want {
			t.Errorf("parseMsg = %+v, %v; want %+v", s, err, tc.want)
		}
	}
}

func TestParseErrors(t *testing.T) {
	good := diagMsg(unix.AF_INET, StateListen, netip.MustParseAddrPort("1.2.3.4:5"), netip.MustParseAddrPort("0.0.0.0:0"), 1, 1)
	badAttr := append([]byte(nil), good...)
	ne.PutUint16(badAttr[sizeofInetDiagMsg:], 200) // attribute longer than the message
	badFamily := append([]byte(nil), good...)
	badFamily[0] = unix.AF_UNIX
	for _, tc := range []struct {
		name string
		msg  []byte
	}{
		{"short inet_diag_msg", good[:40]},
		{"attribute overruns", badAttr},
		{"unknown family", badFamily},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := parseMsg(tc.msg); !errors.Is(err, ErrMalformed) {
				t.Errorf("err = %v, want %v", err, ErrMalformed)
			}
		})
	}
	// An unpadded last attribute is read, not run off.
	unpadded := appendAttr(diagMsg(unix.AF_INET, StateListen, netip.MustParseAddrPort("1.2.3.4:5"), netip.MustParseAddrPort("0.0.0.0:0"), 1, 3), 9, []byte{1})
	if s, err := parseMsg(unpadded[:len(unpadded)-3]); err != nil || s.CgroupID != 3 {
		t.Errorf("unpadded end: %+v, %v", s, err)
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
