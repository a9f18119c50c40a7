// SPDX-License-Identifier: Apache-2.0

package answerfield

import (
	"net/textproto"
	"slices"
	"strings"
)

// The front's own answer fields.
const (
	// Class carries the class a proxied request was dispatched under.
	Class = "Fairshare-Class"
	// QueueWait carries the seconds a proxied request waited for dispatch.
	QueueWait = "Fairshare-Queue-Wait"
	// Refused says why a 429 was given: rate, debt or share.
	Refused = "Fairshare-Refused"
)

// hopByHop are the fields of one connection, never forwarded (RFC 9110
// 7.6.1), as httputil.ReverseProxy strips them; in canonical form.
var hopByHop = [...]string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// HopByHop returns the hop-by-hop fields, in canonical form.
func HopByHop() []string { return slices.Clone(hopByHop[:]) }

// IsHopByHop reports whether key, in canonical form, is a hop-by-hop field.
func IsHopByHop(key string) bool {
	for _, h := range hopByHop {
		if key == h {
			return true
		}
	}
	return false
}

// Reserved returns why name (in any case) cannot be a field the front
// takes out of every answer, or "" if it can be.
func Reserved(name string) string {
	k := textproto.CanonicalMIMEHeaderKey(name)
	switch {
	case IsHopByHop(k):
		return "a hop-by-hop field, never relayed"
	case strings.HasPrefix(k, "Content-"):
		return "a field that frames or describes the answer's body"
	case k == "Date":
		return "the answer's Date, which the front adds when the upstream sends none"
	case k == Class || k == QueueWait || k == Refused:
		return "one of the front's own fields"
	}
	return ""
}
