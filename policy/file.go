// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"

	"go.yaml.in/yaml/v3"
)

// MaxFileSize bounds a policies file: a file larger than this is a mistake
// (or an attack on the daemon's memory), not a node's policies.
const MaxFileSize = 4 << 20

// ParseFile decodes a policies file: a YAML mapping from project name to
// policy, each with the fields of Policy (tier, shares, requests_per_sec,
// work_per_sec, connections_per_sec, enforce); a field left out takes its value from def. An empty file,
// or `{}`, holds no policies. The file is refused as a whole, with the first
// error naming the project and field, if any name or policy is invalid or a
// key is unknown.
func ParseFile(b []byte, def Policy) (map[string]Policy, error) {
	if len(b) > MaxFileSize {
		return nil, fmt.Errorf("%w: the file is larger than %d bytes", ErrInvalid, MaxFileSize)
	}
	out := map[string]Policy{}
	if len(bytes.TrimSpace(b)) == 0 {
		return out, nil
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	if len(doc.Content) == 0 {
		return out, nil
	}
	root := doc.Content[0]
	if root.Kind == yaml.ScalarNode && root.Tag == "!!null" {
		return out, nil
	}
	if root.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%w: line %d: the file must map project names to policies", ErrInvalid, root.Line)
	}
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		name := k.Value
		if k.Kind != yaml.ScalarNode {
			return nil, fmt.Errorf("%w: line %d: a project name must be a string", ErrInvalid, k.Line)
		}
		if err := ValidateProject(name); err != nil {
			return nil, fmt.Errorf("line %d: %w", k.Line, err)
		}
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("%w: line %d: project %s is named twice", ErrInvalid, k.Line, name)
		}
		p := def
		if v.Kind != yaml.MappingNode && !(v.Kind == yaml.ScalarNode && v.Tag == "!!null") {
			return nil, fmt.Errorf("%w: line %d: the policy of %s must be a mapping of its fields", ErrInvalid, v.Line, name)
		}
		if v.Kind == yaml.MappingNode {
			if err := decodeStrict(v, &p); err != nil {
				return nil, fmt.Errorf("%w: line %d: project %s: %w", ErrInvalid, v.Line, name, err)
			}
		}
		if err := p.Validate(); err != nil {
			return nil, fmt.Errorf("line %d: project %s: %w", v.Line, name, err)
		}
		out[name] = p
	}
	return out, nil
}

// decodeStrict decodes a policy node, refusing unknown fields.
func decodeStrict(n *yaml.Node, p *Policy) error {
	// The yaml tags of Policy are its json names.
	var fields struct {
		Tier           *string  `yaml:"tier"`
		Shares         *int     `yaml:"shares"`
		RequestsPerSec *float64 `yaml:"requests_per_sec"`
		WorkPerSec     *float64 `yaml:"work_per_sec"`
		Enforce        *bool    `yaml:"enforce"`
		ConnPerSec     *float64 `yaml:"connections_per_sec"`
	}
	b, err := yaml.Marshal(n)
	if err != nil {
		return err
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&fields); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	pt := Patch{Tier: fields.Tier, Shares: fields.Shares, RequestsPerSec: fields.RequestsPerSec, WorkPerSec: fields.WorkPerSec,
		ConnectionsPerSec: fields.ConnPerSec, Enforce: fields.Enforce}
	np, _ := pt.Apply(*p)
	*p = np
	return nil
}

// File follows a policies file, such as a ConfigMap mounted into the
// daemon's pod. Poll reads it again only when what the path resolves to has
// changed (kubelet updates a ConfigMap by swapping a symlink, so the path
// then names another file) and its content differs.
type File struct {
	path string
	def  Policy

	// what the last Poll saw
	stat    os.FileInfo
	sum     [sha256.Size]byte
	read    bool
	lastErr string
}

// NewFile follows the policies file at path; def fills fields a policy
// leaves out.
func NewFile(path string, def Policy) *File { return &File{path: path, def: def} }

// Path is the file's path.
func (f *File) Path() string { return f.path }

// Poll returns the file's policies when they changed since the last Poll
// (changed true), or changed false. A file that cannot be read or does not
// validate is an error, once per distinct error and content: the caller
// keeps the policies it has. A missing file holds no policies.
func (f *File) Poll() (policies map[string]Policy, changed bool, err error) {
	st, err := os.Stat(f.path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return f.fail(fmt.Errorf("policies file %s: %w", f.path, err))
	}
	if st != nil && f.stat != nil && f.read && os.SameFile(st, f.stat) &&
		st.ModTime().Equal(f.stat.ModTime()) && st.Size() == f.stat.Size() {
		return nil, false, nil
	}
	var b []byte
	if st != nil {
		if !st.Mode().IsRegular() {
			return f.fail(fmt.Errorf("policies file %s is not a regular file", f.path))
		}
		r, err := os.Open(f.path)
		if err != nil {
			return f.fail(fmt.Errorf("policies file %s: %w", f.path, err))
		}
		b, err = io.ReadAll(io.LimitReader(r, MaxFileSize+1))
		r.Close()
		if err != nil {
			return f.fail(fmt.Errorf("policies file %s: %w", f.path, err))
		}
	}
	sum := sha256.Sum256(b)
	if f.read && sum == f.sum && f.lastErr == "" {
		f.stat = st
		return nil, false, nil
	}
	p, err := ParseFile(b, f.def)
	f.stat, f.sum = st, sum
	if err != nil {
		f.read = true
		return f.fail(fmt.Errorf("policies file %s refused, the previous policies stay: %w", f.path, err))
	}
	f.read, f.lastErr = true, ""
	return p, true, nil
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
