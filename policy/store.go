// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"
)

// ErrLocked means another process (normally the running daemon) holds the
// store open.
var ErrLocked = errors.New("policy store is locked by another process")

// FileName is the store's file name inside the state directory.
const FileName = "policies.db"

var (
	bucketPolicies = []byte("policies")
	bucketMeta     = []byte("meta")
	keyVersion     = []byte("version")
)

// Options tune Open.
type Options struct {
	// Timeout bounds the wait for bbolt's file lock; 0 means one second.
	Timeout time.Duration
	// ReadOnly opens with a shared lock and refuses writes.
	ReadOnly bool
}

// Store is the persistent policy table. Its methods are safe for concurrent
// use; bbolt serialises writers.
type Store struct {
	db   *bolt.DB
	path string
}

// Entry is one stored policy.
type Entry struct {
	Project string `json:"project"`
	Policy
	// Source says where the policy in force comes from: "" (the store,
	// set with the CLI) or "file" (the policies file).
	Source string `json:"source,omitempty"`
}

// SourceFile marks an Entry of the policies file.
const SourceFile = "file"

// ErrFromFile means a project's policy comes from the policies file, which
// owns it: change it there.
var ErrFromFile = errors.New("the project's policy comes from the policies file")

// FromFile is the refusal of a change to project, which the policies file
// at path names: the daemon's, and the CLI's when no daemon answers.
func FromFile(path, project string) error {
	return fmt.Errorf("%w %s: %s's policy is set there; edit the file to change it", ErrFromFile, path, project)
}

// Merge returns the policies in force: stored, with the policies file's
// (file) in place of the stored ones of the projects it names, sorted by
// project.
func Merge(stored []Entry, file map[string]Policy) []Entry {
	out := make([]Entry, 0, len(stored)+len(file))
	for _, e := range stored {
		if _, ok := file[e.Project]; !ok {
			out = append(out, e)
		}
	}
	for name, p := range file {
		out = append(out, Entry{Project: name, Policy: p, Source: SourceFile})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Project < out[j].Project })
	return out
}

// Open opens (creating if needed) the store in dir.
func Open(dir string, opts Options) (*Store, error) {
	if opts.Timeout == 0 {
		opts.Timeout = time.Second
	}
	path := filepath.Join(dir, FileName)
	if !opts.ReadOnly {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("creating state dir: %w", err)
		}
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: opts.Timeout, ReadOnly: opts.ReadOnly})
	if errors.Is(err, bolterrors.ErrTimeout) {
		return nil, fmt.Errorf("%w: %s stayed locked for %s", ErrLocked, path, opts.Timeout)
	}
	if err != nil {
		return nil, fmt.Errorf("opening policy store %s: %w", path, err)
	}
	s := &Store{db: db, path: path}
	if !opts.ReadOnly {
		err = db.Update(func(tx *bolt.Tx) error {
			if _, err := tx.CreateBucketIfNotExists(bucketPolicies); err != nil {
				return err
			}
			_, err := tx.CreateBucketIfNotExists(bucketMeta)
			return err
		})
		if err != nil {
			db.Close()
			return nil, fmt.Errorf("initialising policy store %s: %w", path, err)
		}
	}
	return s, nil
}

// Path returns the store's file path.
func (s *Store) Path() string { return s.path }

// Close releases the file and its lock.
func (s *Store) Close() error { return s.db.Close() }

// Get returns the project's policy and whether one is stored.
func (s *Store) Get(project string) (Policy, bool, error) {
	var p Policy
	var found bool
	err := s.db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketPolicies)
		if b == nil {
			return nil
		}
		v := b.Get([]byte(project))
		if v == nil {
			return nil
		}
		found = true
		return json.Unmarshal(v, &p)
	})
	if err != nil {
		return Policy{}, false, fmt.Errorf("reading policy of %s: %w", project, err)
	}
	return p, found, nil
}

