// SPDX-License-Identifier: Apache-2.0

package front

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sendRing is a loop's io_uring, used for two things: sending what one pass
// of the loop has for many sockets (answers to clients, requests to the
// upstream) in one system call, and reading the sockets the pass's events
// found readable, in one system call too (recv, see fastrecv.go). Each send
// is IORING_OP_SEND with
// MSG_DONTWAIT: the kernel tries it at once and answers what a non-blocking
// send(2) answers (bytes taken, or -EAGAIN, never a send left pending), so
// the ring holds no buffer past the call. Why one call: a send wakes the
// peer reading the socket, and the kernel (which preempts a task only on
// its way back to user space here) would switch to that peer after the
// first send(2) and back before the second; in one call every peer finds
// all it was sent when it runs (see Cost in doc.go).
type sendRing struct {
	fd      int
	ring    []byte // the submission and completion rings (one mapping)
	sqeMem  []byte // the submission entries
	entries uint32 // submission entries: the most sends of one call

	sqTail, sqMask *uint32
	sqArray        unsafe.Pointer
	sqes           unsafe.Pointer
	cqHead, cqTail *uint32
	cqMask         *uint32
	cqes           unsafe.Pointer
}

// io_uring's ABI (include/uapi/linux/io_uring.h).
type uringParams struct {
	sqEntries, cqEntries, flags, sqThreadCPU, sqThreadIdle, features, wqFd uint32
	resv                                                                   [3]uint32
	sqOff                                                                  struct {
		head, tail, ringMask, ringEntries, flags, dropped, array, resv1 uint32
		userAddr                                                        uint64
	}
	cqOff struct {
		head, tail, ringMask, ringEntries, overflow, cqes, flags, resv1 uint32
		userAddr                                                        uint64
	}
}

type uringSQE struct {
	opcode   uint8
	flags    uint8
	ioprio   uint16
	fd       int32
	off      uint64
	addr     uint64
	len      uint32
	msgFlags uint32
	userData uint64
	bufIndex uint16
	pers     uint16
	spliceFd int32
	addr3    uint64
	_        uint64
}

type uringCQE struct {
	userData uint64
	res      int32
	flags    uint32
}

const (
	uringOpSend         = 26         // IORING_OP_SEND
	uringOpRecv         = 27         // IORING_OP_RECV
	uringEnterGetEvents = 1          // IORING_ENTER_GETEVENTS
	uringFeatSingleMmap = 1          // IORING_FEAT_SINGLE_MMAP
	uringOffSQEs        = 0x10000000 // IORING_OFF_SQES
	uringSQESize        = 64
	uringCQESize        = 16
)

var errRingBroken = errors.New("io_uring: an operation did not complete")

// newSendRing sets up a ring of (at least) entries sends; an error means
// the kernel offers none to this process (disabled by sysctl
// kernel.io_uring_disabled, refused by a seccomp filter, or too old).
func newSendRing(entries uint32) (*sendRing, error) {
	var p uringParams
	fd, _, e := syscall.Syscall(unix.SYS_IO_URING_SETUP, uintptr(entries), uintptr(unsafe.Pointer(&p)), 0)
	if e != 0 {
		return nil, fmt.Errorf("io_uring_setup: %w", e)
	}
	r := &sendRing{fd: int(fd), entries: p.sqEntries}
	if p.features&uringFeatSingleMmap == 0 {
		unix.Close(r.fd)
		return nil, errors.New("io_uring: the kernel maps its rings apart (before 5.4)")
	}
	size := max(p.sqOff.array+p.sqEntries*4, p.cqOff.cqes+p.cqEntries*uringCQESize)
	ring, err := unix.Mmap(r.fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		unix.Close(r.fd)
		return nil, fmt.Errorf("io_uring: mapping its rings: %w", err)
	}
	sqeMem, err := unix.Mmap(r.fd, uringOffSQEs, int(p.sqEntries)*uringSQESize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		_ = unix.Munmap(ring)
		unix.Close(r.fd)
		return nil, fmt.Errorf("io_uring: mapping its entries: %w", err)
	}
	b := unsafe.Pointer(&ring[0])
	r.ring, r.sqeMem = ring, sqeMem
	r.sqTail = (*uint32)(unsafe.Add(b, p.sqOff.tail))
	r.sqMask = (*uint32)(unsafe.Add(b, p.sqOff.ringMask))
	r.sqArray = unsafe.Add(b, p.sqOff.array)
	r.cqHead = (*uint32)(unsafe.Add(b, p.cqOff.head))
	r.cqTail = (*uint32)(unsafe.Add(b, p.cqOff.tail))
	r.cqMask = (*uint32)(unsafe.Add(b, p.cqOff.ringMask))
	r.cqes = unsafe.Add(b, p.cqOff.cqes)
	r.sqes = unsafe.Pointer(&sqeMem[0])
	return r, nil
}

