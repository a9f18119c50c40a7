// SPDX-License-Identifier: Apache-2.0

package sockdiag

import (
	"fmt"
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

// enterNetns moves the calling goroutine, locked to its thread, into a new
// network namespace with lo up, so a benchmark counts only its own sockets.
// Cleanup returns the thread to the original namespace.
func enterNetns(b *testing.B) {
	b.Helper()
	if os.Geteuid() != 0 {
		b.Skip("needs root for a network namespace")
	}
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		b.Fatal(err)
	}
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		unix.Close(orig)
		runtime.UnlockOSThread()
		b.Fatalf("unshare netns: %v", err)
	}
	b.Cleanup(func() {
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			// Leave the thread locked: it dies with the goroutine instead
			// of serving others in the wrong namespace.
			b.Errorf("restoring netns: %v", err)
		} else {
			runtime.UnlockOSThread()
		}
		unix.Close(orig)
	})
	if err := testutil.LoopbackUp(); err != nil {
		b.Fatalf("bringing lo up: %v", err)
	}
}

// openPairs opens one listener on 127.0.0.1 and n connections to it (2n+1
// sockets), with raw syscalls so they are made on this goroutine's thread
// and so in its namespace. Cleanup closes them.
func openPairs(b *testing.B, n int) {
	b.Helper()
	var fds []int
	b.Cleanup(func() {
		for _, fd := range fds {
			unix.Close(fd)
		}
	})
	ln, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
	if err != nil {
		b.Fatal(err)
	}
	fds = append(fds, ln)
	if err := unix.Bind(ln, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		b.Fatal(err)
	}
	if err := unix.Listen(ln, 128); err != nil {
		b.Fatal(err)
	}
	sa, err := unix.Getsockname(ln)
	if err != nil {
		b.Fatal(err)
	}
	for range n {
		c, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		if err != nil {
			b.Fatal(err)
		}
		fds = append(fds, c)
		if err := unix.Connect(c, sa); err != nil {
			b.Fatalf("connect: %v", err)
		}
		a, _, err := unix.Accept4(ln, unix.SOCK_CLOEXEC)
		if err != nil {
			b.Fatalf("accept: %v", err)
		}
		fds = append(fds, a)
	}
}

// BenchmarkList measures one dump of a fresh network namespace holding
// 2*pairs+1 TCP sockets: with the default options (both families, AllStates)
// and, for the largest size, with bound-inactive sockets asked for too. The
// kernel walks its whole established hash once per family whatever the
// namespace holds (the hash is shared by all namespaces unless
// net.ipv4.tcp_child_ehash_entries is set), so the 1-socket case is the floor.
func BenchmarkList(b *testing.B) {
	for _, tc := range []struct {
		pairs  int
		states uint32
		name   string
	}{
		{0, 0, "default"},
		{500, 0, "default"},
		{5000, 0, "default"},
		{5000, AllStates | StateBoundInactive.Mask(), "bound-inactive"},
	} {
		pairs := tc.pairs
		b.Run(fmt.Sprintf("sockets=%d/%s", 2*pairs+1, tc.name), func(b *testing.B) {
			enterNetns(b)
			openPairs(b, pairs)
			var n int
			cpu0 := threadCPU(b)
			for b.Loop() {
				socks, err := List(Options{States: tc.states})
				if err != nil {
					b.Fatal(err)
				}
				n = len(socks)
			}
			if n != 2*pairs+1 {
				b.Fatalf("listed %d sockets, want %d", n, 2*pairs+1)
			}
			b.ReportMetric(float64(n), "sockets/op")
			// On a shared machine wall time mostly measures waiting for a
			// CPU; the thread's own user+system time is the cost of a dump.
			b.ReportMetric(float64(threadCPU(b)-cpu0)/float64(b.N)/1e6, "cpu-ms/op")
		})
	}
}

// threadCPU returns the user+system time of the calling thread in ns. The
// benchmark goroutine is locked to its thread (enterNetns), and List makes
// its syscalls on the caller's thread, so this counts the kernel's dump work.
func threadCPU(b *testing.B) int64 {
	b.Helper()
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_THREAD, &ru); err != nil {
		b.Fatal(err)
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}
