// SPDX-License-Identifier: Apache-2.0

package drill

import (
	"fmt"
	"syscall"
	"time"

	"github.com/fairshare-dev/fairshare/loader/limits"
	"github.com/fairshare-dev/fairshare/pools"
)

// MaxSlices is the most turns "solo" and "both" may take (Config.Slices):
// the report lists every slice, and a slice also has a least length
// (minSliceServices).
const MaxSlices = 1000

// minSliceServices is the least length of a slice, in service times. A solo
// slice that follows a both slice counts only from when big's last request
// of that slice ended, a service time or more after it began: at ten
// service times a slice, that gap takes a tenth of it at most on an idle
// machine, where shorter slices would leave "solo" counting little of small
// alone.
const minSliceServices = 10

// writerDescriptors is how many file descriptors each writer of the HTTP
// drill keeps open at the least: its keep-alive connection to the front, at
// both ends, in this process.
const writerDescriptors = 2

// Check says why a drill with cfg could not pass, or nil: the verdicts
// follow from the rule (pools/doc.go) and the drill's timing, and some
// combinations of knobs fail one whatever the host does. connections is the
// connections drill (RunConnections, cfg.ToDestination read), else the HTTP
// drill (Run). Zero fields are the defaults, as for Run. The error names the
// knobs as the flags of 'fairshare drill' do.
//
// The bounds:
//
//   - pool (connections): the kernel's pool holds at most
//     limits.MaxPoolSize permits; to a destination pool the node's pool
//     around it is destNodeFactor times larger and holds as many at most.
//   - pool >= 2: beside small, big's share is max(FLOOR, POOL/2); above
//     POOL - FLOOR (POOL 1: FLOOR 1, POOL - FLOOR 0) big is admitted to its
//     share and "big refused at the floor" cannot pass.
//   - big >= pool: a writer holds one permit at a time, so big alone holds
//     the whole pool only with as many writers.
//   - small <= big's share beside small, max(FLOOR, POOL/2): small's writers
//     past its share are refused whenever in_use >= POOL - FLOOR, where big
//     (big >= pool writers) keeps it, so small is refused again and again.
//   - phase > W + k*P + service + retry pause: small's last request ends a
//     service time into "big-alone"; small leaves the active set at most
//     W + 2P after (pools: a recompute stamps an ask, and a project leaves at
//     the first recompute at least W after that stamp; the kernel stamps
//     asks exactly and leaves at most W + P after), and then big's refused
//     writers ask again within a retry pause and take the pool, before the
//     phase ends, when the drill stops recomputing and sampling. W is the
//     active window (1s), P the recompute period (Config.Recompute, 1s).
//   - slices <= MaxSlices, and with more than one, each slice at least
//     minSliceServices service times long.
//   - the HTTP drill: two descriptors per writer within this process's
//     limit (RLIMIT_NOFILE), or asks fail with errors.
func (cfg Config) Check(connections bool) error {
	c := cfg.withDefaults()
	pool := c.PoolSize
	if connections {
		if !c.ToDestination && pool > limits.MaxPoolSize {
			return fmt.Errorf("--pool %d: the kernel's connection pool holds at most %d permits", pool, limits.MaxPoolSize)
		}
		if c.ToDestination && pool > limits.MaxPoolSize/destNodeFactor {
			return fmt.Errorf("--pool %d with --to: the node's pool around the destination pool is %d times larger and holds at most %d permits; give --pool %d or less",
				pool, destNodeFactor, limits.MaxPoolSize, limits.MaxPoolSize/destNodeFactor)
		}
	}
	floor := pools.DefaultFloor(pool)
	share := pools.Share(pool, floor, 2)
	if share > pool-floor {
		return fmt.Errorf("--pool %d: the floor is %d, and beside small big is admitted up to its share of %d, past POOL - FLOOR = %d: 'big refused at the floor' cannot pass; give --pool 2 or more",
			pool, floor, share, pool-floor)
	}
	if c.BigWriters < pool {
		return fmt.Errorf("--pool %d with --big %d: a writer holds one permit at a time, so big alone never holds the pool: 'big alone holds the pool' cannot pass; give --big %d or more, or --pool %d or less",
			pool, c.BigWriters, pool, c.BigWriters)
	}
	if c.SmallWriters > share {
		return fmt.Errorf("--small %d with --pool %d: beside big, small's share is %d (max(FLOOR, POOL/2)), and its writers past it are refused whenever big holds POOL - FLOOR: 'small refused rarely' cannot pass; give --small %d or fewer, or a larger --pool (and --big)",
			c.SmallWriters, pool, share, share)
	}
	periods, how := 2, "two recompute periods"
	if connections {
		periods, how = 1, "one recompute period"
	}
	stay := pools.DefaultWindow + time.Duration(periods)*c.Recompute
	if least := stay + c.ServiceTime + c.RetryPause; c.Phase <= least {
		return fmt.Errorf("--phase %s: small stays in the active set up to %s after its last request ends (the active window, %s, plus %s of %s), that request ends a service time (%s) into big-alone, and big's refused writers ask again within a retry pause (%s): 'big alone holds the pool' cannot pass; give --phase longer than %s",
			c.Phase, stay, pools.DefaultWindow, how, c.Recompute, c.ServiceTime, c.RetryPause, least)
	}
	if c.Slices > MaxSlices {
		return fmt.Errorf("--slices %d: at most %d", c.Slices, MaxSlices)
	}
	if least := minSliceServices * c.ServiceTime; c.Slices > 1 && c.Phase/time.Duration(c.Slices) < least {
		most := max(int(c.Phase/least), 1)
		return fmt.Errorf("--slices %d with --phase %s: slices of %s, shorter than %d service times (%s): a solo slice after a both slice counts only once big's last request ended, a service time or more into it; give --slices %d or fewer",
			c.Slices, c.Phase, (c.Phase / time.Duration(c.Slices)).Round(time.Microsecond), minSliceServices, least, most)
	}
	if !connections {
		var rl syscall.Rlimit
		if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err == nil {
			need := uint64(writerDescriptors) * uint64(c.BigWriters+c.SmallWriters)
			if need > rl.Cur {
				return fmt.Errorf("--big %d and --small %d: each writer keeps %d descriptors open (its connection to the front, both ends), %d in all, past this process's limit of %d (ulimit -n): asks would fail",
					c.BigWriters, c.SmallWriters, writerDescriptors, need, rl.Cur)
			}
		}
	}
	return nil
}
