// SPDX-License-Identifier: Apache-2.0

package policy

import (
	"encoding/json"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"
)

// bucketFile holds the policies file's content as the daemon last put it
// in force (keyAccepted -> Accepted), so that a daemon that starts with a
// file that does not validate keeps the file's policies rather than none.
var (
	bucketFile  = []byte("policies_file")
	keyAccepted = []byte("accepted")
)

// Accepted is a policies file's content as the daemon last put it in
// force, and when.
type Accepted struct {
	// Path is the file's path then: the content of another file is not
	// this one's.
	Path    string    `json:"path"`
	Content []byte    `json:"content"`
	At      time.Time `json:"at"`
}

// SaveAccepted stores a in place of the policies file's content stored
// before.
func (s *Store) SaveAccepted(a Accepted) error {
	buf, err := json.Marshal(a)
	if err != nil {
		return err
	}
	err = s.db.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucketIfNotExists(bucketFile)
		if err != nil {
			return err
		}
		if err := b.Put(keyAccepted, buf); err != nil {
			return err
		}
		return bumpVersion(tx)
	})
	if err != nil {
		return fmt.Errorf("saving the policies file's content: %w", err)
	}
	return nil
}

// ClearAccepted forgets the policies file's content stored before, if any:
// for a daemon that runs without a policies file, whose policies are then
// in force no longer.
func (s *Store) ClearAccepted() error {
	err := s.db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketFile)
		if b == nil || b.Get(keyAccepted) == nil {
			return nil
		}
		if err := b.Delete(keyAccepted); err != nil {
			return err
		}
		return bumpVersion(tx)
	})
	if err != nil {
		return fmt.Errorf("clearing the policies file's content: %w", err)
	}
	return nil
}

// LoadAccepted returns the policies file's content stored last, and
// whether there is one.
func (s *Store) LoadAccepted() (Accepted, bool, error) {
	var a Accepted
	var found bool
	err := s.db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketFile)
		if b == nil {
			return nil
		}
		v := b.Get(keyAccepted)
		if v == nil {
			return nil
		}
		found = true
		return json.Unmarshal(v, &a)
	})
	if err != nil {
		return Accepted{}, false, fmt.Errorf("reading the policies file's content: %w", err)
	}
	return a, found, nil
}