// sendUnknown is a send's result when the ring failed after the kernel
// took it (errRingBroken): it may have gone out, so it must not be sent
// again.
const sendUnknown = math.MinInt32

// send sends bufs[i] (not empty) to socket fds[i] for each i, at most
// entries of them, in one io_uring_enter, and sets res[i] to what send(2)
// with MSG_DONTWAIT would have returned: the bytes taken, or -errno; a send
// the kernel did not take (it stops at an entry it refuses) is -EAGAIN:
// unsent, for send(2) to try. Every send taken has completed when it
// returns, so no buffer is the kernel's after it. An error means the call
// failed: with errRingBroken, a result left sendUnknown may or may not have
// gone out, and the ring must not be used again; otherwise nothing was
// sent (res all -EAGAIN).
func (r *sendRing) send(fds []int, bufs [][]byte, res []int32) error {
	return r.submit(uringOpSend, fds, bufs, res, -int32(unix.EAGAIN))
}

// recv reads from socket fds[i] into bufs[i] (not empty) for each i, at
// most entries of them, in one io_uring_enter, and sets res[i] to what
// recv(2) with MSG_DONTWAIT would have returned: the bytes read (0 at the
// end of the stream), or -errno. A recv the kernel did not take is
// recvUntried: nothing was read, for read(2) to do. As with send, every
// recv taken has completed when it returns (MSG_DONTWAIT: the kernel
// answers -EAGAIN rather than waiting for data), so no buffer is the
// kernel's after it; with errRingBroken, a result left sendUnknown may
// have read bytes that are lost, and the ring must not be used again.
func (r *sendRing) recv(fds []int, bufs [][]byte, res []int32) error {
	return r.submit(uringOpRecv, fds, bufs, res, recvUntried)
}

// recvUntried is a recv's result when the kernel did not take it.
const recvUntried = math.MinInt32 + 1

// submit makes op (a send or a recv with MSG_DONTWAIT) on each of fds
// with bufs, as send and recv say; a result the kernel did not take is
// untried.
func (r *sendRing) submit(op uint8, fds []int, bufs [][]byte, res []int32, untried int32) error {
	n := uint32(len(fds))
	if n == 0 || n > r.entries {
		return fmt.Errorf("io_uring: %d operations in a ring of %d", n, r.entries)
	}
	tail, mask := *r.sqTail, *r.sqMask
	for i := range n {
		idx := (tail + i) & mask
		sqe := (*uringSQE)(unsafe.Add(r.sqes, uintptr(idx)*uringSQESize))
		*sqe = uringSQE{opcode: op, fd: int32(fds[i]), addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(bufs[i])))),
			len: uint32(len(bufs[i])), msgFlags: unix.MSG_DONTWAIT | unix.MSG_NOSIGNAL, userData: uint64(i)}
		*(*uint32)(unsafe.Add(r.sqArray, uintptr(idx)*4)) = idx
		res[i] = sendUnknown
	}
	atomic.StoreUint32(r.sqTail, tail+n) // the entries before the tail (a release)
	defer runtime.KeepAlive(bufs)
	var taken uint32
	for {
		got, _, e := syscall.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(n), uintptr(n), uringEnterGetEvents, 0, 0)
		if e == unix.EINTR {
			continue // nothing taken: a call that takes some returns their number
		}
		if e != 0 {
			atomic.StoreUint32(r.sqTail, tail) // nothing taken: take the entries back
			for i := range n {
				res[i] = untried
			}
			return fmt.Errorf("io_uring_enter: %w", e)
		}
		taken = uint32(got)
		break
	}
	if taken < n {
		// The kernel stopped at an entry it refused (its completion
		// says why); the rest stay unsent, taken back from the queue.
		atomic.StoreUint32(r.sqTail, tail+taken)
		for i := taken; i < n; i++ {
			res[i] = untried
		}
	}
	head, ctail, cm := *r.cqHead, atomic.LoadUint32(r.cqTail), *r.cqMask
	done := uint32(0)
	for ; head != ctail; head++ {
		cqe := (*uringCQE)(unsafe.Add(r.cqes, uintptr(head&cm)*uringCQESize))
		if cqe.userData < uint64(taken) && res[cqe.userData] == sendUnknown {
			res[cqe.userData] = cqe.res
			done++
		}
	}
	atomic.StoreUint32(r.cqHead, head)
	if done < taken {
		// A send with MSG_DONTWAIT completes before the call returns: one
		// that did not, or a completion for no send of this call, means
		// the ring is not what it seems. Not waited for (it might never
		// come), and the loop stops using the ring.
		return fmt.Errorf("%w: %d of %d operations complete", errRingBroken, done, taken)
	}
	return nil
}

func (r *sendRing) close() {
	_ = unix.Munmap(r.sqeMem)
	_ = unix.Munmap(r.ring)
	unix.Close(r.fd)
}
