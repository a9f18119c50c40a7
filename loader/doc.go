// SPDX-License-Identifier: Apache-2.0

// Package loader loads the fairshare BPF programs (bpf/limiter.c and its
// headers in bpf/lib), attaches them to the cgroup2 root, to the daemon's
// network namespace and to every namespace AttachNetns names, pins them
// under bpffs and reads and steers their maps.
//
// # Who is counted
//
// Membership is data. A project is a name with a compact id (1..MaxProjects-1,
// an index into the per-project array fs_projects; the name is pinned in
// fs_names, so a restarted daemon and a read-only status name it). Its
// members are registered cgroups at any depth (fs_members: cgroup id ->
// project id), which SetMembers keeps exactly as the caller's sources say.
// A socket counts for the project of the first registered cgroup found
// walking its cgroup's ancestors from Options.BaseLevel down, at most
// MaxDepth levels: one hash lookup per level, with no helper call
// (BenchmarkConnectDepth: about 6-9 ns per level here). The walk was chosen
// over an exact map of every cgroup kept in step by user space: that map
// costs the same as a walk that hits at its first level, and it misses every
// cgroup made between two scans (a container that starts and connects at
// once). The walk's answer is remembered per CPU for the last cgroup asked
// about (bpf/lib/project.h), and every change SetMembers or SetExempt makes
// to fs_members bumps fs_member_gen (an atomic add in the kernel, by
// fs_adjust; a bump that fails is tried again at the next SetMembers or
// Tick), which drops every answer remembered before it
// (TestMemberMemoFollowsChanges, TestMemberGenOwed): the sockets of a cgroup come in
// runs, and connect4 pays the hash lookup only when the cgroup changes.
// Sockets of no registered cgroup are not counted and not limited.
// Registrations of different projects never nest (SetMembers refuses both),
// so the first hit is the only one, with the exceptions of the next section. A member removed releases nothing: the
// permits its sockets hold end with them; its new connections stop counting
// at once. A project with no member, holding nothing and idle for a minute
// frees its id at Tick (not while a listening socket still names it).
//
// # Unclassified pods
//
// A pod the daemon has not classified yet (just made, or made while no
// daemon runs) must not run unlimited. Its cgroup is below the pod roots
// (kubepods, kubepods.slice and their QoS children), which the daemon
// registers as weak members (MEMBER_WEAK) of the reserved project
// Unclassified, "(unclassified)", a name no policy, label or CLI can take.
// The walk keeps a weak hit and goes on below it; the first other member
// found wins, and the weak one counts only for a socket below no other.
// So an unclassified pod is one project under the rule from its first
// connect and its first SYN, and a classified pod's own cgroup, deeper,
// counts for its project. A pod of the host's network namespace is the
// exception (Options.LimitHostNetwork off, the default): its connects count
// for Unclassified past the rule if need be (KIND_OUT_HOST), its listeners
// only once it is classified; a destination pool takes it past its rule
// too (TestHostNetworkPodPastDestPool). The levels below a weak hit are walked as a
// cgroup of no member walks them, so the fallback costs nothing more than
// before (BenchmarkConnectUnclassified against BenchmarkConnectDepth; on a
// quiet machine, 5 rounds alternating with the build before the weak
// members, 4e4a8e4: connect4 at depth 3 ran 294 ns against 288 ns before,
// per-round ratios 0.96-1.02, median 1.01, and an unclassified socket 284
// ns: within the noise).
// Members of NoProject, "(none)", have project id 0: the walk stops there
// and the socket counts for none (the pods of system namespaces, the
// daemon's own cgroup). They may sit below a weak member; an Unclassified
// or NoProject member below a project's member, or any member below a
// NoProject one, would never be found and is refused alone.
//
// Permits taken as Unclassified stay with it until the next Settle or
// Reconcile after the pod is classified: its dump, which sees every socket with the socket
// locked, moves a permit held under a weak member's project whose cgroup is
// now a deeper member's to that project (move_held in bpf/limiter.c: the
// entry ended as a release ends it, the count moved, the entry held again;
// ReconcileReport.Moved, and MovedPast when the project was past the rule,
// which counts it all the same). Until then the pod has at most the
// unclassified project's share plus its own; the pool's in_use never passes
// POOL (TestUnclassifiedPods, TestUnclassifiedPermitsMoveAtReconcile), but
// for a pod of the host's network namespace's connects, which may take it
// past until the pod is classified (TestHostNetworkPodsCountOnceClassified). With the daemon's tick at 1s a pod is
// classified within about a poll of its sandbox starting. A listener opened
// before its pod was classified is counted under Unclassified until the
// next Settle or Reconcile, whose dump counts it again under its pod's
// project (or uncounts it, for a pod of no project); the permits taken as
// Unclassified by sockets whose cgroup is in no project now are released by
// the next Reconcile as a gone socket's (TestUnclassifiedListener). A
// socket of a member removed since, or moved to no project, keeps the
// permit it holds until it ends: the dump writes it out, so a pass does not
// take it for gone (TestRemovedMemberKeepsPermits).
//
// # Lapse
//
// Options.LapseAfter (connections.lapse_after) bounds how long the pins
// enforce without a daemon. Open renews a heartbeat in fs_lapses
// (CLOCK_BOOTTIME) as its last step, once nothing can fail the start (a
// start refused renews nothing, so a crash loop lapses; maps that never
// had one get one before the programs are attached), and every Tick
// renews it; once it is older than LapseAfter, every refusal of the rule
// or of a rate is admitted as dry-run admits it: the permit is taken past
// the rule and counted, the event carries Refusal.Lapsed, and
// Lapse.Admitted (Events.LapsedAdmitted) counts it. The clock is read on
// the refusal path, and on an unclassified pod's connect (so that one made
// in a lapse is never aborted when its pod is classified: KIND_OUT_LAX);
// a classified project's admitted path costs the same. A daemon
// that comes back refuses again from its Open (TestLapse). LapseAfter 0
// never lapses.
//
// # Network namespaces
//
// The cgroup programs and the tracepoints see every namespace; inbound
// admission (sk_lookup) is per namespace, and an sk_lookup program cannot
// learn its namespace (bpf_get_netns_cookie is refused to it). So Open
// attaches the program with the daemon's namespace cookie as a load-time
// constant, and AttachNetns loads one more instance per namespace with that
// namespace's cookie, sharing the pinned maps, its link pinned as
// netns/<cookie> in the pin directory (BenchmarkAttachNetns: ~30 ms of
// verifier time and 20 KiB of kernel memory per namespace here). A restart
// takes the links up again (moved to the new program); DetachGone unpins
// those whose namespace died (the kernel reports it in the link's info).
// Reconcile enters every attached namespace it has a path for.
//
// # What holds a permit
//
// An outbound TCP connection (IPv4, IPv6, v4-mapped IPv6; plain TCP or an
// MPTCP subflow) holds one from connect() until the connection dies or the
// process closes the socket, whichever comes first. An inbound connection
// accepted by a project's listener holds one from the kernel's request
// socket for it (as a reservation) through the handshake, while it waits in
// the accept queue, and until it dies or is closed. Release happens exactly
// once per socket (the permit is an entry keyed by the socket cookie; only
// the path whose compare-and-swap or delete succeeds gives it back) on the
// first of: the transition to TCP_CLOSE (RST, failed or timed-out connect,
// end of the FIN exchange, children dropped with their listener) or the
// close of the last file descriptor (sock_release, which also covers
// SIGKILL), or the socket's next connect(): a connect() that fails past the
// hook and before the socket leaves TCP_CLOSE (no route, a multicast or
// broadcast address, another cgroup program's refusal) leaves its permit
// with no state change to release it, and the socket may connect() again;
// that connect ends the leftover, its destination pool's permit with it,
// and is admitted as a socket that holds none (connect_stale; before, it
// kept the leftover and reached a destination pool uncounted:
// TestReconnectAfterEarlyFailure).
//
// # The rule and its bound
//
// Admission applies the rule of package pools with POOL and FLOOR from the
// config map and share = max(FLOOR, POOL/active), with one difference:
// inbound, the share is the one beside one more active project (see
// "Handshakes in flight"). The programs keep the
// active count themselves: a project's first ask in the window (a new
// project, or one idle and empty for a window) adds it at once, so a
// newcomer's first connection already shrinks everyone's share, as in
// package pools; Tick recounts and takes out the projects that left the
// window. Node-wide in_use is taken with a bounded compare-and-swap loop that
// only moves it to a value the rule allows, so it never exceeds POOL, not even
// for an instant a reader could see (losing the race eight times in a row
// refuses: a spurious refusal, never an overshoot). A project's own count is
// read before and added after: concurrent connects of one project (at most
// one per CPU) can all see it under its share, so a project can pass its share
// by at most CPUs - 1 while the pool has room, never the pool. Adoption of sockets that predate the programs
// (Reconcile) counts them without the rule and can take in_use above POOL;
// new connections are then refused until it falls back.
//
// # The exempt class
//
// Operator and probe traffic must get through a full node. Options.Exempt
// (or SetExempt) names up to limits.ExemptCap cgroups: registered ones,
// which exempt everything below them, or others, such as a project's
// "probes" cgroup, which exempt their own sockets. A socket whose own cgroup
// or whose registered cgroup is in the set takes its permit from a
// separate exempt budget (Options.ExemptMax, default FLOOR) instead of the
// pool: it is not refused by the rule and counted neither in the pool's nor
// in its project's in_use, outbound (the task's cgroup at connect) and
// inbound (the listener's cgroup). The budget is taken with a
// fetch-add, rolled back when it went over, so at most ExemptMax exempt
// permits are held at any instant; an exempt socket that finds it spent is
// handled like any other socket of its project, under the rule. Hence the
// bound: the connections of all projects together never exceed
// POOL + ExemptMax (adoption aside, see below), whatever the set names, and
// a tenant that gets itself exempted gains at most ExemptMax connections
// beyond its share. Exempt permits are released by the same exactly-once
// paths; each held permit records which budget it came from, so changing the
// set never misdirects a release. Snapshot.Exempt reports the budget, its
// use, and the exempt sockets sent back under the rule (OverBudget).
//
// # What a refused client sees
//
// Outbound: connect() fails at once with ECONNREFUSED (the hook sets the
// return value; no packet leaves). Inbound: the SYN is dropped by the
// sk_lookup program, the kernel answers it with an RST, and the client's
// connect() fails at once with ECONNREFUSED; the server's accept() never
// sees the connection and no permit is held for it. A listener answering
// with SYN cookies is no different, except that the rule is applied again to
// the cookie's ACK: one the pool has filled for meanwhile is reset, and the
// client, whose connect() had succeeded, sees its connection reset.
//
// # Handshakes in flight
//
// Inbound admission is decided at the SYN, but the accepted socket exists
// only after the handshake. A permit exists only while the handshake can
// still become an accepted connection, and only the kernel knows when that
// is: no packet is trusted. sk_lookup, which sees every segment no socket of
// the host took yet (SYNs, but also stray segments of any flags and the ACK
// of a SYN cookie) and cannot see TCP flags, applies the rule and takes
// nothing. The permit is taken when the kernel makes the handshake's request
// socket (a sockops program at BPF_SOCK_OPS_TIMEOUT_INIT, attached with the
// cgroup programs at the cgroup2 root, which tcp_conn_request runs in the
// listener's cgroup only for a request socket it queues), as a reservation
// keyed by that socket's cookie. A segment that is not a SYN, a SYN the
// kernel drops (a full accept queue, of whichever SO_REUSEPORT member the
// kernel steered it to) and a SYN answered with a SYN cookie take nothing. When the child reaches
// ESTABLISHED it has the request socket's cookie, and the reservation
// becomes its permit (whoever ends the reservation owns the permit: it is
// ended with a compare-and-swap on its slot, whose tag is the cookie, or a
// delete from the spill table). A child without a reservation (a SYN
// cookie's, one whose reservation was given back) takes its permit at
// ESTABLISHED under the rule (Events.Late); if the rule refuses then, the
// connection cannot be stopped any more and is left without a permit
// (Events.Unaccounted; Reconcile adopts it).
//
// Inbound, a project is judged by the share it would have if one more
// project were active: sk_lookup, the reservation and a child taken at
// ESTABLISHED apply the rule that way. A newcomer's arrival, which shrinks
// every share, is taken as given, so handshakes leave a newcomer its floor.
// How long a handshake holds its permit is the client's choice: a SYN flood
// from sources that never answer keeps its request sockets through the
// kernel's SYN-ACK retries, about a minute, and under the plain rule one
// that reached a lone project's share (all of the pool) would shut out every
// project arriving meanwhile. Judged so, a lone flooded project stops at
// POOL - FLOOR (at FLOOR when FLOOR is over half the pool), and beside k
// others once it holds POOL/(k+2) (or its floor): a flood pushes a project
// no further than a newcomer's arrival would leave it. The SYNs past the bound are reset as
// past a share (ReasonFloor), so a request socket goes without its permit
// only in the race between sk_lookup and the reservation, as before, and no
// handshakes can be completed together past the pool. The price: alone, a
// project's inbound connections get the pool less a floor (its connects all
// of it), and beside others a project under its share but past the share of
// one more stops inbound a floor short too. The floor goes to the first
// newcomer: a flood at a second project, itself a newcomer, takes it; and
// a flooded project under the share it would have beside a newcomer may fill
// the pool when the others hold the rest, as the plain rule lets a project
// under its share (TestSynFloodLeavesNewcomerItsFloor).
//
// A reservation is given back by Tick once it is older than
// Options.ReservationTTL (100ms..2m, default 3s) and its request socket is
// gone (sock_diag lists no request socket with its cookie): a client that
// reset its handshake, one that vanished and whose request socket the kernel
// timed out. Such a permit is held at most the TTL plus one Tick period; a
// request socket that still exists keeps its permit (its handshake can still
// complete). A listener's reservations are bounded by its SYN queue (its
// listen backlog); beyond it the kernel answers with cookies. Reservations
// of listeners in other network namespaces, whose sockets this process
// cannot list, are given back after the TTL as they are.
//
// A listening address takes the families it takes in the kernel: 0.0.0.0
// IPv4, [::] with IPV6_V6ONLY IPv6, a dual-stack [::] both; listeners of
// different projects on one port (0.0.0.0 and a v6-only [::], or two
// addresses) each get their own connections. Several listeners on one
// address (SO_REUSEPORT) are counted: the address stays known until the last
// of them closes, and the latest names the project.
//
// Inbound refusal covers listeners in the network namespace Open ran in
// (sk_lookup is attached per namespace); inbound counting (the sockops
// program, by cgroup) and outbound enforcement cover every namespace.
//
// # A rate of new connections
//
// SetRates gives a project its rates of new connections per second: Out
// (the policy's connections_per_sec) for those it opens, In
// (accepts_per_sec) for those its listeners accept; SetRate sets both to
// one value. Each is a token bucket of its own in the project's entry of
// fs_rates (bpf/lib/rate.h), refilled at the rate from the programs' clock
// and holding one second's worth (at least one token). They are apart
// because the SYNs to a listener come from clients the project does not
// control: from one bucket, an outsider's flood spent the project's
// outbound budget. connect4/6 take a token of the outbound bucket and
// sk_lookup one of the inbound bucket before the rule; an empty bucket
// refuses as the rule does (ECONNREFUSED at connect, an RST to the SYN) and
// is counted apart (ProjectCounters.RateLimitedOut/In, Events.RateLimited*),
// and a token taken for a connection the rule refuses, or (at connect) one
// that has its permit already, is given back. sk_lookup cannot tell a SYN
// from another segment: each segment that reaches a project's listener with
// no socket of its own takes a token (a SYN, a SYN cookie's ACK, a stray
// segment; a retransmitted SYN finds its request socket first), so a SYN
// answered with a SYN cookie and its ACK take one each. Exempt sockets take
// none. The take is one
// compare-and-swap; the rate is written in place by a syscall program
// (fs_rate_set), which keeps the bucket's tokens (at most the new burst).
// SetRate writes it at once if the project's cgroup exists; Tick writes
// every rate again (a project whose cgroup appeared or was made again),
// makes unbounded the buckets of projects SetRate no longer names, and
// forgets a bucket with its project entry.
//
// # Restarts
//
// Maps and links are pinned in Options.PinDir. Close only closes file
// descriptors: the kernel keeps counting and refusing, and the next Open
// reuses the pinned objects and their counts. Cleanup detaches and unpins.
// While no control loop runs, the active count can only grow (newcomers are
// added, nobody is taken out), so the share can only shrink: a full node
// still keeps a floor free and a node with room refuses nothing, but expired
// reservations are not given back until Tick runs again. Open recounts the
// active projects (the node's and each destination pool's) as Tick does: a
// project that left the window while no Tick ran is still in the pinned
// count, and its next ask, counted as a newcomer's, would count it twice
// until the first Tick (TestRestartRecountsActive). Open moves pinned
// links to the programs it loaded, so a new version's programs take effect
// on restart. Links of programs a version no longer has (link_send_reset,
// link_drop) are detached on the next Open.
//
// # Upgrades
//
// Maps of another layout (a value that grew, flags that changed), a
// directory missing a map the others must agree with, or one holding pins
// but no fs_config (an interrupted cleanup's leftovers), are migrated by Open
// (migrate.go), under the pin directory's lock (Options.PinLock, or one it
// takes; ErrPinsLocked while another process holds it): fresh maps pinned
// in <pin dir>/migrating, configured as at a first start with the members
// and project names copied over (as bytes, when their entries have the
// same size; the members only with the names), and what has the old
// programs admit past the rule, which the daemon writes only after Open:
// the events' settings and the pool's dry-run (unless Options.Events
// gives them), the projects in dry-run, and the heartbeat with its
// lapse_after (carryOver), so that the new programs admit what the old
// admit while both run, and lapse when they do after a crash that leaves
// them attached; the new programs attached beside the old ones (a connect is
// refused if either refuses) and the live sockets counted into the new
// maps by a reconcile pass, which enters every network namespace a process
// of the host is in (otherNetns), not only the daemon's; the directory renamed to "migrated", the
// commit; the other namespaces' sk_lookup links updated in place; the new
// pins renamed over the old, which detaches the old links; a second pass
// for connects the old programs alone admitted and that were hashed after
// the first walked by. A crash before the commit leaves "migrating", which
// the next Open discards (the old programs never stopped); after it,
// "migrated", whose pins the next Open moves in place first. Counts the
// live sockets cannot give back are lost: rate tokens, unread events,
// per-project admitted/refused counters, reservations. (A live socket's
// destination pool is found again from its peer's address, as at a first
// start.) Check reports a coming migration in CheckReport.Migrate.
//
// # Reconcile
//
// Reconcile walks the TCP sockets of the caller's network namespace with an
// iter/tcp program: project sockets that hold no permit are adopted
// (connections older than the daemon), listeners are recorded, and permits
// held for sockets of that namespace that no longer exist are released. A
// listener still counted for its port although it no longer exists (its
// close came while the programs were detached, as while a restart swaps the
// tracepoint link) would keep its port its project's: SYNs to that port
// would take that project's permits. Listeners counted before the walk and
// missing from it are uncounted (ReconcileReport.StaleListeners); a socket
// cookie is never reused, so a live one is never taken for a gone one.
// Where a project's in_use differs from its held permits plus its
// reservations, the difference is repaired with the programs' own atomics;
// so is the exempt budget's use against the exempt permits held and
// reserved. The held-permit slots are read in batches (one system call per
// 4096 slots).
// Every repair needs the same finding in two consecutive reads and is
// logged. Permits held in other namespaces are counted but not checked
// against live sockets. An adopted socket exists, so it is counted for its
// project whatever the rule says; one adopted while the rule would have
// refused it (in_use at the project's limit, or the project at its fleet
// cap, in the node's pool or in the destination pool of its peer; enforced
// or in dry-run) is
// reported per project, and per pool (ReconcileReport.AdoptedPast and
// AdoptedPastIn, a warning per pool and project, Events.AdoptedPast, and
// the daemon's adopted_past_rule event per pool and project): that pool's in_use then exceeds its
// size by at most the sockets adopted past its rule, until they end. They are
// sockets made while no program counted them: before the first Open on a
// node, while the programs were detached, or while their cgroup was in no
// member (a pod outside kubernetes.pod_cgroups, a cgroup registered after
// it connected). A socket the held-permit table has no room for (its slot
// taken by another socket's permit and the spill table full, as only a flood
// of such sockets makes it) is not adopted; it is reported per project at
// every pass (ReconcileReport.Unadopted, a warning, the daemon's unadopted
// event), counts nowhere, and is adopted by a pass once permits are given
// back. Open's own pass is reported too (StartReport).
// sock_diag's view is returned alongside (ReconcileReport.Kernel) for
// comparison.
// Destination pools are reconciled alike, per pool and project
// (ReconcileReport.Dests, DestDrift).
//
// # Destination pools
//
// A destination pool (dest.go, bpf/lib/dest.h, docs/destination-pools.md)
// is a named connections pool for the connects to its destinations: CIDRs
// with an optional port (package internal/destination). connect4 and
// connect6 look the address (IPv4 v4-mapped, so v4-mapped IPv6 matches the
// IPv4 pool) up in an open-addressing table of (prefix, port) (fs_dnets,
// 2 x MaxDestinations slots), probed once per prefix length it holds,
// longest first: a hash of the masked address, port and length, and at most
// 4 probes, all inlined loads. A pool of every port is kept under port 0
// and looked up second, so a pool naming the port wins over one that does
// not, then the longest prefix. The table holds the 4 longest lengths of
// each kind, listed per address family in the config the programs read
// already (an IPv4 connect probes only the lengths of prefixes that can
// hold a v4-mapped address); the others, and a destination that finds no
// slot within the probes with every shorter length of its kind, are in an
// LPM trie keyed (port, address) looked up after it
// (TestDestHostTableCollisions, TestDestLookupMatchesMatch: random nested
// IPv4 and IPv6 pools against destination.Match). SetDestPools
// (rewriteDestsLocked) answers from the old and the new destinations
// together in the trie while it rewrites the table, so that a connect
// meanwhile is counted in the pool the old or the new pools give it, never
// a third, never none when both give one (TestDestRewriteNeverMisses,
// TestDestRewriteRaces); the trie holds twice MaxDestinations for that. The same prefix and port
// in two pools is refused (ErrBadDestPool). On a match the pool's rule runs
// (its size, floor, window, dry-run; active and share its own: the node's
// own code, bpf/lib/share.h's pool_admit over the pool's fields) before the
// node's: its permit is taken with the same bounded compare-and-swap, then
// the node's; if the node's pool refuses (or the socket has its permit
// already), the destination permit is given back; if the destination pool
// refuses, the node's is never taken and the refusal event names the pool
// (Refusal.DestPool). The pool's id is kept in the socket's held-permit
// entry beside its project (fs_sock.dest), so the one release path that
// ends the entry (end_held) gives both back: every path of "What holds a
// permit" releases a destination permit too (TestDestPoolNoLeakAcrossLifecycles).
//
// Per pool: settings (fs_dpool_conf, written by SetDestPools and
// SetDestPoolSize, copied by fs_adjust to the line of its counts, where
// the programs read them), counts (fs_dpool_state: atomics only) and one row of
// per-project counts (fs_dpool_proj, indexed (pool-1) x MaxProjects +
// project: an inlined array lookup, no hashing). Pool ids are kept by name
// across calls and restarts (the name is in fs_dpool_conf). A pool removed
// while its permits are held leaves the trie at once and keeps its id and
// counts until Tick sees its in_use at 0; only then can another pool take
// the id, starting from zero. A new pool that finds no other id takes that
// of a pool the same call removes and that holds nothing (a rename with
// every id in use): its destinations leave the tables first, and the id
// is given destForgetGrace later (connects to them meanwhile are in no
// pool), or the call is refused with everything put back if a permit was
// taken meanwhile (TestDestPoolRenameAtFull, TestDestPoolRenameAtFullHeld).
// Tick recounts each pool's active projects as it does the node's; a
// project's id is not freed while it holds a destination permit (an exempt
// socket's, which holds none of the node's).
// fs_settings.dest_kinds says what the trie and the table hold (port,
// every port) in its low bits: 0, with no pool configured, and connect does
// no lookup at all; they are widened before the tables change and narrowed
// after, so no connect misses a pool in force while SetDestPools runs.
// Above them a generation moves at each of the loader's writes to what a
// lookup reads, and a lookup that saw it move is made again (dest_connect's
// second try; dest_find, the same for the tests).
// The filter a connect meets first (fs_settings.dest_quick) holds exactly up
// to four ports, three IPv4 /16s and two IPv6 first bytes, on the line the
// kinds are read from; past that, or where a byte of the part is 0xff (a
// value with one, or a lane read while the loader writes), the exact filter
// (fs_dfilter: by port, IPv4 /16 and IPv6 first byte) decides. With Options.NoDestPools
// (the daemon's when no destination pool is configured) the tables are made
// for none, and SetDestPools refuses a pool until a start without it.
//
// Cost (BenchmarkConnectAcceptClose/outbound-dests: connect4's run time
// from BPF stats, each case's difference from no pool in force taken within
// turns of 250 connects, 40 turns; medians of 5 runs, three sets, a7261e7,
// this shared 2-vCPU VM; connect4 itself 274-288 ns/run, 358-371 in the
// first set, a slow spell; the same case twice in a turn, -0.3 to +2 ns,
// is the method's bias; the match is a host, 127.0.0.1/32:port, the prefix
// a /24 around it, the miss past the filter a prefix of every port,
// 127.0.0.2/31, one probe):
//
//	pools  match (host)   match (/24)  miss (filter)  miss past the filter
//	1      +22/+15/+18    +18/+19/+18  +6/-2/+1       +27/+16/+14
//	64     +33/+21/+19    -            +6/+3/-0       +27/+17/+14
//
// The filter places pools of every port by IPv4 /16 since cac91d3:
// alternating binaries of 3fa4cd0 and cac91d3, 8 rounds, medians, 1/64
// pools: a miss beside such a pool in another /16 of its first octet
// +17/+20 ns -> +1.5/+1.5, beside a /8 (the exact filter) +2.5/+1.5 ->
// +5/+4, in its /16 (the probe) +16/+17 -> +19/+18.
//
// What a match pays: one probe of the table (a hash, an inlined load, the
// slot's line), the pool's line (settings and counts together), and the
// admission: a compare-and-swap on the pool's count and one atomic add on
// the project's entry (held and admitted packed in one word), the clock
// read once for both pools. The filter's lanes and the lengths are on the
// config line connect reads already. Alternating test binaries of 0d9e3ef
// (the filter on a line of its own) and 3886ae4 (on the config line), 8
// rounds, medians: host match +31/+32 ns against +26/+24 (1/64 pools), /24
// match +39.5 against +26.5, miss past the filter +21.5/+25.5 against
// +18.5/+18.5. With no pool configured the only cost is reading dest_kinds
// from the config map connect reads already (the same case twice: within
// ±3 ns).
package loader
