// SPDX-License-Identifier: Apache-2.0

package front

import (
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// sendRing is a loop's io_uring, used for one thing: sending what one pass
// of the loop has for many sockets (answers to clients, requests to the
// upstream) in one system call. Each send is IORING_OP_SEND with
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
	uringEnterGetEvents = 1          // IORING_ENTER_GETEVENTS
	uringFeatSingleMmap = 1          // IORING_FEAT_SINGLE_MMAP
	uringOffSQEs        = 0x10000000 // IORING_OFF_SQES
	uringSQESize        = 64
	uringCQESize        = 16
)

var errRingBroken = errors.New("io_uring: a send did not complete")

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

// send sends bufs[i] (not empty) to socket fds[i] for each i, at most
// entries of them, in one io_uring_enter, and sets res[i] to what send(2)
// with MSG_DONTWAIT would have returned: the bytes taken, or -errno. Every
// send has completed when it returns, so no buffer is the kernel's after
// it. An error (the call itself failed) leaves res unset: the caller sends
// with send(2) instead.
func (r *sendRing) send(fds []int, bufs [][]byte, res []int32) error {
	n := uint32(len(fds))
	if n == 0 || n > r.entries {
		return fmt.Errorf("io_uring: %d sends in a ring of %d", n, r.entries)
	}
	tail, mask := *r.sqTail, *r.sqMask
	for i := range n {
		idx := (tail + i) & mask
		sqe := (*uringSQE)(unsafe.Add(r.sqes, uintptr(idx)*uringSQESize))
		*sqe = uringSQE{opcode: uringOpSend, fd: int32(fds[i]), addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(bufs[i])))),
			len: uint32(len(bufs[i])), msgFlags: unix.MSG_DONTWAIT | unix.MSG_NOSIGNAL, userData: uint64(i)}
		*(*uint32)(unsafe.Add(r.sqArray, uintptr(idx)*4)) = idx
	}
	atomic.StoreUint32(r.sqTail, tail+n) // the entries before the tail (a release)
	submit, done := n, uint32(0)
	for done < n {
		got, _, e := syscall.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(r.fd), uintptr(submit), uintptr(n-done), uringEnterGetEvents, 0, 0)
		switch {
		case e == unix.EINTR:
		case e != 0:
			if submit > 0 {
				// Nothing was taken: take the entries back.
				atomic.StoreUint32(r.sqTail, tail)
				return fmt.Errorf("io_uring_enter: %w", e)
			}
			// Taken but not all reaped: the buffers may still be read.
			// Never so with MSG_DONTWAIT; the loop stops using the ring.
			return fmt.Errorf("%w: io_uring_enter: %w", errRingBroken, e)
		default:
			if submit > 0 && uint32(got) != submit {
				return fmt.Errorf("%w: %d of %d sends taken", errRingBroken, got, submit)
			}
			submit = 0
		}
		head, ctail, cm := *r.cqHead, atomic.LoadUint32(r.cqTail), *r.cqMask
		for ; head != ctail; head++ {
			cqe := (*uringCQE)(unsafe.Add(r.cqes, uintptr(head&cm)*uringCQESize))
			if cqe.userData < uint64(n) {
				res[cqe.userData] = cqe.res
				done++
			}
		}
		atomic.StoreUint32(r.cqHead, head)
	}
	runtime.KeepAlive(bufs)
	return nil
}

func (r *sendRing) close() {
	_ = unix.Munmap(r.sqeMem)
	_ = unix.Munmap(r.ring)
	unix.Close(r.fd)
}
