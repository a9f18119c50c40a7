// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"strings"
	"testing"
	"testing/iotest"
)

// The session's reader hands out the lines bufio.Reader.ReadSlice would,
// however the bytes arrive, with a buffer that starts at 4 KiB, grows only
// for a long line and goes back when the line is handled. Before, every
// session held a 64 KiB bufio buffer from its first byte to its end.
func TestLineReader(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 4))
	var in bytes.Buffer
	for range 300 {
		n := rng.IntN(200)
		if rng.IntN(20) == 0 {
			n = rng.IntN(MaxLine - 1)
		}
		in.WriteString(strings.Repeat("x", n) + "\n")
	}
	in.WriteString("tail without newline")
	for _, rd := range []io.Reader{bytes.NewReader(in.Bytes()), iotest.OneByteReader(bytes.NewReader(in.Bytes())),
		iotest.HalfReader(bytes.NewReader(in.Bytes()))} {
		want := bufio.NewReaderSize(bytes.NewReader(in.Bytes()), MaxLine)
		lr := &lineReader{rd: rd}
		for {
			wl, werr := want.ReadSlice('\n')
			gl, gerr := lr.readLine()
			if !bytes.Equal(wl, gl) || (werr == nil) != (gerr == nil) {
				t.Fatalf("line %.40q (%v), want %.40q (%v)", gl, gerr, wl, werr)
			}
			if len(gl) < minReadBuf && lr.buffered() == 0 && len(lr.buf) > minReadBuf {
				t.Fatalf("after a short line with nothing buffered the buffer is %d bytes", len(lr.buf))
			}
			if werr != nil {
				break
			}
		}
	}
	lr := &lineReader{rd: strings.NewReader("ping\n")}
	if l, err := lr.readLine(); string(l) != "ping\n" || err != nil || len(lr.buf) != minReadBuf {
		t.Fatalf("first line %q %v with a buffer of %d bytes, want %d", l, err, len(lr.buf), minReadBuf)
	}
	lr = &lineReader{rd: strings.NewReader(strings.Repeat("y", MaxLine) + "\n")}
	if _, err := lr.readLine(); !errors.Is(err, errLineTooLong) || len(lr.buf) != MaxLine {
		t.Fatalf("a line past MaxLine: %v with a buffer of %d", err, len(lr.buf))
	}
}
