// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fairshare-dev/fairshare/internal/testutil"
)

func TestParseFile(t *testing.T) {
	def := Default()
	for _, c := range []struct {
		name, in string
		want     map[string]Policy
		err      string
	}{
		{"empty", "", map[string]Policy{}, ""},
		{"empty map", "{}\n", map[string]Policy{}, ""},
		{"comment only", "# nothing yet\n", map[string]Policy{}, ""},
		{"full", "team-a: {tier: pro, shares: 2, requests_per_sec: 100, work_per_sec: 5.5}\n",
			map[string]Policy{"team-a": {Tier: "pro", Shares: 2, RequestsPerSec: 100, WorkPerSec: 5.5}}, ""},
		{"connections", "team-a: {connections_per_sec: 50}\nteam-b: {connections_per_sec: 0}\n",
			map[string]Policy{"team-a": {Tier: "none", Shares: 1, ConnectionsPerSec: 50}, "team-b": def}, ""},
		{"bad connections", "team-a: {connections_per_sec: -5}\n", nil, "project team-a: connections per second"},
		{"accepts", "team-a: {connections_per_sec: 5, accepts_per_sec: 200}\n",
			map[string]Policy{"team-a": {Tier: "none", Shares: 1, ConnectionsPerSec: 5, AcceptsPerSec: 200}}, ""},
		{"defaults fill", "team-a: {tier: lite}\nteam-b:\n", map[string]Policy{"team-a": {Tier: "lite", Shares: 1}, "team-b": def}, ""},
		{"unknown field", "team-a: {tier: pro, sharez: 2}\n", nil, `unknown field "sharez"`},
		{"bad tier", "team-a: {tier: gold}\n", nil, "project team-a: tier must be"},
		{"negative rate", "team-a: {requests_per_sec: -1}\n", nil, "requests per second"},
		{"bad name", "\"(other)\": {tier: pro}\n", nil, `"(other)" is not a project name`},
		{"duplicate", "a: {}\na: {}\n", nil, "named twice"},
		{"not a map", "- a\n- b\n", nil, "must map project names"},
		{"policy not a map", "a: pro\n", nil, "must be a mapping"},
		{"syntax", "a: {tier: pro\n", nil, "invalid policy"},
	} {
		got, err := ParseFile([]byte(c.in), def)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%s: error %v, want one containing %q", c.name, err, c.err)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", c.name, err)
			continue
		}
		if len(got) != len(c.want) {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
		for k, v := range c.want {
			if got[k] != v {
				t.Errorf("%s: %s = %+v, want %+v", c.name, k, got[k], v)
			}
		}
	}
	if _, err := ParseFile(make([]byte, MaxFileSize+1), def); !errors.Is(err, ErrInvalid) {
		t.Errorf("oversize file: %v", err)
	}
}

// TestFileFollowsConfigMap: Poll sees kubelet's atomic swap, keeps quiet
// while nothing changed, refuses a bad file once and sees the next good one.
// A change is put in force (or refused) at the second Poll that reads it.
func TestFileFollowsConfigMap(t *testing.T) {
	cm := testutil.NewConfigMapDir(t)
	f := NewFile(cm.Path("policies.yaml"), Default(), "")

	write := func(content string) { cm.Write(map[string]string{"policies.yaml": content}) }
	p, changed, err := f.Poll()
	if err != nil || !changed || len(p) != 0 {
		t.Fatalf("missing file: %v %v %v; want no policies, changed", p, changed, err)
	}
	write("a: {tier: pro}\n")
	if _, changed, err = f.Poll(); err != nil || changed || !f.Pending() {
		t.Fatalf("first version, first read: changed %v, %v, pending %v; want it pending", changed, err, f.Pending())
	}
	if p, changed, err = f.Poll(); err != nil || !changed || p["a"].Tier != "pro" || f.Pending() {
		t.Fatalf("first version: %v %v %v", p, changed, err)
	}
	if _, changed, err = f.Poll(); err != nil || changed {
		t.Fatalf("unchanged: changed %v, %v", changed, err)
	}
	write("a: {tier: pro}\n") // new files, same content
	if _, changed, err = f.Poll(); err != nil || changed || f.Pending() {
		t.Fatalf("same content rewritten: changed %v, %v, pending %v", changed, err, f.Pending())
	}
	write("a: {tier: gold}\n")
	if _, changed, err = f.Poll(); err != nil || changed {
		t.Fatalf("bad file, first read: changed %v, %v; want nothing yet", changed, err)
	}
	if _, changed, err = f.Poll(); err == nil || changed || !strings.Contains(err.Error(), "refused") {
		t.Fatalf("bad file: changed %v, %v", changed, err)
	}
	if _, changed, err = f.Poll(); err != nil || changed {
		t.Fatalf("bad file again: reported twice (%v) or changed %v", err, changed)
	}
	write("a: {tier: lite}\nb: {shares: 3}\n")
	f.Poll()
	if p, changed, err = f.Poll(); err != nil || !changed || p["a"].Tier != "lite" || p["b"].Shares != 3 {
		t.Fatalf("fixed file: %v %v %v", p, changed, err)
	}
	if got := string(f.Accepted()); got != "a: {tier: lite}\nb: {shares: 3}\n" {
		t.Fatalf("Accepted() = %q, want the fixed file", got)
	}
}

