// SPDX-License-Identifier: Apache-2.0

// Package client is the runtime's side of the permit API served by package
// permitd on a local unix socket: flights and other pool permits as leases,
// and resident objects that the daemon may ask to put to sleep.
//
// One Client is one connection and one session. Its methods are safe for
// concurrent use, and concurrent calls are pipelined on the connection, so a
// runtime should share one Client rather than dial per call. Every lease the
// session holds ends when the connection closes, including when the process
// dies. Release is idempotent: releasing a lease twice, or a lease that ended
// with an earlier connection, succeeds and reports that nothing was released.
//
// With Options.Reconnect the client redials after losing the daemon (a
// daemon restart drops every connection) and spawns its resident objects
// again, oldest call first, which is how the daemon rebuilds its view of what
// is resident. Leases of flights and other pools are not carried over: the
// daemon ended them with the connection, and OnReconnect is given a
// *LostLeasesError listing those callers held and had not released, so that
// the runtime can take new ones or stop what they covered.
//
// Calls do no I/O of their own: a flusher writes the buffered requests, so a
// daemon that stops reading holds up no call past its context. A write the
// daemon has not taken within ten seconds closes the connection.
package client
