// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
)

var nftSeq atomic.Int64

// NftTable loads an nftables table of family inet, named uniquely for this
// process, whose body is the given ruleset text (chains and rules, without
// the "table" line), and deletes it when the test ends, failed or not. It
// skips the test when nft is not installed. The name is returned.
func NftTable(t testing.TB, body string) string {
	t.Helper()
	nft, err := exec.LookPath("nft")
	if err != nil {
		t.Skip("nft is not installed (Debian: apt-get install nftables)")
	}
	NftSweep(nft)
	name := fmt.Sprintf("fairshare_test_%d_%d", os.Getpid(), nftSeq.Add(1))
	if err := NftRun(nft, fmt.Sprintf("table inet %s {\n%s\n}\n", name, body)); err != nil {
		t.Fatalf("loading nft table %s: %v", name, err)
	}
	t.Cleanup(func() {
		if err := NftRun(nft, "delete table inet "+name+"\n"); err != nil {
			t.Errorf("deleting nft table %s: %v", name, err)
		}
	})
	return name
}

// NftRun runs nft -f - with the given script.
func NftRun(nft, script string) error {
	cmd := exec.Command(nft, "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("%w: %s", err, bytes.TrimSpace(out.Bytes()))
	}
	return nil
}

var sweepOnce sync.Once

// NftSweep deletes, once per process, the inet tables a test process left
// behind when it was killed before its cleanup ran: the tables named
// fairshare_test_<pid>_* or fairshare_bench_<pid> whose process is gone.
// One such table (a benchmark's "ct count" rule for a cgroup since
// removed) made every raw socket's sendto on the host fail with EPERM, and
// with it the inbound tests of whoever ran next.
func NftSweep(nft string) {
	sweepOnce.Do(func() {
		out, err := exec.Command(nft, "list", "tables", "inet").Output()
		if err != nil {
			return
		}
		for _, line := range strings.Split(string(out), "\n") {
			name, ok := strings.CutPrefix(strings.TrimSpace(line), "table inet ")
			if !ok || nftOwnerAlive(name) {
				continue
			}
			_ = NftRun(nft, "delete table inet "+name+"\n")
		}
	})
}

// nftOwnerAlive says whether the test process that named table name is
// still running; a table that is not a test's counts as alive (kept).
func nftOwnerAlive(name string) bool {
	var rest string
	if r, ok := strings.CutPrefix(name, "fairshare_test_"); ok {
		rest, _, _ = strings.Cut(r, "_")
	} else if r, ok := strings.CutPrefix(name, "fairshare_bench_"); ok {
		rest = r
	} else {
		return true
	}
	pid, err := strconv.Atoi(rest)
	if err != nil || pid <= 0 {
		return true
	}
	return syscall.Kill(pid, 0) != syscall.ESRCH
}
