// SPDX-License-Identifier: Apache-2.0

// Package front is the HTTP request front of fairshare: a reverse proxy in
// front of one upstream server that applies, per request and before any
// upstream work, the project's rate buckets and the requests pool's fair-share
// rule, then hands admitted requests to the request-class scheduler, which
// dispatches them to the upstream only while it has room.
//
// # Naming the project
//
// Every request belongs to exactly one project. The front resolves it in this
// order:
//
//  1. Config.Routes, written by the operator: a key "host" matches the request's
//     Host (with or without its port, case-insensitive); a key
//     "host/path-prefix" matches that host and a URL path under the prefix (the
//     longest prefix wins over a bare host). A matching route decides the
//     project and any project header the client sent is ignored, so a client
//     cannot step out of the project its host is routed to.
//  2. The project header (Config.ProjectHeader, default "Fairshare-Project").
//
// A request with neither, or with a name that is not a valid project name
// (1 to 64 characters from [A-Za-z0-9._-], starting with a letter or digit, the
// same names the cgroup projects use), is answered 400 with a one-line body.
// There is no registration: any valid name is a project as soon as it sends.
//
// The project header is removed before the request goes upstream, because it is
// the client's claim and not the front's decision. With Config.ForwardProject
// the front sets it upstream to the project it resolved (routes included).
//
// # Order of checks
//
// For each request, each step before any upstream work:
//
//  1. pools.Rates.Allow: the project's requests/s bucket and its work-units
//     debt. Refused: 429, Retry-After, "Fairshare-Refused: rate" or "debt".
//  2. pools.Pool.TryAcquire on the requests pool (the fair-share rule).
//     Refused: 429, Retry-After from the refusal's own estimate (whole seconds,
//     rounded up, at least 1), "Fairshare-Refused: share".
//  3. scheduler.Scheduler.Submit and Ticket.Wait with the request's context: the
//     request waits in its project's queue until the scheduler dispatches it.
//
// The requests-pool permit is held from step 2 until the request ends (the
// response body is copied, the client went away, or the upstream failed) and
// released exactly once. Dispatched work is completed with Ticket.Done(cost)
// and the same cost is charged to the project's work-units bucket
// (pools.Rates.Charge). The cost is the number of work units the upstream
// reports in Config.CostHeader (default "Fairshare-Work-Units"; the header is
// consumed by the front and not passed to the client); without that header it is
// the measured service time in units of Config.CostUnit when
// Config.CostFromTime is set, and 1 otherwise.
//
// # What the client sees
//
// Proxied responses carry "Fairshare-Class" (P1, P2 or P3: the class the
// scheduler dispatched the request under) and "Fairshare-Queue-Wait" (seconds
// spent waiting for dispatch). Refusals carry "Fairshare-Refused" and
// Retry-After, with a one-line body that states only the project's own numbers
// (what it holds and its share), never another project's. Hop-by-hop headers
// are removed in both directions. Bodies stream both ways: a response of
// unknown length is flushed to the client as the upstream writes it.
//
// # Serving
//
// *Front is an http.Handler. Front.Server returns an *http.Server for
// Config.Listen that speaks HTTP/1.1 with keep-alive and HTTP/2 over cleartext
// (h2c, prior knowledge) through net/http's own support for unencrypted HTTP/2
// (the x/net h2c package is deprecated in favour of it). The upstream side keeps
// idle connections for reuse.
//
// # Metrics
//
// Front.Collector reports per-project request totals by outcome and per-project
// latency histograms, read at scrape time. The number of project label values
// is capped (Config.MaxProjects); projects past the cap are reported as
// "other".
package front
