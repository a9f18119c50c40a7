// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
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