// List returns every stored policy, sorted by project.
func (s *Store) List() ([]Entry, error) {
	var out []Entry
	err := s.db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketPolicies)
		if b == nil {
			return nil
		}
		return b.ForEach(func(k, v []byte) error {
			e := Entry{Project: string(k)}
			if err := json.Unmarshal(v, &e.Policy); err != nil {
				return fmt.Errorf("decoding %s: %w", k, err)
			}
			out = append(out, e)
			return nil
		})
	})
	if err != nil {
		return nil, fmt.Errorf("listing policies: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Project < out[j].Project })
	return out, nil
}

// Put stores p for project after validating both.
func (s *Store) Put(project string, p Policy) error {
	_, err := s.Update(project, func(Policy, bool) (Policy, error) { return p, nil })
	return err
}

// Update replaces project's policy with fn(old, found) in one transaction, so
// concurrent patches of different fields do not lose each other's writes.
// It returns the stored policy; nothing is written if fn or validation fails.
func (s *Store) Update(project string, fn func(old Policy, found bool) (Policy, error)) (Policy, error) {
	if err := ValidateProject(project); err != nil {
		return Policy{}, err
	}
	var out Policy
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketPolicies)
		var old Policy
		v := b.Get([]byte(project))
		if v != nil {
			if err := json.Unmarshal(v, &old); err != nil {
				return fmt.Errorf("decoding stored policy: %w", err)
			}
			// A value stored out of today's bounds is taken as it is
			// enforced, so a patch of another field is not refused for it.
			old, _ = old.InBounds()
		}
		p, err := fn(old, v != nil)
		if err != nil {
			return err
		}
		if err := p.Validate(); err != nil {
			return err
		}
		buf, err := json.Marshal(p)
		if err != nil {
			return err
		}
		if err := b.Put([]byte(project), buf); err != nil {
			return err
		}
		out = p
		return bumpVersion(tx)
	})
	if err != nil {
		return Policy{}, fmt.Errorf("saving policy of %s: %w", project, err)
	}
	return out, nil
}

// Repair writes every stored policy that is out of bounds back within them
// (Policy.InBounds), in one transaction, and returns what it changed by
// project.
func (s *Store) Repair() (map[string][]string, error) {
	out := map[string][]string{}
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketPolicies)
		type fix struct {
			key []byte
			p   Policy
		}
		var fixes []fix
		err := b.ForEach(func(k, v []byte) error {
			var p Policy
			if err := json.Unmarshal(v, &p); err != nil {
				return fmt.Errorf("decoding %s: %w", k, err)
			}
			if q, changed := p.InBounds(); len(changed) > 0 {
				fixes = append(fixes, fix{bytes.Clone(k), q})
				out[string(k)] = changed
			}
			return nil
		})
		if err != nil || len(fixes) == 0 {
			return err
		}
		for _, f := range fixes {
			buf, err := json.Marshal(f.p)
			if err != nil {
				return err
			}
			if err := b.Put(f.key, buf); err != nil {
				return err
			}
		}
		return bumpVersion(tx)
	})
	if err != nil {
		return nil, fmt.Errorf("repairing stored policies: %w", err)
	}
	return out, nil
}

// Patch applies pt to project's policy (def if none is stored) and stores it.
func (s *Store) Patch(project string, pt Patch, def Policy) (Policy, error) {
	return s.Update(project, func(old Policy, found bool) (Policy, error) {
		if !found {
			old = def
		}
		return pt.Apply(old)
	})
}

// Delete removes project's policy and reports whether there was one.
func (s *Store) Delete(project string) (bool, error) {
	if err := ValidateProject(project); err != nil {
		return false, err
	}
	var found bool
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketPolicies)
		if b.Get([]byte(project)) == nil {
			return nil
		}
		found = true
		if err := b.Delete([]byte(project)); err != nil {
			return err
		}
		return bumpVersion(tx)
	})
	if err != nil {
		return false, fmt.Errorf("deleting policy of %s: %w", project, err)
	}
	return found, nil
}

// Version returns the write counter: it changes on every successful write.
func (s *Store) Version() (uint64, error) {
	var v uint64
	err := s.db.View(func(tx *bolt.Tx) error {
		if b := tx.Bucket(bucketMeta); b != nil {
			if raw := b.Get(keyVersion); len(raw) == 8 {
				v = binary.BigEndian.Uint64(raw)
			}
		}
		return nil
	})
	return v, err
}

// bumpVersion increments the version inside the write transaction tx, so
// the counter and the change commit (or not) together.
func bumpVersion(tx *bolt.Tx) error {
	b := tx.Bucket(bucketMeta)
	var v uint64
	if raw := b.Get(keyVersion); len(raw) == 8 {
		v = binary.BigEndian.Uint64(raw)
	}
	var buf [8]byte
	binary.BigEndian.PutUint64(buf[:], v+1)
	return b.Put(keyVersion, buf[:])
}
