// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"

	"github.com/fairshare-dev/fairshare/pools"
)

// checkFastAgrees fails when the hand parser accepts a line that
// encoding/json rejects or reads differently.
func checkFastAgrees(t *testing.T, line string) (fast bool) {
	t.Helper()
	var in interner
	var got, want request
	if !in.parseFast([]byte(line), &got) {
		return false
	}
	if err := parseRequest([]byte(line), &want); err != nil {
		t.Fatalf("fast path accepted %q, encoding/json says %v", line, err)
	}
	if got != want {
		t.Fatalf("line %q: fast %+v, encoding/json %+v", line, got, want)
	}
	return true
}

func TestParseFastAgreesWithJSON(t *testing.T) {
	for _, tc := range []struct {
		line string
		fast bool // whether the fast path should take it
	}{
		{`{"id":1,"op":"acquire","pool":"flights","project":"p"}` + "\n", true},
		{` { "id" : 7 , "op":"release", "lease":18446744073709551615 }` + "\r\n", false}, // 20 digits
		{`{"id":7,"op":"release","lease":9007199254740993}`, true},
		{`{}`, true},
		{`{"id":8}`, true},
		{`{"id":1,"op":"acquire","pool":"flights","project":"p","wait_ms":250}`, true},
		{`{"id":1,"op":"spawn","project":"é","object":"ö"}`, true},
		{`{"ID":1,"op":"ping"}`, false},       // encoding/json matches keys without case
		{`{"id":1,"op":"ping","x":1}`, false}, // unknown key
		{`{"id":01,"op":"ping"}`, false},
		{`{"id":1.0,"op":"ping"}`, false},
		{`{"id":1e3,"op":"ping"}`, false},
		{`{"id":-4,"op":"ping"}`, false},
		{`{"id":null,"op":"ping"}`, false},
		{`{"id":"1","op":"ping"}`, false},
		{`{"id":1,"op":"ping"} x`, false},
		{`{"id":1,"op":"ping",}`, false},
		{`{"id":1,"op":"ping"`, false},
		{`{"id":1,"op":"p\u0069ng"}`, false},
		{"{\"id\":1,\"op\":\"p\xffng\"}", false},
		{`{"id":1,"wait_ms":-1}`, false},
		{`{"id":1,"wait_ms":9223372036854775807}`, false},
		{`[1,2,3]`, false},
		{`not json`, false},
	} {
		if got := checkFastAgrees(t, tc.line); got != tc.fast {
			t.Errorf("%q: fast path took it = %v, want %v", tc.line, got, tc.fast)
		}
	}
}

func FuzzParseFast(f *testing.F) {
	for _, s := range []string{
		`{"id":1,"op":"acquire","pool":"flights","project":"p"}`,
		`{"id":2,"op":"release","lease":123}`,
		`{"id":3,"wait_ms":5,"object":"o"}`,
		` {"op" : "ping" }` + "\n",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		if strings.IndexByte(line, '\n') >= 0 && strings.IndexByte(line, '\n') < len(line)-1 {
			return // a line is one frame
		}
		checkFastAgrees(t, line)
	})
}

// The string table keeps names up to its bound in bytes, and none that is
// too long.
func TestInternerIsBounded(t *testing.T) {
	var in interner
	for i := range 20000 {
		name := strings.Repeat("x", i%300+1) + string(rune('a'+i%26)) + strings.Repeat("y", i/26)
		if got := in.object([]byte(name)); got != name {
			t.Fatalf("object = %q, want %q", got, name)
		}
	}
	if in.bytes > internMaxBytes {
		t.Fatalf("interner holds %d bytes, bound %d", in.bytes, internMaxBytes)
	}
	sum := 0
	for k := range in.m {
		if len(k) > internMaxLen {
			t.Fatalf("interned a %d-byte name", len(k))
		}
		sum += internCost(k)
	}
	if sum != in.bytes {
		t.Fatalf("interner counts %d bytes, holds %d", in.bytes, sum)
	}
}

