// SPDX-License-Identifier: Apache-2.0

package proxyclaim

import "strings"

// names are the claims besides every X-Forwarded-* (For, Host, Proto,
// Port, Scheme, Ssl, Prefix and the rest), as Fold folds them: those read by
// gorilla/handlers, Rack, werkzeug's ProxyFix, Tornado, Express, IIS and the
// client-address helpers of PHP applications.
var names = []string{"forwarded", "forwarded-for", "x-forwarded", "x-real-ip", "client-ip", "x-client-ip",
	"true-client-ip", "x-cluster-client-ip", "x-scheme", "x-url-scheme", "front-end-https"}

// Is reports whether request header k is a proxy claim under any spelling:
// an X-Forwarded-* or one of the names above. It does not allocate: a proxy
// asks it for every header of every request.
func Is(k string) bool {
	const xf = "x-forwarded-"
	if len(k) > len(xf) && FoldEq(k[:len(xf)], xf) {
		return true
	}
	for _, c := range names {
		if FoldEq(k, c) {
			return true
		}
	}
	return false
}

// Fold folds a header name as the many upstreams that read headers through
// CGI-style variables do: lower case, '_' as '-'.
func Fold(k string) string {
	b := []byte(k)
	for i, c := range b {
		b[i] = fold(c)
	}
	return string(b)
}

// FoldEq reports whether Fold(k) is c (already folded), without
// allocating.
func FoldEq(k, c string) bool {
	if len(k) != len(c) {
		return false
	}
	for i := range len(k) {
		if fold(k[i]) != c[i] {
			return false
		}
	}
	return true
}

func fold(b byte) byte {
	switch {
	case b == '_':
		return '-'
	case 'A' <= b && b <= 'Z':
		return b + 'a' - 'A'
	}
	return b
}

// framing are the fields that frame a request or its connection, as Fold
// folds them.
var framing = []string{"content-length", "transfer-encoding", "connection", "keep-alive", "proxy-connection",
	"te", "trailer", "upgrade", "host", "expect"}

// FramingAlias reports whether request header k spells a field that frames
// the request with a '_' for a '-' (Transfer_Encoding, Content_Length). A
// proxy drops these: it frames the request it sends itself, and an upstream
// that reads '_' as '-' (as CGI-style variables do) would frame it by the
// client's word, a second request smuggled past the proxy's limits.
func FramingAlias(k string) bool {
	if !strings.Contains(k, "_") {
		return false
	}
	for _, c := range framing {
		if FoldEq(k, c) {
			return true
		}
	}
	return false
}
