// SPDX-License-Identifier: Apache-2.0

// Package permitd serves the node's user-space pools (flights, residents and
// any other configured pool) to local runtimes over a unix stream socket, as
// leases that cannot outlive the connection that took them.
//
// # Transport and sessions
//
// The socket (default /run/fairshare/permits.sock, mode 0660, group
// configurable by name or gid) is separate from the admin socket; its
// directory is created 0711 so that members of the group can reach it. One
// connection is one session. The server reads the peer's credentials
// (SO_PEERCRED) when the connection is accepted, logs them, and refuses peers
// that are neither root, the daemon's own uid, nor members of the configured
// group (primary or supplementary).
//
// The socket is served through package internal/listen: sessions are capped
// in number (Config.MaxConns) and per peer user (Config.MaxConnsPerPeer; a
// subordinate uid of /etc/subuid counts as its owner, Config.Owners); a
// connection past a cap gets one TOO_MANY_SESSIONS line and is closed, and
// running out of descriptors is waited out rather than ending the server.
// Sessions have no idle timeout: a session's leases end with it, so only the
// client decides when it is over. An idle session holds a 4 KiB read buffer;
// it grows, up to 64 KiB, only while a longer line is read. Its table of the
// names it repeats keeps only names that are valid (a known op, a served
// pool, a valid project name, an object name) and at most 8 KiB of them, so
// no stream of made-up names makes an idle session hold more.
//
// # Framing
//
// Both directions carry newline-delimited JSON objects, one per line, at most
// 64 KiB per line. A client may pipeline: it can send any number of requests
// without waiting, and matches answers to requests by the id it chose.
// Non-blocking operations are answered in the order they were sent; an
// operation that waits (a spawn the pool cannot admit at once, acquire with
// wait_ms) is answered when it completes, possibly after later requests.
//
// Request fields:
//
//	id       unsigned integer chosen by the client, echoed in the answer
//	op       hello | ping | acquire | release | spawn | touch | sleep | remove
//	pool     pool name (acquire)
//	project  project name (acquire, spawn)
//	object   object name (spawn, touch, sleep, remove; acquire on the residents pool)
//	lease    lease id (release)
//	wait_ms  acquire: wait up to this long for a permit instead of refusing now
//	         (a value above MaxWaitMS, ten minutes, waits ten minutes)
//
// A project is named by the rule every entry point of fairshare applies
// (package internal/project: 1 to 64 bytes of letters, digits, '.', '_' and
// '-', starting with a letter or digit, not "cgroup."); any other name is
// BAD_REQUEST and is not counted anywhere. An object name is 1 to
// MaxObjectLen (1024) bytes of anything.
//
// Answer fields: id, ok, and when relevant lease, released (release: whether
// this call ended the lease), evicted (spawn: the object that was put to sleep
// to make room), code and error (when ok is false), retry_after_ms (with
// REFUSED), refusal (the pool's numbers behind a refusal), session and
// server (hello).
//
// The server may also send an event line, which has no id and an "event"
// field: "evict" or "dropped". "evict": the session owns object and must put it
// to sleep and then confirm, by releasing the event's lease (the residence
// being ended) or by sending sleep (or remove) for the object; a spawn
// elsewhere waits for that confirmation. Until then the object is the
// owner's, in memory: a spawn of it from the owner is a call, answered
// "already resident" with the same lease, and ends nothing. So a runtime
// must not spawn an object again between putting it to sleep and
// confirming (the Go client waits for its own confirmation first). The event is written by a goroutine of its own: an
// owner that does not read delays only its own events (and is disconnected
// after ten seconds of not reading), never the spawn that evicted from it.
// "dropped" (same fields, reason "unconfirmed"): the server ended the
// residence lease of object without its owner, which left evictions
// unconfirmed (see Residents); the object no longer holds a permit and must
// be put to sleep, with nothing to confirm (a release of the lease or a
// sleep of the object is answered, and ends nothing).
//
// # Error codes
//
//	BAD_REQUEST         the line is not a JSON object, a field has the wrong type,
//	                    a number is out of range (for example an id past 2^64-1),
//	                    the project is not a valid project name or the object name
//	                    is too long; the answer's id is 0 when the id itself could
//	                    not be read
//	UNKNOWN_OP          op is missing or not one of the above
//	UNKNOWN_POOL        no pool by that name is served
//	MISSING_FIELD       a field the op needs is empty (project, object, pool, lease)
//	REFUSED             the pool refused by the fair-share rule; retry_after_ms says when to retry
//	TOO_MANY_RESIDENTS  the residents pool is full and nothing was put to sleep within a second
//	UNKNOWN_OBJECT      touch/sleep/remove of an object this session does not own
//	CONFLICT            spawn of an object that another session owns
//	CANCELED            the wait ended because the session or the server closed
//	LINE_TOO_LONG       a line exceeded 64 KiB; the server answers and closes the connection
//	TOO_MANY_WAITING    the operation would wait (acquire with wait_ms refused at once,
//	                    a spawn that must wait for room or for a victim's owner) but
//	                    the session already has Config.MaxWaitingPerSession operations
//	                    waiting (512 by default), the peer's user over all its sessions
//	                    Config.MaxWaitingPerUID (512), or the server Config.MaxWaiting
//	                    (4096), of which acquires may take three quarters (3072): the
//	                    last quarter is kept for spawns, whose waits last a second
//	                    where an acquire's may last ten minutes. The error says which.
//	                    Retry when one has ended, or acquire without wait_ms. A spawn
//	                    the pool admits at once never gets it
//	TOO_MANY_OBJECTS    spawn of a new object while the peer's user keeps
//	                    Config.MaxObjectsPerUID objects (resident or asleep) over
//	                    all its sessions (65536 by default) or the server
//	                    Config.MaxObjects (262144); the error says which. An object
//	                    is kept until its owner removes it or its session ends
//	TOO_MANY_SESSIONS   sent once, with id 0, to a connection past the socket's caps,
//	                    which is then closed
//	FORBIDDEN           sent once, with id 0, to a peer that may not use the API,
//	                    which is then closed
//
// retry_after_ms (REFUSED, TOO_MANY_RESIDENTS) is computed for the refused
// project: each refusal of a project gets its own return slot, the first at the
// pool's estimate for that project, each later one spaced by the pool's release
// rate (a second when no release was seen lately), plus a uniform jitter of one
// slot. Clients that obey it come back at about the rate the pool can admit
// them instead of all at once; see package internal/pace.
//
// Every error except LINE_TOO_LONG leaves the connection usable: a line is a
// frame, so a bad line cannot desynchronise the stream.
//
// # Leases
//
// acquire takes a permit with TryAcquire (or Acquire with a deadline when
// wait_ms > 0) and answers a lease id. Lease ids carry a random per-server
// epoch in their high bits, so an id from before a daemon restart does not
// name a lease of the new daemon, and a count of the server's grants in their
// low 32: an id comes back only after 2^32 grants, and never while the
// session given it before still holds it. release of
// a lease this session holds ends it and answers released=true; release of any
// other id (already released, ended by a disconnect, from an earlier
// connection or daemon, or held by another session) answers ok with
// released=false and never touches another session's lease. So a client that
// reconnects may repeat its releases safely.
//
// A session's leases end when its connection closes, for whatever reason: a
// runtime that crashes leaks nothing. When the server stops, it ends every
// lease before Serve returns.
//
// # Residents
//
// spawn(project, object) asks the residents pool for room (a wake is a
// spawn). If there is room it answers at once with a lease. If the pool is full
// the pool names an object to put to sleep (the spawner's own idlest when it is
// over its share, else the idlest object of the project furthest over its
// share); the server sends an evict event to the session owning that object
// and answers the spawn only after that session confirms with sleep (or
// remove), or with TOO_MANY_RESIDENTS when nothing was put to sleep within a
// second. That second is one deadline for the whole spawn, started when the
// spawn is read: the wait for room and the wait for the owner's confirmation
// share it. An owner that did not confirm in time still has the object in
// memory, so the object is counted resident again and the spawner's permit
// goes back; a confirmation that comes later is taken as an ordinary sleep.
// (Ending the owner's session instead would end its leases in every pool
// while the runtime may still be using them.) The object goes back as its
// project's most recently called, so the next spawns name the project's
// other objects first.
//
// An owner that leaves evictions unconfirmed (it does not act on the events,
// its OnEvict fails or hangs) would otherwise keep its project over its
// share for ever. So once a session has left MaxUnconfirmed (3) evictions of
// one project's objects unconfirmed in a row, the server stops waiting for
// it: at the third, the victim's residence is ended without its owner, it
// stays asleep, and the spawn is admitted; the session's other objects of
// that project left unconfirmed are put to sleep with it, their permits
// freed. Each such object is counted (the residents pool's evictions for
// reason "unconfirmed", and ResidentsStat.Dropped), published as an
// eviction with reason "unconfirmed", logged, and its owner is sent a
// "dropped" event; its lease is ended, and the object is asleep for the
// server (a spawn wakes it, under the rule). Until the session confirms an
// eviction of the project again (in time, or late: a sleep of an object
// whose eviction went unconfirmed), each further unconfirmed eviction is
// dropped at once. A runtime that honours the dropped events puts those
// objects away; one that does not holds them in memory uncounted, which
// is its own doing: the pool never counts more than its size. touch records a call on a resident object (idleness is the time since
// the last call). sleep frees the object's permit and keeps it known as
// sleeping; remove forgets it. Releasing a resident's lease is a sleep.
//
// When a session ends, the objects it owns are removed: the runtime that owned
// them is gone, and so are they.
//
// The daemon does not persist residents. The runtime is the authority on which
// of its objects are in memory, so after a daemon restart (which drops every
// connection) the runtime reconnects and spawns its resident objects again,
// oldest call first so that idleness order is kept; package client does this
// on its own when reconnecting (and reports the acquire leases that ended). The re-registration goes through the same rule
// as any spawn, so a pool that shrank across the restart evicts rather than
// over-admits.
//
// Config.Events, if set, receives the refusals (with the rule's numbers and
// the peer's uid and pid), the would-be refusals a pool in dry-run admitted
// (pools.Pool.SetDryRun; acquire reads them with TryAcquireInto), the
// TOO_MANY_WAITING answers, and each eviction: the victim, its project, its
// owner's session and the spawner's project.
package permitd
