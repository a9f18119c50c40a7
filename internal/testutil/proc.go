// SPDX-License-Identifier: Apache-2.0

package testutil

import (
	"io"
	"os/exec"
	"testing"
)

// Pipes connects to the stdin and stdout of cmd, not started yet: how the
// tests talk to the helper processes they start (often the test binary
// itself, recognising an environment variable).
func Pipes(t testing.TB, cmd *exec.Cmd) (stdin io.WriteCloser, stdout io.ReadCloser) {
	t.Helper()
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err = cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	return stdin, stdout
}