// TestPollWaitsForStableFile: an editor that saves in place truncates the
// file, then writes it. A Poll between the two read an empty file and
// released every project; one in the middle of the write read
// "requests_per_sec: 100" as 1. Now a content is put in force only once two
// Polls in a row read it the same: a truncated or half-written file keeps
// the policies in force, and so does a file removed to be replaced, until
// the next Poll finds it the same.
func TestPollWaitsForStableFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policies.yaml")
	if err := os.WriteFile(path, []byte("a: {tier: pro, requests_per_sec: 50}\nb: {shares: 2}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f := NewFile(path, Default(), "")
	if p, changed, err := f.Poll(); err != nil || !changed || len(p) != 2 {
		t.Fatalf("first Poll: %v %v %v; want the file at once", p, changed, err)
	}
	// The editor saves in place: truncate, then write.
	full := "a: {tier: pro, requests_per_sec: 100}\nb: {shares: 3}\n"
	half := "a: {tier: pro, requests_per_sec: 1"
	w, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if p, changed, err := f.Poll(); err != nil || changed || p != nil {
		t.Fatalf("truncated: %v %v %v; want no change, the policies in force kept", p, changed, err)
	}
	if _, err := w.WriteString(half); err != nil {
		t.Fatal(err)
	}
	if p, changed, err := f.Poll(); err != nil || changed || p != nil {
		t.Fatalf("half written: %v %v %v; want no change", p, changed, err)
	}
	if _, err := w.WriteString(full[len(half):]); err != nil {
		t.Fatal(err)
	}
	if p, changed, err := f.Poll(); err != nil || changed || p != nil {
		t.Fatalf("written, first Poll: %v %v %v; want none yet", p, changed, err)
	}
	p, changed, err := f.Poll()
	if err != nil || !changed || len(p) != 2 || p["a"].RequestsPerSec != 100 || p["b"].Shares != 3 {
		t.Fatalf("written, second Poll: %v %v %v; want the full set", p, changed, err)
	}
	// Truncated and written back as it was: no change at all.
	if err := w.Truncate(0); err != nil {
		t.Fatal(err)
	}
	if _, changed, err := f.Poll(); err != nil || changed {
		t.Fatalf("truncated again: changed %v, %v", changed, err)
	}
	if _, err := w.WriteAt([]byte(full), 0); err != nil {
		t.Fatal(err)
	}
	if _, changed, err := f.Poll(); err != nil || changed || f.Pending() {
		t.Fatalf("the same content written back: changed %v, %v, pending %v", changed, err, f.Pending())
	}

	// A save by rename that removes the file first: missing for a moment,
	// then the same content; then another content renamed into place.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if p, changed, err := f.Poll(); err != nil || changed || p != nil {
		t.Fatalf("missing: %v %v %v; want no change yet, the policies in force kept", p, changed, err)
	}
	rename := func(content string) { t.Helper(); renameInto(t, path, content) }
	rename(full)
	if _, changed, err := f.Poll(); err != nil || changed || f.Pending() {
		t.Fatalf("back in place: changed %v, %v, pending %v; want no change", changed, err, f.Pending())
	}
	rename("a: {requests_per_sec: 7}\n")
	if _, changed, err := f.Poll(); err != nil || changed {
		t.Fatalf("renamed into place, first Poll: changed %v, %v", changed, err)
	}
	if p, changed, err := f.Poll(); err != nil || !changed || len(p) != 1 || p["a"].RequestsPerSec != 7 {
		t.Fatalf("renamed into place: %v %v %v", p, changed, err)
	}
	// Missing at two Polls in a row: no policies.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	f.Poll()
	if p, changed, err := f.Poll(); err != nil || !changed || len(p) != 0 {
		t.Fatalf("missing at two Polls: %v %v %v; want no policies", p, changed, err)
	}
}

