// SPDX-License-Identifier: Apache-2.0

package project

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// MaxLen is the longest project name accepted, in bytes.
const MaxLen = 64

// ErrInvalid is wrapped by every error of Validate.
var ErrInvalid = errors.New("invalid project name")

// Validate reports whether name can be a project (see the package
// documentation for the rule). Its errors wrap ErrInvalid and quote the name,
// so they are safe to print.
func Validate(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: the project name is empty", ErrInvalid)
	case len(name) > MaxLen:
		return fmt.Errorf("%w: the project name is longer than %d bytes (%d)", ErrInvalid, MaxLen, len(name))
	case !plain(name):
		return fmt.Errorf("%w: %q may use only letters, digits, '.', '_' and '-', and must start with a letter or digit", ErrInvalid, name)
	case strings.HasPrefix(name, "cgroup."):
		return fmt.Errorf("%w: %q would collide with cgroupfs control files", ErrInvalid, name)
	}
	return nil
}

// plain checks the character set: [A-Za-z0-9][A-Za-z0-9._-]*.
func plain(name string) bool {
	for i := 0; i < len(name); i++ {
		c := name[i]
		alnum := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
		if !alnum && (i == 0 || c != '.' && c != '_' && c != '-') {
			return false
		}
	}
	return true
}

// Display returns name as it may be printed in a table, a log line or a
// terminal: unchanged when it is printable ASCII without spaces, quotes or
// backslashes (every valid name, and the daemon's own markers such as
// "(other)" or "#1234"), else quoted with Go escapes, so a newline, a tab or
// a terminal escape sequence shows as \n, \t or \x1b and cannot forge a row.
// The empty name is shown as "".
func Display(name string) string {
	if name == "" {
		return `""`
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c >= 0x7f || c == '"' || c == '\\' {
			return strconv.QuoteToASCII(name)
		}
	}
	return name
}
