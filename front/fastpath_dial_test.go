// SPDX-License-Identifier: Apache-2.0

package front

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
	"golang.org/x/net/dns/dnsmessage"
)

// testDNS answers A queries for every name with the address in ip, over
// UDP on loopback; with no valid address in ip, it answers with none.
func testDNS(t *testing.T, ip *atomic.Value) string {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			var p dnsmessage.Parser
			h, err := p.Start(buf[:n])
			if err != nil {
				continue
			}
			q, err := p.Question()
			if err != nil {
				continue
			}
			b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true})
			_ = b.StartQuestions()
			_ = b.Question(q)
			_ = b.StartAnswers()
			if a := ip.Load().(netip.Addr); q.Type == dnsmessage.TypeA && a.IsValid() {
				_ = b.AResource(dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 1}, dnsmessage.AResource{A: a.As4()})
			}
			out, _ := b.Finish()
			_, _ = pc.WriteTo(out, from)
		}
	}()
	return pc.LocalAddr().String()
}

// An upstream named by a host name is looked up for each new connection on
// the fast path too, as on net/http's path: a name that does not resolve
// when the front starts gives 502 until it does (the front still starts),
// and an upstream that moves to another address is followed. (The fast
// path looked the name up once, when it started: it did not start without
// it, and after a move answered 502 for as long as it ran.)
func TestFastPathUpstreamNameFollowed(t *testing.T) {
	var ip atomic.Value
	ip.Store(netip.Addr{}) // no answer yet
	dns := testDNS(t, &ip)
	old := net.DefaultResolver
	net.DefaultResolver = &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "udp", dns)
	}}
	t.Cleanup(func() { net.DefaultResolver = old })

	// The upstream at 127.0.0.1:P, and where it moves, 127.0.0.2:P.
	l1, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l1.Addr().(*net.TCPAddr).Port
	l2, err := net.Listen("tcp", "127.0.0.2:"+strconv.Itoa(port))
	if err != nil {
		l1.Close()
		t.Fatal(err)
	}
	serve := func(l net.Listener, who string) *http.Server {
		s := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain")
			_, _ = w.Write([]byte(who))
		})}
		go func() { _ = s.Serve(l) }()
		return s
	}
	s1, s2 := serve(l1, "old"), serve(l2, "new")
	t.Cleanup(func() { s1.Close(); s2.Close() })

	name := "upstream.fairshare.test:" + strconv.Itoa(port)
	named := func(f *Front) { // as New sets them for Upstream "http://" + name
		d := f.up.(*directUpstream)
		d.addr, d.host = name, name
	}
	fast := fastRig(t, rigOpts{tweak: named}, ok)
	slow := newRig(t, rigOpts{tweak: func(f *Front) { f.cfg.FastPath = false; named(f) }}, ok)
	rigs := map[string]*rig{"net/http's path": slow, "fast path": fast}
	expect := func(when string, status int, body string) {
		t.Helper()
		for path, r := range rigs {
			r.client.CloseIdleConnections()
			resp := r.get(t, "alpha", "/")
			if got := readAll(t, resp); resp.StatusCode != status || (body != "" && got != body) {
				t.Errorf("%s, %s: %d %q, want %d %q", when, path, resp.StatusCode, got, status, body)
			}
		}
	}
	expect("before the name resolves", http.StatusBadGateway, "")
	ip.Store(netip.MustParseAddr("127.0.0.1"))
	expect("once it resolves", http.StatusOK, "old")
	ip.Store(netip.MustParseAddr("127.0.0.2"))
	s1.Close()
	fast.front.CloseIdle()
	slow.front.CloseIdle()
	time.Sleep(100 * time.Millisecond) // the loop closes its idle connection
	expect("after the move", http.StatusOK, "new")
	waitInUse(t, fast.pool, 0)
}

// emfileOnce fails its second Accept with EMFILE, as a listener does when
// the process is out of descriptors for a moment.
type emfileOnce struct {
	net.Listener
	n atomic.Int32
}

func (l *emfileOnce) Accept() (net.Conn, error) {
	if l.n.Add(1) == 2 {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	return l.Listener.Accept()
}

// Front.Serve on a plain listener (not the daemon's, which backs off
// itself) waits out a transient accept error on both paths, as net/http's
// server does. (The fast path ended at the first error of any kind: Serve
// returned "use of closed network connection" after one EMFILE.)
func TestServeAcceptErrorBacksOff(t *testing.T) {
	for _, fast := range []bool{false, true} {
		r := newRig(t, rigOpts{anyServer: true, tweak: func(f *Front) { f.cfg.FastPath = fast }}, ok)
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- r.front.Serve(ctx, &emfileOnce{Listener: l}) }()
		var codes []string
		for range 3 {
			req, _ := http.NewRequest("GET", "http://"+l.Addr().String()+"/", nil)
			req.Header.Set(DefaultProjectHeader, "alpha")
			req.Close = true
			resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
			if err != nil {
				codes = append(codes, err.Error())
				continue
			}
			resp.Body.Close()
			codes = append(codes, resp.Status)
		}
		returned := false
		select {
		case err := <-done:
			returned = true
			t.Errorf("fast path %v: Serve returned after one EMFILE: %v", fast, err)
		default:
		}
		if got := strings.Join(codes, ", "); got != "200 OK, 200 OK, 200 OK" {
			t.Errorf("fast path %v: answers %s", fast, got)
		}
		cancel()
		if returned {
			l.Close()
			continue
		}
		if err := <-done; err != nil {
			t.Errorf("fast path %v: Serve: %v", fast, err)
		}
		l.Close()
	}
}