// Resume makes a content read by an earlier run what the first Poll
// compares with: the same file is no change, another one waits for a
// second Poll.
// TestFirstPollWaitsForStableFile: the first Poll has no Poll before it to
// agree with; a file written in place while it reads (truncated, half
// written, then finished) is read again until two reads agree, and the
// finished content is what it returns, in every order of the writer's
// steps and the reads.
func TestFirstPollWaitsForStableFile(t *testing.T) {
	full := "a: {tier: pro, requests_per_sec: 150}\n"
	for round := range 16 {
		path := filepath.Join(t.TempDir(), "policies.yaml")
		if err := os.WriteFile(path, []byte(full), 0o644); err != nil {
			t.Fatal(err)
		}
		f := NewFile(path, Default(), "")
		f.settle = 250 * time.Millisecond
		w, err := os.OpenFile(path, os.O_WRONLY|os.O_TRUNC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.WriteString("a: {tier: pro, requests_per_sec: 1"); err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			defer w.Close()
			// The rest comes within a settle, at any moment in it.
			time.Sleep(time.Duration(round%4) * 30 * time.Millisecond)
			w.WriteString("50}\n")
		}()
		p, changed, err := f.Poll()
		<-done
		if err != nil || !changed || p["a"].RequestsPerSec != 150 {
			t.Fatalf("round %d: first Poll %v %v %v; want the finished file's 150", round, p, changed, err)
		}
	}
}

