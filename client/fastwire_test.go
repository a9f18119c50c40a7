// SPDX-License-Identifier: Apache-2.0

package client

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// checkReplyAgrees fails when the hand parser accepts a line that
// encoding/json rejects or reads differently.
func checkReplyAgrees(t *testing.T, line string) (fast bool) {
	t.Helper()
	var got, want reply
	if !parseReply([]byte(line), &got) {
		return false
	}
	if err := json.Unmarshal([]byte(line), &want); err != nil {
		t.Fatalf("fast path accepted %q, encoding/json says %v", line, err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("line %q: fast %+v, encoding/json %+v", line, got, want)
	}
	return true
}

func TestParseReplyAgreesWithJSON(t *testing.T) {
	for _, tc := range []struct {
		line string
		fast bool
	}{
		{`{"id":1,"ok":true,"lease":4294967297}` + "\n", true},
		{`{"id":2,"ok":true,"released":true}` + "\n", true},
		{`{"id":3,"ok":true,"released":false,"note":"already released"}`, true},
		{`{"id":4,"ok":false,"code":"REFUSED","error":"pool f: project p refused","retry_after_ms":12}`, true},
		{`{"event":"evict","project":"p","object":"o","reason":"own-idlest"}`, true},
		{`{"id":5,"ok":false,"code":"REFUSED","retry_after_ms":3,"refusal":{"pool":"f"}}`, false},
		{`{"id":6,"ok":true,"session":3,"server":"fairshare-permitd/1"}`, false},
		{`{"id":7,"ok":truex}`, false},
		{`{"id":7,"ok":1}`, false},
		{`{"id":8,"ok":false,"error":"unknown pool \"x\""}`, false},
		{`{"Id":9,"ok":true}`, false},
		{`{"id":10,"ok":true} trailing`, false},
	} {
		if got := checkReplyAgrees(t, tc.line); got != tc.fast {
			t.Errorf("%q: fast path took it = %v, want %v", tc.line, got, tc.fast)
		}
	}
}

func FuzzParseReply(f *testing.F) {
	for _, s := range []string{
		`{"id":1,"ok":true,"lease":4294967297}`,
		`{"id":2,"ok":true,"released":true}`,
		`{"id":4,"ok":false,"code":"REFUSED","error":"x","retry_after_ms":12}`,
		`{"event":"evict","project":"p","object":"o","reason":"own-idlest"}`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		if i := strings.IndexByte(line, '\n'); i >= 0 && i < len(line)-1 {
			return // a line is one frame
		}
		checkReplyAgrees(t, line)
	})
}
