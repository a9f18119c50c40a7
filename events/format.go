// SPDX-License-Identifier: Apache-2.0

package events

import (
	"fmt"
	"strconv"
	"strings"
)

// Text is e as one line for a terminal: time, source, kind, pool, project,
// then what applies (direction and addresses, the reason with the rule's
// inputs, the victim of an eviction, a count).
func (e Event) Text() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %-9s %-12s %-11s %s", e.Time.UTC().Format("15:04:05.000"), safe(e.Source), safe(e.Kind), dash(e.Pool), dash(e.Project))
	if e.Direction != "" {
		fmt.Fprintf(&b, " %s", safe(e.Direction))
	}
	if e.Local != "" || e.Remote != "" {
		fmt.Fprintf(&b, " %s -> %s", dash(e.Local), dash(e.Remote))
	}
	if e.Reason != "" {
		fmt.Fprintf(&b, " reason=%s", safe(e.Reason))
	}
	if e.PoolSize > 0 {
		fmt.Fprintf(&b, " held=%d share=%d in_use=%d/%d", e.Held, e.Share, e.InUse, e.PoolSize)
	}
	if e.Victim != "" {
		fmt.Fprintf(&b, " victim=%s owner=%s spawner=%s", safe(e.Victim), dash(e.Owner), dash(e.Spawner))
	}
	if e.Count > 0 {
		fmt.Fprintf(&b, " count=%d", e.Count)
	}
	if e.Detail != "" {
		fmt.Fprintf(&b, " (%s)", safe(e.Detail))
	}
	return b.String()
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return safe(s)
}

// safe is s as it may be printed on a terminal: unchanged when it is
// printable ASCII, else quoted with Go escapes, so a name a client chose (a
// permit object's, up to 1 KiB of anything) cannot forge a line or drive
// the terminal.
func safe(s string) string {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < ' ' || c >= 0x7f {
			return strconv.QuoteToASCII(s)
		}
	}
	return s
}

// TextHeader is the legend of Text's columns.
const TextHeader = "TIME         SOURCE    KIND         POOL        PROJECT ..."
