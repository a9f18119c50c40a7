// SPDX-License-Identifier: Apache-2.0

package loader

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strconv"

	"github.com/cilium/ebpf/link"

	"github.com/fairshare-dev/fairshare/sockdiag"
)

// ReconcileReport says what a reconcile pass found and fixed. Maps are keyed
// by project name ("#<cgroup id>" for a project whose cgroup is gone).
type ReconcileReport struct {
	// Adopted is the number of project sockets that held no permit and now
	// do: connections older than the programs, or admitted late and refused.
	Adopted int
	// Held counts the sockets holding a permit, read from the sockets
	// themselves (iter/tcp).
	Held map[string]int
	// Kernel counts, from sock_diag, the project sockets that should hold a
	// permit: SYN_SENT, ESTABLISHED and CLOSE_WAIT, and the closing states
	// while a process still has the socket open.
	Kernel map[string]int
	// Reservations counts inbound handshakes holding a permit.
	Reservations map[string]int
	// Drift is the map's in_use minus (Held + Reservations), as seen twice in
	// a row, before repair.
	Drift map[string]int
	// Repaired is the correction applied to in_use per project.
	Repaired map[string]int
}

// sockRecordSize is sizeof(struct fs_sock_record), checked by a test.
const sockRecordSize = 32

// Reconcile compares the maps with the kernel's own socket table and repairs
// drift. It adopts project sockets that hold no permit, then, for each
// project whose in_use differs from the sockets that hold a permit plus its
// reservations in two consecutive reads, adds the difference back with the
// programs' own atomics. It sees the sockets of the caller's network
// namespace only; projects with sockets in other namespaces must not be
// repaired from here (their permits would look like drift).
func (l *Limiter) Reconcile(ctx context.Context) (ReconcileReport, error) {
	if err := l.checkOpen(); err != nil {
		return ReconcileReport{}, err
	}
	if err := ctx.Err(); err != nil {
		return ReconcileReport{}, err
	}
	return l.reconcile()
}

type pass struct {
	held    map[uint64]int
	resv    map[uint64]int
	inUse   map[uint64]int64
	adopted int
}

func (l *Limiter) readPass() (pass, error) {
	p := pass{held: map[uint64]int{}}
	before, err := l.readProjects()
	if err != nil {
		return p, err
	}
	it, err := link.AttachIter(link.IterOptions{Program: l.objs.FsDump})
	if err != nil {
		return p, fmt.Errorf("attaching the tcp iterator: %w", err)
	}
	defer it.Close()
	rd, err := it.Open()
	if err != nil {
		return p, fmt.Errorf("opening the tcp iterator: %w", err)
	}
	buf, err := io.ReadAll(rd)
	rd.Close()
	if err != nil {
		return p, fmt.Errorf("reading the tcp iterator: %w", err)
	}
	for len(buf) >= sockRecordSize {
		var r limiterFsSockRecord
		if _, err := binary.Decode(buf[:sockRecordSize], binary.NativeEndian, &r); err != nil {
			return p, fmt.Errorf("decoding a socket record: %w", err)
		}
		buf = buf[sockRecordSize:]
		if r.Held == 1 {
			p.held[r.Project]++
		}
		if r.Adopted == 1 {
			p.adopted++
		}
	}
	if p.resv, err = l.reservationsByProject(); err != nil {
		return p, err
	}
	after, err := l.readProjects()
	if err != nil {
		return p, err
	}
	// A project whose count moved while we looked is not comparable.
	was := map[uint64]int64{}
	for _, e := range before {
		was[e.id] = e.val.InUse
	}
	p.inUse = map[uint64]int64{}
	for _, e := range after {
		if v, ok := was[e.id]; ok && v == e.val.InUse {
			p.inUse[e.id] = e.val.InUse
		}
	}
	return p, nil
}

func (p pass) drift() map[uint64]int64 {
	d := map[uint64]int64{}
	for id, n := range p.inUse {
		if x := n - int64(p.held[id]+p.resv[id]); x != 0 {
			d[id] = x
		}
	}
	return d
}

func (l *Limiter) reconcile() (ReconcileReport, error) {
	names, err := l.projectNames()
	if err != nil {
		return ReconcileReport{}, err
	}
	name := func(id uint64) string {
		if n, ok := names[id]; ok {
			return n
		}
		return "#" + strconv.FormatUint(id, 10)
	}
	rep := ReconcileReport{Held: map[string]int{}, Kernel: map[string]int{}, Reservations: map[string]int{},
		Drift: map[string]int{}, Repaired: map[string]int{}}

	first, err := l.readPass()
	if err != nil {
		return rep, err
	}
	rep.Adopted = first.adopted
	d1 := first.drift()
	last := first
	if len(d1) > 0 {
		second, err := l.readPass()
		if err != nil {
			return rep, err
		}
		rep.Adopted += second.adopted
		last = second
		for id, x := range second.drift() {
			y, ok := d1[id]
			if !ok || (x > 0) != (y > 0) {
				continue // churn, not drift
			}
			fix := min(abs(x), abs(y))
			if x > 0 {
				fix = -fix
			}
			rep.Drift[name(id)] = int(x)
			if _, err := l.adjust(limiterFsAdjustArgs{Op: opAdd, Project: id, Delta: fix}); err != nil {
				return rep, fmt.Errorf("repairing project %s: %w", name(id), err)
			}
			rep.Repaired[name(id)] = int(fix)
			l.log.Warn("repaired connection count drift", "project", name(id), "cgroup_id", id, "map_minus_sockets", x, "applied", fix)
		}
	}
	for id, n := range last.held {
		rep.Held[name(id)] += n
	}
	for id, n := range last.resv {
		rep.Reservations[name(id)] += n
	}
	if rep.Adopted > 0 {
		l.log.Info("adopted connections that held no permit", "count", rep.Adopted)
	}

	socks, err := sockdiag.List(sockdiag.Options{})
	if err != nil {
		return rep, fmt.Errorf("listing kernel sockets: %w", err)
	}
	index, err := sockdiag.CgroupIndex(l.root)
	if err != nil && !errors.Is(err, context.Canceled) {
		return rep, err
	}
	for _, s := range socks {
		proj, ok := index[s.CgroupID]
		if !ok || !ShouldHold(s) {
			continue
		}
		rep.Kernel[proj]++
	}
	return rep, nil
}

// ShouldHold says whether a project socket in this state holds a permit:
// from connect (SYN_SENT) or the end of the handshake (ESTABLISHED) until the
// process closes it or the connection dies, whichever comes first. A socket
// the process has closed (no inode) while it finishes its FIN exchange holds
// none; a child still queued for accept() (no inode either) does.
func ShouldHold(s sockdiag.Socket) bool {
	switch s.State {
	case sockdiag.StateSynSent, sockdiag.StateEstablished, sockdiag.StateCloseWait:
		return true
	case sockdiag.StateFinWait1, sockdiag.StateFinWait2, sockdiag.StateLastAck, sockdiag.StateClosing:
		return s.Inode != 0
	}
	return false
}

func abs(x int64) int64 {
	if x < 0 {
		return -x
	}
	return x
}
