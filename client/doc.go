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
// is resident. Leases of flights are not carried over: a call that was in
// flight across the restart simply finishes without one.
package client