// Only names that mean something are kept: a known op or a served pool
// (the server's own strings), a valid project name, an object name.
func TestInternerKeepsOnlyValidNames(t *testing.T) {
	in := interner{pools: map[string]string{"flights": "flights"}}
	var rq request
	for _, line := range []string{
		`{"id":1,"op":"frobnicate","pool":"nopool","project":"bad name"}`,
		`{"id":2,"op":"acquire","pool":"nopool","project":"cgroup.procs"}`,
		`{"id":3,"op":"acquire","pool":"flights","project":"` + strings.Repeat("p", 65) + `"}`,
	} {
		if !in.parseFast([]byte(line), &rq) {
			t.Fatalf("%s: not on the fast path", line)
		}
	}
	if len(in.m) != 0 || in.bytes != 0 {
		t.Fatalf("invalid names kept: %v (%d bytes)", in.m, in.bytes)
	}
	in.parseFast([]byte(`{"id":4,"op":"spawn","project":"shop","object":"o1"}`), &rq)
	if len(in.m) != 2 || in.m["shop"] == "" || in.m["o1"] == "" {
		t.Fatalf("valid names not kept: %v", in.m)
	}
}

// TestSessionNamesBounded: a flood of made-up names (ops, pools, invalid
// and valid project names, objects) leaves a session holding no more than
// the 16 KiB a connection is budgeted. Before, each of the 4096 table
// places kept a name of up to 256 bytes, checked or not: 1.3 MB a session.
func TestSessionNamesBounded(t *testing.T) {
	fp, err := pools.New(pools.Config{Name: "flights", Size: 4}, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := New(Config{Socket: t.TempDir() + "/p.sock"}, map[string]*pools.Pool{"flights": fp}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	word := func(n int) string {
		const letters = "abcdefghijklmnopqrstuvwxyz0123456789"
		b := make([]byte, n)
		for i := range b {
			b[i] = letters[rng.IntN(len(letters))]
		}
		return string(b)
	}
	const sessions, lines = 8, 4096
	// Every line is made first, so that only the sessions' memory is
	// measured.
	var flood [][]byte
	for i := range lines {
		for _, l := range []string{
			`{"id":1,"op":"` + word(250) + `"}`,
			`{"id":1,"op":"acquire","pool":"` + word(250) + `","project":"p"}`,
			`{"id":1,"op":"acquire","pool":"nopool","project":"` + word(60) + `"}`,
			`{"id":1,"op":"acquire","pool":"nopool","project":"-` + word(250) + `"}`,
			`{"id":1,"op":"touch","object":"` + word(1+i%250) + `"}`,
		} {
			flood = append(flood, []byte(l))
		}
	}
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	held := make([]*session, sessions)
	for i := range held {
		ss := newSession(srv, nil, Cred{})
		var rq request
		var resp response
		for _, line := range flood {
			if !ss.handle(line, &rq, &resp) {
				t.Fatalf("%s: answered later", line)
			}
		}
		if ss.names.bytes > internMaxBytes {
			t.Fatalf("session's table holds %d bytes, bound %d", ss.names.bytes, internMaxBytes)
		}
		held[i] = ss
	}
	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	per := (int64(after.HeapAlloc) - int64(before.HeapAlloc)) / sessions
	t.Logf("%d bytes retained per session after %d made-up names", per, len(flood))
	if per > 16<<10 {
		t.Fatalf("a session retains %d bytes after a flood of made-up names, past the 16 KiB budget", per)
	}
	runtime.KeepAlive(held)
	runtime.KeepAlive(flood)
}

func TestParseFastAllocatesNothingForKnownNames(t *testing.T) {
	in := interner{pools: map[string]string{"flights": "flights"}}
	line := []byte(`{"id":1,"op":"acquire","pool":"flights","project":"p"}` + "\n")
	var rq request
	in.parseFast(line, &rq)
	if n := testing.AllocsPerRun(100, func() { in.parseFast(line, &rq) }); n != 0 {
		t.Fatalf("parseFast allocates %v times per line", n)
	}
}
