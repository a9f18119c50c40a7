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
// tries again. It does not wait for Retry-After: the drill is about what the
// admitted work holds and how fast it completes, and a writer sleeping a whole
// second per refusal would only hide the pressure the rule is meant to
// withstand. Latencies are those of admitted requests, measured by the writer
// from sending the request to reading the end of the response.
//
// Permits held per project are sampled from the pool's snapshots every
// Config.Sample, so a peak shorter than that can be missed (the rule itself is
// tested exactly in package pools).
//
// The verdicts, each pass or fail:
//
//   - small's p99 in "both" is within 3x its "solo" p99 (the specification's
//     bound) and within Config.TargetRatio (2x by default, our own goal);
//   - big is refused (429) in "both" and never holds more than POOL - FLOOR
//     there, while small is active;
//   - big holds the whole pool at some point in "big-alone", once small has
//     left the active set (one active window plus one recompute period).
//
// The connections drill (RunConnections) is the same experiment one level
// down: the connection pool enforced by the BPF programs of package loader,
// projects as cgroups, and connect loops in processes placed in them.
package drill