// A client that goes away while its upstream connection is being dialed
// (a slow lookup) gives its permit back at once and the dial is stopped
// (its context canceled); a connection a dial brings all the same (one
// that ignores its context, or ends as the client leaves) is closed, not
// pooled or leaked; a dial still pending when the front stops does not
// hold Serve past its drain.
func TestFastPathDialPendingClientGone(t *testing.T) {
	started, release, hold := make(chan struct{}, 4), make(chan struct{}), make(chan struct{})
	var wait atomic.Value // the channel a dial waits on
	wait.Store(release)
	var stopped atomic.Bool // the first dial's context was canceled
	// Checked once the front stopped (cleanups run last first).
	var held atomic.Bool
	t.Cleanup(func() {
		if held.Load() {
			t.Error("a dial pending when the front stopped held Serve until it was let go 10s later")
		}
	})
	// The upstream counts the connections it has open: one the loop
	// closes reads its end here.
	var upConns, upOpen atomic.Int64
	ul := loopbackListen(t)
	go acceptEach(ul, func(c net.Conn) {
		upConns.Add(1)
		upOpen.Add(1)
		defer upOpen.Add(-1)
		_, _ = io.Copy(io.Discard, c)
	})
	fast := fastRig(t, rigOpts{tweak: func(f *Front) {
		d := f.up.(*directUpstream)
		real, dial := ul.Addr().String(), d.dial
		d.addr = "slow.fairshare.test:80"
		d.dial = func(ctx context.Context, network, _ string) (net.Conn, error) {
			started <- struct{}{}
			w := wait.Load().(chan struct{})
			if w == release {
				<-release // and connects even if stopped
				// The loop stops the dial as it drops the client, which
				// may come a moment after the client's permit is back.
				select {
				case <-ctx.Done():
					stopped.Store(true)
				case <-time.After(5 * time.Second):
				}
				return dial(context.Background(), network, real)
			}
			select {
			case <-w:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return dial(ctx, network, real)
		}
	}}, ok)
	c := sendGet(t, fast.url[len("http://"):], "/")
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("no dial")
	}
	waitInUse(t, fast.pool, 1)
	c.Close()
	waitInUse(t, fast.pool, 0) // given back while the dial is pending
	close(release)
	// The dialed connection is closed by the loop: the upstream's
	// server sees no connection left open.
	deadline := time.Now().Add(5 * time.Second)
	for upConns.Load() == 0 || upOpen.Load() > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("upstream connections: %d, still open: %d", upConns.Load(), upOpen.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !stopped.Load() {
		t.Error("the dial of a client gone was not stopped")
	}
	// A dial pending when the front stops ends with the loop.
	wait.Store(hold)
	sendGet(t, fast.url[len("http://"):], "/")
	select {
	case <-started:
	case <-time.After(5 * time.Second):
		t.Fatal("no second dial")
	}
	t.Cleanup(func() { // before the rig's own, which stops the front
		time.AfterFunc(10*time.Second, func() { held.Store(true); close(hold) })
	})
}

// panicTimeout is a dial error whose Timeout panics the first time: a
// defect reached from what the loop does with a dial's result.
type panicTimeout struct{ n *atomic.Int32 }

func (e panicTimeout) Error() string { return "dial failed" }
func (e panicTimeout) Timeout() bool {
	if e.n.Add(1) == 1 {
		panic("a defect reached from dialed")
	}
	return false
}
func (e panicTimeout) Temporary() bool { return false }

// A panic in the loop's handling of a dial's result is contained with the
// client whose request it was: its exchange is aborted (no answer, its
// permit back at once) and the loop serves the next. (From the review of
// this change: the client waited with its permit until it left, and the
// functions posted after it in the same batch were dropped.)
func TestFastPathDialedPanicContained(t *testing.T) {
	var n atomic.Int32
	logs := &logBuffer{}
	fast := fastRig(t, rigOpts{tweak: func(f *Front) {
		f.log = slog.New(slog.NewTextHandler(logs, nil))
		d := f.up.(*directUpstream)
		d.addr = "x.fairshare.test:80"
		d.dial = func(context.Context, string, string) (net.Conn, error) {
			return nil, panicTimeout{&n}
		}
	}}, ok)
	c := sendGet(t, fast.url[len("http://"):], "/")
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if resp, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
		t.Errorf("the aborted exchange was answered %d", resp.StatusCode)
	} else if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Error("no end of the aborted exchange within 5s")
	}
	waitInUse(t, fast.pool, 0)
	// The next request, whose dial fails plainly, is answered.
	resp := fast.get(t, "alpha", "/")
	readAll(t, resp)
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("the next request: %d, want 502", resp.StatusCode)
	}
	if !strings.Contains(logs.String(), "a defect reached from dialed") {
		t.Error("the panic was not logged")
	}
}

// A new client's cgroup is looked up (sock_diag, a netlink round trip) as
// its connection is accepted, before the loop takes it: a flood of new
// connections does not hold up the loop's other clients for a lookup each.
// (The loop looked it up at the client's first request.)
func TestFastPathPeerFoundOffLoop(t *testing.T) {
	root := testutil.MkCgroup(t, cgroupMount(t), fmt.Sprintf("fairshare-front-offloop-%d", os.Getpid()))
	fast := fastRig(t, rigOpts{cfg: Config{ProjectsRoot: root}}, ok)
	c, err := net.Dial("tcp", fast.url[len("http://"):])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var seen, looked int
		onLoop(fast.front, func(lp *loop) {
			for _, fc := range lp.clients {
				seen++
				ran := false
				fc.p.once.Do(func() { ran = true })
				if !ran {
					looked++
				}
			}
		})
		if seen > 0 {
			if looked != seen {
				t.Fatalf("%d of the loop's %d clients (no request sent yet) had no cgroup lookup", seen-looked, seen)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the loop did not take the connection")
		}
		time.Sleep(5 * time.Millisecond)
	}
}
