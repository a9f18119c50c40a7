// SPDX-License-Identifier: Apache-2.0

// Package drill runs the fair-share drill: the experiment that shows the rule
// working on this host, with nothing to set up beforehand.
//
// The HTTP drill (Run) starts, in process and on loopback, an upstream with a
// fixed service time, a requests pool cut small (8 by default), rate buckets,
// the request-class scheduler and the front, then drives them with
// closed-loop writers: each writer sends a request, waits for the answer and
// sends the next. Two projects take part: "small" with 2 writers and "big"
// with 16. Three phases follow each other:
//
//	solo       small alone: its baseline latency
//	both       small and big together
//	big-alone  big alone, after small stopped
//
// "solo" and "both" take turns in slices (Config.Slices, 10 by default: ten
// half-second turns each with 5s phases), solo first, and "big-alone"
// follows the last "both" slice. The p99 ratio compares two phases measured
// on the same machine, and whatever else that machine is doing (other
// processes, a compile, the drill's own garbage collection) changes over
// seconds: run one after the other, a burst of outside load that falls on
// one phase and not the other moves the ratio more than the rule does. Taking
// turns puts such a burst on both sides alike. A solo slice after a both
// slice counts from when big's last request of that slice ended, so "solo"
// is small alone.
//
// A writer that is refused (429) pauses briefly (Config.RetryPause) and
// tries again. It does not wait for Retry-After: a writer sleeping a whole
// second per refusal would only hide the pressure the rule is meant to
// withstand. A request's latency is what its writer waited for it: from its
// first ask to the end of the response, every refusal and pause on the way
// included, as the project's own client would see it. Measuring from the
// admitted ask alone would say nothing: the upstream's service time is fixed
// and the front admits no more than it can send at once, so admitted work
// never queues, and a scheme that refused small again and again would show
// it as fast as the rule does. Each phase also counts the refused asks, the
// admitted requests that were refused first (retried) and the most refusals
// one request had. A request still refused when its writer's phase ends is
// counted cut (JSON "cut"), and in the latencies from its first ask to that
// end, a lower bound: a scheme that kept small refused to the end of a
// phase does not leave those requests out of its p99.
//
// Permits held per project are sampled from the pool's snapshots every
// Config.Sample, so a peak shorter than that can be missed (the rule itself is
// tested exactly in package pools).
//
// The verdicts, each pass or fail:
//
//   - small's p99 in "both" is within 3x its "solo" p99 (the specification's
//     bound). Within Config.TargetRatio (2x by default) is our own goal,
//     reported as met or missed without failing the run: a request's latency
//     runs from its first ask, so small's retries on a pool big has filled
//     count, and a loaded host alone can take the ratio past 2x;
//   - small is refused rarely in "both": at most SmallRefusalLimit refused
//     asks per admitted request. Below its share, small is refused only on
//     a full pool and gets the next permit released; where big may take
//     every permit released, small is refused again and again;
//   - big is refused (429) in "both" and never holds more than POOL - FLOOR
//     there, while small is active;
//   - big holds the whole pool at some point in "big-alone", once small has
//     left the active set (one active window plus one recompute period).
//
// The latency verdicts are timing targets: the machine's other load moves
// them. The others count what was admitted and refused, and the tests run
// the drill with the rule replaced (first come, first served; a static cap
// per project) to show that each such scheme fails them.
//
// The connections drill (RunConnections) is the same experiment one level
// down: the connection pool enforced by the BPF programs of package loader,
// projects as cgroups, and connect loops in processes placed in them.
package drill