func TestFileResume(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policies.yaml")
	if err := os.WriteFile(path, []byte("a: {tier: pro}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	f := NewFile(path, Default(), "")
	f.Resume([]byte("a: {tier: pro}\n"))
	if _, changed, err := f.Poll(); err != nil || changed || f.Pending() {
		t.Fatalf("the content resumed: changed %v, %v, pending %v; want no change", changed, err, f.Pending())
	}
	f = NewFile(path, Default(), "")
	f.Resume([]byte("a: {tier: lite}\n"))
	if _, changed, err := f.Poll(); err != nil || changed || !f.Pending() {
		t.Fatalf("another content: changed %v, %v, pending %v; want it pending", changed, err, f.Pending())
	}
	if p, changed, err := f.Poll(); err != nil || !changed || p["a"].Tier != "pro" {
		t.Fatalf("another content, second Poll: %v %v %v", p, changed, err)
	}
}

// The policies file's content kept in the store: none at first, the last
// saved after.
func TestStoreAccepted(t *testing.T) {
	s, err := Open(t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, found, err := s.LoadAccepted(); err != nil || found {
		t.Fatalf("empty store: found %v, %v", found, err)
	}
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for _, c := range []string{"a: {tier: pro}\n", ""} {
		if err := s.SaveAccepted(Accepted{Path: "/etc/p.yaml", Content: []byte(c), At: at}); err != nil {
			t.Fatal(err)
		}
		a, found, err := s.LoadAccepted()
		if err != nil || !found || a.Path != "/etc/p.yaml" || string(a.Content) != c || !a.At.Equal(at) {
			t.Fatalf("saved %q: %+v %v %v", c, a, found, err)
		}
	}
}

// A file that fails to parse is never quoted beyond a short, escaped
// excerpt of the offending key: not its values, not the parser's quotes of
// the text, not a long key. Before, 'policies_file: /etc/shadow' logged the
// file's first line ("root:*:20228:0:99999:7::" as an invalid project name)
// at ERROR, and a bad value was quoted by the YAML parser.
func TestParseFileQuotesNoContent(t *testing.T) {
	secret := "s3cr3t-VALUE-xyz-0123456789"
	for _, in := range []string{
		"root:" + secret + ":20228:0:99999:7:::\ndaemon:*:20228:0:99999:7:::\n",
		"a: {tier: \"" + secret + "\"}\n",
		"a: {shares: " + secret + "}\n",
		"a: {connections_per_sec: " + secret + "}\n",
		"a: {" + secret + ": 1}\n",
		"a: {enforce: " + secret + "}\n",
		"a: [" + secret + "\n",
		"a: {tier: pro}\n" + secret + " \x01\n",
	} {
		_, err := ParseFile([]byte(in), Default())
		if err == nil || !errors.Is(err, ErrInvalid) {
			t.Errorf("%q: %v, want ErrInvalid", in, err)
			continue
		}
		if strings.Contains(err.Error(), secret) || strings.Contains(err.Error(), secret[:excerptLen+1]) {
			t.Errorf("%q: the error quotes the file: %v", in, err)
		}
	}
	// The offending key is named by an excerpt, escaped.
	_, err := ParseFile([]byte("a: {\"bad\\x01key-that-is-rather-long\": 1}\n"), Default())
	if err == nil || !strings.Contains(err.Error(), `"bad\x01key-that-is-"...`) {
		t.Errorf("unknown key: %v, want its escaped excerpt", err)
	}
}

// A policies file outside the configuration's directory that fails at its
// first line is not the operator's YAML: the error says only that.
func TestFileNotAPoliciesFile(t *testing.T) {
	dir, other := t.TempDir(), t.TempDir()
	shadow := filepath.Join(other, "shadow")
	if err := os.WriteFile(shadow, []byte("root:*:20228:0:99999:7:::\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err := NewFile(shadow, Default(), dir).Poll()
	if err == nil || !strings.HasSuffix(err.Error(), "not a policies file: "+ErrInvalid.Error()) || strings.Contains(err.Error(), "root") {
		t.Errorf("outside the config dir: %v, want only 'not a policies file'", err)
	}
	// Inside the configuration's directory it is the operator's file: the
	// line and the excerpt help them fix it.
	mine := filepath.Join(dir, "policies.yaml")
	if err := os.WriteFile(mine, []byte("root:*:20228:0:99999:7:::\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err = NewFile(mine, Default(), dir).Poll()
	if err == nil || !strings.Contains(err.Error(), `line 1: "root:*:20228:0:9"... is not a project name`) {
		t.Errorf("inside the config dir: %v", err)
	}
	// A policies file with a bad value at its first line is one, wherever
	// it is (a ConfigMap's mount): its error says what is wrong.
	cm := filepath.Join(other, "policies.yaml")
	if err := os.WriteFile(cm, []byte("alpha: {tier: lite, shares: -1}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, err = NewFile(cm, Default(), dir).Poll()
	if err == nil || !strings.Contains(err.Error(), "line 1: project alpha: shares must be") {
		t.Errorf("a bad value outside the config dir: %v", err)
	}
}

// A file written again at every poll with the same new content (an agent
// that renders it each time) is applied at the second read: its times
// differ between the reads, not its content.
func TestPollAppliesContentRewrittenEachTime(t *testing.T) {
	path := filepath.Join(t.TempDir(), "policies.yaml")
	write := func(s string) { t.Helper(); renameInto(t, path, s) }
	write("alpha: {shares: 2}\n")
	f := NewFile(path, Policy{Tier: "none", Shares: 1}, "")
	if _, changed, err := f.Poll(); err != nil || !changed {
		t.Fatalf("first poll: %v %v", changed, err)
	}
	applied := false
	for i := range 3 {
		write("alpha: {shares: 3}\n") // a new inode and time each time
		p, changed, err := f.Poll()
		if err != nil {
			t.Fatal(err)
		}
		if changed {
			if p["alpha"].Shares != 3 {
				t.Fatalf("applied %+v", p)
			}
			applied = true
			if i != 1 {
				t.Fatalf("applied at read %d, want the second", i+1)
			}
			break
		}
	}
	if !applied {
		t.Fatal("content rewritten at every poll was never applied")
	}
}

// renameInto writes content to path as a save by rename does: a new file
// renamed over it.
func renameInto(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path+".tmp", []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}
