// SPDX-License-Identifier: Apache-2.0

// Package front is the HTTP request front of fairshare: a reverse proxy in
// front of one upstream server that applies, per request and before any
// upstream work, the project's rate buckets and the requests pool's fair-share
// rule, then hands admitted requests to the request-class scheduler, which
// dispatches them to the upstream only while it has room.
//
// # Naming the project
//
// Every request belongs to exactly one project, and the project comes from
// what the client cannot choose: what the kernel knows about the peer comes
// before anything the request says. The front resolves it in this order:
//
//  1. A trusted peer (Config.TrustedPeers: a TCP peer whose address is in one
//     of the listed CIDRs, or a local peer whose cgroup is a listed cgroup or
//     below one; an edge proxy that has already authenticated its clients is
//     the intended one): a route of Config.Routes matching the request, then
//     the project header (Config.ProjectHeader, default "Fairshare-Project"),
//     then its own cgroup's project as in 2.
//  2. A peer the kernel places in a project, when Config.ProjectsRoot is set:
//     the project is the directory directly below the root that contains the
//     client's cgroup (a client in root/web/workers is in "web"), the same
//     project the kernel side counts its connections under. Routes do not
//     apply to it: a local client cannot spend another project's budget, or
//     be exempt by route, by naming a host. On a unix socket the client is
//     the process SO_PEERCRED names and its cgroup is read from
//     /proc/<pid>/cgroup while the process is held by a pidfd
//     (SO_PEERPIDFD); on TCP the client's own socket is found in the
//     kernel's table (sockdiag.Lookup by the connection's two ends), from
//     any address, and its cgroup id mapped through an index of the
//     cgroups below the root, walked again at once on the first miss of an
//     id (a sub-cgroup created a moment ago is found; an id outside every
//     tree is remembered and costs one walk).
//  3. Any other peer (remote, or local in a known cgroup outside every
//     project): a route, else nothing.
//
// A local client whose cgroup the kernel cannot give is refused 403 ("the
// front cannot tell which cgroup this local client is in"), never taken for
// a peer outside every project: a unix peer whose connecting process exited
// (its socket passed to another process) or a TCP client of this node (its
// address is loopback or one of the node's) whose socket is already gone
// (reset or closed right after its request). A TCP peer whose socket is not
// in the kernel's table and whose address is not the node's is remote.
//
// A route is written by the operator: a key "host" matches the request's Host
// (with or without its port, case-insensitive; for an absolute-form request
// URI net/http sets Host from the URI); a key "host/path-prefix" matches that
// host and a URL path under the prefix (the longest prefix wins over a bare
// host). Exempt by route (Config.Exempt.Routes) follows the route: it applies
// only where the route decided the project. Forwarded and X-Forwarded-* are
// never read for identity, and no spelling of the project header or of a
// proxy claim (below) with underscores (which CGI-style upstreams would
// read as the same variable) is passed upstream.
//
// The header from a peer that is not trusted is refused, never silently
// believed: 403 when the peer's cgroup names another project ("the peer's
// cgroup belongs to project web"), and 403 when the peer has no project of
// its own. A local client may send the header with its own project's name.
// Nothing named (no route, no trusted header, no cgroup project) is 400. The
// default trusts nobody, so a front configured with nothing but an upstream
// serves routes and local cgroup clients only. A name is valid when it is 1 to
// 64 characters from [A-Za-z0-9._-] starting with a letter or digit; an invalid
// one is 400. There is no registration: any valid name is a project as soon
// as it sends.
//
// The peer's facts are found once per connection, at its first request that
// needs them (with no projects root and no cgroup in the trusted or exempt
// sets, none does), and shared by the requests of the connection. Addresses are the kernel's (the accepted socket's peer), never
// a forwarded-for header. Known limits: the pid of SO_PEERCRED is the one at
// connect time and the cgroup read is its current one (a process that moved
// is seen where it is now); a handler mounted on another server (without Front.Server's
// ConnContext) gets the address from http.Request.RemoteAddr and no cgroup.
//
// The project header is removed before the request goes upstream, because it is
// the client's claim and not the front's decision. With Config.ForwardProject
// the front sets it upstream to the project it resolved. The client's
// proxy claims are removed too, under any spelling: Forwarded,
// Forwarded-For, X-Forwarded and every X-Forwarded-*, X-Real-Ip,
// Client-Ip, X-Client-Ip, True-Client-Ip, X-Cluster-Client-Ip, X-Scheme,
// X-Url-Scheme and Front-End-Https, which upstream frameworks read as a
// proxy's word on the client's address or scheme (package proxyclaim); the
// same go from a chunked request's trailers. The front sets
// X-Forwarded-For to the peer's address, and X-Forwarded-Proto: https only
// for a request that came over TLS. It sends no X-Forwarded-Host, since
// the Host line is passed on unchanged, and no X-Forwarded-Proto: http,
// which its own listener would always say. A project header named as a
// proxy claim is refused at start.
//
// # Exempt class
//
// Operator and probe traffic must get through a full node. Config.Exempt names
// it by project (however the project was named: a trusted header, a route or
// a cgroup), by route key (where the route decided, see above), or by the
// client's cgroup (and those below it). An
// exempt request takes no requests-pool permit, skips the rate buckets and is
// not queued by the scheduler: it goes straight to the upstream. Its answer
// carries "Fairshare-Class: exempt".
//
// The bound: at most Config.ExemptMax exempt requests (default 4, or
// MaxInFlight when that is smaller) are in
// flight at once. Past that an exempt request is an ordinary request of its
// project, under every rule. The upstream therefore never carries more than
// MaxInFlight + ExemptMax requests, whatever exempt clients do, and being
// exempt cannot be claimed by a client: it follows from an identity the
// client cannot forge (a header is only believed from trusted peers).
//
// # Order of checks
//
// For each request, each step before any upstream work, after the head's
// own check: a head the front could not pass on as written (a method that
// is not a token, a space or control byte in the query, a Host that is not
// a host: net/http's HTTP/2 server hands such heads over) is answered 400
// (wellFormed) before the peer's identity is looked at.
//
//  0. The exempt class, within its budget, skips the steps below.
//  1. pools.Rates.Allow: the project's requests/s bucket and its work-units
//     debt. Refused: 429, Retry-After (and Retry-After-Ms), "Fairshare-Refused: rate" or "debt".
//  2. pools.Pool.TryAcquire on the requests pool (the fair-share rule).
//     Refused: 429, Retry-After (and Retry-After-Ms), "Fairshare-Refused: share".
//  3. scheduler.Scheduler.Submit and Ticket.Wait with the request's context: the
//     request waits in its project's queue until the scheduler dispatches it.
//
// The requests-pool permit is held from step 2 until the request ends (the
// response body is copied, the client went away, or the upstream failed) and
// released exactly once. Dispatched work is completed with Ticket.Done(cost)
// and the same cost is charged to the project's work-units bucket
// (pools.Rates.Charge). The cost is the number of work units the upstream
// reports in Config.CostHeader (default "Fairshare-Work-Units"; the header is
// consumed by the front and not passed to the client, so New refuses one the
// relay or the client needs or the front sets: a hop-by-hop field, a
// Content-* field, Date, the front's own; see internal/answerfield); without
// that header it is
// the measured service time in units of Config.CostUnit when
// Config.CostFromTime is set, and 1 otherwise.
//
// These steps are in admit.go (Front.admit, Front.finish); what follows
// them, the request's way to the upstream and its answer's way back, in
// proxy.go and upstream.go; the configuration and the servers in front.go.
//
// # Retry-After
//
// Every 429 carries a Retry-After computed for the project from an estimate
// and a rate: for "rate", the time until its request bucket holds a token and
// its requests/s; for "debt", the time until its work debt is paid and its
// work units/s (assuming a request costs one unit); for "share", the pool's
// own estimate from recent releases and the pool's measured release rate
// (pools.Refusal.ReleaseRate).
//
// A project's refused clients form a backlog (package internal/pace): a
// refusal is told the estimate plus one 1/rate for each of the project's
// clients refused before it and still due back, the backlog draining at the
// rate as time passes, so clients that obey come back about when they can be
// admitted, one after the other. The value is spread over one slot centred
// on it (pace.Spread) and rounded to a whole second at random (up with
// probability equal to the fraction), so its expected value is the slot;
// it is at least 1. Retry-After-Ms (HeaderRetryAfterMs) carries the slot
// itself, rounded up to the millisecond, at least 1: a client that reads it
// comes back when the slot says rather than in the whole second the
// standard header cannot go below. Before the pool has seen any release
// the rate is unknown: a refusal gets the estimate alone (the time since the
// pool's last recompute, at most one window; see package pools) and no place
// in line, and the crowd comes back once, when the rate is known; in the
// rest of the pool's first second the rate is measured from the releases
// so far. Projects have their own backlogs: a crowd of one project, obeying
// or not, does not move another's hints. A project whose clients ignore the
// header pushes its own backlog out, up to 60 seconds: without that bound a
// client of the same project that does obey was told up to 15400s in
// TestRetryAfterHonest's flood (32 clients retrying every 10ms), 1577 times
// its true wait; with it, 60s. In the same test, 16 obeying clients of 5
// requests each on a pool of 4 serving 8 requests/s finish in 11.5s against
// 10s of capacity, and no hint is more than twice the true wait.
//
// # Limits
//
// What one client or the upstream can make the front hold is bounded; each
// bound is a Config field (front.limits in the daemon's configuration):
//
//	MaxUpstreamHead      1 MiB  an upstream answer head (1xx heads included) larger: 502, connection closed
//	MaxInformational     8      more 1xx answers to one request: 502, connection closed
//	MaxRequestHead       64 KiB a client request head larger (net/http allows 4 KiB of slack): 431
//	ReadHeaderTimeout    10s    a client that has not sent its whole head by then: connection closed, no answer
//	IdleTimeout          2m     a client's kept-alive connection idle this long: closed
//	UpstreamIdleTimeout  90s    an upstream connection kept for reuse, idle this long: closed
//	BodyReadTimeout      30s    one read of a request body waiting this long: 408, connection closed
//	BodyMinRate          1 KiB/s a body averaging less, counted from BodyReadTimeout after admission: 408
//	WriteTimeout         30s    a piece of an answer the client does not take this long: connection closed
//	                            (HTTP/2: its stream reset, the window not opened counting as not taken);
//	                            a piece of a request body the upstream does not take: 504, or its answer cut off
//	UpstreamHeadTimeout  1m     no answer head this long after the whole request went out: 504
//	UpstreamReadTimeout  1m     one read of an answer's body waiting this long for the upstream (up to
//	                            an eighth more): the answer cut off, the upstream connection closed;
//	                            below 0: no bound
//	TunnelTimeout        10m    an upgraded connection (a tunnel) this old: both ends closed
//
// The last five bound how long an admitted request holds its permit, and
// its place among the scheduler's MaxInFlight (which projects share),
// against a client or an upstream that stops: a request whose peers keep
// moving is not cut short (a long download, a slow upload, a long poll, a
// stream of events that sends more often than UpstreamReadTimeout), but
// one that waits on a silent peer gives its permit back within the bound.
// A tunnel is cut at TunnelTimeout whether it is busy or not, as one
// admission could otherwise carry any number of requests over it, and
// UpstreamReadTimeout does not concern it.
//
// UpstreamReadTimeout is nginx's proxy_read_timeout for the body (its
// default too): the wait is counted only while the front reads, not while
// the client has yet to take what came before (WriteTimeout bounds that).
// An answer cut so ends as one the upstream broke off (see "What the
// upstream may not do"), counted an error: HTTP/1.1, the client's
// connection is closed before the body's end (a chunked body without its
// last chunk); HTTP/2, its stream is reset. On the direct path a read
// deadline bounds each read of the body from the connection (upConn.Read;
// the deadline, a runtime timer, is moved only when it would give the read
// less than the bound, to an eighth past it, so a stream moves it once
// every eighth of the bound at most, and an answer that came whole with its
// head sets none); the fast path's loop arms a deadline of its own at each
// piece it relays; the ReverseProxy path, whose http.Transport bounds no
// read of a body, watches each read with a timer and cancels the upstream
// request (the HTTP/1 connection closed, the HTTP/2 stream reset) when one
// has waited the bound (stallBody).
//
// WriteTimeout bounds, besides a client that does not take its answer, an
// upstream that does not take the request: no piece of its body taken for
// that long aborts the exchange (504, or the answer cut off if it had
// begun), on every path. The ReverseProxy path times the wait from each
// piece http.Transport takes from the body (32 KiB at most, as the direct
// path's) to its next ask, or to the trace's WroteRequest (the body out, or
// dropped by an HTTP/2 answer of 300 or more), so neither the client's own
// pace nor the wait for the answer is counted (sendBody), and stops the
// upstream request when one has waited the bound; an HTTP/2 stream that
// waits for a flow-control window once its answer's head is in sees no
// context end, so the stop closes the answer's body too (once, whoever
// closes it first), which resets the stream, and a frame write that waits
// the bound closes an h2c connection (WriteByteTimeout).
//
// UpstreamIdlePerProject (default 32) bounds the idle upstream connections
// kept for one project's requests; past it the project's least recently
// used one is closed (see "What the upstream may not do").
//
// Connecting to the upstream may take 5 seconds: past them the client gets
// 504, as for an answer head that does not come (nginx answers its
// proxy_connect_timeout so too); a connection refused or failed at once
// gets 502.
//
// The accepting side (connection caps, accept-error backoff) is the
// listener's, not the front's.
//
// # What the upstream may not do
//
// An upstream is not trusted to frame its answers. On the direct path (see
// Serving) a connection goes back to the pool only when its answer ended
// exactly at its framing with nothing more buffered and, for a request with
// a body, when the whole body had gone out before the answer began (an
// upstream that answers early may leave the rest unread, to be taken for the
// next request); it is checked again when taken out: anything the upstream
// sent while it was idle (a second or late answer, a body longer than its
// Content-Length, a body after HEAD, 204 or 304) is an answer nobody asked
// for, and the connection is closed rather than handing those bytes to the
// next request (a check with a non-blocking peek, one system call; a sweep
// every second closes idle connections that spoke or hung up). An answer
// head that is not plain must also pass a strict check (every line ended by
// CRLF, no folded line, no control character in a value, at most one
// Content-Length of digits only, not both Content-Length and
// Transfer-Encoding, a status in 100-599) or the client gets 502 and the
// connection is closed; net/http would accept several of these. A body that
// breaks off mid-way is cut on the client's side too (its connection is
// aborted, so the answer cannot read as complete), and the upstream
// connection is closed. What no HTTP/1.1 client can do is tell an answer the
// upstream sends only after the next request went out on the connection
// from that request's own answer; against an upstream that does that, only
// a connection per request helps. So an upstream connection serves one
// project (below): such an answer reaches at most another request of the
// project it was meant for, never another project's client.
//
// An upstream connection carries the requests of one project, ordinary or
// exempt (upKey: a project's exempt requests have connections of their
// own), from its dial to its close, on every path: the direct path (behind
// net/http's server, on TCP and on the unix socket), each fast-path loop,
// and an exchange a loop hands over, which goes on with the connection's
// project. Idle connections are kept by key (idlePool in idlepool.go: a
// map from key to the key's connections, each linked through the
// connection itself, so that a request's lookup is one map read and
// allocates nothing) and a request takes only one of its own key, else
// dials. The bounds: Config.UpstreamIdlePerProject idle connections of one
// key (default 32, the keepalive of nginx's examples), and
// idleUpstream(MaxInFlight, ExemptMax) in all (MaxInFlight plus the exempt
// budget: every request the front may have upstream at once; 64 without
// MaxInFlight). The direct path's pool and every loop's count against the
// same two bounds (idleBudget: one count per key and one in all, under a
// lock taken at each put and take), so that they are the front's, not
// each pool's; a connection put back past either bound closes the least
// recently used one of its key, or of all keys, in the pool it goes to,
// or itself when that pool holds none to give way (another loop's do).
// No check before reuse can replace this. TestLateAnswerStaysInProject
// has an upstream send, after one answer in four and at a random moment up
// to 500 ms later (most within 50 ms), a second answer, a piece of one from
// a random offset, or bytes glued after the body, to clients of four
// projects (one exempt) on keep-alive connections, with the default bounds
// and with 1 idle connection a project and MaxInFlight 4, one answer in 48
// chunked (handed from a fast-path loop to net/http's path): the front
// before this handed 1 to 10 answers a mode to another project's clients
// in 5,000 requests, on the fast path (three loops) with and without
// io_uring, on net/http's server and on the unix socket; it now hands
// none, while about 100 in 20,000 (the most with the default bounds)
// still reach another request of the same project, which the test counts
// and logs. On the fallback (ReverseProxy, see
// Serving) http.Transport applies its own framing rules, the head bound and
// the 1xx count, a status outside 100-599 is 502 with its connection closed,
// and an HTTP/1 connection carries one request (so it serves one project as
// well; to an h2c upstream each project has a transport of its own,
// keyedTransport, though HTTP/2 frames each answer with its request's
// stream): Transport looks for unasked
// bytes in a background read that races the next request, and under
// concurrency it gave clients each other's answers. TestHostileUpstream sends
// 25 such upstream behaviours, one by one and in random sequences on one
// pooled connection, through the front and through net/http's own
// ReverseProxy: the front is never less strict, and no client gets another's
// bytes; TestHostileConcurrent sends them from clients of two projects at
// once, with honest requests between them, on both paths.
//
// # What the client sees
//
// Proxied responses carry "Fairshare-Class" (P1, P2 or P3: the class the
// scheduler dispatched the request under; none without a scheduler) and
// "Fairshare-Queue-Wait" (seconds spent waiting for dispatch). These, the
// refusal's field and the cost header are the front's: an upstream that sends
// them in its head, in an informational answer or in its trailer does not
// get them to the client. Informational answers (1xx) reach HTTP/1.1 and
// HTTP/2 clients only; an HTTP/1.0 client gets the final answer alone. Refusals carry "Fairshare-Refused" and
// Retry-After, with a one-line body that states only the project's own numbers
// (what it holds and its share), never another project's. Hop-by-hop headers
// are removed in both directions. Bodies stream both ways: a response of
// unknown length is flushed to the client as the upstream writes it.
//
// # Serving
//
// *Front is an http.Handler. Front.Server returns an *http.Server (for
// Config.Listen, or any listener given to Serve: TCP or a unix socket) that
// records each connection's peer and speaks HTTP/1.1 with keep-alive and HTTP/2 over cleartext
// (h2c, prior knowledge) through net/http's own support for unencrypted HTTP/2
// (the x/net h2c package is deprecated in favour of it). The upstream side keeps
// idle connections for reuse, each for one project's requests (see "What
// the upstream may not do").
//
// Every request but a tunnel (a WebSocket upgrade, CONNECT), to a plain
// HTTP/1.1 upstream (http://, no base path), takes the direct path: the
// request is written and the answer read on the handler's own goroutine
// over a kept-alive connection the front owns. A request body goes upstream on a
// goroutine of its own while the answer is read, each piece as the client
// sends it (an upstream may answer before it read all of it) and within
// WriteTimeout (an upstream that takes none for that long has the
// exchange aborted, as it may never answer), with its Content-Length, or
// chunked (with the client's trailer) when its length is unknown; Expect: 100-continue is answered by the front's server when the
// body is first read, that is once the request was admitted, and not passed
// on. A connection the upstream closed while idle is replaced once for a
// request that may be sent again (no body; GET, HEAD, OPTIONS, TRACE or an
// Idempotency-Key), as http.Transport does; see "What the upstream may not
// do" for when one is reused. An answer whose head is plain (HTTP/1.1, one
// Content-Length, no chunking, trailer or Connection field, no field twice,
// all of it in the first read) is parsed straight into the client's header;
// any other by http.ReadResponse. A client that goes away aborts the
// exchange: under Front.Serve, HTTP/1 clients are heard from their own
// connection (net/http's read of it fails, or, while the request waits in
// the queue, a look at the connection finds it shut: see hangup.go);
// HTTP/2 streams and connections of another server through the request's
// context. A client that pipelined the start of its next request and then
// left is heard once out of the queue only when its answer is written, as
// net/http's read stops at that byte. A client that half-closes its
// connection after its request (shuts down its sending side) is taken as
// gone too, as nginx takes it unless
// proxy_ignore_client_abort is on (499) and as net/http's server does:
// the end of its stream cannot be told from a client that closed its
// socket and left, whose permit would otherwise be held until the upstream
// answers. Such a client reads no answer, on every path: the connection is
// closed (an HTTP/2 stream reset), and the front never lets net/http write
// its empty 200 for a request it could not answer. What reaches the
// upstream and the client is what httputil.ReverseProxy would send (a test
// compares the two) but for Expect and a client's trailer, whose values
// ReverseProxy drops, at about half of its CPU per request: in
// BenchmarkOverhead with wrk, the front with the direct path served 1.6
// times the GETs of the same front with it off, at 24 against 45 µs of CPU
// per request; for POSTs of 1 KiB, 1.55 times the requests of the front that
// sent bodies through ReverseProxy over kept-alive connections, at 32
// against 57 µs, and 2.9 times those of ReverseProxy with a connection per
// request (113 µs). Tunnels, an h2c or https upstream and an upstream with a
// base path go through httputil.ReverseProxy (the fallback); over HTTP/1 it
// opens a connection per request (see "What the upstream may not do").
//
// Of upgrades the front tunnels WebSocket alone (tunnelUpgrade): an
// HTTP/1.1 request with upgrade in Connection and websocket among the
// protocols of Upgrade goes upstream offering websocket and nothing else,
// and its tunnel holds the request's permit until it ends, at TunnelTimeout
// at the latest. Any other upgrade is ignored, as RFC 9110 7.8 lets a
// server do: Upgrade and HTTP2-Settings are dropped and the request is
// served as the plain HTTP/1.1 request it also is, which an h2c client
// follows in HTTP/1.1 (RFC 7540 3.2). An h2c upgrade passed on, once the
// upstream took it, left the client speaking HTTP/2 to the upstream: any
// number of requests on one permit, past the rate buckets and the
// scheduler, their fields (the project header, X-Forwarded-For) as the
// client wrote them.
//
// # Fast path
//
// With Config.FastPath (the daemon's front.fast_path, on by default; the
// defects four reviews found are fixed, each with a test in
// fastpath_review_test.go, fastpath_drain_test.go, fastpath_smallbuf_test.go
// or fastpath_dial_test.go),
// Serve on a TCP listener serves the commonest exchange in event loops of
// the front's own, GOMAXPROCS-1 of them (at least one), each an epoll instance over
// non-blocking sockets, instead of net/http's server: a plain HTTP/1.1
// request (see plainRequest: a token method other than CONNECT and HEAD, an
// origin-form target, every line ended by CRLF, no folded line, no control
// or non-ASCII byte in a value, one Host, at most one Content-Length of
// digits, no Transfer-Encoding, Connection, Upgrade, Expect or Trailer, a
// head of at most 8 KiB, and MaxRequestHead, and a body of at most 64 KiB
// that came with it),
// admitted by the same Front.admit as ServeHTTP (identity, exempt budget,
// rate buckets, pool, scheduler ticket; a ticket that must wait waits on a
// goroutine that posts the rest back to its loop), written upstream with the
// direct path's own head (directUpstream.writeHead) on a connection of the
// loop's pool kept for the request's project, and answered in the loop when the answer's head is plain
// (plainHead, with a Content-Type) and its body framed by Content-Length.
// The listener's caps and accept backoff apply as before: the loops take
// over the accepted connections' sockets.
// A new client's cgroup is looked up (sock_diag) as its connection is
// accepted, before a loop takes it, so that the round trip of each new
// connection holds up no loop. A transient accept error on a listener
// without its own backoff (out of descriptors, say) is waited out as
// net/http's server does. A new upstream connection is the loop's own
// non-blocking connect when the upstream is given by its address; one
// given by a host name is dialed by the direct path's dialer on a
// goroutine, the name looked up each time and every address tried, as on
// net/http's path, and the request waits for it in the loop.
//
// Anything else goes to net/http's server, for the rest of the
// connection's life, with the bytes the loop had read and not yet written
// and the peer's facts already found: HTTP/2, HTTP/1.0, upgrades, a head or
// body that is not plain (net/http answers what it refuses, 400 or 431, as
// it always did: the fast path is never looser, FuzzRequestHead), a body
// sent after its head (read there under BodyReadTimeout and BodyMinRate).
// An answer whose head is not plain (chunked, a 1xx, a trailer, a head
// strictHead must check, one over 16 KiB so far) hands over the exchange
// too: the request, already admitted and sent, is finished by
// serveResumed on the upstream connection with what the loop had read of
// the answer, by the same code as the direct path. What the loop had not
// written of the request yet (an upstream may answer before it read the
// body, and end its answer only after) goes out meanwhile, as the direct
// path sends a body, each piece within WriteTimeout: an upstream that
// takes none for that long has the exchange aborted (504 before the
// answer's head, the answer cut off after it), and the connection is
// never reused. An upstream that hangs up while the loop writes the
// request has what it answered before relayed (an early 413, say), as on
// net/http's path.
//
// The loops keep the direct path's rules: an upstream connection is reused
// only after an answer that ended exactly at its framing with nothing more
// received and the whole request out before it began; an idle one stays
// registered and is closed on any readable or hang-up event, and the loop
// looks once more for such events (epoll_wait with no wait) before it
// reuses any (the race with bytes sent just then is the one no HTTP/1.1
// client avoids, see above). Their deadlines are the front's limits:
// ReadHeaderTimeout for the first head from the accept, as net/http counts
// it (neither its first byte nor a hand-over to net/http's server starts it
// again), and for a later one from its first byte; IdleTimeout between
// requests, WriteTimeout on a client that does not take its answer and on
// an upstream that does not take the request (504), UpstreamHeadTimeout
// once the request is out (504), UpstreamReadTimeout from each piece of
// the answer's body relayed (or from when the client took the last one)
// to the next (the answer cut off), 5s to connect (504
// as on net/http's path; a refused connection is 502), UpstreamIdleTimeout
// in the pool. A client that goes away
// (hang-up or error event, a half-close included, see Serving) aborts its
// exchange and gives the permit back; an answer broken mid-body closes the
// client's connection. The loop
// blocks in epoll_wait only after a look found nothing: a blocked system
// call costs the Go runtime a hand-off of its P to another thread each
// time. A loop that saw 400 events or more in 10 ms locks its goroutine to
// its OS thread until a window sees fewer (loopHeat in fastloop.go; see
// Cost).
//
// A loop reads the sockets a pass's events report readable in one io_uring
// call too, before it handles the events (recvAll in fastrecv.go:
// IORING_OP_RECV with MSG_DONTWAIT, each read what recv(2) would have
// read, into its share of a 64 KiB buffer of the loop): each such read is
// the one the event's handling would have made first (a client waiting
// for a request, an upstream connection whose answer is relayed to a
// client that took what it was sent), and its bytes wait on their
// connection until that read takes them. A read that fills its share
// leaves the socket readable, and read(2) goes on; a read of the ring not
// taken during the pass leaves its connection readable (its bytes kept on
// it: an upstream connection with bytes not taken is never pooled). An
// event the ring did not read for is handled as without it, and a pass
// with a single such read makes it with read(2). A read whose result did
// not come (a broken ring) ends its connection: bytes may be lost.
//
// A loop sends nothing while it handles a pass's events: the requests it
// dispatches and the answers it relays wait in their connections' buffers
// until the pass ends, and then all go out in one io_uring call (sendRing
// in uring.go: IORING_OP_SEND with MSG_DONTWAIT, up to 256 a call). Each
// send is tried at once and answers what a non-blocking send(2) answers, so
// no buffer is the kernel's after the call; what a socket did not take is
// sent as before, when it has room again, under WriteTimeout. The reason is
// the peers: a send wakes the client or upstream reading the socket, and
// the kernel, which switches tasks only on their way back to user space
// here, switched to the first woken peer after each send(2) and back; after
// one call each finds everything it was sent (see Cost). Until the pass
// ends a client counts as one that has not taken its answer: its next
// pipelined request, and the next piece of a long answer, wait for the next
// pass (the loop's again list), as another client's turn would.
// Config.PlainSends (the daemon's front.io_uring: false) sends each with
// its own send(2), as does a loop the kernel gives no io_uring
// (kernel.io_uring_disabled, a seccomp filter: logged once). A send the
// kernel refuses as it takes it ends the call there; it and the sends after
// it are made with send(2). A ring whose call fails is closed, logged, and
// the loop sends without it from then on; a send the kernel took whose
// result did not come is never made again (an answer twice would answer the
// client's next request, a request twice would run twice): its client is
// closed, or its exchange with the upstream fails (502).
//
// When Serve is told to stop, the loops close their idle clients and give
// the others until the drain's end (five seconds, as net/http's server
// gets) to finish the exchange in flight; a request whose head had begun
// is still served (net/http's own server closes such a connection
// unanswered). A connection a loop hands over during the drain
// (an answer or a head that is not plain) is served by a server of its
// own for that one exchange, as net/http's server serves what is in
// flight at its shutdown, and closed at the drain's end at the latest. At
// the end every exchange still in flight (waiting for the scheduler, too)
// is aborted, and its permit is given back before Serve returns; a
// connection handed over that could not be served gives back the
// exchange it carried (permit, upstream connection). On either path the
// connections net/http's server still has at the drain's end are closed,
// and Serve waits up to a second more for their requests to give their
// permits back; an upgraded connection's tunnel is left to end by
// tunnel_timeout (as net/http's Shutdown leaves hijacked connections),
// and logged. A client idle when the stop comes is closed, once it took
// what it had not read of its last answer; one whose head had begun is
// served, and closed after its answer.
//
// Each epoll registration carries a number of its own, so that an event
// of one batch for a connection closed earlier in that batch never reaches
// a connection that took its descriptor number meanwhile. An idle client
// keeps no read buffer larger than 4 KiB, nor a send buffer larger than
// 2 KiB (kept so that an answer a pass does not allocate one).
//
// FAIRSHARE_FRONT_FAST=1 runs every front of the package's tests on the
// fast path (make test runs the suite both ways); TestFastPathServes shows
// the plain exchanges staying in the loops.
//
// The code is cut by what each part owns, each file opening with what it
// owns: fastpath.go (the listener and the loops it starts), fastloop.go
// (a loop: its polling, its pass, its thread, its deadlines),
// fastclient.go (a client connection's states), fastupstream.go (an
// upstream connection's), fastrecv.go (the pass's reads with the ring),
// fastsend.go (the sends, with the ring of
// uring.go or without), fastanswer.go (the heads a loop writes) and
// fasthand.go (the hand-over to net/http).
//
// # Cost
//
// Upstream connections kept per project (see "What the upstream may not
// do") cost nothing measurable. In BenchmarkOverhead (2026-12-06, on a
// machine loaded by others to a load average near 30 on its 2 cores, so
// that the three processes of a turn kept 0.6-0.9 of a core busy with one
// wrk; FAIRSHARE_BENCH_SECONDS=4, 5 runs, medians of each run's ratios;
// the throughput ratios of single runs spread from 0.8 to 1.9, the CPU
// ones far less), against the build before with its fast path
// (FAIRSHARE_BENCH_BASELINE_FAST=1) the fast path spent 1.00 of its CPU a
// request with one project and 0.99 with 20 (FAIRSHARE_BENCH_PROJECTS=20,
// a wrk of 2 connections in each project's cgroup), at 1.04 and 0.97 of
// its throughput. Against nginx and HAProxy (haproxy 2.6, two threads,
// http-reuse always, maxconn 1024 on the server) in the same runs: one
// project, 1.15 and 1.05 of their throughput at 0.84 and 0.85 of their CPU
// a request; 20 projects, 1.09 and 1.20 at 0.75 and 0.70.
//
// With a pass's reads in one io_uring call as well (recvAll), a request
// costs the loop 0.9 system calls instead of 2.6 (perf stat -p on the
// front under wrk -t1 -c32, the build before beside it in the same
// minute: read(2) 0.09 a request instead of 2.0, io_uring_enter 0.31
// instead of 0.17, epoll_pwait 0.33 instead of 0.27; nginx makes 5.3). In
// BenchmarkOverhead against the build before (FAIRSHARE_BENCH_BASELINE with
// FAIRSHARE_BENCH_BASELINE_FAST=1; a machine loaded by others, the three
// processes of a turn keeping 0.6-0.9 of its 2 cores busy; medians of 5
// rounds in one run each) it spent 0.81 and 0.88 of the CPU a request in
// two runs with one project and 0.89 with 20; the throughput ratios
// (1.06 and 0.93 with one, 1.16 with 20) are inside that machine's noise.
// The ring's part in the loop's CPU profile is now mostly the sends' own
// work in the kernel (the loopback's receive path runs in the sender's
// context), user code about a quarter.
//
// With a pass's sends in one io_uring call, the fast path serves more than
// nginx at less CPU a request. In BenchmarkOverhead with wrk (2 cores
// shared with wrk and the upstream; one run of 5 rounds, medians of the
// rounds' ratios) it served GETs at 1.03 of nginx's throughput (rounds 1.03
// to 1.09) and 0.72 of its CPU a request (21.8 against 29.5 us), POSTs of 1
// KiB at 1.14 (1.10 to 1.17) and 0.66 (21.1 against 32.8 us); the build
// before, in the same runs, 0.91 and 0.96 of nginx's throughput, at 0.96 of
// its CPU a request for GETs. The loop is preempted 0.09 to 0.11 times a
// GET where it was 0.23 to 0.30 (nginx's workers 0.16 to 0.17), wrk spends
// less CPU a request behind it than behind nginx (14.9 against 15.7 us;
// 15.8 behind the build before), and the upstream no more. At the moderate
// rate its CPU a request is 1.07 of nginx's (the build before 1.14) and it
// adds 0.66 ms at p99 against nginx's 0.55 (0.92 before). What follows, up
// to the ring, measured the loop before it.
//
// Of what a proxied request costs the front, its own steps (identity, rate
// buckets, pool, scheduler, metrics, the front's headers) are a few
// microseconds; the rest is the HTTP/1.1 server, the parsing of the
// upstream's answer, and above all the kernel. On net/http's server a
// request costs 8.2 system calls (perf stat under wrk; nginx 4.4): Go's
// netpoller reads before it waits, so the read of the client's next request
// and of the upstream's answer each return EAGAIN once, net/http's
// background read of the client adds one more, the idle check of the
// upstream connection one (a non-blocking peek), and a fifth of the CPU
// samples are the runtime switching and waking threads. The fast path
// reads only what epoll reported, never peeks (an idle upstream connection
// that speaks is an event), and needed 4.4 system calls and 0.38 context
// switches a request (perf stat -p on the front under wrk: with the ring,
// 2.95 and 0.28 where the build before made 4.23 and 0.75 in the same run;
// its two sends a request are 0.36 io_uring calls, its two reads still
// two read(2)s). In BenchmarkOverhead with wrk (medians of 5, 2 cores
// shared with wrk and the upstream) the fast path served GETs at 9.9 us of
// CPU a request against nginx's 10.5 (net/http's server, earlier: 23.1), at
// 0.94 of nginx's throughput (two later runs: 0.87 and 0.92 at 0.99 and
// 0.94 of its CPU; net/http 0.66); POSTs of 1 KiB at 10.2
// against 11.8 and 30.1 us, 0.95 of nginx (net/http 0.55). The upstream
// behind the front costs what it costs behind nginx (11.7 against 12.2 us
// a GET) since the front sends it no X-Forwarded-Host, nor
// X-Forwarded-Proto but over TLS (see isClaim in identity.go): the two had
// cost it 0.6-0.9 us. The loop relays an answer's head from its parsed
// fields (plainFields) with no header map between: against the build with
// the map, 0.955 times the CPU a request and 1.033 times the throughput
// (medians of 5 in one run, FAIRSHARE_BENCH_BASELINE with
// FAIRSHARE_BENCH_BASELINE_FAST=1).
//
// Where the rest of the gap goes: BenchmarkOverhead also reports wrk's own
// CPU a request and how many of the two cores proxy, upstream and wrk keep
// busy together, and has targets that take the front apart: fastnosched
// (the fast path without the scheduler) and fastpool (the pool alone, no
// rate buckets either, which is what nginx's limit_conn does). The
// reference that explains the gap is nginx with one worker
// (FAIRSHARE_BENCH_NGINX_WORKERS=1, target nginx1): single-threaded, as the
// loop is, it serves 0.95-1.01 of what nginx with two workers serves, at
// 0.91-0.96 of its CPU a request (three runs). Against it (medians of 5,
// FAIRSHARE_BENCH_TARGETS=nginx,nginx1,fast,fastnosched,fastpool) the fast
// path spends 0.99-1.03 times the CPU a request and serves 0.92-0.93
// (three runs; before the
// loop dropped the answer's header map, 1.09-1.11 and 0.88-0.90 in two
// runs). The upstream and wrk spend about the same behind each, and busy
// cores follow throughput (1.62 for the fast path, 1.85 for nginx1). The
// front's steps beyond the pool are not what is left: fastpool spent 0.95
// to 1.01 of the fast path's CPU a request in three runs, inside the
// noise. From /proc under wrk, each proxy alone with its upstream (before
// that change), the loop's kernel time a request was nginx's (about 7 us,
// over 4.3 system calls a request against nginx's 5.3 with two workers, by
// perf stat), and its user time 3.1-3.6 us against nginx1's 2.3-2.7; its
// voluntary switches are 0.08-0.10 a request against 0.04-0.07, its
// preemptions about the same (0.3).
// The loop's user time is spread thin (perf record -e cpu-clock:u, before
// that change): the header maps of the request and the answer 10-18% of
// it, building the request's net/http structures (url, fields) 8%,
// allocation and collection 10%, clock reads 7% (seven a request then, 36
// ns each here: the front's own latency figures three, the scheduler two
// and the rate buckets two, which now read it only for a project with
// limits), the
// runtime's system call entry and exit 5%. Ruled out, each measured
// against main's build in one run and reverted: collecting less often
// (GOGC=800 in the front's process);
// leaving out the loop's Gosched, which made 87% of its futex calls
// (perf record -e syscalls:sys_enter_futex -g) and moved its goroutine
// between threads: futex calls 18.1k to 2.7k in 5 s, throughput the
// same; sending each request upstream in the pass that read it (upstream
// events first) instead of after the next look; a queue wait (there is
// none: Fairshare-Queue-Wait 0 under wrk). A locked thread without the
// Gosched served 1.04 times main's requests at saturation (medians of 5,
// two runs; with three more looks before blocking, 1.08), but took 1.14
// times the CPU a request at the moderate rate (1.19 with the looks), and
// with 2 connections served 0.82 of main's requests while wrk's own CPU a
// request rose from 9.9 to 12.8 us; the extra looks without a locked
// thread changed nothing. A thread locked always, with the Gosched kept,
// served 1.10 times the requests of the unlocked loop (medians of 5 in one
// run) at 0.99 of its CPU a request, but took 1.10 times the CPU a request
// at the moderate rate: a locked goroutine's Gosched hands its P to another
// thread and back. So the loop locks its thread only while it is hot
// (loopHeat: 400 events or more in a window of 10 ms, some 20k requests a
// second): against the build before (FAIRSHARE_BENCH_BASELINE, medians of 5
// in one run) it served 1.06 times the requests at saturation, 0.975-0.98 of
// nginx's in each of the five rounds where the build before served
// 0.89-0.945 (over six runs the medians were 0.93-0.975 of nginx's, about
// 0.95; the build before, in the same runs, 0.86-0.93), at about nginx's CPU
// a request (10.47 against 10.30 us by the medians, 0.99 the median of the
// per-round ratios; 1.02 of the build before's); at the moderate rate its
// CPU a request was the build before's (0.98) and 0.91 of nginx's. Unlocked,
// the loop's goroutine ran on three or four threads in turn under wrk (perf
// sched); why the lock gains more than the futex calls it saves is not
// measured. A hot loop also blocks without the Gosched (which, locked, hands
// its P away and back): against the build that kept it, the same throughput
// (1.00 and 0.99, medians of 10 and of 5 in two runs) at 0.95 and 1.03 times
// the CPU a request; the futex calls it saves were 5% of the loop's samples
// (pprof). Few connections do not bring back the 0.82 above: with wrk -c2
// and -c4 (4 s turns, one upstream, medians of 3) the hot loop served 18.0k
// and 32.3k requests a second where the build before the lock served 18.3k
// and 32.6k, nginx with one worker 14.9k and 31.8k, and the lock with the
// Gosched 17.9k and 30.5k (at 1.2 times the CPU a request with -c4). A
// higher priority for the loop's thread (nice -5 on the front's threads) cut
// its preemptions from 0.3 to 0.07 a request
// and gained 2% throughput at 1.08 times the CPU a request; a shorter
// EEVDF slice for its locked thread (sched_setattr, 0.1 and 0.3 ms) gained
// nothing; raw system calls for its reads and writes (no runtime entry and
// exit around them) saved 0.15 us a request and gained no throughput.
// A second
// loop (FAIRSHARE_BENCH_FAST_LOOPS="1 2" adds targets fast1 and fast2)
// reached 0.93-0.99 of nginx's throughput at 1.2
// times its CPU a request, and 1.4-1.6 times at the moderate rate; giving
// the loops Ps of their own on top of GOMAXPROCS, or a locked thread each,
// or blocking without the look before it, changed neither beyond the
// noise. Two loops on locked threads whose epoll_wait the runtime does not
// see as a system call (so that no P is handed off) came to 0.90-0.91 of
// nginx at 1.15 times its CPU a request (from /proc, each proxy alone
// with its own upstream under wrk). The two
// loops are not slowed by each other: they contended for the pool's and
// the scheduler's locks 405 times in 5 s, 14 ms in all.
// On these virtual machines a context switch is much of what a request
// costs, and BenchmarkOverhead reports them a request (X-sleeps/req,
// X-preempts/req, X-upstream-switches/req). In the five rounds of one run
// one loop was preempted 0.24 to 0.29 times a request, nginx's two workers
// 0.16 to 0.18. perf (sched:sched_switch on the front's threads) names the
// preempting task: wrk, woken by the loop's write of an answer (17,212 of
// the 20,423 preemptions of the front's threads in 2 s). Such a wake-up is
// synchronous, so the kernel queues wrk on the loop's CPU, which the loop
// does not leave, and it does so while the other CPU idles: these VMs
// describe no cache their two CPUs share (no /sys/devices/system/cpu/*/cache),
// so the scheduler does not look for an idle CPU at a wake-up. In 1 s of
// sched:sched_wakeup under wrk, the loop woke wrk onto its own busy CPU
// 7,197 times, 3,579 of them with the other CPU idle, and onto the other
// CPU 244 times. That is where a single-threaded proxy's idle core comes
// from, nginx with one worker's as well. SCHED_BATCH for the front's threads changed none of it
// (0.43 to 0.53 preemptions a request against 0.45 to 0.49, by /proc with
// wrk alone). Against nginx with one worker the loop stands level (24.1k,
// 24.4k and 23.8k requests a second against 24.0k, 23.6k and 23.8k, three
// rounds of one run). Two loops spend a fifth of their CPU in the Go
// runtime's scheduler: sysmon, which naps 20 us at a time again whenever it
// hands away the P of a loop blocked in epoll_wait, took 14.7% of the
// front's samples, against 5.3% with one loop. Two locked loops whose
// epoll_wait is a raw system call, with a P each added to GOMAXPROCS, took
// sysmon back to 4.4% and kept the cores as busy as nginx does (1.84 to
// 1.93), but slept 0.23 to 0.26 times a request against nginx's 0.15 to
// 0.19 and served 0.94 of nginx's throughput at 1.12 times its CPU a
// request (medians of 5 in one run, where one loop served 0.91 at 0.97).
// With their reads and writes raw system calls as well, what two loops
// spend beyond one is the hypervisor's: of perf's samples a request, the
// interrupts enabled at the end of a context switch (pvm_irq_enable under
// finish_task_switch) took 6.2 us against 3.1 for one loop and 3.1 for
// nginx's two workers, and those enabled after waking a sleeping peer
// (under sock_def_readable) 3.7 against 3.2 and 1.7: nginx's peers are
// asleep less often when it writes to them. Sending all of a pass's
// answers and requests in one call (see Fast path) is what removed the
// preemptions without a second loop.
// FAIRSHARE_BENCH_TARGETS keeps a run to the targets named, and
// FAIRSHARE_BENCH_BASELINE_FAST=1 runs the baseline build on its fast path.
// BenchmarkOverhead measures the whole against going straight to the
// upstream and against nginx in the same run: throughput and CPU per request
// at saturation, and the p50 and p99 added at a moderate open-loop rate.
// BenchmarkRequest counts the allocations of one request, a figure that does
// not move with the load on the machine.
//
// # Metrics
//
// Front.Collector reports per-project request totals by outcome (ok,
// refused_rate, refused_debt, refused_share, error, canceled, and exempt for
// exempt requests answered by the upstream) and per-project latency
// histograms, read at scrape time; the requests refused before they had a
// project (400, and 403 for an untrusted header); the exempt requests in
// flight, the exempt budget, and the exempt requests that found it spent. The
// number of project label values is capped (Config.MaxProjects, "(other)"
// included) by the daemon's one label policy (package internal/labels): the
// busiest projects keep a label of their own while they ask, and a label
// frees when its project has had no request for a minute (the pools' forget
// period), when the front forgets the project's counts.
//
// # Events and dry-run
//
// Deps.Events, if set, receives each refusal (share, with the rule's
// numbers; rate; debt; 400 and 403 with the peer) as an events.Event; it
// must not block. A project for which Deps.DryRun reports true is admitted
// where its rate or debt would refuse it, and the requests pool admits it
// past its share (pools.Pool.SetDryRun): each such request is published as
// would_refuse and counted in fairshare_front_would_refuse_total{reason}.
// The rate buckets count it in their own refusals as well, as the decision
// was made.
package front
