// SPDX-License-Identifier: Apache-2.0

// Package proxyclaim names the request headers that upstream frameworks
// take as a proxy's word on the client's address or scheme: a proxy that
// does not vouch for a client's copy must strip them, under every spelling
// an upstream may read as the same name (case, and '-' versus '_' as
// CGI-style variables fold them), so that an upstream trusting the proxy
// takes no client's word for either.
package proxyclaim
