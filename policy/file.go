// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/fairshare-dev/fairshare/internal/project"
	"go.yaml.in/yaml/v3"
)

// MaxFileSize bounds a policies file: a file larger than this is a mistake
// (or an attack on the daemon's memory), not a node's policies.
const MaxFileSize = 4 << 20

// ParseFile decodes a policies file: a YAML mapping from project name to
// policy, each with the fields of Policy (tier, shares, requests_per_sec,
// work_per_sec, connections_per_sec, accepts_per_sec, enforce); a field left
// out takes its value from def. An empty file, or `{}`, holds no policies.
// The file is refused as a whole, with the first error naming the line, the
// project and the field, if any name or policy is invalid or a key is
// unknown.
//
// An error never quotes the file beyond a short, escaped excerpt of the
// offending key (see excerpt): the path may name a file that is not a
// policies file at all (/etc/shadow), and the error goes to the log. Errors
// are *FileError, which wrap ErrInvalid.
func ParseFile(b []byte, def Policy) (map[string]Policy, error) {
	if len(b) > MaxFileSize {
		return nil, &FileError{Msg: fmt.Sprintf("the file is larger than %d bytes", MaxFileSize)}
	}
	out := map[string]Policy{}
	if len(bytes.TrimSpace(b)) == 0 {
		return out, nil
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return nil, yamlError(err)
	}
	if len(doc.Content) == 0 {
		return out, nil
	}
	root := doc.Content[0]
	if root.Kind == yaml.ScalarNode && root.Tag == "!!null" {
		return out, nil
	}
	if root.Kind != yaml.MappingNode {
		return nil, notPolicies(root.Line, "the file must map project names to policies")
	}
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		name := k.Value
		if k.Kind != yaml.ScalarNode {
			return nil, notPolicies(k.Line, "a project name must be a string")
		}
		if err := ValidateProject(name); err != nil {
			return nil, notPolicies(k.Line, "%s is not a project name (letters, digits, '.', '_' and '-', starting with a letter or digit, at most %d bytes)",
				excerpt(name), project.MaxLen)
		}
		if _, dup := out[name]; dup {
			return nil, fileErr(k.Line, "project %s is named twice", name)
		}
		p := def
		if v.Kind != yaml.MappingNode && !(v.Kind == yaml.ScalarNode && v.Tag == "!!null") {
			return nil, notPolicies(v.Line, "the policy of %s must be a mapping of its fields", name)
		}
		if v.Kind == yaml.MappingNode {
			if err := decodeStrict(v, &p); err != nil {
				return nil, fileErr(v.Line, "project %s: %v", name, err)
			}
		}
		if !validTier(p.Tier) {
			// Validate would quote the value.
			return nil, fileErr(v.Line, "project %s: tier must be pro, lite or none", name)
		}
		if err := p.Validate(); err != nil {
			// The other fields are numbers and a bool, which Validate
			// quotes as numbers.
			return nil, fileErr(v.Line, "project %s: %v", name, strings.TrimPrefix(err.Error(), ErrInvalid.Error()+": "))
		}
		out[name] = p
	}
	return out, nil
}

// FileError is why a policies file was refused: the line (1-based; 0 when
// the parser did not say) and a message that quotes at most an excerpt of
// the offending key. Shape is set when the text is not shaped as a
// policies file at all (not YAML, not a mapping of project names to
// mappings), as opposed to a policies file with a bad field or value.
type FileError struct {
	Line  int
	Msg   string
	Shape bool
}

func (e *FileError) Error() string {
	if e.Line > 0 {
		return fmt.Sprintf("%v: line %d: %s", ErrInvalid, e.Line, e.Msg)
	}
	return fmt.Sprintf("%v: %s", ErrInvalid, e.Msg)
}

// Unwrap makes a FileError an ErrInvalid.
func (e *FileError) Unwrap() error { return ErrInvalid }

func fileErr(line int, format string, args ...any) *FileError {
	return &FileError{Line: line, Msg: fmt.Sprintf(format, args...)}
}

// notPolicies is fileErr for text not shaped as a policies file.
func notPolicies(line int, format string, args ...any) *FileError {
	e := fileErr(line, format, args...)
	e.Shape = true
	return e
}

// excerptLen is the most of a key an error quotes.
const excerptLen = 16

// excerpt is a key as an error quotes it: its first excerptLen bytes,
// escaped, and "..." when there was more.
func excerpt(key string) string {
	if len(key) <= excerptLen {
		return strconv.Quote(key)
	}
	return strconv.Quote(key[:excerptLen]) + "..."
}

// yamlLine finds the line number in a YAML parser's message.
var yamlLine = regexp.MustCompile(`line (\d+)`)

// yamlError turns the parser's error into a FileError with its line and
// none of its quotes (the parser quotes the text it stumbled on).
func yamlError(err error) *FileError {
	line := 0
	if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
		line, _ = strconv.Atoi(m[1])
	}
	return &FileError{Line: line, Msg: "not valid YAML", Shape: true}
}

