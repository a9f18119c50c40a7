// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestFastPathRingReads: with the loop's reads made by its ring (recvAll),
// many clients at once (so that a pass reads many sockets, each into a
// small share of the arena: requests and answers larger than their share
// go on with read(2)) each get their own answers, byte for byte, over
// keep-alive connections, with requests of random sizes (bodies up to
// 40 KiB), some pipelined two in one write, and answers of random sizes (up
// to 96 KiB) that the upstream sends in pieces at random, and bursts of
// small requests pipelined in one write. The ring read
// (unless FAIRSHARE_FRONT_PLAIN_SENDS=1, which makes no read with it).
func TestFastPathRingReads(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	// A small arena: a pass's reads each have a few hundred bytes, and
	// the rest of a request or an answer is read by read(2).
	r := fastRig(t, rigOpts{poolSize: 64, tweak: func(f *Front) { f.fastRecvArena = 1 << 10 }}, func(w http.ResponseWriter, req *http.Request) {
		body, err := io.ReadAll(req.Body)
		if err != nil {
			return
		}
		n, _ := strconv.Atoi(req.URL.Query().Get("n"))
		ans := ringAnswer(req.URL.Path, body, n)
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(len(ans)))
		// In pieces, flushed: the answer's body comes in several reads.
		for len(ans) > 0 {
			k := min(len(ans), 1+len(ans)/3)
			_, _ = w.Write(ans[:k])
			w.(http.Flusher).Flush()
			ans = ans[k:]
		}
	})
	const clients, rounds = 24, 60
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i := range clients {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(i)))
			if err := ringReadsClient(strings.TrimPrefix(r.url, "http://"), i, rounds, rng); err != nil {
				errs <- fmt.Errorf("client %d: %w", i, err)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	waitInUse(t, r.pool, 0)
	var recvd int64
	for _, lp := range r.front.fast.Load().loops {
		recvd += lp.ringRecvd.Load()
		if lp.ringErr != nil && !plainSendsAlways {
			if ringDenied(lp.ringErr) {
				t.Logf("no io_uring here: %v", lp.ringErr)
				return
			}
			t.Errorf("a loop has no io_uring: %v", lp.ringErr)
		}
	}
	t.Logf("%d reads made with the ring", recvd)
	if plainSendsAlways && recvd != 0 || !plainSendsAlways && recvd == 0 {
		t.Errorf("%d reads with the ring (plain sends %v)", recvd, plainSendsAlways)
	}
}

// ringAnswer is the answer to a request for path with body: n bytes that
// name both, so that an answer given to another request shows.
func ringAnswer(path string, body []byte, n int) []byte {
	head := fmt.Sprintf("%s %d %x|", path, len(body), crc(body))
	var b bytes.Buffer
	for b.Len() < n {
		b.WriteString(head)
	}
	return b.Bytes()[:n]
}

// crc is a cheap checksum of b.
func crc(b []byte) uint32 {
	h := uint32(2166136261)
	for _, c := range b {
		h = (h ^ uint32(c)) * 16777619
	}
	return h
}

// ringReadsClient sends rounds requests (one or two in a write) on one
// keep-alive connection and checks each answer.
func ringReadsClient(addr string, id, rounds int, rng *rand.Rand) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Minute))
	br := bufio.NewReader(c)
	type sent struct {
		path string
		body []byte
		n    int
	}
	for k := 0; k < rounds; {
		var out bytes.Buffer
		var batch []sent
		// Mostly one or two requests in a write; now and then a burst of
		// small ones, more than a read's share of the arena takes.
		many, burst := 1+rng.IntN(2), rng.IntN(4) == 0
		if burst {
			many = 20 + rng.IntN(40)
		}
		for range many {
			s := sent{path: fmt.Sprintf("/c%d/r%d", id, k), n: rng.IntN(96 << 10)}
			if burst {
				s.n = rng.IntN(64)
			} else if rng.IntN(2) == 0 {
				s.body = bytes.Repeat([]byte{byte('a' + rng.IntN(26))}, rng.IntN(40<<10))
				if len(s.body) > 0 { // an empty body now and then (1 in 40960)
					s.body[len(s.body)/2] = byte(k) // not all alike
				}
			}
			fmt.Fprintf(&out, "POST %s?n=%d HTTP/1.1\r\nHost: x\r\nFairshare-Project: p%d\r\nContent-Length: %d\r\n\r\n", s.path, s.n, id%3, len(s.body))
			out.Write(s.body)
			batch = append(batch, s)
			k++
		}
		if _, err := c.Write(out.Bytes()); err != nil {
			return err
		}
		for _, s := range batch {
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				return fmt.Errorf("%s: %w", s.path, err)
			}
			got, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				return fmt.Errorf("%s: %w", s.path, err)
			}
			if resp.StatusCode != http.StatusOK {
				return fmt.Errorf("%s: status %d: %q", s.path, resp.StatusCode, got)
			}
			if want := ringAnswer(s.path, s.body, s.n); !bytes.Equal(got, want) {
				return fmt.Errorf("%s: an answer of %d bytes that is not its own (want %d): %.80q", s.path, len(got), len(want), got)
			}
		}
	}
	return nil
}

// TestRingRecv: the ring's reads answer what recv(2) with MSG_DONTWAIT
// answers: the bytes waiting (at most the buffer's), -EAGAIN on a socket
// with none, 0 at the end of the stream, and every read has completed
// when the call returns.
func TestRingRecv(t *testing.T) {
	r := newTestRing(t, 8)
	defer r.close()
	pair := func() (int, int) {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
		return fds[0], fds[1]
	}
	a, a2 := pair() // 5 bytes waiting
	b, _ := pair()  // nothing
	c, c2 := pair() // the end of the stream
	d, d2 := pair() // more than the buffer
	_, _ = unix.Write(a2, []byte("hello"))
	unix.Close(c2)
	_, _ = unix.Write(d2, []byte(strings.Repeat("x", 100)))
	bufs := [][]byte{make([]byte, 64), make([]byte, 64), make([]byte, 64), make([]byte, 64)}
	res := make([]int32, 4)
	if err := r.recv([]int{a, b, c, d}, bufs, res); err != nil {
		t.Fatal(err)
	}
	if res[0] != 5 || string(bufs[0][:5]) != "hello" {
		t.Errorf("a: %d %q", res[0], bufs[0][:max(0, res[0])])
	}
	if res[1] != -int32(unix.EAGAIN) {
		t.Errorf("b: %d, want -EAGAIN", res[1])
	}
	if res[2] != 0 {
		t.Errorf("c: %d, want 0 (the end)", res[2])
	}
	if res[3] != 64 {
		t.Errorf("d: %d, want 64 (its buffer)", res[3])
	}
	// The rest of d is still there for read(2).
	rest := make([]byte, 100)
	if n, err := unix.Read(d, rest); err != nil || n != 36 {
		t.Errorf("d after: %d %v, want 36", n, err)
	}
}
