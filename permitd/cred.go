// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Cred is a session's peer as the kernel reported it at connect time.
type Cred struct {
	PID      int32
	UID, GID uint32
}

// peerCred reads SO_PEERCRED: the kernel's word on who connected, which the
// client cannot forge.
func peerCred(c *net.UnixConn) (Cred, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return Cred{}, fmt.Errorf("raw conn: %w", err)
	}
	var uc *unix.Ucred
	var serr error
	if err := rc.Control(func(fd uintptr) {
		uc, serr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return Cred{}, fmt.Errorf("raw conn control: %w", err)
	}
	if serr != nil {
		return Cred{}, fmt.Errorf("reading SO_PEERCRED: %w", serr)
	}
	return Cred{PID: uc.Pid, UID: uc.Uid, GID: uc.Gid}, nil
}

// inGroup reports whether process pid has gid among its supplementary groups.
// SO_PEERCRED carries only the primary gid, and a runtime usually gets the
// permit group as a supplementary one.
func inGroup(pid int32, gid int) bool {
	f, err := os.Open("/proc/" + strconv.Itoa(int(pid)) + "/status")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "Groups:")
		if !ok {
			continue
		}
		for _, g := range strings.Fields(rest) {
			if n, err := strconv.Atoi(g); err == nil && n == gid {
				return true
			}
		}
		return false
	}
	return false
}
