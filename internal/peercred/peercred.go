// SPDX-License-Identifier: Apache-2.0

package peercred

import (
	"errors"
	"fmt"
	"net"

	"golang.org/x/sys/unix"
)

// Cred is a peer's credentials at connect time.
type Cred struct {
	PID      int32
	UID, GID uint32
}

// ErrNotUnix means the connection is not a unix socket, which has no peer
// credentials.
var ErrNotUnix = errors.New("not a unix socket connection")

// Unwrap returns the innermost connection of c, following NetConn methods.
func Unwrap(c net.Conn) net.Conn {
	for i := 0; i < 8; i++ { // bounded: a wrapper returning itself must not hang us
		w, ok := c.(interface{ NetConn() net.Conn })
		if !ok {
			break
		}
		inner := w.NetConn()
		if inner == nil || inner == c {
			break
		}
		c = inner
	}
	return c
}

// Of reads SO_PEERCRED of c (or of the unix connection it wraps).
func Of(c net.Conn) (Cred, error) {
	uc, ok := Unwrap(c).(*net.UnixConn)
	if !ok {
		return Cred{}, fmt.Errorf("peer credentials of %T: %w", c, ErrNotUnix)
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return Cred{}, fmt.Errorf("peer credentials: %w", err)
	}
	var u *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		u, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Cred{}, fmt.Errorf("peer credentials: %w", err)
	}
	if serr != nil {
		return Cred{}, fmt.Errorf("reading SO_PEERCRED: %w", serr)
	}
	return Cred{PID: u.Pid, UID: u.Uid, GID: u.Gid}, nil
}