// policyFields are the fields of a policy in a file, by their YAML name.
var policyFields = map[string]string{
	"tier": "a string", "shares": "a whole number", "requests_per_sec": "a number", "work_per_sec": "a number",
	"connections_per_sec": "a number", "accepts_per_sec": "a number", "enforce": "true or false",
}

// decodeStrict decodes a policy node, refusing unknown fields. Its errors
// name the field (an unknown one by an excerpt) and never the value.
func decodeStrict(n *yaml.Node, p *Policy) error {
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := n.Content[i]
		if _, ok := policyFields[k.Value]; !ok || k.Kind != yaml.ScalarNode {
			return fmt.Errorf("unknown field %s (the fields are tier, shares, requests_per_sec, work_per_sec, connections_per_sec, accepts_per_sec, enforce)",
				excerpt(k.Value))
		}
	}
	var fields struct {
		Tier           *string  `yaml:"tier"`
		Shares         *int     `yaml:"shares"`
		RequestsPerSec *float64 `yaml:"requests_per_sec"`
		WorkPerSec     *float64 `yaml:"work_per_sec"`
		Enforce        *bool    `yaml:"enforce"`
		ConnPerSec     *float64 `yaml:"connections_per_sec"`
		AcceptsPerSec  *float64 `yaml:"accepts_per_sec"`
	}
	if err := n.Decode(&fields); err != nil {
		// A value of the wrong type: find which field, by decoding each.
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			var dst any
			switch k.Value {
			case "tier":
				dst = new(string)
			case "shares":
				dst = new(int)
			case "enforce":
				dst = new(bool)
			default:
				dst = new(float64)
			}
			if v.Decode(dst) != nil {
				return fmt.Errorf("%s must be %s", k.Value, policyFields[k.Value])
			}
		}
		return errors.New("a value of the wrong type")
	}
	pt := Patch{Tier: fields.Tier, Shares: fields.Shares, RequestsPerSec: fields.RequestsPerSec, WorkPerSec: fields.WorkPerSec,
		ConnectionsPerSec: fields.ConnPerSec, AcceptsPerSec: fields.AcceptsPerSec, Enforce: fields.Enforce}
	np, _ := pt.Apply(*p)
	*p = np
	return nil
}

// File follows a policies file, such as a ConfigMap mounted into the
// daemon's pod. Poll reads it again only when what the path resolves to has
// changed (kubelet updates a ConfigMap by swapping a symlink, so the path
// then names another file) and its content differs.
//
// A content that differs from the one last put in force (or refused) is a
// change only once two Polls in a row read it the same (the same file, size
// and modification time, and the same checksum): an editor that saves in
// place truncates the file and then writes it, and a Poll between the two,
// or in the middle of the write, would read an empty file or a part of one.
// A file removed to be replaced (a save by rename) is the same: a missing
// file holds no policies, once the next Poll finds it missing still.
type File struct {
	path string
	def  Policy
	// dir is the directory of the configuration that named the file ("":
	// none): a file outside it that fails at its first line is not the
	// operator's policies file, and its error says only that.
	dir string

	// the content last put in force or refused (read: there is one); stat
	// is nil when it was not read by this File (Resume) or the last Poll
	// could not read the file
	stat     os.FileInfo
	sum      [sha256.Size]byte
	read     bool
	accepted []byte // the content last put in force
	lastErr  string
	// pending is a content that differs from the one above, as the last
	// Poll read it: it is put in force (or refused) when the next Poll
	// reads it the same.
	pending *seen
	// settle is the wait between the first Poll's reads.
	settle time.Duration
}

// seen is a content as one Poll read it.
type seen struct {
	stat os.FileInfo // nil: no file
	sum  [sha256.Size]byte
}

// NewFile follows the policies file at path; def fills fields a policy
// leaves out. configDir is the directory of the configuration file that
// named it ("" when none did): a file outside it whose first line is not
// shaped as a policies file (not YAML, not a mapping of project names to
// mappings) is refused as "not a policies file", with no detail at all.
func NewFile(path string, def Policy, configDir string) *File {
	return &File{path: path, def: def, dir: configDir, settle: 50 * time.Millisecond}
}

// Resume makes content, put in force from this file before (by an earlier
// run of the daemon), the content the next Poll compares with: the same
// content is no change, and another one is a change as for any Poll but
// the first, put in force once a second Poll reads it the same.
func (f *File) Resume(content []byte) {
	f.stat, f.sum, f.read, f.lastErr, f.pending = nil, sha256.Sum256(content), true, "", nil
	f.accepted = bytes.Clone(content)
}

// Accepted is the content last put in force: what the last Poll that
// returned changed read, or what Resume was given.
func (f *File) Accepted() []byte { return f.accepted }

// Pending says whether the last Poll read a change it has not put in force
// yet: the next Poll will, if it reads the same.
func (f *File) Pending() bool { return f.pending != nil }

