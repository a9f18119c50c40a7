// SPDX-License-Identifier: Apache-2.0

package permitd

import (
	"bufio"
	"os"
	"strconv"
	"strings"

	"github.com/fairshare-dev/fairshare/internal/peercred"
)

// Cred is a session's peer as the kernel reported it at connect time
// (SO_PEERCRED, read by package internal/peercred).
type Cred = peercred.Cred

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
