// SPDX-License-Identifier: Apache-2.0

package wire

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"
)

// checkString fails when ScanString accepts a value that encoding/json
// rejects or reads differently. The value is scanned as the whole of a line
// so that what follows it cannot matter.
func checkString(t *testing.T, v string) (fast bool) {
	t.Helper()
	s, next, ok := ScanString([]byte(v), 0)
	if !ok {
		return false
	}
	if next != len(v) {
		return true // a value followed by more: encoding/json would reject the rest, not the string
	}
	var want string
	if err := json.Unmarshal([]byte(v), &want); err != nil {
		t.Fatalf("ScanString accepted %q, encoding/json says %v", v, err)
	}
	if string(s) != want {
		t.Fatalf("%q: ScanString %q, encoding/json %q", v, s, want)
	}
	return true
}

// checkUint does the same for ScanUint.
func checkUint(t *testing.T, v string) (fast bool) {
	t.Helper()
	n, next, ok := ScanUint([]byte(v), 0)
	if !ok {
		return false
	}
	if strings.Trim(v[next:], " \t\r\n") != "" {
		return true // what follows is a separator, judged by the caller's parser
	}
	var want uint64
	if err := json.Unmarshal([]byte(v), &want); err != nil {
		t.Fatalf("ScanUint accepted %q, encoding/json says %v", v, err)
	}
	if n != want {
		t.Fatalf("%q: ScanUint %d, encoding/json %d", v, n, want)
	}
	return true
}

func TestScanString(t *testing.T) {
	for _, tc := range []struct {
		in   string
		fast bool
	}{
		{`"flights"`, true},
		{`""`, true},
		{`"é ö 日本"`, true},
		{`"a\"b"`, false},
		{`"a\u0041"`, false},
		{"\"a\tb\"", false},
		{"\"a\xffb\"", false},
		{`"unterminated`, false},
		{`flights`, false},
	} {
		if got := checkString(t, tc.in); got != tc.fast {
			t.Errorf("%q: scanned %v, want %v", tc.in, got, tc.fast)
		}
	}
	// The contents are a sub-slice and next points past the quote.
	b := []byte(`{"op":"ping"}`)
	s, next, ok := ScanString(b, 6)
	if !ok || string(s) != "ping" || next != 12 {
		t.Fatalf("ScanString in a line: %q %d %v", s, next, ok)
	}
}

func TestScanUint(t *testing.T) {
	for _, tc := range []struct {
		in   string
		fast bool
	}{
		{`0`, true},
		{`7`, true},
		{`9999999999999999999`, true}, // 19 digits
		{`18446744073709551615`, false},
		{`01`, false},
		{`1.5`, false},
		{`1e3`, false},
		{`-1`, false},
		{`1x`, false},
		{``, false},
		{`12 `, true},
	} {
		if got := checkUint(t, tc.in); got != tc.fast {
			t.Errorf("%q: scanned %v, want %v", tc.in, got, tc.fast)
		}
	}
	for _, end := range []string{",", "}", " ", "\n"} {
		if v, next, ok := ScanUint([]byte("42"+end), 0); !ok || v != 42 || next != 2 {
			t.Errorf("42 before %q: %d %d %v", end, v, next, ok)
		}
	}
}

func TestScanBool(t *testing.T) {
	for _, tc := range []struct {
		in      string
		v, fast bool
	}{
		{"true", true, true},
		{"false", false, true},
		{"true,", true, true},
		{"false}", false, true},
		{"truex", false, false},
		{"tru", false, false},
		{"True", false, false},
		{"1", false, false},
	} {
		v, _, ok := ScanBool([]byte(tc.in), 0)
		if ok != tc.fast || v != tc.v {
			t.Errorf("%q: %v %v, want %v %v", tc.in, v, ok, tc.v, tc.fast)
		}
	}
}

func TestAppendString(t *testing.T) {
	for _, s := range []string{"", "flights", `a"b\c`, "new\nline\x00", "é日本", "bad\xffutf8", "\u2028"} {
		b := AppendString(nil, s)
		if bytes.IndexByte(b, '\n') >= 0 {
			t.Fatalf("%q encodes with a raw newline: %s", s, b)
		}
		var got string
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("%q encodes as %s: %v", s, b, err)
		}
		if want := strings.ToValidUTF8(s, "\uFFFD"); utf8.ValidString(s) && got != s || !utf8.ValidString(s) && got != want {
			t.Fatalf("%q round-trips as %q", s, got)
		}
	}
}

func FuzzScanString(f *testing.F) {
	for _, s := range []string{`"flights"`, `"é"`, `"a\"b"`, "\"\xff\"", `""`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) { checkString(t, v) })
}

func FuzzScanUint(f *testing.F) {
	for _, s := range []string{`0`, `12`, `01`, `1.5`, `18446744073709551615`, `9999999999999999999`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) { checkUint(t, v) })
}

// FuzzAppendString checks that any string encodes as one valid JSON string
// without a raw newline, which decodes back to the string (with invalid UTF-8
// replaced, as encoding/json does).
func FuzzAppendString(f *testing.F) {
	for _, s := range []string{"", "flights", `a"b`, "x\ny", "\xff", "日本"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b := AppendString(nil, s)
		if bytes.IndexByte(b, '\n') >= 0 {
			t.Fatalf("raw newline in %s", b)
		}
		var got string
		if err := json.Unmarshal(b, &got); err != nil {
			t.Fatalf("%q encodes as invalid JSON %s: %v", s, b, err)
		}
		if want := strings.ToValidUTF8(s, "\uFFFD"); !utf8.ValidString(s) {
			// Each invalid byte becomes one U+FFFD; ToValidUTF8 merges runs.
			if strings.ReplaceAll(got, "\uFFFD", "") != strings.ReplaceAll(want, "\uFFFD", "") {
				t.Fatalf("%q decodes as %q", s, got)
			}
		} else if got != s {
			t.Fatalf("%q decodes as %q", s, got)
		}
	})
}
