// SPDX-License-Identifier: Apache-2.0

// Package admin is the daemon's control API: HTTP/JSON over a unix socket.
//
// Nothing admin-like listens on TCP. The socket (default
// /run/fairshare/admin.sock) is created mode 0600 (in a directory created
// 0711, which the permit socket shares: others may reach a socket by name but
// not list the directory), and on top of the file mode every connection's
// peer is checked with SO_PEERCRED: a peer whose uid is not root is answered
// 403 on every request. The file mode keeps honest non-root users out; the
// credential check still holds if the mode is loosened by mistake, and gives
// them a clear answer. A file at the socket path that is not a socket is never
// removed: Listen refuses it, naming it.
//
// The daemon serves the socket through package internal/listen with a small
// cap of which half is reserved for root, so however many connections other
// users open anywhere, the operator's CLI gets in; the server closes a
// connection idle for 30s.
//
// Paths are versioned; v1 is:
//
//	GET    /v1/health              {"ok":true,"version":"..."}
//	GET    /v1/status              Status: every pool with its projects, rates, scheduler
//	GET    /v1/policies            [Entry...] sorted by project
//	GET    /v1/policies/{project}  Entry, or 404 when none is stored
//	PATCH  /v1/policies/{project}  body policy.Patch; fields left out are kept (or
//	                               defaulted for a new project); answers the stored Entry
//	DELETE /v1/policies/{project}  204, or 404 when none was stored
//	GET    /v1/projects            Membership: members by source, refusals, namespaces
//	POST   /v1/projects/{project}  body {"cgroups": [...]}: registers them, answers the
//	                               Registration once it is in force (or Pending)
//	DELETE /v1/projects/{project}  ?cgroup=PATH repeated, or none for all: removes
//	                               registrations, answers the Registration
//	GET    /v1/events?project=P&pool=NAME[&follow=1]
//	                               the kept events (package events) that match, one JSON
//	                               object a line (application/x-ndjson); with follow, the
//	                               new ones as they come until the client hangs up
//
// An events stream is bounded: StreamBuffer events may wait for a reader,
// past that it loses events and receives a "dropped" event with the count;
// a write that takes streamWrite ends the stream; at most MaxStreams streams
// are open at once (503 past it), so followers never take the places the
// CLI needs. The stream is exempt from the 10s read and 30s write timeouts
// of the one-shot requests.
//
// Errors are JSON {"error": "one lowercase sentence"} with 400 for invalid
// input (nothing was written), 403 for a non-root peer, 404 for a missing
// policy or registration, 409 for a registration refused (its cgroup is
// registered already, or nested in another project's) and 500 for anything
// else. A policy write is acknowledged only after
// the store has fsynced it and the running daemon has applied it.
//
// Client is the CLI's side. ErrNoDaemon tells the CLI nothing listens on the
// socket, so it may open the policy store itself.
package admin