// foreign says whether path is outside dir (always, without a dir).
func foreign(path, dir string) bool {
	if dir == "" {
		return true
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return true
	}
	d, err := filepath.Abs(dir)
	if err != nil {
		return true
	}
	rel, err := filepath.Rel(d, abs)
	return err != nil || rel == ".." || strings.HasPrefix(rel, "../")
}

// Path is the file's path.
func (f *File) Path() string { return f.path }

// sameStat says whether a and b (nil: no file) are the same file, of the
// same size and modification time.
func sameStat(a, b os.FileInfo) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return os.SameFile(a, b) && a.ModTime().Equal(b.ModTime()) && a.Size() == b.Size()
}

// Poll returns the file's policies when they changed since the last Poll
// (changed true), or changed false. The first Poll returns what it reads
// once two reads a moment apart (settle) agree; a later one returns a change only when the Poll before read the same
// content (see File), and until then changed is false. A file that cannot
// be read or does not validate is an error, once per distinct error and
// content: the caller keeps the policies it has. A missing file holds no
// policies.
func (f *File) Poll() (policies map[string]Policy, changed bool, err error) {
	st, err := os.Stat(f.path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return f.failRead(fmt.Errorf("policies file %s: %w", f.path, err))
	}
	if st != nil && f.stat != nil && f.read && f.pending == nil && sameStat(st, f.stat) {
		return nil, false, nil
	}
	st, b, err := f.readAt(st)
	if err != nil {
		return f.failRead(err)
	}
	sum := sha256.Sum256(b)
	// The first read has no Poll before it to agree with: it is read
	// again a moment later, until two reads agree (a file being written
	// in place at the daemon's start is not put in force half-written).
	for i := 0; !f.read && i < firstReads; i++ {
		time.Sleep(f.settle)
		st2, err := os.Stat(f.path)
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return f.failRead(fmt.Errorf("policies file %s: %w", f.path, err))
		}
		st2, b2, err := f.readAt(st2)
		if err != nil {
			return f.failRead(err)
		}
		sum2 := sha256.Sum256(b2)
		if sum2 == sum && (st2 == nil) == (st == nil) {
			break
		}
		st, b, sum = st2, b2, sum2
	}
	if f.read && sum == f.sum {
		f.stat, f.pending = st, nil
		if f.lastErr == "" {
			return nil, false, nil
		}
		// The content of the last error: read again, as the error may
		// have been the reading's.
	} else if f.read {
		// A change: put in force once the next Poll reads the same
		// content (the file's times may differ: a file written again at
		// every tick with the same content is applied).
		if p := f.pending; p == nil || p.sum != sum || (st == nil) != (p.stat == nil) {
			f.pending = &seen{stat: st, sum: sum}
			return nil, false, nil
		}
		f.pending = nil
	}
	p, err := ParseFile(b, f.def)
	f.stat, f.sum, f.read = st, sum, true
	if err != nil {
		var fe *FileError
		if errors.As(err, &fe) && fe.Shape && fe.Line <= 1 && foreign(f.path, f.dir) {
			return f.fail(fmt.Errorf("policies file %s refused, the previous policies stay: not a policies file: %w", f.path, ErrInvalid))
		}
		return f.fail(fmt.Errorf("policies file %s refused, the previous policies stay: %w", f.path, err))
	}
	f.lastErr, f.accepted = "", b
	return p, true, nil
}

// firstReads bounds the reads again of the first Poll (File.settle apart).
const firstReads = 20

// readAt reads the file that st (nil: none) describes: no file holds nothing.
func (f *File) readAt(st os.FileInfo) (os.FileInfo, []byte, error) {
	if st == nil {
		return nil, nil, nil
	}
	if !st.Mode().IsRegular() {
		return nil, nil, fmt.Errorf("policies file %s is not a regular file", f.path)
	}
	r, err := os.Open(f.path)
	if err != nil {
		return nil, nil, fmt.Errorf("policies file %s: %w", f.path, err)
	}
	defer r.Close()
	b, err := io.ReadAll(io.LimitReader(r, MaxFileSize+1))
	if err != nil {
		return nil, nil, fmt.Errorf("policies file %s: %w", f.path, err)
	}
	return st, b, nil
}

// failRead is fail for a file that could not be read: the next Poll reads
// it again whatever its stat says, and a change read before it waits for
// two Polls in a row again.
func (f *File) failRead(err error) (map[string]Policy, bool, error) {
	f.stat, f.pending = nil, nil
	return f.fail(err)
}

// fail returns err the first time it is seen for the current content.
func (f *File) fail(err error) (map[string]Policy, bool, error) {
	if err.Error() == f.lastErr {
		return nil, false, nil
	}
	f.lastErr = err.Error()
	return nil, false, err
}

// Names lists the projects of policies, sorted.
func Names(policies map[string]Policy) []string {
	out := make([]string, 0, len(policies))
	for n := range policies {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}
