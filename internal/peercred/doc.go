// SPDX-License-Identifier: Apache-2.0

// Package peercred reads who is at the other end of a local unix socket
// connection, as the kernel recorded it when the peer connected
// (SO_PEERCRED): pid, uid and primary gid, which the peer cannot forge.
//
// Of sees through connection wrappers that expose the connection they wrap
// with a NetConn method (the convention of crypto/tls, followed by package
// internal/listen), so a listener's accounting can wrap connections without
// hiding their credentials from the servers behind it.
//
// Owners folds the subordinate uids of /etc/subuid (the ranges newuidmap
// lets a user map into a user namespace) onto the user they were given to,
// so that the per-peer caps count a user once, however many of its 65,536
// uids it runs as. It rereads the file when it changes; a missing file folds
// nothing. Folding is for counting only: privilege is decided on the uid
// the kernel reported.
package peercred
