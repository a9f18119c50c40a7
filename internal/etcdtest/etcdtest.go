// SPDX-License-Identifier: Apache-2.0

package etcdtest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// Etcd is one running (or stopped) etcd member.
type Etcd struct {
	t        testing.TB
	bin, dir string
	client   string // client URL
	peer     string
	cmd      *exec.Cmd
	done     chan struct{}
}

// Start starts an etcd for t and stops it at t's cleanup. It skips t when
// no etcd binary is found (set FAIRSHARE_ETCD to point at one).
func Start(t testing.TB) *Etcd {
	t.Helper()
	bin := os.Getenv("FAIRSHARE_ETCD")
	if bin == "" {
		var err error
		if bin, err = exec.LookPath("etcd"); err != nil {
			t.Skip("etcd not found (apt-get install etcd-server, or set FAIRSHARE_ETCD): skipping the real-etcd test")
		}
	}
	e := &Etcd{t: t, bin: bin, dir: t.TempDir(), client: "http://" + freePort(t), peer: "http://" + freePort(t)}
	e.Restart()
	t.Cleanup(e.Stop)
	return e
}

func freePort(t testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Endpoints are the client URLs.
func (e *Etcd) Endpoints() []string { return []string{e.client} }

// Restart starts the member (again, on the same data and ports) and waits
// until it answers.
func (e *Etcd) Restart() {
	e.t.Helper()
	e.cmd = exec.Command(e.bin, "--name", "test", "--data-dir", filepath.Join(e.dir, "data"),
		"--listen-client-urls", e.client, "--advertise-client-urls", e.client,
		"--listen-peer-urls", e.peer, "--initial-advertise-peer-urls", e.peer,
		"--initial-cluster", "test="+e.peer, "--log-level", "error")
	log, err := os.Create(filepath.Join(e.dir, fmt.Sprintf("etcd-%d.log", time.Now().UnixNano())))
	if err != nil {
		e.t.Fatal(err)
	}
	e.cmd.Stdout, e.cmd.Stderr = log, log
	e.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := e.cmd.Start(); err != nil {
		e.t.Fatalf("starting etcd: %v", err)
	}
	e.done = make(chan struct{})
	go func(c *exec.Cmd, done chan struct{}, log *os.File) { _ = c.Wait(); log.Close(); close(done) }(e.cmd, e.done, log)
	c, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: time.Second, Logger: zap.NewNop()})
	if err != nil {
		e.t.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.Get(ctx, "health")
		cancel()
		if err == nil {
			return
		}
		select {
		case <-e.done:
			e.t.Fatalf("etcd exited at start (logs in %s)", e.dir)
		default:
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("etcd did not answer in 30s: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Stop kills the member (SIGKILL: as lost as it gets) and waits for it.
func (e *Etcd) Stop() {
	if e.cmd == nil {
		return
	}
	_ = e.cmd.Process.Kill()
	<-e.done
	e.cmd = nil
}

// Client returns a client of the member, closed at t's cleanup.
func (e *Etcd) Client(t testing.TB) *clientv3.Client {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{Endpoints: e.Endpoints(), DialTimeout: time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}
