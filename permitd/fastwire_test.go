// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"strings"
	"testing"
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

func TestInternerIsBounded(t *testing.T) {
	var in interner
	for i := 0; i < internMax+100; i++ {
		in.str([]byte(strings.Repeat("x", i%300+1) + string(rune('a'+i%26)) + strings.Repeat("y", i/26)))
	}
	if len(in.m) > internMax {
		t.Fatalf("interner holds %d names, bound %d", len(in.m), internMax)
	}
	for k := range in.m {
		if len(k) > internMaxLen {
			t.Fatalf("interned a %d-byte name", len(k))
		}
	}
	if got := in.str([]byte("flights")); got != "flights" {
		t.Fatalf("str = %q", got)
	}
}

func TestParseFastAllocatesNothingForKnownNames(t *testing.T) {
	var in interner
	line := []byte(`{"id":1,"op":"acquire","pool":"flights","project":"p"}` + "\n")
	var rq request
	in.parseFast(line, &rq)
	if n := testing.AllocsPerRun(100, func() { in.parseFast(line, &rq) }); n != 0 {
		t.Fatalf("parseFast allocates %v times per line", n)
	}
}
